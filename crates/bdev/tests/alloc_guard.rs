//! The data path proves itself: 100k I/Os through malloc and uring bdevs
//! and a stripe (child I/O on borrowed iovecs, over malloc and uring) on two
//! reactors, some writes with FUA, under a counting global allocator, with
//! zero allocations (on any thread) once warmed up.

mod common;
mod stripe;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use ustor_bdev::modules::{malloc, uring, RamOpts};
use ustor_bdev::IoFlags;
use ustor_runtime::IoBuf;

#[global_allocator]
static ALLOC: testkit::CountingAlloc = testkit::CountingAlloc::new();

const TASKS_PER_BDEV: usize = 4;
const TOTAL_IOS: usize = 100_000;

#[test]
fn steady_state_io_allocates_nothing() {
    let path = temp_file("alloc", 16 << 20);
    let rt = runtime(2);
    let reg = registry(&rt);
    malloc::create(
        &reg,
        RamOpts {
            name: "m".into(),
            num_blocks: 8192,
            block_size: 512,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .unwrap();
    uring::create(
        &reg,
        uring::UringOpts {
            name: "u".into(),
            filename: path.to_string_lossy().into(),
            block_size: 0,
            uuid: None,
            direct: true,
            sqpoll: false,
            iopoll: false,
        },
    )
    .unwrap();
    let ubs = reg.get("u").unwrap().info().block_size;
    malloc::create(
        &reg,
        RamOpts {
            name: "m2".into(),
            num_blocks: (8 << 20) / ubs as u64,
            block_size: ubs,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .unwrap();
    // Strips of half a 4 KiB I/O: most I/Os have two children.
    let strip = (2048 / ubs as u64).max(1);
    stripe::create(&reg, "s", "m2", "u", strip, 0).unwrap();
    let names = ["m", "u", "s"];
    let tasks = 2 * names.len() * TASKS_PER_BDEV;
    let per_task = TOTAL_IOS / tasks;
    let ready = Arc::new(AtomicUsize::new(0));
    let go = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let ios = Arc::new(AtomicUsize::new(0));
    for r in 0..2 {
        for bdev in names {
            let desc = Arc::new(reg.open(bdev, true, |_| {}).unwrap());
            let (ready, go, done, ios) = (ready.clone(), go.clone(), done.clone(), ios.clone());
            rt.handle()
                .send(r, move || {
                    let ch = desc.channel().unwrap();
                    let blocks = 4096 / ch.block_size() as u64;
                    let units = ch.num_blocks() / blocks;
                    for t in 0..TASKS_PER_BDEV {
                        let (ch, ready, go, done, ios) = (
                            ch.clone(),
                            ready.clone(),
                            go.clone(),
                            done.clone(),
                            ios.clone(),
                        );
                        ustor_runtime::spawn(async move {
                            let mut buf = IoBuf::alloc(4096).await;
                            let mut x = (r * 31 + t * 7 + 1) as u64;
                            let run = |n: usize, buf: IoBuf| {
                                let ch = ch.clone();
                                async move {
                                    let mut buf = buf;
                                    let mut ok = 0usize;
                                    for i in 0..n {
                                        x = x
                                            .wrapping_mul(6364136223846793005)
                                            .wrapping_add(1442695040888963407);
                                        let lba = ((x >> 33) % units) * blocks;
                                        let (res, b) = if i % 8 == 0 {
                                            ch.write_flagged(lba, blocks, buf, IoFlags::FUA).await
                                        } else if i % 2 == 0 {
                                            ch.write(lba, blocks, buf).await
                                        } else {
                                            ch.read(lba, blocks, buf).await
                                        };
                                        buf = b;
                                        ok += res.is_ok() as usize;
                                    }
                                    (ok, buf)
                                }
                            };
                            // Warm-up: channels, slots, histograms, ring all touched.
                            let (_, b) = run(2000, buf).await;
                            buf = b;
                            ready.fetch_add(1, Ordering::SeqCst);
                            while !go.load(Ordering::SeqCst) {
                                ustor_runtime::yield_now().await;
                            }
                            let (ok, b) = run(per_task, buf).await;
                            buf = b;
                            ios.fetch_add(ok, Ordering::SeqCst);
                            done.fetch_add(1, Ordering::SeqCst);
                            drop(buf);
                        });
                    }
                })
                .unwrap();
        }
    }
    testkit::wait_until("the warm-up to finish", Duration::from_secs(60), || {
        ready.load(Ordering::SeqCst) == tasks
    });
    ALLOC.reset();
    ALLOC.set_window(true);
    go.store(true, Ordering::SeqCst);
    // Polling allocates nothing, so it can run inside the window.
    let finished = testkit::try_wait_for(Duration::from_secs(120), || {
        (done.load(Ordering::SeqCst) == tasks).then_some(())
    });
    if finished.is_none() {
        ALLOC.set_window(false);
        panic!("measured phase did not finish");
    }
    ALLOC.set_window(false);
    let n = ALLOC.allocations();
    assert_eq!(
        ios.load(Ordering::SeqCst),
        per_task * tasks,
        "some I/O failed"
    );
    assert!(per_task * tasks >= TOTAL_IOS - tasks);
    assert_eq!(
        n,
        0,
        "{n} allocations during {} steady-state I/Os",
        per_task * tasks
    );
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

//! The composite data path allocates nothing: I/Os through raid0 over two
//! uring files (two children per I/O, completions from the ring), concat
//! over malloc (I/Os crossing the member boundary) and raid1 over malloc
//! (watched children, writes to both, balanced reads), passthru over a
//! split part, the error bdev and the delay bdev (timed poller), on two
//! reactors, under a counting global allocator, after warm-up.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use ustor_bdev::modules::uring;
use ustor_bdev::IoChannel;
use ustor_runtime::IoBuf;

#[global_allocator]
static ALLOC: testkit::CountingAlloc = testkit::CountingAlloc::new();

const TASKS: usize = 4;
const IOS_PER_TASK: usize = 3000;

fn file(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ustor-vbdev-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("disk.img");
    std::fs::File::create(&p).unwrap().set_len(8 << 20).unwrap();
    p
}

/// `n` I/Os of 8 KiB at pseudo-random half-unit offsets (crossing
/// strips and members), alternating writes and reads; how many succeeded.
async fn run(ch: &IoChannel, n: usize, mut buf: IoBuf, mut x: u64) -> (usize, IoBuf, u64) {
    let blocks = 8192 / ch.block_size() as u64;
    let units = ch.num_blocks() / blocks - 1;
    let mut good = 0;
    for i in 0..n {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let lba = ((x >> 33) % units) * blocks + blocks / 2;
        let (res, b) = if i % 2 == 0 {
            ch.write(lba, blocks, buf).await
        } else {
            ch.read(lba, blocks, buf).await
        };
        buf = b;
        good += res.is_ok() as usize;
    }
    (good, buf, x)
}

#[test]
fn raid0_over_uring_concat_and_raid1_over_malloc_allocate_nothing_per_io() {
    let files = [file("u0"), file("u1")];
    let rt = runtime(2);
    let reg = registry(&rt);
    for (i, f) in files.iter().enumerate() {
        uring::create(
            &reg,
            uring::UringOpts {
                name: format!("u{i}"),
                filename: f.to_string_lossy().into(),
                block_size: 0,
                uuid: None,
                direct: true,
                sqpoll: false,
                iopoll: false,
            },
        )
        .unwrap();
    }
    // 4 KiB strips and 8 KiB I/Os: every raid0 I/O has two children.
    raid(&reg, "r0", "raid0", &["u0", "u1"], 4);
    ram(&reg, "m0", 1 << 20);
    ram(&reg, "m1", 1 << 20);
    raid(&reg, "cat", "concat", &["m0", "m1"], 4);
    ram(&reg, "m2", 1 << 20);
    ram(&reg, "m3", 1 << 20);
    create(
        &reg,
        "raid",
        serde_json::json!({"name": "mir", "raid_level": "raid1", "base_bdevs": ["m2", "m3"]}),
    )
    .unwrap();
    // A passthru over a split part, an error bdev (nothing armed) and a
    // delay bdev (timed poller) each over RAM.
    ram(&reg, "m4", 1 << 20);
    create(
        &reg,
        "split",
        serde_json::json!({"base_bdev": "m4", "split_count": 2}),
    )
    .unwrap();
    create(
        &reg,
        "passthru",
        serde_json::json!({"base_bdev_name": "m4p1", "name": "pt"}),
    )
    .unwrap();
    ram(&reg, "m5", 1 << 20);
    create(&reg, "error", serde_json::json!({"base_name": "m5"})).unwrap();
    ram(&reg, "m6", 1 << 20);
    create(
        &reg,
        "delay",
        serde_json::json!({"base_bdev_name": "m6", "name": "dl", "avg_read_latency": 10,
            "p99_read_latency": 30, "avg_write_latency": 10, "p99_write_latency": 30}),
    )
    .unwrap();
    let names = ["r0", "cat", "mir", "pt", "EE_m5", "dl"];
    let tasks = 2 * names.len() * TASKS;
    let (ready, go) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let (done, ok) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    for r in 0..2 {
        for name in names {
            let desc = Arc::new(reg.open(name, true, |_| {}).unwrap());
            let (ready, go, done, ok) = (ready.clone(), go.clone(), done.clone(), ok.clone());
            rt.handle()
                .send(r, move || {
                    let ch = desc.channel().unwrap();
                    for t in 0..TASKS {
                        let (ch, ready, go) = (ch.clone(), ready.clone(), go.clone());
                        let (done, ok) = (done.clone(), ok.clone());
                        ustor_runtime::spawn(async move {
                            let seed = (r * 31 + t * 7 + 1) as u64;
                            let buf = IoBuf::alloc(8192).await;
                            // Warm-up: channels, slots, ring all touched.
                            let (_, buf, seed) = run(&ch, 1000, buf, seed).await;
                            ready.fetch_add(1, Ordering::SeqCst);
                            while !go.load(Ordering::SeqCst) {
                                ustor_runtime::yield_now().await;
                            }
                            let (good, buf, _) = run(&ch, IOS_PER_TASK, buf, seed).await;
                            ok.fetch_add(good, Ordering::SeqCst);
                            done.fetch_add(1, Ordering::SeqCst);
                            drop(buf);
                        });
                    }
                })
                .unwrap();
        }
    }
    let t0 = Instant::now();
    while ready.load(Ordering::SeqCst) < tasks {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "warm-up did not finish"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    ALLOC.reset();
    ALLOC.set_window(true);
    go.store(true, Ordering::SeqCst);
    while done.load(Ordering::SeqCst) < tasks {
        if t0.elapsed() > Duration::from_secs(120) {
            ALLOC.set_window(false);
            panic!("measured phase did not finish");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    ALLOC.set_window(false);
    let n = ALLOC.allocations();
    assert_eq!(
        ok.load(Ordering::SeqCst),
        IOS_PER_TASK * tasks,
        "some I/O failed"
    );
    assert_eq!(n, 0, "{n} allocations during {} I/Os", IOS_PER_TASK * tasks);
    for f in files {
        let _ = std::fs::remove_dir_all(f.parent().unwrap());
    }
}

//! The iSCSI data path allocates nothing in steady state.
//!
//! A counting `#[global_allocator]` sees every thread of this process (the
//! reactor runs the SCSI bdev, the mid-layer and the iSCSI LLD). Against
//! tgtd with header and data digests, ImmediateData and InitialR2T=No: after
//! a warm-up (login, scan, every path taken once) the window opens and 16
//! workers drive 24k I/Os — 4 KiB writes (immediate data), 4 KiB reads, and
//! every 16th a 128 KiB write (unsolicited Data-Out, then R2Ts) read back —
//! each read compared with what was written; no allocation may happen
//! until the window closes. `harness = false`: no libtest threads share the
//! process. `ALLOC_TRACE=1` prints a backtrace of each allocation in the
//! window.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::Poll;
use std::time::Instant;

use common::*;
use ustor_bdev::IoChannel;
use ustor_iscsi::initiator::IscsiConfig;
use ustor_runtime::IoBuf;

struct Counting;

static WINDOW: AtomicBool = AtomicBool::new(false);
static TRACE: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static IN_TRACE: Cell<bool> = const { Cell::new(false) };
}

fn note(size: usize) {
    if !WINDOW.load(Ordering::Relaxed) {
        return;
    }
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    if TRACE.load(Ordering::Relaxed) {
        let _ = IN_TRACE.try_with(|t| {
            if !t.replace(true) {
                eprintln!(
                    "allocation of {size} bytes:\n{}",
                    std::backtrace::Backtrace::force_capture()
                );
                t.set(false);
            }
        });
    }
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note(l.size());
        System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note(l.size());
        System.alloc_zeroed(l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        note(new);
        System.realloc(p, l, new)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const WORKERS: u64 = 16;
const PER_WORKER: u64 = 750;
/// Each worker owns 64 KiB of blocks ... and one 128 KiB region.
const AREA_BLOCKS: u64 = 512;

fn fill(b: &mut [u8], seed: u64) {
    for (i, c) in b.chunks_mut(8).enumerate() {
        c.copy_from_slice(&(seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes());
    }
}

/// One worker: write, read back, compare; `n` rounds. Returns mismatches.
async fn worker(ch: std::rc::Rc<IoChannel>, id: u64, n: u64) -> u64 {
    let mut w = IoBuf::alloc(128 << 10).await;
    let mut r = IoBuf::alloc(128 << 10).await;
    let mut bad = 0;
    let base = id * AREA_BLOCKS;
    for i in 0..n {
        let big = i % 16 == 15;
        let (blocks, at) = if big {
            (256, base + 256)
        } else {
            (8, base + (i % 32) * 8)
        };
        let len = blocks as usize * 512;
        let seed = id << 32 | i;
        w.set_len(len);
        r.set_len(len);
        fill(&mut w[..len], seed);
        let (res, wb) = ch.write(at, blocks, w).await;
        w = wb;
        if res.is_err() {
            bad += 1;
        }
        let (res, rb) = ch.read(at, blocks, r).await;
        r = rb;
        if res.is_err() || r[..len] != w[..len] {
            if bad < 3 {
                eprintln!("worker {id} round {i}: {res:?}");
            }
            bad += 1;
        }
    }
    bad
}

/// Runs the workers to completion (boxed, and their results' slots made,
/// before the window opens).
async fn join(mut futs: Vec<Pin<Box<dyn Future<Output = u64>>>>, done: &mut [Option<u64>]) -> u64 {
    std::future::poll_fn(|cx| {
        let mut all = true;
        for (f, d) in futs.iter_mut().zip(done.iter_mut()) {
            if d.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *d = Some(v),
                    Poll::Pending => all = false,
                }
            }
        }
        if all {
            Poll::Ready(done.iter().map(|d| d.unwrap_or(0)).sum())
        } else {
            Poll::Pending
        }
    })
    .await
}

fn main() {
    TRACE.store(std::env::var_os("ALLOC_TRACE").is_some(), Ordering::Relaxed);
    let Some(mut rig) = Rig::start("iscsi_alloc_free", 64 << 20) else {
        return;
    };
    rig.target_params(&[
        ("HeaderDigest", "CRC32C,None"),
        ("DataDigest", "CRC32C,None"),
        ("InitialR2T", "No"),
    ]);
    let mut cfg = IscsiConfig::new(rig.portal(), Some(IQN.into()));
    cfg.header_digest = true;
    cfg.data_digest = true;
    cfg.queue_depth = 32;
    rig.attach(cfg).expect("iSCSI host");
    let dev = rig.disk();
    rig.bdev("a0", &dev, 0, 32 << 20);
    let desc = rig.reg.open("a0", true, |_| {}).unwrap();
    let t0 = Instant::now();
    let (bad, allocs) = rig
        .rt
        .handle()
        .block_on(0, move || async move {
            let ch = std::rc::Rc::new(desc.channel().unwrap());
            let mk = |n| -> Vec<Pin<Box<dyn Future<Output = u64>>>> {
                (0..WORKERS)
                    .map(|id| {
                        Box::pin(worker(ch.clone(), id, n)) as Pin<Box<dyn Future<Output = u64>>>
                    })
                    .collect()
            };
            let (warm, measured) = (mk(64), mk(PER_WORKER));
            let (mut d1, mut d2) = (vec![None; WORKERS as usize], vec![None; WORKERS as usize]);
            let mut bad = join(warm, &mut d1).await;
            WINDOW.store(true, Ordering::SeqCst);
            bad += join(measured, &mut d2).await;
            WINDOW.store(false, Ordering::SeqCst);
            let allocs = ALLOCS.load(Ordering::SeqCst);
            let st = ustor_iscsi::initiator::local_sessions()
                .pop()
                .expect("session")["stats"]
                .clone();
            println!("session stats: {st}");
            // Every write path ran: immediate data, unsolicited Data-Out, R2Ts.
            assert!(st["immediate_bytes"].as_u64() > Some(0), "{st}");
            assert!(st["r2ts"].as_u64() > Some(0), "{st}");
            assert!(st["data_out_bytes"].as_u64() > Some(0), "{st}");
            (bad, allocs)
        })
        .unwrap();
    let ios = WORKERS * PER_WORKER * 2;
    println!(
        "iscsi alloc_free: {ios} I/Os in {:?}, {bad} bad, {allocs} allocations in the window",
        t0.elapsed()
    );
    assert_eq!(bad, 0, "I/O failed or data differs");
    assert_eq!(
        allocs, 0,
        "allocations on the iSCSI data path (ALLOC_TRACE=1 shows where)"
    );
}

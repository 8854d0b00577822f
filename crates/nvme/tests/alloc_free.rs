//! The NVMe/TCP target data path allocates nothing in steady state.
//!
//! A counting `#[global_allocator]` tags each thread: the target's reactor
//! (runtime A, malloc namespace), the initiator's reactor (runtime B: the
//! ustor initiator bdev and the load, in-process over 127.0.0.1) and
//! "other" (main and helper threads). After a warm-up on both sides
//! (connections up, worker tasks spawned, every path taken: in-capsule
//! 4 KiB writes, 16 KiB writes through R2T/H2CData, 4 KiB and 16 KiB reads
//! checked against what was written) the window opens for `MEASURED` I/Os
//! at QD 8, and no allocation or free may happen on either reactor until it
//! closes. Both sides are asserted: the target, and the initiator too.
//! The initiator's Keep Alive (admin queue, every KATO/2, allocates its
//! capsule) is moved out of the window with a 120 s KATO.
//!
//! `harness = false`: no libtest threads share the process. Set
//! `ALLOC_TRACE=1` to print a backtrace of each allocation in the window.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use ustor_bdev::{modules, Registry};
use ustor_nvme::initiator::{attach_controller, AttachParams};
use ustor_nvme::nvmf::{CreateTransportParams, Target, TransportOpts};
use ustor_runtime::{IoBuf, PollMode, Runtime, RuntimeConfig};

struct Counting;

static WINDOW_OPEN: AtomicBool = AtomicBool::new(false);
static TRACE: AtomicBool = AtomicBool::new(false);
/// Allocations + frees in the window by tag: 0 other, 1 target, 2 initiator.
static EVENTS: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
static BYTES: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static TAG: Cell<usize> = const { Cell::new(0) };
    static IN_TRACE: Cell<bool> = const { Cell::new(false) };
}

fn note(what: &str, size: usize) {
    if !WINDOW_OPEN.load(Ordering::Relaxed) {
        return;
    }
    let tag = TAG.try_with(Cell::get).unwrap_or(0);
    EVENTS[tag].fetch_add(1, Ordering::Relaxed);
    BYTES.fetch_add(size as u64, Ordering::Relaxed);
    if TRACE.load(Ordering::Relaxed) {
        // The backtrace allocates too: not counted, not traced again.
        let _ = IN_TRACE.try_with(|t| {
            if !t.replace(true) {
                WINDOW_OPEN.store(false, Ordering::Relaxed);
                eprintln!(
                    "{what} of {size} bytes on thread tag {tag}:\n{}",
                    std::backtrace::Backtrace::force_capture()
                );
                WINDOW_OPEN.store(true, Ordering::Relaxed);
                t.set(false);
            }
        });
    }
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note("allocation", layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note("allocation", layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        note("reallocation", new);
        System.realloc(ptr, layout, new)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note("free", layout.size());
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const NQN: &str = "nqn.2024-01.io.ustor:alloc";
const DEPTH: usize = 8;
const WARMUP: u64 = 4_000;
const MEASURED: u64 = 20_000;
/// Each worker owns a 1 MiB region (2048 blocks of 512 bytes).
const REGION_BLOCKS: u64 = 2048;

fn runtime(core: usize) -> Runtime {
    Runtime::start(RuntimeConfig {
        cores: vec![core],
        pin: false,
        poll_mode: PollMode::Adaptive,
        ..RuntimeConfig::default()
    })
    .expect("runtime")
}

fn target(rt: &Runtime) -> (Target, String) {
    let reg = Registry::new(Some(rt.handle()));
    modules::malloc::create(
        &reg,
        modules::RamOpts {
            name: "Malloc0".into(),
            num_blocks: REGION_BLOCKS * DEPTH as u64,
            block_size: 512,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .expect("malloc");
    let t = Target::new(rt.handle(), reg);
    t.nvmf_create_transport(&CreateTransportParams {
        trtype: "TCP".into(),
        opts: TransportOpts::default(),
    })
    .unwrap();
    let port = t
        .export_local(NQN, "ALLOC", "ustor alloc", "Malloc0", "0")
        .unwrap();
    (t, port)
}

/// Runs on the initiator's reactor: DEPTH workers, each cycling through
/// write 4 KiB (in-capsule), read it back, write 16 KiB (R2T), read it
/// back, on its own region. Opens the window after WARMUP I/Os and closes
/// it after MEASURED more. Returns (I/Os, data mismatches).
async fn load(reg: std::sync::Arc<Registry>, bdev: String) -> (u64, u64) {
    let d = reg.open(&bdev, true, |_| {}).expect("open");
    let ch = d.channel().expect("channel");
    let done = Rc::new(Cell::new(0u64));
    let bad = Rc::new(Cell::new(0u64));
    let total = WARMUP + MEASURED;
    let mut hs = Vec::new();
    for w in 0..DEPTH {
        let (ch, done, bad) = (ch.clone(), done.clone(), bad.clone());
        hs.push(ustor_runtime::spawn(async move {
            let mut small = IoBuf::alloc(4096).await;
            let mut big = IoBuf::alloc(16384).await;
            let base = w as u64 * REGION_BLOCKS;
            let mut seq = 0u64;
            while done.get() < total {
                let slot = base + (seq / 4 * 32) % REGION_BLOCKS;
                let tag = (seq / 4) as u8 ^ w as u8;
                let r = match seq % 4 {
                    0 => {
                        small.fill(tag);
                        let (r, b) = ch.write(slot, 8, small).await;
                        small = b;
                        r
                    }
                    1 => {
                        let (r, b) = ch.read(slot, 8, small).await;
                        small = b;
                        if small.iter().any(|&x| x != tag) {
                            bad.set(bad.get() + 1);
                        }
                        r
                    }
                    2 => {
                        big.fill(tag.wrapping_add(1));
                        let (r, b) = ch.write(slot, 32, big).await;
                        big = b;
                        r
                    }
                    _ => {
                        let (r, b) = ch.read(slot, 32, big).await;
                        big = b;
                        if big.iter().any(|&x| x != tag.wrapping_add(1)) {
                            bad.set(bad.get() + 1);
                        }
                        r
                    }
                };
                r.expect("I/O");
                seq += 1;
                let n = done.get() + 1;
                done.set(n);
                if n == WARMUP {
                    WINDOW_OPEN.store(true, Ordering::SeqCst);
                } else if n == total {
                    WINDOW_OPEN.store(false, Ordering::SeqCst);
                }
            }
        }));
    }
    for h in hs {
        h.await;
    }
    WINDOW_OPEN.store(false, Ordering::SeqCst);
    (done.get(), bad.get())
}

fn main() {
    let name = "nvmf_data_path_allocates_nothing";
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        println!("{name}: test");
        return;
    }
    let filters: Vec<&String> = args
        .iter()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
        return;
    }
    TRACE.store(
        std::env::var("ALLOC_TRACE").is_ok_and(|v| v == "1"),
        Ordering::Relaxed,
    );
    let trt = runtime(0);
    let irt = runtime(1);
    trt.handle().call(0, || TAG.set(1)).unwrap();
    irt.handle().call(0, || TAG.set(2)).unwrap();
    let (t, port) = target(&trt);
    let ireg = Registry::new(Some(irt.handle()));
    let mut p = AttachParams::tcp("Alloc", "127.0.0.1", &port, NQN);
    // Keep Alive (every KATO/2, admin queue, control path: it builds its
    // capsule in a heap buffer) must not fall into the window.
    p.keep_alive_timeout_ms = 120_000;
    let bdev = attach_controller(&irt.handle(), &ireg, &p).expect("attach")[0].clone();
    let t0 = Instant::now();
    let (ios, bad) = irt
        .handle()
        .block_on(0, move || load(ireg, bdev))
        .expect("load");
    let el = t0.elapsed();
    let ev: Vec<u64> = EVENTS.iter().map(|e| e.load(Ordering::SeqCst)).collect();
    let st = t.nvmf_get_stats().expect("stats");
    let copies: u64 = st.poll_groups.iter().map(|g| g.payload_copies).sum();
    let errors: u64 = st.poll_groups.iter().map(|g| g.errors).sum();
    println!(
        "test {name}: {ios} I/Os in {el:?} ({MEASURED} in the window); allocations+frees in \
         the window: target reactor {}, initiator reactor {}, other threads {} ({} bytes); \
         target payload copies {copies}",
        ev[1],
        ev[2],
        ev[0],
        BYTES.load(Ordering::SeqCst)
    );
    assert_eq!(bad, 0, "data read back differs");
    assert_eq!(errors, 0);
    assert!(ios >= WARMUP + MEASURED);
    assert_eq!(
        ev[1], 0,
        "the target's data path allocated/freed (ALLOC_TRACE=1 prints where)"
    );
    assert_eq!(
        ev[2], 0,
        "the initiator's data path allocated/freed (ALLOC_TRACE=1 prints where)"
    );
    // Quiet exit: the runtimes stop with the process.
    println!("test {name} ... ok");
    std::process::exit(0);
}

//! The NBD data path allocates nothing in steady state.
//!
//! A counting `#[global_allocator]` sees every thread of this process: the
//! server's reactors (malloc bdev export, two reactors) and the raw clients
//! (`common::raw`, preallocated slots, blocking std sockets). After a
//! warm-up (connections negotiated, worker tasks spawned, every code path
//! taken once) the window opens and the clients drive 50k requests — 4 KiB
//! reads and writes at QD 8, one connection with simple replies and one with
//! structured replies, each read checking the data written before — and no
//! allocation or free may happen until the window closes.
//!
//! `harness = false`: no libtest threads share the process. Set
//! `ALLOC_TRACE=1` to print a backtrace of each allocation in the window.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::raw::RawClient;

struct Counting;

static WINDOW_OPEN: AtomicBool = AtomicBool::new(false);
static TRACE: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static ALLOC_BYTES: AtomicU64 = AtomicU64::new(0);
static FREES: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static IN_TRACE: Cell<bool> = const { Cell::new(false) };
}

fn note_alloc(size: usize) {
    if !WINDOW_OPEN.load(Ordering::Relaxed) {
        return;
    }
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    ALLOC_BYTES.fetch_add(size as u64, Ordering::Relaxed);
    trace("allocation", size);
}

fn trace(what: &str, size: usize) {
    if TRACE.load(Ordering::Relaxed) {
        // The backtrace allocates too: not counted, not traced again.
        let _ = IN_TRACE.try_with(|t| {
            if !t.replace(true) {
                WINDOW_OPEN.store(false, Ordering::Relaxed);
                let thread = std::thread::current();
                eprintln!(
                    "{what} of {size} bytes on {:?}:\n{}",
                    thread.name(),
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
        note_alloc(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        note_alloc(new);
        System.realloc(ptr, layout, new)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if WINDOW_OPEN.load(Ordering::Relaxed) {
            FREES.fetch_add(1, Ordering::Relaxed);
            trace("free", layout.size());
        }
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const DEPTH: usize = 8;
const BS: usize = 4096;
const WARMUP_REQUESTS: u64 = 5_000;
const MEASURED_REQUESTS: u64 = 25_000;
/// Each slot owns a 1 MiB region of the export.
const REGION: u64 = 1 << 20;

/// Clients past their warm-up; the window opens when all are.
static WARM: AtomicUsize = AtomicUsize::new(0);
static GO: AtomicBool = AtomicBool::new(false);
/// Clients done with the measured requests; they then wait for `END`
/// before freeing anything.
static DONE: AtomicUsize = AtomicUsize::new(0);
static END: AtomicBool = AtomicBool::new(false);

/// Waits for the main thread's signal (it allocates nothing: clients call it
/// inside the window).
fn wait_for(flag: &'static AtomicBool, what: &str) {
    testkit::wait_until(what, Duration::from_secs(120), || {
        flag.load(Ordering::SeqCst)
    });
}

/// Waits until every reactor has gone to sleep twice more: since the call,
/// each has made a whole pass with nothing left to do, so the work of the
/// replies the clients already have (send completions, slot recycling) is
/// done. Reading the sleep counters and waking a sleeping reactor (an
/// eventfd write) allocate nothing.
fn wait_reactors_idle(rt: &ustor_runtime::RuntimeHandle) {
    for r in 0..rt.num_reactors() {
        let s0 = rt.sleeps(r).expect("reactor");
        testkit::wait_until(
            "every reactor to go idle (two sleeps)",
            Duration::from_secs(30),
            || {
                rt.wake(r);
                rt.sleeps(r).expect("reactor") >= s0 + 2
            },
        );
    }
}

/// Per slot: write a block, then read it back and check it; the next block
/// of the slot's region each round. Returns requests completed.
fn drive(c: &mut RawClient, requests: u64, seq: &mut [u64]) -> u64 {
    let blocks = REGION / BS as u64;
    let mut issued = 0u64;
    let mut done = 0u64;
    let mut is_read = [false; DEPTH];
    let start = |c: &mut RawClient, slot: usize, seq: &mut [u64], read: bool| {
        let n = seq[slot];
        let offset = slot as u64 * REGION + (n / 2 % blocks) * BS as u64;
        if read {
            c.read(slot, offset, BS).expect("send read");
        } else {
            c.data(slot)[..BS].fill(n as u8);
            c.write(slot, offset, BS).expect("send write");
        }
    };
    for slot in 0..c.depth() {
        start(c, slot, seq, false);
        issued += 1;
    }
    while done < issued {
        let (slot, err) = c.complete().expect("reply");
        assert_eq!(err, 0, "NBD error {err} on slot {slot}");
        done += 1;
        if is_read[slot] {
            let want = (seq[slot] - 1) as u8;
            let got = &c.data(slot)[..BS];
            assert!(
                got.iter().all(|b| *b == want),
                "slot {slot}: read back wrong data"
            );
        }
        seq[slot] += 1;
        if issued < requests {
            // Even sequence numbers write, odd ones read the block back.
            is_read[slot] = seq[slot] % 2 == 1;
            start(c, slot, seq, is_read[slot]);
            issued += 1;
        }
    }
    done
}

fn client(port: u16, structured: bool) -> u64 {
    let mut c = RawClient::connect(port, "malloc", structured, DEPTH, BS).expect("connect");
    assert_eq!(c.structured, structured);
    let mut seq = [0u64; DEPTH];
    drive(&mut c, WARMUP_REQUESTS, &mut seq);
    WARM.fetch_add(1, Ordering::SeqCst);
    wait_for(&GO, "the main thread to open the window");
    let n = drive(&mut c, MEASURED_REQUESTS, &mut seq);
    DONE.fetch_add(1, Ordering::SeqCst);
    wait_for(&END, "the main thread to close the window");
    c.disconnect().expect("disconnect");
    n
}

fn main() {
    // `cargo test -- --list` and filters: this binary has one test.
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        println!("nbd_data_path_allocates_nothing: test");
        return;
    }
    let name = "nbd_data_path_allocates_nothing";
    let mut filters = Vec::new();
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--skip" => {
                if it.next().is_some_and(|s| name.contains(s.as_str())) {
                    return;
                }
            }
            a if a.starts_with('-') => {}
            a => filters.push(a),
        }
    }
    if !filters.is_empty() && !filters.iter().any(|f| name.contains(*f)) {
        return;
    }
    TRACE.store(
        std::env::var("ALLOC_TRACE").is_ok_and(|v| v == "1"),
        Ordering::Relaxed,
    );
    let f = common::start_bdev(64 << 20, 512, 2);
    let port = f.port;
    let clients: Vec<_> = [false, true]
        .into_iter()
        .map(|structured| std::thread::spawn(move || client(port, structured)))
        .collect();
    testkit::wait_until(
        "both clients to finish warm-up",
        Duration::from_secs(120),
        || WARM.load(Ordering::SeqCst) == clients.len(),
    );
    // Let the reactors finish the warm-up's last wake-ups.
    let h = f.rt.handle();
    wait_reactors_idle(&h);
    let t0 = Instant::now();
    WINDOW_OPEN.store(true, Ordering::SeqCst);
    GO.store(true, Ordering::SeqCst);
    testkit::wait_until("both clients to finish", Duration::from_secs(120), || {
        DONE.load(Ordering::SeqCst) == clients.len()
    });
    // The last replies are out; let the reactors finish their pass.
    wait_reactors_idle(&h);
    WINDOW_OPEN.store(false, Ordering::SeqCst);
    let elapsed = t0.elapsed();
    END.store(true, Ordering::SeqCst);
    let total: u64 = clients.into_iter().map(|h| h.join().expect("client")).sum();
    let (allocs, bytes, frees) = (
        ALLOCS.load(Ordering::SeqCst),
        ALLOC_BYTES.load(Ordering::SeqCst),
        FREES.load(Ordering::SeqCst),
    );
    let stats = f.server.get_stats().expect("stats");
    println!(
        "test nbd_data_path_allocates_nothing: {total} requests in {elapsed:?}, \
         {allocs} allocations ({bytes} bytes), {frees} frees in the window"
    );
    assert_eq!(total, 2 * MEASURED_REQUESTS);
    assert_eq!(stats.io_errors, 0, "{stats:?}");
    assert!(
        allocs == 0 && frees == 0,
        "steady-state NBD I/O allocated {allocs} times ({bytes} bytes) and freed {frees} \
         times (ALLOC_TRACE=1 prints where)"
    );
    println!("test nbd_data_path_allocates_nothing ... ok");
}

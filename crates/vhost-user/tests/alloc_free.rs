//! The vhost-user-blk data path allocates nothing per request once warm.
//!
//! A counting `#[global_allocator]` counts what the reactor threads
//! allocate (the rings, their workers and the bdev run there; the libblkio
//! frontend and the controller's control thread do not count). After a
//! warm-up (frontend connected, both queues started, every worker the
//! queue depth needs spawned, single- and multi-segment requests and a
//! sleep on the kick eventfd taken once) the window opens and libblkio
//! drives 4 KiB writes, 16 KiB four-segment writes and reads back at
//! queue depth 32 on two queues served by two reactors, every read
//! compared with what was written; no allocation may happen on a reactor
//! until the window closes. `harness = false`: no libtest threads share
//! the process. A failure prints the backtrace of the window's first
//! reactor allocation (captured only once one happens, so a clean run's
//! timing is untouched); `ALLOC_TRACE=1` prints one for each.
//!
//! The same for vhost-user-scsi (`scsi_phase`): the test frontend
//! (`common/frontend.rs`, rust-vmm's `vhost` crate plus a split-ring
//! driver) sends WRITE(10) and READ(10) commands, 4 KiB and 16 KiB in four
//! segments, at queue depth 32 on two request queues on two reactors; each
//! runs on the SCSI target core (`LunTable::execute`) over a malloc bdev,
//! every read compared, and no reactor may allocate in the window.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use blkio::{Blkio, Blkioq, ReqFlags};
use ustor_bdev::Registry;
use ustor_runtime::{PollMode, Runtime, RuntimeConfig};
use ustor_vhost::scsi::{ScsiController, ScsiControllerConfig};
use ustor_vhost::{BlkController, BlkControllerConfig};

#[path = "common/frontend.rs"]
mod frontend;
#[path = "common/scsi.rs"]
mod scsi;

struct Counting;

static WINDOW: AtomicBool = AtomicBool::new(false);
static TRACE: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);
/// The first reactor allocation in the window: its size and backtrace.
static FIRST: Mutex<Option<String>> = Mutex::new(None);

thread_local! {
    static IN_TRACE: Cell<bool> = const { Cell::new(false) };
}

fn note(size: usize) {
    if !WINDOW.load(Ordering::Relaxed) || !ustor_runtime::is_reactor_thread() {
        return;
    }
    // The backtrace's own allocations (below) are not the data path's.
    if IN_TRACE.try_with(|t| t.get()).unwrap_or(true) {
        return;
    }
    let first = ALLOCS.fetch_add(1, Ordering::Relaxed) == 0;
    if !first && !TRACE.load(Ordering::Relaxed) {
        return;
    }
    // Capturing and formatting a backtrace allocates: the guard keeps
    // those allocations from recursing into this.
    let _ = IN_TRACE.try_with(|t| {
        if t.replace(true) {
            return;
        }
        let bt = format!(
            "allocation of {size} bytes on a reactor:\n{}",
            std::backtrace::Backtrace::force_capture()
        );
        if TRACE.load(Ordering::Relaxed) {
            eprintln!("{bt}");
        }
        if first {
            if let Ok(mut f) = FIRST.lock() {
                f.get_or_insert(bt);
            }
        }
        t.set(false);
    });
}

/// The first allocation's backtrace, for a failure message.
fn first_alloc() -> String {
    FIRST
        .lock()
        .ok()
        .and_then(|f| f.clone())
        .unwrap_or_default()
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

const QD: usize = 32;
/// Bytes per request slot: a write area and a read area per slot.
const SLOT: usize = 16 << 10;
/// Per queue: QD write slots then QD read slots.
const QUEUE_AREA: usize = 2 * QD * SLOT;

fn fill(b: &mut [u8], seed: u64) {
    for (i, c) in b.chunks_mut(8).enumerate() {
        c.copy_from_slice(&(seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes());
    }
}

struct Client {
    _b: Blkio,
    queues: Vec<Blkioq>,
    base: usize,
}

impl Client {
    fn ptr(&self, off: usize) -> *mut u8 {
        (self.base + off) as *mut u8
    }
    fn slice(&mut self, off: usize, len: usize) -> &mut [u8] {
        // SAFETY: inside the region libblkio allocated and mapped; touched
        // only while no request on it is in flight.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(off), len) }
    }

    /// Waits until `n` requests on queue `q` complete; counts failures.
    fn reap(&mut self, q: usize, n: usize) -> usize {
        let mut comps: [MaybeUninit<blkio::Completion>; QD] =
            std::array::from_fn(|_| MaybeUninit::uninit());
        let (mut done, mut bad) = (0, 0);
        while done < n {
            let mut t = Duration::from_secs(10);
            let k = self.queues[q]
                .do_io(&mut comps, 1, Some(&mut t), None)
                .expect("do_io");
            assert!(k > 0, "queue {q}: completions stopped at {done}/{n}");
            for c in &comps[..k] {
                // SAFETY: do_io initialised the first k entries.
                if unsafe { c.assume_init_ref() }.ret != 0 {
                    bad += 1;
                }
            }
            done += k;
        }
        bad
    }

    /// One round on both queues: QD writes (every 4th one 16 KiB in four
    /// segments), then QD reads of the same blocks, compared. Returns
    /// (requests, failures + mismatches).
    fn round(&mut self, round: u64) -> (u64, u64) {
        let mut bad = 0u64;
        // Per queue and slot: libblkio may read a request's iovecs until it
        // is submitted.
        let mut iov = [[[libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 4]; QD]; 2];
        for (q, q_iov) in iov.iter_mut().enumerate() {
            for (k, slot_iov) in q_iov.iter_mut().enumerate() {
                let len = if k % 4 == 3 { SLOT } else { 4096 };
                let off = q * QUEUE_AREA + k * SLOT;
                fill(self.slice(off, len), round << 32 | (q * QD + k) as u64);
                let lba = ((q * QD + k) * SLOT) as u64;
                if len == SLOT {
                    for (j, v) in slot_iov.iter_mut().enumerate() {
                        v.iov_base = self.ptr(off + j * 4096).cast();
                        v.iov_len = 4096;
                    }
                    let p = slot_iov.as_ptr();
                    self.queues[q].writev(lba, p, 4, k, ReqFlags::empty());
                } else {
                    let p = self.ptr(off);
                    self.queues[q].write(lba, p, len, k, ReqFlags::empty());
                }
            }
        }
        for q in 0..self.queues.len() {
            bad += self.reap(q, QD) as u64;
        }
        for q in 0..self.queues.len() {
            for k in 0..QD {
                let len = if k % 4 == 3 { SLOT } else { 4096 };
                let off = q * QUEUE_AREA + (QD + k) * SLOT;
                self.slice(off, len).fill(0);
                let lba = ((q * QD + k) * SLOT) as u64;
                let p = self.ptr(off);
                self.queues[q].read(lba, p, len, k, ReqFlags::empty());
            }
        }
        for q in 0..self.queues.len() {
            bad += self.reap(q, QD) as u64;
            for k in 0..QD {
                let len = if k % 4 == 3 { SLOT } else { 4096 };
                let w = q * QUEUE_AREA + k * SLOT;
                let r = q * QUEUE_AREA + (QD + k) * SLOT;
                // SAFETY: both inside the mapped region, nothing in flight.
                let (a, b) = unsafe {
                    (
                        std::slice::from_raw_parts(self.ptr(w), len),
                        std::slice::from_raw_parts(self.ptr(r), len),
                    )
                };
                bad += (a != b) as u64;
            }
        }
        (4 * QD as u64, bad)
    }
}

fn main() {
    TRACE.store(std::env::var_os("ALLOC_TRACE").is_some(), Ordering::Relaxed);
    let rt = Runtime::start(RuntimeConfig {
        cores: vec![0, 1],
        pin: false,
        poll_mode: PollMode::Adaptive,
        ..RuntimeConfig::default()
    })
    .expect("runtime starts");
    let registry = Registry::new(Some(rt.handle()));
    let dir = std::env::temp_dir().join(format!("ustor-vhost-alloc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("socket dir");
    let opts = ustor_bdev::modules::RamOpts {
        name: "af_bdev".into(),
        num_blocks: (64 << 20) / 512,
        block_size: 512,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    };
    ustor_bdev::modules::malloc::create(&registry, opts).expect("malloc bdev");
    let ctrl = BlkController::create(
        &registry,
        rt.handle(),
        BlkControllerConfig {
            name: "af".into(),
            socket: dir.join("af"),
            bdev: "af_bdev".into(),
            reactors: vec![0, 1],
            read_only: false,
            num_queues: 2,
            poll_window: Duration::from_micros(50),
            packed_ring: false,
        },
    )
    .expect("controller");

    let mut b = Blkio::new("virtio-blk-vhost-user").expect("driver");
    b.set_str("path", ctrl.config.socket.to_str().unwrap())
        .unwrap();
    b.connect().expect("connect");
    b.set_i32("num-queues", 2).unwrap();
    let out = b.start().expect("start");
    let mem = b.alloc_mem_region(2 * QUEUE_AREA).expect("mem region");
    b.map_mem_region(&mem).expect("map region");
    let base = mem.addr;
    let mut cl = Client {
        _b: b,
        queues: out.queues,
        base,
    };

    // Warm-up: workers for the whole depth, both request shapes, and the
    // rings' sleep on their kick eventfds (the pause below).
    let mut bad = 0;
    for r in 0..20 {
        bad += cl.round(r).1;
        if r == 10 {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    assert_eq!(bad, 0, "warm-up: failed requests or mismatches");

    WINDOW.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    let (mut ios, mut bad) = (0u64, 0u64);
    for r in 20..220 {
        let (n, b) = cl.round(r);
        ios += n;
        bad += b;
    }
    WINDOW.store(false, Ordering::SeqCst);
    let took = t0.elapsed();
    let allocs = ALLOCS.load(Ordering::SeqCst);
    eprintln!("alloc_free: {ios} requests on 2 queues in {took:?}, {allocs} reactor allocations");
    assert_eq!(bad, 0, "failed requests or mismatches in the window");
    let st: u64 = ctrl
        .device()
        .queue_stats
        .iter()
        .map(|s| s.requests.load(Ordering::Relaxed))
        .sum();
    assert!(
        st >= ios,
        "the queues counted {st} requests, expected {ios}"
    );
    assert_eq!(
        allocs,
        0,
        "the data path allocated on a reactor; the first one:\n{}",
        first_alloc()
    );
    drop(cl);
    ctrl.stop();
    scsi_phase(&rt, &registry, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    println!("alloc_free: ok");
}

/// Bytes per scsi request slot (data-out and data-in areas each).
const SSLOT: u64 = 16 << 10;

/// One scsi round on every request ring: QD writes (every 4th one
/// 16 KiB in four segments), then QD reads of the same blocks into other
/// buffers, compared. Returns (requests, failures + mismatches).
fn scsi_round(f: &mut frontend::Fe, round: u64, rings: &[usize]) -> (u64, u64) {
    use scsi::{cmd, resp, rw10};
    let mut bad = 0;
    let area = |qi: usize, k: usize, read: bool| {
        frontend::DATA_BASE + ((qi * 2 * QD + k + if read { QD } else { 0 }) as u64) * SSLOT
    };
    let segs = |at: u64, len: u64| -> Vec<(u64, u32)> {
        (0..len / 4096).map(|j| (at + j * 4096, 4096)).collect()
    };
    for (qi, &q) in rings.iter().enumerate() {
        for k in 0..QD {
            let len = if k % 4 == 3 { SSLOT } else { 4096 };
            let mut b = vec![0u8; len as usize];
            fill(&mut b, round << 32 | (qi * QD + k) as u64);
            f.mem.write(area(qi, k, false), &b);
            let lba = ((qi * QD + k) as u64 * SSLOT / 512) as u32;
            let c = rw10(true, lba, (len / 512) as u16);
            cmd(
                f,
                q,
                k,
                0,
                k as u64,
                &c,
                &segs(area(qi, k, false), len),
                &[],
            );
        }
    }
    for &q in rings {
        f.wait_n(q, QD);
        bad += (0..QD).filter(|&k| !resp(f, q, k).good()).count() as u64;
    }
    for (qi, &q) in rings.iter().enumerate() {
        for k in 0..QD {
            let len = if k % 4 == 3 { SSLOT } else { 4096 };
            f.mem.write(area(qi, k, true), &vec![0u8; len as usize]);
            let lba = ((qi * QD + k) as u64 * SSLOT / 512) as u32;
            let c = rw10(false, lba, (len / 512) as u16);
            cmd(f, q, k, 0, k as u64, &c, &[], &segs(area(qi, k, true), len));
        }
    }
    for (qi, &q) in rings.iter().enumerate() {
        f.wait_n(q, QD);
        for k in 0..QD {
            let len = (if k % 4 == 3 { SSLOT } else { 4096 }) as usize;
            let r = resp(f, q, k);
            let same = f.mem.bytes(area(qi, k, false), len) == f.mem.bytes(area(qi, k, true), len);
            bad += (!r.good() || r.resid != 0 || !same) as u64;
        }
    }
    (4 * QD as u64, bad)
}

/// vhost-user-scsi: the same window through the test frontend.
fn scsi_phase(rt: &Runtime, registry: &std::sync::Arc<Registry>, dir: &std::path::Path) {
    let opts = ustor_bdev::modules::RamOpts {
        name: "af_scsi_bdev".into(),
        num_blocks: (64 << 20) / 512,
        block_size: 512,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    };
    ustor_bdev::modules::malloc::create(registry, opts).expect("malloc bdev");
    let ctrl = ScsiController::create(
        rt.handle(),
        ScsiControllerConfig {
            name: "af_scsi".into(),
            socket: dir.join("af_scsi"),
            reactors: vec![0, 1],
            request_queues: 2,
            poll_window: Duration::from_micros(50),
            packed_ring: false,
        },
    )
    .expect("scsi controller");
    ctrl.add_target(registry, 0, "af_scsi_bdev")
        .expect("target 0");
    // Control, events and two request rings (on reactors 0 and 1).
    let mut f = frontend::Fe::connect(&ctrl.config.socket, 4, false);
    let rings = [scsi::REQ0, scsi::REQ0 + 1];
    for &q in &rings {
        scsi::ready(&mut f, q, 0);
    }
    let mut bad = 0;
    for r in 0..20 {
        bad += scsi_round(&mut f, r, &rings).1;
        if r == 10 {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    assert_eq!(bad, 0, "scsi warm-up: failed commands or mismatches");
    ALLOCS.store(0, Ordering::SeqCst);
    if let Ok(mut f) = FIRST.lock() {
        *f = None;
    }
    WINDOW.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    let (mut ios, mut bad) = (0u64, 0u64);
    for r in 20..220 {
        let (n, b) = scsi_round(&mut f, r, &rings);
        ios += n;
        bad += b;
    }
    WINDOW.store(false, Ordering::SeqCst);
    let took = t0.elapsed();
    let allocs = ALLOCS.load(Ordering::SeqCst);
    eprintln!(
        "alloc_free: scsi: {ios} commands on 2 queues in {took:?}, {allocs} reactor allocations"
    );
    assert_eq!(bad, 0, "scsi: failed commands or mismatches in the window");
    assert_eq!(
        allocs,
        0,
        "the scsi data path allocated on a reactor; the first one:\n{}",
        first_alloc()
    );
    drop(f);
    ctrl.stop();
}

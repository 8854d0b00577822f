//! vhost-user-blk against a real frontend without a VM: libblkio's
//! virtio-blk-vhost-user driver (the `blkio` crate) connects to a
//! controller serving a malloc bdev on two reactors. Every case checks the
//! data: what is written is read back (through the frontend and straight
//! from the bdev), discard and write-zeroes read back as zeroes.

use std::mem::MaybeUninit;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use blkio::{Blkio, Blkioq, MemoryRegion, ReqFlags};
use ustor_bdev::Registry;
use ustor_runtime::{IoBuf, PollMode, Runtime, RuntimeConfig};
use ustor_vhost::{BlkController, BlkControllerConfig};

const BDEV_BYTES: u64 = 64 << 20;

/// The tests share two reactors; the coalescing test measures signal
/// rates and takes this for writing, so no other test runs beside it.
static RUN_ALONE: RwLock<()> = RwLock::new(());

struct Fixture {
    registry: Arc<Registry>,
    dir: PathBuf,
    rt: Runtime,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let rt = Runtime::start(RuntimeConfig {
            cores: vec![0, 1],
            pin: false,
            poll_mode: PollMode::Adaptive,
            ..RuntimeConfig::default()
        })
        .expect("runtime starts");
        let registry = Registry::new(Some(rt.handle()));
        let dir = std::env::temp_dir().join(format!("ustor-vhost-blkio-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("socket dir");
        Fixture { registry, dir, rt }
    })
}

/// A malloc bdev and a controller over it, with its own socket.
fn controller(name: &str, queues: u16, read_only: bool) -> Arc<BlkController> {
    let f = fixture();
    let opts = ustor_bdev::modules::RamOpts {
        name: format!("{name}_bdev"),
        num_blocks: BDEV_BYTES / 512,
        block_size: 512,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    };
    ustor_bdev::modules::malloc::create(&f.registry, opts).expect("malloc bdev");
    BlkController::create(
        &f.registry,
        f.rt.handle(),
        BlkControllerConfig {
            name: name.into(),
            socket: f.dir.join(name),
            bdev: format!("{name}_bdev"),
            reactors: vec![0, 1],
            read_only,
            num_queues: queues,
            poll_window: Duration::from_micros(50),
            packed_ring: false,
        },
    )
    .expect("controller")
}

struct Client {
    b: Blkio,
    queues: Vec<Blkioq>,
    mem: MemoryRegion,
}

fn connect(c: &BlkController, queues: i32) -> Client {
    let mut b = Blkio::new("virtio-blk-vhost-user").expect("driver");
    b.set_str("path", c.config.socket.to_str().unwrap())
        .unwrap();
    if c.config.read_only {
        b.set_bool("read-only", true).unwrap();
    }
    b.connect().expect("connect");
    b.set_i32("num-queues", queues).unwrap();
    let out = b.start().expect("start");
    let mem = b.alloc_mem_region(4 << 20).expect("mem region");
    b.map_mem_region(&mem).expect("map region");
    Client {
        b,
        queues: out.queues,
        mem,
    }
}

impl Client {
    fn buf(&self, off: usize) -> *mut u8 {
        (self.mem.addr + off) as *mut u8
    }
    fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.mem.len);
        // SAFETY: inside the region libblkio allocated for us; the test
        // touches it only between requests.
        unsafe { std::slice::from_raw_parts(self.buf(off), len) }
    }
    fn slice_mut(&mut self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.mem.len);
        // SAFETY: as in `slice`; `&mut self` keeps it unique in the test.
        unsafe { std::slice::from_raw_parts_mut(self.buf(off), len) }
    }
    /// Waits for one completion on queue `q`; its `ret`.
    fn wait(&mut self, q: usize) -> i32 {
        let mut c = [MaybeUninit::uninit()];
        let mut t = Duration::from_secs(10);
        let n = self.queues[q]
            .do_io(&mut c, 1, Some(&mut t), None)
            .expect("do_io");
        assert_eq!(n, 1, "no completion within 10 s");
        // SAFETY: do_io initialised the first n entries.
        unsafe { c[0].assume_init_ref() }.ret
    }
    fn write(&mut self, q: usize, start: u64, off: usize, len: usize) -> i32 {
        let p = self.buf(off);
        self.queues[q].write(start, p, len, 0, ReqFlags::empty());
        self.wait(q)
    }
    fn read(&mut self, q: usize, start: u64, off: usize, len: usize) -> i32 {
        let p = self.buf(off);
        self.queues[q].read(start, p, len, 0, ReqFlags::empty());
        self.wait(q)
    }
}

fn pattern(seed: u64, out: &mut [u8]) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for b in out.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

/// Reads bytes straight from the bdev (not through vhost).
fn bdev_bytes(bdev: &str, off: u64, len: usize) -> Vec<u8> {
    let f = fixture();
    let desc = Arc::new(f.registry.open(bdev, false, |_| {}).expect("open"));
    f.rt.handle()
        .block_on(0, move || async move {
            let ch = desc.channel().expect("channel");
            let (r, buf) = ch.read(off / 512, len as u64 / 512, IoBuf::heap(len)).await;
            r.expect("bdev read");
            buf.to_vec()
        })
        .expect("reactor")
}

#[test]
fn reads_and_writes_land_in_the_bdev() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    let c = controller("rw", 1, false);
    let mut cl = connect(&c, 1);
    assert_eq!(cl.b.get_u64("capacity").unwrap(), BDEV_BYTES);
    for (i, (start, len)) in [
        (0u64, 4096usize),
        (512, 512),
        (1 << 20, 128 << 10),
        (BDEV_BYTES - 8192, 8192),
    ]
    .into_iter()
    .enumerate()
    {
        pattern(i as u64, cl.slice_mut(0, len));
        assert_eq!(cl.write(0, start, 0, len), 0, "write {start}+{len}");
        cl.slice_mut(1 << 20, len).fill(0);
        assert_eq!(cl.read(0, start, 1 << 20, len), 0, "read {start}+{len}");
        assert_eq!(
            cl.slice(1 << 20, len),
            cl.slice(0, len),
            "read back {start}+{len}"
        );
        assert_eq!(
            bdev_bytes("rw_bdev", start, len),
            cl.slice(0, len),
            "bdev holds {start}+{len}"
        );
    }
    // Beyond the end: an error, not a crash; the device still works.
    assert_ne!(cl.read(0, BDEV_BYTES, 0, 4096), 0, "read past the end");
    assert_eq!(cl.read(0, 0, 0, 4096), 0);
    // Scatter-gather: three segments into one request.
    pattern(99, cl.slice_mut(0, 12288));
    let iov: Vec<libc::iovec> = (0..3)
        .map(|k| libc::iovec {
            iov_base: cl.buf(k * 4096 + 8192 * k) as *mut libc::c_void,
            iov_len: 4096,
        })
        .collect();
    // Segment k at offset 12288*k: spread them out first.
    let src: Vec<u8> = cl.slice(0, 12288).to_vec();
    for k in 0..3 {
        cl.slice_mut(k * 12288, 4096)
            .copy_from_slice(&src[k * 4096..(k + 1) * 4096]);
    }
    cl.queues[0].writev(65536, iov.as_ptr(), 3, 0, ReqFlags::empty());
    assert_eq!(cl.wait(0), 0, "writev");
    assert_eq!(
        bdev_bytes("rw_bdev", 65536, 12288),
        src,
        "writev landed in order"
    );
    drop(cl);
    c.stop();
}

#[test]
fn flush_discard_write_zeroes() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    let c = controller("dz", 1, false);
    let mut cl = connect(&c, 1);
    pattern(7, cl.slice_mut(0, 65536));
    assert_eq!(cl.write(0, 0, 0, 65536), 0);
    cl.queues[0].flush(0, ReqFlags::empty());
    assert_eq!(cl.wait(0), 0, "flush");
    cl.queues[0].write_zeroes(4096, 8192, 0, ReqFlags::empty());
    assert_eq!(cl.wait(0), 0, "write zeroes");
    let got = bdev_bytes("dz_bdev", 0, 65536);
    assert!(got[4096..12288].iter().all(|&b| b == 0), "zeroed range");
    assert_eq!(
        got[..4096],
        cl.slice(0, 4096)[..],
        "before the zeroed range"
    );
    assert_eq!(got[12288..], cl.slice(12288, 65536 - 12288)[..], "after it");
    cl.queues[0].discard(32768, 32768, 0, ReqFlags::empty());
    assert_eq!(cl.wait(0), 0, "discard");
    let got = bdev_bytes("dz_bdev", 32768, 32768);
    assert!(
        got.iter().all(|&b| b == 0),
        "malloc reads discarded blocks as zeroes"
    );
    drop(cl);
    c.stop();
}

#[test]
fn two_queues_on_two_reactors() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    let c = controller("mq", 2, false);
    let mut cl = connect(&c, 2);
    assert_eq!(cl.queues.len(), 2);
    // Queue q writes its own 1 MiB stripe with 64 requests in flight,
    // then reads it back through the other queue.
    for q in 0..2usize {
        let base = (q as u64) << 20;
        pattern(q as u64 + 10, cl.slice_mut(0, 1 << 20));
        for k in 0..64usize {
            let p = cl.buf(k * 16384);
            cl.queues[q].write(base + (k as u64) * 16384, p, 16384, k, ReqFlags::empty());
        }
        reap(&mut cl, q, 64);
        let other = 1 - q;
        assert_eq!(cl.read(other, base, 2 << 20, 1 << 20), 0);
        assert_eq!(
            cl.slice(2 << 20, 1 << 20),
            cl.slice(0, 1 << 20),
            "queue {q}'s data via queue {other}"
        );
    }
    drop(cl);
    c.stop();
}

/// Waits for `n` completions on queue `q`, each a success.
fn reap(cl: &mut Client, q: usize, n: usize) {
    let mut comps: [MaybeUninit<blkio::Completion>; 64] =
        std::array::from_fn(|_| MaybeUninit::uninit());
    let mut done = 0;
    while done < n {
        let mut t = Duration::from_secs(10);
        let got = cl.queues[q]
            .do_io(&mut comps[..n - done], 1, Some(&mut t), None)
            .unwrap();
        assert!(got > 0, "queue {q}: completions stopped at {done}/{n}");
        for c in &comps[..got] {
            // SAFETY: do_io initialised the first `got` entries.
            assert_eq!(unsafe { c.assume_init_ref() }.ret, 0);
        }
        done += got;
    }
}

/// Puts the process's queues back to ordering by cost, also when the
/// test fails.
struct TakeAll;

impl Drop for TakeAll {
    fn drop(&mut self) {
        ustor_vhost::pace::always_take_all(false);
    }
}

/// The order a queue runs in where requests are dear (the vCPUs on two
/// core complexes): each pass takes its whole batch first, with the
/// chains' lines read ahead and the used index stored once after the
/// batch ran. Forced here on the machine's placement, whatever it is:
/// rounds of 32 writes in flight (a pattern per block), then 32 reads of
/// them in flight, every block compared through the frontend and the
/// bdev; the queue counts requests taken that way.
#[test]
fn passes_that_take_the_batch_first_and_read_ahead_keep_the_data() {
    // Alone: the order is set for every queue of the process.
    let _alone = RUN_ALONE.write().unwrap_or_else(|e| e.into_inner());
    ustor_vhost::pace::always_take_all(true);
    let _back = TakeAll;
    const QD: usize = 32;
    let c = controller("ta", 1, false);
    let mut cl = connect(&c, 1);
    for round in 0..16u64 {
        let block = |k: usize| (round * QD as u64 + k as u64) * 4096;
        for k in 0..QD {
            pattern(block(k), cl.slice_mut(k * 4096, 4096));
            let p = cl.buf(k * 4096);
            cl.queues[0].write(block(k), p, 4096, k, ReqFlags::empty());
        }
        reap(&mut cl, 0, QD);
        cl.slice_mut(1 << 20, QD * 4096).fill(0);
        for k in 0..QD {
            let p = cl.buf((1 << 20) + k * 4096);
            cl.queues[0].read(block(k), p, 4096, k, ReqFlags::empty());
        }
        reap(&mut cl, 0, QD);
        assert_eq!(
            cl.slice(1 << 20, QD * 4096),
            cl.slice(0, QD * 4096),
            "round {round} read back"
        );
        assert_eq!(
            bdev_bytes("ta_bdev", block(0), QD * 4096),
            cl.slice(0, QD * 4096),
            "round {round} in the bdev"
        );
    }
    let s = c.device().queue_stats[0].snapshot();
    assert!(s.read_ahead > 0, "no pass read ahead: {s:?}");
    assert_eq!((s.errors, s.in_flight()), (0, 0), "{s:?}");
    drop(cl);
    c.stop();
}

#[test]
fn read_only_controller_refuses_writes() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    let c = controller("ro", 1, true);
    let mut cl = connect(&c, 1);
    assert!(cl.b.get_bool("read-only").unwrap_or(true));
    cl.slice_mut(0, 4096).fill(0xAB);
    assert_ne!(cl.write(0, 0, 0, 4096), 0, "write to a read-only device");
    assert_eq!(cl.read(0, 0, 0, 4096), 0);
    assert!(
        cl.slice(0, 4096).iter().all(|&b| b == 0),
        "nothing was written"
    );
    drop(cl);
    c.stop();
}

#[test]
fn reconnect_after_the_frontend_leaves() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    let c = controller("rc", 1, false);
    let mut cl = connect(&c, 1);
    pattern(3, cl.slice_mut(0, 4096));
    assert_eq!(cl.write(0, 8192, 0, 4096), 0);
    let want = cl.slice(0, 4096).to_vec();
    drop(cl);
    // The same controller serves the next frontend.
    let mut cl = connect(&c, 1);
    assert_eq!(cl.read(0, 8192, 0, 4096), 0);
    assert_eq!(cl.slice(0, 4096), &want[..]);
    assert_eq!(c.connections_served(), 2);
    drop(cl);
    c.stop();
    assert!(!c.config.socket.exists(), "socket removed at stop");
}

/// The queue depth `stream_writes` keeps.
const QD_STREAM: usize = 32;

/// Keeps `QD` 4 KiB writes in flight on queue 0 for `n` requests, the
/// driver sleeping on its completion eventfd between reaps (as a guest
/// waits for its interrupt). Returns (signals the backend sent, times the
/// frontend woke with completions).
fn stream_writes(c: &BlkController, cl: &mut Client, n: usize, seed: u64) -> (u64, u64) {
    const QD: usize = QD_STREAM;
    let stats = &c.device().queue_stats[0];
    let before = stats.signals.load(std::sync::atomic::Ordering::Relaxed);
    pattern(seed, cl.slice_mut(0, QD * 4096));
    let (mut sent, mut done, mut wakeups) = (0usize, 0usize, 0u64);
    let mut comps: [MaybeUninit<blkio::Completion>; QD] =
        std::array::from_fn(|_| MaybeUninit::uninit());
    while done < n {
        while sent < n && sent - done < QD {
            let k = sent % QD;
            let p = cl.buf(k * 4096);
            cl.queues[0].write((k * 4096) as u64, p, 4096, k, ReqFlags::empty());
            sent += 1;
        }
        let mut t = Duration::from_secs(10);
        let got = cl.queues[0]
            .do_io(&mut comps, 1, Some(&mut t), None)
            .unwrap();
        assert!(got > 0, "completions stopped at {done}/{n}");
        for c in &comps[..got] {
            // SAFETY: do_io initialised the first `got` entries.
            assert_eq!(unsafe { c.assume_init_ref() }.ret, 0, "write failed");
        }
        done += got;
        wakeups += 1;
    }
    let signals = stats.signals.load(std::sync::atomic::Ordering::Relaxed) - before;
    (signals, wakeups)
}

/// Coalescing holds call signals back and loses none. Asserted on the
/// backend's own state, not on a signal rate (two timed phases compared
/// under load flaked): without settings no signal is held; with a delay
/// above the threshold, once the delay is in force (waited for: signals
/// start being held) the stream goes on to its end, signals are held, and
/// fewer signals than requests reach the driver; the data lands.
#[test]
fn coalescing_batches_call_signals() {
    // Alone on the reactors: it drives the queue at full rate.
    let _alone = RUN_ALONE.write().unwrap_or_else(|e| e.into_inner());
    let c = controller("co", 1, false);
    let mut cl = connect(&c, 1);
    cl.queues[0].set_completion_fd_enabled(true);
    let stats = &c.device().queue_stats[0];
    let held = || stats.held.load(std::sync::atomic::Ordering::Relaxed);
    let (sig0, wake0) = stream_writes(&c, &mut cl, 4000, 1);
    assert_eq!(held(), 0, "no settings: every signal goes at once");
    // A delay of 100 µs * (rate - threshold) / threshold above 1000 IOPS
    // (rate and threshold per 10 ms check).
    c.device().set_coalescing(100, 1000);
    // The delay applies after a rate check: write until signals are held
    // (the state the rest asserts on), 30 s at most.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while held() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "coalescing never held a signal back"
        );
        stream_writes(&c, &mut cl, 500, 2);
    }
    let (held0, n) = (held(), 10_000);
    let t0 = std::time::Instant::now();
    let (sig1, wake1) = stream_writes(&c, &mut cl, n, 3);
    let took = t0.elapsed();
    let held1 = held() - held0;
    eprintln!(
        "QD 32 writes: without coalescing {sig0} signals, {wake0} wake-ups for 4000; \
         with {sig1} signals ({held1} held back), {wake1} wake-ups for {n} in {took:?}"
    );
    // Every request was answered (stream_writes waits for each), signals
    // were held, and they covered several completions each.
    assert!(held1 > 0, "no signal held back while coalescing");
    assert!(sig1 < n as u64, "{sig1} signals for {n} requests");
    // Below the threshold again: back to a signal per completion batch.
    c.device().set_coalescing(0, 1000);
    // Nothing lost: the last batch written is in the bdev.
    let got = bdev_bytes("co_bdev", 0, 32 * 4096);
    assert_eq!(got, cl.slice(0, 32 * 4096), "data written while coalescing");
    drop(cl);
    c.stop();
}

#[test]
fn queue_counters_follow_the_requests() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    let c = controller("ct", 1, false);
    let mut cl = connect(&c, 1);
    pattern(5, cl.slice_mut(0, 8192));
    assert_eq!(cl.write(0, 0, 0, 8192), 0);
    assert_eq!(cl.read(0, 0, 8192, 8192), 0);
    assert_eq!(cl.slice(8192, 8192), cl.slice(0, 8192), "read back");
    assert_ne!(cl.read(0, BDEV_BYTES, 0, 4096), 0, "read past the end");
    // Every counter but `signals` is written before the request is
    // returned used, so the driver's completion orders them.
    let s = c.device().queue_stats[0].snapshot();
    assert_eq!(
        (s.requests, s.completed, s.errors, s.resubmitted),
        (3, 3, 1, 0),
        "{s:?}"
    );
    assert_eq!(s.in_flight(), 0);
    // One at a time on a malloc bdev: each ran in the queue task's inline
    // slot, answered in the pass that took it.
    assert_eq!(s.inline, 3, "{s:?}");
    assert!(s.running, "{s:?}");
    assert_eq!(c.frontend_pid(), Some(std::process::id() as i32));
    drop(cl);
    testkit::wait_until("queue stopped", Duration::from_secs(10), || {
        !c.device().queue_stats[0].snapshot().running && c.frontend_pid().is_none()
    });
    c.stop();
}

#[test]
fn hot_removed_bdev_fails_requests() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    let c = controller("hr", 1, false);
    let mut cl = connect(&c, 1);
    pattern(6, cl.slice_mut(0, 4096));
    assert_eq!(cl.write(0, 4096, 0, 4096), 0);
    fixture()
        .registry
        .hot_remove("hr_bdev")
        .expect("hot remove");
    assert!(c.device().removed());
    // New requests fail (IOERR reaches libblkio as an error), none hangs,
    // and the queue goes on answering.
    assert_ne!(cl.read(0, 4096, 0, 4096), 0, "read after removal");
    assert_ne!(cl.write(0, 4096, 0, 4096), 0, "write after removal");
    cl.queues[0].flush(0, ReqFlags::empty());
    assert_ne!(cl.wait(0), 0, "flush after removal");
    let s = c.device().queue_stats[0].snapshot();
    assert_eq!((s.requests, s.errors, s.in_flight()), (4, 3, 0), "{s:?}");
    drop(cl);
    c.stop();
}

/// Writes held at the bdev (a delay bdev) when it is hot-removed: every
/// one is answered with an error (none hangs, none is lost), later
/// requests fail at once, and nothing is left in flight.
#[test]
fn hot_remove_answers_requests_in_flight() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    let f = fixture();
    const N: usize = 16;
    // The removal must find the writes at the bdev: if a stalled machine
    // let them finish first, try again with a longer hold.
    for (attempt, us) in [300_000u64, 2_000_000, 8_000_000].into_iter().enumerate() {
        let base = format!("hf{attempt}_base");
        let opts = ustor_bdev::modules::RamOpts {
            name: base.clone(),
            num_blocks: BDEV_BYTES / 512,
            block_size: 512,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        };
        ustor_bdev::modules::malloc::create(&f.registry, opts).expect("malloc bdev");
        let name = format!("hf{attempt}");
        let p = ustor_vbdev::delay::DelayParams {
            base_bdev_name: base,
            name: format!("{name}_bdev"),
            avg_read_latency: 0,
            p99_read_latency: 0,
            avg_write_latency: us,
            p99_write_latency: us,
            uuid: None,
        };
        ustor_vbdev::delay::create(&f.registry, &Arc::downgrade(&f.registry), p)
            .expect("delay bdev");
        let c = BlkController::create(
            &f.registry,
            f.rt.handle(),
            BlkControllerConfig {
                name: name.clone(),
                socket: f.dir.join(&name),
                bdev: format!("{name}_bdev"),
                reactors: vec![0, 1],
                read_only: false,
                num_queues: 1,
                poll_window: Duration::from_micros(50),
                packed_ring: false,
            },
        )
        .expect("controller");
        let mut cl = connect(&c, 1);
        pattern(7, cl.slice_mut(0, N * 4096));
        for k in 0..N {
            let p = cl.buf(k * 4096);
            cl.queues[0].write(k as u64 * 4096, p, 4096, k, ReqFlags::empty());
        }
        // Submitted without waiting for completions.
        let none: &mut [MaybeUninit<blkio::Completion>] = &mut [];
        cl.queues[0].do_io(none, 0, None, None).expect("submit");
        let q = &c.device().queue_stats[0];
        testkit::wait_until("writes in flight", Duration::from_secs(10), || {
            q.snapshot().in_flight() == N as u64
        });
        f.registry
            .hot_remove(&format!("{name}_bdev"))
            .expect("hot remove");
        let held = q.snapshot().in_flight() == N as u64;
        let failed = (0..N).filter(|_| cl.wait(0) != 0).count();
        if held {
            assert_eq!(failed, N, "writes held at the removal must fail");
        }
        assert_ne!(cl.read(0, 0, 0, 4096), 0, "read after removal");
        let s = q.snapshot();
        assert_eq!((s.requests, s.in_flight()), (N as u64 + 1, 0), "{s:?}");
        drop(cl);
        c.stop();
        if held {
            return;
        }
    }
    panic!("the writes finished before every removal");
}

#[test]
fn resize_reaches_the_config_space() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    let c = controller("rs", 1, false);
    let cl = connect(&c, 1);
    assert_eq!(cl.b.get_u64("capacity").unwrap(), BDEV_BYTES);
    drop(cl);
    let e = fixture().registry.get("rs_bdev").expect("bdev");
    // Shrink (malloc keeps its memory; the range check follows the size).
    assert!(e.resize(BDEV_BYTES / 2 / 512));
    let mut cl = connect(&c, 1);
    assert_eq!(cl.b.get_u64("capacity").unwrap(), BDEV_BYTES / 2);
    assert_eq!(
        cl.read(0, BDEV_BYTES / 2 - 4096, 0, 4096),
        0,
        "new last block"
    );
    assert_ne!(cl.read(0, BDEV_BYTES / 2, 0, 4096), 0, "past the new end");
    drop(cl);
    assert!(e.resize(BDEV_BYTES / 512));
    c.stop();
}

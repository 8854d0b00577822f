//! One virtqueue served on one reactor: the task that takes available
//! chains, and the per-request futures that run them on the bdev with
//! buffers pointing into guest memory (no copy).
//!
//! Adaptive polling: while requests keep coming the task re-polls the
//! avail index every reactor pass (notifications off, so the driver makes
//! no kick syscall); after `poll_window` with nothing new it turns
//! notifications back on (EVENT_IDX: avail_event), checks once more, and
//! parks on the kick eventfd through the reactor's ring. An idle queue
//! costs no CPU. Stopping (GET_VRING_BASE, disconnect) sets a flag and
//! writes the kick eventfd; the task waits for its requests in flight and
//! reports the ring indices back.

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use ustor_bdev::{BdevError, IoChannel};
use ustor_runtime::IoBuf;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap};

use crate::blk::{self, status, Kind, Request, Seg};
use crate::device::BlkDevice;

/// Everything a queue needs to run, sent from the control thread.
pub struct VringStart {
    pub index: u16,
    pub size: u16,
    /// Guest physical addresses of the three parts of the split ring.
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub next_avail: u16,
    pub event_idx: bool,
    pub kick: Arc<File>,
    pub call: Option<Arc<File>>,
    pub mem: GuestMemoryAtomic<GuestMemoryMmap>,
    pub dev: Arc<BlkDevice>,
    pub stop: Arc<AtomicBool>,
    /// Where the task reports `(next_avail, next_used)` once stopped.
    pub done: mpsc::Sender<(u16, u16)>,
}

/// Counters a queue keeps (read by `vhost_get_controllers`).
#[derive(Default)]
pub struct VringStats {
    pub requests: Cell<u64>,
    pub kicks: Cell<u64>,
    pub notifications: Cell<u64>,
    pub errors: Cell<u64>,
}

/// Per-queue state shared by the queue task and its requests (one reactor).
struct Vring {
    queue: RefCell<Queue>,
    ch: IoChannel,
    dev: Arc<BlkDevice>,
    call: Option<Arc<File>>,
    inflight: Cell<u32>,
    /// Reused segment lists, one per request in flight.
    seg_pool: RefCell<Vec<Vec<Seg>>>,
    stats: VringStats,
    broken: Cell<bool>,
}

/// The queue task: spawned on the queue's reactor by the controller.
pub async fn run(s: VringStart) {
    let done = s.done.clone();
    let stop = s.stop.clone();
    let kick = s.kick.clone();
    let mem_atomic = s.mem.clone();
    let v = match setup(s) {
        Ok(v) => Rc::new(v),
        Err(e) => {
            tracing::warn!("vhost: queue not started: {e}");
            // Wait to be stopped so the control side gets its answer.
            while !stop.load(Ordering::Acquire) {
                let _ = ustor_runtime::ops::poll_ready(kick.as_raw_fd(), libc::POLLIN as u32).await;
                drain_eventfd(&kick);
            }
            let _ = done.send((0, 0));
            return;
        }
    };
    let poll_window = v.dev.poll_window;
    let mut last_work = Instant::now();
    while !stop.load(Ordering::Acquire) {
        let mem = mem_atomic.memory().into_inner();
        let n = take_available(&v, &mem);
        if n > 0 {
            last_work = Instant::now();
            ustor_runtime::yield_now().await;
            continue;
        }
        if last_work.elapsed() < poll_window {
            ustor_runtime::yield_now().await;
            continue;
        }
        // Going to sleep: ask for kicks, then look once more (a chain made
        // available between the last look and the re-enable would
        // otherwise wait for the next kick).
        let more = v
            .queue
            .borrow_mut()
            .enable_notification(&*mem)
            .unwrap_or(false);
        drop(mem);
        if !more {
            let _ = ustor_runtime::ops::poll_ready(kick.as_raw_fd(), libc::POLLIN as u32).await;
            drain_eventfd(&kick);
            v.stats.kicks.set(v.stats.kicks.get() + 1);
        }
        let mem = mem_atomic.memory();
        let _ = v.queue.borrow_mut().disable_notification(&*mem);
        last_work = Instant::now();
    }
    // Drain: the indices are reported only once every request taken has
    // been returned used, so a restarted ring repeats nothing.
    while v.inflight.get() > 0 {
        ustor_runtime::sleep(Duration::from_micros(100)).await;
    }
    let q = v.queue.borrow();
    let _ = done.send((q.next_avail(), q.next_used()));
}

fn setup(s: VringStart) -> Result<Vring, String> {
    let ch = s.dev.desc.channel().map_err(|e| e.to_string())?;
    let mut q = Queue::new(s.size).map_err(|e| format!("{e:?}"))?;
    q.set_size(s.size);
    q.set_desc_table_address(Some(s.desc as u32), Some((s.desc >> 32) as u32));
    q.set_avail_ring_address(Some(s.avail as u32), Some((s.avail >> 32) as u32));
    q.set_used_ring_address(Some(s.used as u32), Some((s.used >> 32) as u32));
    q.set_event_idx(s.event_idx);
    q.set_ready(true);
    let mem = s.mem.memory();
    if !q.is_valid(&*mem) {
        return Err(format!("queue {}: ring outside guest memory", s.index));
    }
    q.set_next_avail(s.next_avail);
    // The used index in guest memory is where the previous backend (or
    // this one before a stop) left it.
    let used = q
        .used_idx(&*mem, Ordering::Acquire)
        .map_err(|e| format!("{e:?}"))?;
    q.set_next_used(used.0);
    set_nonblocking(&s.kick);
    Ok(Vring {
        queue: RefCell::new(q),
        ch,
        dev: s.dev,
        call: s.call,
        inflight: Cell::new(0),
        seg_pool: RefCell::new(Vec::new()),
        stats: VringStats::default(),
        broken: Cell::new(false),
    })
}

/// Takes every available chain (at most a ring's worth per call: a budget
/// so one queue cannot hold the reactor) and starts a request for each.
fn take_available(v: &Rc<Vring>, mem: &Arc<GuestMemoryMmap>) -> usize {
    if v.broken.get() {
        return 0;
    }
    let mut descs = blk::chain_buf();
    let mut n = 0;
    let budget = v.queue.borrow().size() as usize;
    while n < budget {
        let chain = {
            let mut q = v.queue.borrow_mut();
            match q.pop_descriptor_chain(&**mem) {
                Some(c) => c,
                None => break,
            }
        };
        n += 1;
        let head = chain.head_index();
        let k = blk::collect_chain(chain, &mut descs);
        let segs = v.seg_pool.borrow_mut().pop().unwrap_or_default();
        match blk::parse_chain(&descs[..k], &**mem, segs) {
            Ok(req) => {
                v.inflight.set(v.inflight.get() + 1);
                v.stats.requests.set(v.stats.requests.get() + 1);
                ustor_runtime::spawn(execute(v.clone(), mem.clone(), head, req));
            }
            Err((e, segs)) => {
                v.seg_pool.borrow_mut().push(segs);
                v.stats.errors.set(v.stats.errors.get() + 1);
                tracing::debug!("vhost-blk: queue request {head}: {e}");
                if let Some(at) = e.status_addr() {
                    let _ = mem.write_obj(status::IOERR, at);
                    complete(v, mem, head, 1);
                } else {
                    complete(v, mem, head, 0);
                }
            }
        }
    }
    n
}

/// Runs one request and returns it used.
async fn execute(v: Rc<Vring>, mem: Arc<GuestMemoryMmap>, head: u16, mut req: Request) {
    let (st, written) = run_request(&v, &mem, &req).await;
    let len = if mem.write_obj(st, req.status).is_ok() {
        written + 1
    } else {
        0
    };
    if st != status::OK {
        v.stats.errors.set(v.stats.errors.get() + 1);
    }
    v.seg_pool.borrow_mut().push(std::mem::take(&mut req.segs));
    v.inflight.set(v.inflight.get() - 1);
    complete(&v, &mem, head, len);
}

/// Adds `head` to the used ring and signals the driver if it asked.
fn complete(v: &Vring, mem: &GuestMemoryMmap, head: u16, len: u32) {
    let mut q = v.queue.borrow_mut();
    if q.add_used(mem, head, len).is_err() {
        // The used ring is not writable: the driver broke the device.
        v.broken.set(true);
        return;
    }
    if q.needs_notification(mem).unwrap_or(true) {
        if let Some(call) = &v.call {
            signal(call);
            v.stats.notifications.set(v.stats.notifications.get() + 1);
        }
    }
}

/// (status, bytes the device wrote into the data segments).
async fn run_request(v: &Vring, mem: &GuestMemoryMmap, req: &Request) -> (u8, u32) {
    let dev = &v.dev;
    match req.kind {
        Kind::Read | Kind::Write => {
            let write = req.kind == Kind::Write;
            if write && dev.read_only {
                return (status::IOERR, 0);
            }
            let Some((off, blocks)) = dev.blocks(req.sector, req.data_len as u64) else {
                return (status::IOERR, 0);
            };
            let r = rw(&v.ch, mem, write, off, blocks, &req.segs).await;
            let r = match r {
                Ok(()) if write && !dev.writeback.load(Ordering::Relaxed) => {
                    v.ch.flush(off, blocks).await
                }
                r => r,
            };
            (bdev_status(r), if write { 0 } else { req.data_len })
        }
        Kind::Flush => (bdev_status(v.ch.flush(0, dev.geometry.num_blocks).await), 0),
        Kind::GetId => match blk::write_id(req, mem, &dev.serial) {
            Ok(n) => (status::OK, n),
            Err(_) => (status::IOERR, 0),
        },
        Kind::Discard | Kind::WriteZeroes => (ranges(v, mem, req).await, 0),
        Kind::Other(_) => (status::UNSUPP, 0),
    }
}

async fn ranges(v: &Vring, mem: &GuestMemoryMmap, req: &Request) -> u8 {
    let dev = &v.dev;
    let discard = req.kind == Kind::Discard;
    if dev.read_only
        || (discard && !dev.geometry.discard)
        || (!discard && !dev.geometry.write_zeroes)
    {
        return if dev.read_only {
            status::IOERR
        } else {
            status::UNSUPP
        };
    }
    let mut list = Vec::with_capacity(blk::MAX_RANGES as usize);
    if blk::read_ranges(req, mem, &mut list).is_err() {
        return status::IOERR;
    }
    for r in &list {
        let Some((off, blocks)) = dev.blocks(r.sector, r.num_sectors as u64 * blk::SECTOR_SIZE)
        else {
            return status::IOERR;
        };
        let res = if discard {
            v.ch.unmap(off, blocks).await
        } else {
            v.ch.write_zeroes(off, blocks).await
        };
        if res.is_err() {
            return bdev_status(res);
        }
    }
    status::OK
}

/// Reads or writes with buffers that point into guest memory.
async fn rw(
    ch: &IoChannel,
    mem: &GuestMemoryMmap,
    write: bool,
    off: u64,
    blocks: u64,
    segs: &[Seg],
) -> Result<(), BdevError> {
    if segs.len() == 1 {
        let buf = guest_buf(mem, segs[0]).ok_or(BdevError::Io(libc::EFAULT))?;
        let (r, _buf) = if write {
            ch.write(off, blocks, buf).await
        } else {
            ch.read(off, blocks, buf).await
        };
        return r;
    }
    let mut bufs = Vec::with_capacity(segs.len());
    for s in segs {
        bufs.push(guest_buf(mem, *s).ok_or(BdevError::Io(libc::EFAULT))?);
    }
    let (r, _bufs) = if write {
        ch.writev(off, blocks, bufs).await
    } else {
        ch.readv(off, blocks, bufs).await
    };
    r
}

/// A buffer over guest memory (checked to lie in one mapped region). The
/// caller holds the `Arc` of the memory map until the I/O is done, so the
/// mapping outlives the buffer.
fn guest_buf(mem: &GuestMemoryMmap, s: Seg) -> Option<IoBuf> {
    let slice = mem.get_slice(s.addr, s.len as usize).ok()?;
    let ptr = NonNull::new(slice.ptr_guard_mut().as_ptr())?;
    // SAFETY: get_slice checked that [addr, addr+len) lies inside one
    // mapped region; the mapping stays alive while the request's
    // Arc<GuestMemoryMmap> does, which outlives the I/O (the future owns
    // both and drops the buffer first). Guest memory is shared with the
    // VM, so no Rust reference to it is created here: the bdev layer
    // reads and writes it through raw pointers (iovecs).
    Some(unsafe { IoBuf::borrowed(ptr, s.len) })
}

fn bdev_status(r: Result<(), BdevError>) -> u8 {
    match r {
        Ok(()) => status::OK,
        Err(BdevError::NotSupported) => status::UNSUPP,
        Err(_) => status::IOERR,
    }
}

fn signal(f: &File) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a valid u64 to an eventfd we hold open.
    let _ = unsafe { libc::write(f.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

/// Wakes a queue task parked on its kick eventfd (used to stop it).
pub fn kick(f: &File) {
    signal(f)
}

fn drain_eventfd(f: &File) {
    let mut v = 0u64;
    // SAFETY: reads at most 8 bytes into a valid u64; the fd is non-blocking.
    let _ = unsafe { libc::read(f.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
}

fn set_nonblocking(f: &File) {
    let fd = f.as_raw_fd();
    // SAFETY: fcntl on a descriptor we hold open; no pointers involved.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
    }
}

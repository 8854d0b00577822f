//! The direct data path: an image's data objects read and written with
//! librados, without librbd (`rbd_direct`, on by default where correct).
//!
//! Why: librbd's I/O path (its dispatch layers, work queues and a second
//! completion hand-off) costs about as much client CPU as librados itself;
//! fio's `rados` engine uses 0.55x the CPU per I/O of its `rbd` engine at
//! QD32 on the same cluster (bench/RESULTS-rbd.md). The kernel's krbd does
//! the same: its own striping over libceph.
//!
//! Where it is correct: librbd stays the image's owner (open, size, resize,
//! header watch, compare-and-write), and the direct path is used only while
//! the image needs nothing of librbd on the data path ([`Layout::probe`]):
//! a format 2 image in its own pool, object size = stripe unit, one
//! stripe; no exclusive lock, object map, fast-diff or journal (each needs
//! librbd's bookkeeping per write), no parent (reads would fall through to
//! it), no snapshots (writes would need the snapshot context). A header
//! change (watch callback) probes again and turns the path off for good
//! when the image stops qualifying (a snapshot taken, a feature enabled).
//!
//! Why exclusive-lock + object-map images (Ceph's defaults) stay on
//! librbd even while this process holds the lock: holding it is possible
//! (`rbd_lock_acquire` turns off librbd's hand-over to other clients), but
//! librbd keeps the object map in memory and trusts it. Its reads (and
//! compare-and-write, discard, shrink) skip an object the map says does
//! not exist, and a write to such an object first updates the map object
//! (`rbd_object_map.<id>`, a cls call) and then librbd's copy. A write made
//! here would have to update the map object itself before the data, and
//! librbd's copy in this process would then be stale: its next read of
//! that object would return zeros, a shrink would leave the object behind.
//! librbd reloads its copy only when it acquires the lock again, and
//! marking the map invalid (what makes librbd assume every object exists)
//! would cost the operator fast-diff until `rbd object-map rebuild`. Not
//! done: see bench/RESULTS-rbd.md for what a correct version would need.
//!
//! Mapping: byte `off` of the image lies in object `off / object_size`,
//! named `<block_name_prefix>.<object number, 16 hex digits>`. A request
//! becomes one rados op per object it touches; it completes when the last
//! one does, with the first error. Holes read as zeros (a missing object,
//! or the part past a short object's end), as librbd reads them.
//! Discard and write-zeroes remove whole objects and zero partial ones
//! (no parent, no snapshots: a removed object reads as zeros).
//!
//! Time limit: a request carries a deadline (`op_timeout_s` of its
//! cluster; an rdtsc and a store per I/O, no timer syscall or Ceph timer
//! event). The channel's reactor looks over its requests once per
//! [`Reqs::period`] and cancels the rados ops of any past its deadline
//! (`rados_aio_cancel`: librados drops the op, so a late reply writes
//! nothing into the I/O's buffers, and completes it with ECANCELED), and
//! the I/O fails with ETIMEDOUT. A completion and a cancel meet on two
//! flags (`Req::deadline`, `Req::cancelling`, sequentially consistent):
//! the completing thread clears the deadline, then waits while a cancel is
//! under way; the reactor raises `cancelling`, then claims the deadline;
//! so the completions it cancels are never released under it.

use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;

use libc::{c_char, c_int, c_void};
use ustor_bdev::io::TABLE_SLOTS;
use ustor_bdev::remote::{Completer, RemoteIo};
use ustor_bdev::{IoDesc, IoType};
use ustor_runtime::ticks;

use crate::bdev::{errno_err, RbdOpts};
use crate::ffi;
use crate::image::Image;

/// Features the direct path handles: layering (only without a parent),
/// striping v2 (only in the default layout), deep-flatten (clones only).
const DIRECT_FEATURES: u64 = 1 | 1 << 1 | 1 << 5;

/// Longest object name: prefix, dot, 16 hex digits, NUL.
const OID_MAX: usize = 64;

/// Where an image's data lives, read from its header through librbd.
#[derive(Clone, Debug)]
pub struct Layout {
    /// `rbd_data.<image id>`.
    prefix: String,
    pub object_size: u64,
}

impl Layout {
    /// The layout when the direct path is correct for `img`, else why not.
    pub(crate) fn probe(img: ffi::rbd_image_t) -> Result<Layout, String> {
        let q = |what: &str, r: c_int| match r {
            r if r < 0 => Err(format!("{what}: {}", std::io::Error::from_raw_os_error(-r))),
            _ => Ok(()),
        };
        let (mut old, mut feat, mut unit, mut count) = (0u8, 0u64, 0u64, 0u64);
        // SAFETY: an open image; each call writes its out-parameter.
        let mut info: ffi::rbd_image_info_t = unsafe { std::mem::zeroed() };
        let mut prefix = [0 as c_char; OID_MAX];
        unsafe {
            q("format", ffi::rbd_get_old_format(img, &mut old))?;
            q("features", ffi::rbd_get_features(img, &mut feat))?;
            q("stripe unit", ffi::rbd_get_stripe_unit(img, &mut unit))?;
            q("stripe count", ffi::rbd_get_stripe_count(img, &mut count))?;
            let sz = std::mem::size_of::<ffi::rbd_image_info_t>();
            q("stat", ffi::rbd_stat(img, &mut info, sz))?;
            q(
                "prefix",
                ffi::rbd_get_block_name_prefix(img, prefix.as_mut_ptr(), 40),
            )?;
        }
        if old != 0 {
            return Err("format 1 image".into());
        }
        if feat & !DIRECT_FEATURES != 0 {
            return Err(format!(
                "features {:#x} need librbd",
                feat & !DIRECT_FEATURES
            ));
        }
        let obj = info.obj_size;
        if !obj.is_power_of_two() || unit != obj || count != 1 {
            return Err(format!(
                "striping (unit {unit}, count {count}, object {obj})"
            ));
        }
        // SAFETY: an open image; without a parent librbd answers -ENOENT
        // before touching the (empty) buffers.
        let nul = std::ptr::null_mut();
        let r = unsafe { ffi::rbd_get_parent_info(img, nul, 0, nul, 0, nul, 0) };
        if r != -libc::ENOENT {
            return Err("a clone (has a parent)".into());
        }
        let (mut max, mut none) = (0 as c_int, 0u64);
        // SAFETY: with `max` 0 librbd writes nothing to the list and
        // answers -ERANGE with the count plus one (or 0: no snapshots).
        let r = unsafe { ffi::rbd_snap_list(img, (&mut none as *mut u64).cast(), &mut max) };
        if !(r == 0 || (r == -libc::ERANGE && max <= 1)) {
            return Err("has snapshots".into());
        }
        // SAFETY: librbd wrote a NUL-terminated prefix into the buffer,
        // which is one byte longer than the length it was given.
        let prefix = unsafe { CStr::from_ptr(prefix.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        if prefix.is_empty() || prefix.len() + 18 > OID_MAX {
            return Err(format!("object prefix `{prefix}`"));
        }
        Ok(Layout {
            prefix,
            object_size: obj,
        })
    }

    /// Object `objno`'s name, NUL-terminated, in `buf` (by hand: it is
    /// made for every piece, and `write!` costs more than the rest of the
    /// mapping).
    fn oid<'a>(&self, objno: u64, buf: &'a mut [u8; OID_MAX]) -> &'a CStr {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        // `probe` checked that prefix, dot, 16 digits and NUL fit.
        let p = self.prefix.as_bytes();
        buf[..p.len()].copy_from_slice(p);
        buf[p.len()] = b'.';
        for (i, b) in buf[p.len() + 1..p.len() + 17].iter_mut().enumerate() {
            *b = HEX[(objno >> (60 - 4 * i) & 0xf) as usize];
        }
        buf[p.len() + 17] = 0;
        CStr::from_bytes_until_nul(buf).unwrap_or_default()
    }
}

impl Image {
    /// Turns the direct data path on when the image allows it; says in
    /// the log which path the image runs.
    pub(crate) fn choose_path(&self, bdev: &str, o: &RbdOpts, rbd_cache: bool) {
        let why = match (o.rbd_direct, o.read_only, Layout::probe(self.handle())) {
            (false, ..) => "rbd_direct is off".to_string(),
            // librbd refuses writes to a read-only image; rados would not.
            (_, true, _) => "read-only".to_string(),
            // Compare-and-write goes through librbd: its cache would not
            // see the direct path's writes.
            _ if rbd_cache => "rbd_cache is on".to_string(),
            (_, _, Err(why)) => why,
            (_, _, Ok(l)) => {
                let size = l.object_size;
                let _ = self.direct.set(l);
                self.direct_on.store(true, Ordering::Release);
                // Bounded by the reactor's deadline instead.
                if self.holds_timeout.swap(false, Ordering::AcqRel) {
                    self.cluster.release_osd_timeout();
                }
                tracing::info!(bdev, image = %self.name, "rbd data path: direct over librados ({size}-byte objects)");
                return;
            }
        };
        tracing::info!(bdev, image = %self.name, "rbd data path: librbd ({why})");
    }

    /// The direct path's layout while it is on.
    pub(crate) fn direct(&self) -> Option<&Layout> {
        self.direct_on
            .load(Ordering::Acquire)
            .then(|| self.direct.get())
            .flatten()
    }
}

/// One object's part of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub objno: u64,
    /// Offset in the object.
    pub obj_off: u64,
    pub len: u64,
    /// Offset in the request.
    pub req_off: u64,
}

/// The objects `[off, off + len)` of an image lies in, in order.
pub fn extents(off: u64, len: u64, object_size: u64) -> impl Iterator<Item = Extent> {
    let mut at = 0u64;
    std::iter::from_fn(move || {
        if at >= len {
            return None;
        }
        let pos = off + at;
        let obj_off = pos % object_size;
        let n = (object_size - obj_off).min(len - at);
        let e = Extent {
            objno: pos / object_size,
            obj_off,
            len: n,
            req_off: at,
        };
        at += n;
        Some(e)
    })
}

/// A data segment of one object's part, and what a read returned into it.
struct Seg {
    buf: *mut u8,
    len: usize,
    /// Offset in the object.
    obj_off: u64,
    bytes_read: usize,
    prval: c_int,
}

/// One rados op of a request: its completion's argument.
struct Piece {
    req: *mut Req,
    objno: u64,
    obj_off: u64,
    len: u64,
    /// Its segments in `Req::segs`.
    segs: std::ops::Range<usize>,
    read_op: ffi::rados_read_op_t,
    write_op: ffi::rados_write_op_t,
    /// Its rados completion, released with the request (a cancel may
    /// still name it after its callback ran).
    c: ffi::rados_completion_t,
}

/// A request in flight, or idle in its channel's [`Reqs`]: given back by
/// the last of its pieces to complete.
pub(crate) struct Req {
    /// Where it goes back to (cloned once, when the box is made).
    pool: Arc<Reqs>,
    /// The I/O, while in flight.
    io: Option<RemoteIo>,
    kind: IoType,
    left: AtomicUsize,
    /// The first error (a positive errno), 0 while none.
    err: AtomicI32,
    /// The image (its health); the channel's `Arc` outlives its I/O.
    image: *const Image,
    /// Owned here, written through `seg_at` (librados fills in reads).
    segs: Vec<Seg>,
    seg_at: *mut Seg,
    pieces: Vec<Piece>,
    /// The tick it times out at while in flight, `u64::MAX` once its
    /// cancel is claimed, 0 when done (see the module doc).
    deadline: AtomicU64,
    /// The reactor is cancelling its ops.
    cancelling: AtomicBool,
}

// SAFETY: a request moves between the reactor that submits it and the
// librados thread that completes it, one at a time (the pool's queue hands
// it over). Its raw pointers (the I/O's buffers, the image) are valid while
// it is in flight and never read while it is idle.
unsafe impl Send for Req {}

/// Most idle requests a channel keeps: as many as it may have in flight
/// (its completion table's slots), so none is ever freed while the
/// channel lives and the deadline check may look at every one made.
const POOL: usize = TABLE_SLOTS;

/// A channel's requests, reused: a request's box and its segment and piece
/// lists are made the first time they are needed and kept with their
/// capacity, so once warm the per-I/O path does not allocate. Taken on the
/// reactor, given back by the librados thread that completes the request
/// (a lock-free queue: one push and one pop per I/O), which also completes
/// the I/O through `completer` (one clone per channel, not per I/O).
pub(crate) struct Reqs {
    free: ArrayQueue<Box<Req>>,
    completer: Completer,
    /// Every request made (the deadline check's list; freed by `drain`).
    all: Mutex<Vec<usize>>,
    /// Ticks an I/O may take (0: no limit).
    timeout: u64,
    timeout_s: u64,
}

impl Reqs {
    pub(crate) fn new(completer: Completer, timeout_s: u64) -> Arc<Reqs> {
        Arc::new(Reqs {
            free: ArrayQueue::new(POOL),
            completer,
            all: Mutex::new(Vec::new()),
            timeout: ticks::from_duration(Duration::from_secs(timeout_s)),
            timeout_s,
        })
    }

    /// How often the reactor should call [`Self::expire`] (`None`: no
    /// limit): a tenth of the limit, at most a second.
    pub(crate) fn period(&self) -> Option<Duration> {
        let tenth = Duration::from_nanos(ticks::to_ns(self.timeout / 10));
        (self.timeout > 0).then(|| tenth.min(Duration::from_secs(1)))
    }

    /// The limit, in whole seconds (for the log).
    pub(crate) fn timeout_s(&self) -> u64 {
        self.timeout_s
    }

    /// Cancels the ops of every request past its deadline (on the
    /// channel's reactor, the thread that submits); how many.
    pub(crate) fn expire(&self) -> usize {
        let now = ticks::now();
        let all = self.all.lock().unwrap_or_else(|p| p.into_inner());
        let mut n = 0;
        for &a in all.iter() {
            // SAFETY: requests are freed only by `drain`, after the channel
            // (and with it this check) is gone; see POOL.
            let r = unsafe { &*(a as *const Req) };
            let d = r.deadline.load(Ordering::SeqCst);
            if d == 0 || d == u64::MAX || d > now {
                continue;
            }
            r.cancelling.store(true, Ordering::SeqCst);
            let claimed = r
                .deadline
                .compare_exchange(d, u64::MAX, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok();
            if claimed {
                n += 1;
                // SAFETY: the request is in flight and its completions are
                // not released while `cancelling` is up; its pieces and
                // image were written on this thread before it was issued.
                let io = unsafe { (*r.image).ioctx() };
                for p in r.pieces.iter().filter(|p| !p.c.is_null()) {
                    // SAFETY: as above. A finished op answers ENOENT.
                    unsafe { ffi::rados_aio_cancel(io, p.c) };
                }
            }
            r.cancelling.store(false, Ordering::SeqCst);
        }
        n
    }

    /// An idle request, its lists empty.
    fn take(self: &Arc<Self>) -> Box<Req> {
        let Some(mut r) = self.free.pop() else {
            let r = Box::new(Req {
                pool: self.clone(),
                io: None,
                kind: IoType::Read,
                left: AtomicUsize::new(0),
                err: AtomicI32::new(0),
                image: std::ptr::null(),
                segs: Vec::new(),
                seg_at: std::ptr::null_mut(),
                pieces: Vec::new(),
                deadline: AtomicU64::new(0),
                cancelling: AtomicBool::new(false),
            });
            let at = &*r as *const Req as usize;
            self.all.lock().unwrap_or_else(|p| p.into_inner()).push(at);
            return r;
        };
        r.segs.clear();
        r.pieces.clear();
        r
    }

    /// Drops the idle requests: each holds an `Arc` of the pool (the
    /// channel calls this when it goes; a request still in flight then
    /// comes back into a pool nobody takes from, and stays there).
    pub(crate) fn drain(&self) {
        while self.free.pop().is_some() {}
        self.all.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// Starts `d` (at image byte `off`, `len` bytes) on the direct path.
/// Flush completes at once: without librbd's cache there is nothing to
/// write back, and a write completes when the OSDs have it.
pub(crate) fn submit(
    img: &Image,
    l: &Layout,
    d: &IoDesc,
    off: u64,
    len: u64,
    pool: &Arc<Reqs>,
    io: RemoteIo,
) {
    if d.kind == IoType::Flush {
        return pool.completer.complete(io, Ok(()));
    }
    let mut req = pool.take();
    req.io = Some(io);
    req.kind = d.kind;
    req.err.store(0, Ordering::Relaxed);
    let t = pool.timeout;
    // Read and claimed on this thread only (`Reqs::expire`).
    req.deadline
        .store(if t > 0 { ticks::now() + t } else { 0 }, Ordering::Relaxed);
    req.image = img;
    // SAFETY: the I/O's segments stay valid until it completes.
    let iov = unsafe { d.iovecs() };
    let data = matches!(d.kind, IoType::Read | IoType::Write);
    for e in extents(off, len, l.object_size) {
        let start = req.segs.len();
        if data {
            split(iov, e, &mut req.segs);
        }
        let segs = start..req.segs.len();
        req.pieces.push(Piece {
            req: std::ptr::null_mut(),
            objno: e.objno,
            obj_off: e.obj_off,
            len: e.len,
            segs,
            read_op: std::ptr::null_mut(),
            write_op: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
        });
    }
    let n = req.pieces.len();
    req.left.store(n, Ordering::Relaxed);
    req.seg_at = req.segs.as_mut_ptr();
    let (kind, segs, pieces) = (req.kind, req.seg_at, req.pieces.as_mut_ptr());
    let req = Box::into_raw(req);
    for i in 0..n {
        // SAFETY: `req` (and its vectors, which no longer change) live
        // until its last piece is done; piece `i` and those after it are
        // not issued yet, so nothing else touches them.
        let p = unsafe { pieces.add(i) };
        let r = unsafe {
            (*p).req = req;
            issue(img, l, kind, segs, p)
        };
        if r < 0 {
            // Refused at once: this piece and the ones not issued yet are
            // done, with this error.
            for j in i..n {
                // SAFETY: as above; the last call gives `req` back.
                unsafe {
                    (*pieces.add(j)).req = req;
                    piece_done(pieces.add(j), r as isize);
                }
            }
            return;
        }
    }
}

/// The segments of `iov` (the request's data) that fall in extent `e`.
fn split(iov: &[libc::iovec], e: Extent, out: &mut Vec<Seg>) {
    let (lo, hi) = (e.req_off, e.req_off + e.len);
    let mut at = 0u64;
    for v in iov {
        let (s, t) = (at, at + v.iov_len as u64);
        at = t;
        if t <= lo || s >= hi {
            continue;
        }
        let (a, b) = (s.max(lo), t.min(hi));
        out.push(Seg {
            // SAFETY: `a - s` is inside this segment.
            buf: unsafe { v.iov_base.cast::<u8>().add((a - s) as usize) },
            len: (b - a) as usize,
            obj_off: e.obj_off + (a - lo),
            bytes_read: 0,
            prval: 0,
        });
    }
}

/// Starts piece `p`; 0 or the negative errno librados refused it with.
///
/// # Safety
/// `p` is a piece of a live request of this `kind`, not issued yet, and
/// `seg_at` that request's segments.
unsafe fn issue(img: &Image, l: &Layout, kind: IoType, seg_at: *mut Seg, p: *mut Piece) -> c_int {
    let (obj_off, len) = ((*p).obj_off, (*p).len);
    let mut name = [0u8; OID_MAX];
    let oid = l.oid((*p).objno, &mut name).as_ptr();
    let io = img.ioctx();
    let mut c: ffi::rados_completion_t = std::ptr::null_mut();
    let r = ffi::rados_aio_create_completion2(p.cast(), Some(on_complete), &mut c);
    if r < 0 {
        return r;
    }
    (*p).c = c;
    let segs_mut = seg_at.add((*p).segs.start);
    let segs = std::slice::from_raw_parts(segs_mut, (*p).segs.len());
    let r = match kind {
        IoType::Read if segs.len() == 1 => {
            ffi::rados_aio_read(io, oid, c, segs[0].buf.cast(), segs[0].len, segs[0].obj_off)
        }
        IoType::Write if segs.len() == 1 => {
            ffi::rados_aio_write(io, oid, c, segs[0].buf.cast(), segs[0].len, segs[0].obj_off)
        }
        IoType::Read => {
            let op = ffi::rados_create_read_op();
            (*p).read_op = op;
            for k in 0..segs.len() {
                let s = segs_mut.add(k);
                ffi::rados_read_op_read(
                    op,
                    (*s).obj_off,
                    (*s).len,
                    (*s).buf.cast(),
                    &mut (*s).bytes_read,
                    &mut (*s).prval,
                );
            }
            ffi::rados_aio_read_op_operate(op, io, c, oid, 0)
        }
        IoType::Write => {
            let op = ffi::rados_create_write_op();
            (*p).write_op = op;
            for s in segs {
                ffi::rados_write_op_write(op, s.buf.cast(), s.len, s.obj_off);
            }
            ffi::rados_aio_write_op_operate(op, io, c, oid, std::ptr::null_mut(), 0)
        }
        // Unmap / WriteZeroes: the extent's bytes.
        _ => {
            if obj_off == 0 && len == l.object_size {
                ffi::rados_aio_remove(io, oid, c)
            } else {
                let op = ffi::rados_create_write_op();
                (*p).write_op = op;
                ffi::rados_write_op_zero(op, obj_off, len);
                ffi::rados_aio_write_op_operate(op, io, c, oid, std::ptr::null_mut(), 0)
            }
        }
    };
    if r < 0 {
        ffi::rados_aio_release(c);
        (*p).c = std::ptr::null_mut();
    }
    r
}

/// librados' completion callback (one of its threads).
unsafe extern "C" fn on_complete(c: ffi::rados_completion_t, arg: *mut c_void) {
    // SAFETY: `arg` is the piece this completion was created for; `c` is
    // that completion (released with the request, in `complete`).
    let r = unsafe { ffi::rados_aio_get_return_value(c) };
    unsafe { piece_done(arg.cast(), r as isize) };
}

/// Piece `p` finished with `r`; the last piece completes the request.
///
/// # Safety
/// `p` is a piece of a live request, done once.
unsafe fn piece_done(p: *mut Piece, r: isize) {
    let req = (*p).req;
    let nsegs = (*p).segs.len();
    let segs = std::slice::from_raw_parts((*req).seg_at.add((*p).segs.start), nsegs);
    if !(*p).read_op.is_null() {
        ffi::rados_release_read_op((*p).read_op);
    }
    if !(*p).write_op.is_null() {
        ffi::rados_release_write_op((*p).write_op);
    }
    let enoent = r == -libc::ENOENT as isize;
    // ENOENT is also what a deleted pool answers (librbd fails the I/O).
    let err = match (*req).kind {
        // Only the deadline cancels.
        _ if r == -libc::ECANCELED as isize => libc::ETIMEDOUT,
        _ if enoent && (*(*req).image).pool_gone() => libc::ENOENT,
        // A missing object is a hole: zeros.
        IoType::Read if enoent => {
            segs.iter().for_each(|s| zero(s, 0));
            0
        }
        IoType::Read if r >= 0 && nsegs == 1 => {
            zero(&segs[0], r as usize);
            0
        }
        IoType::Read if r >= 0 => segs.iter().map(read_seg).find(|&e| e != 0).unwrap_or(0),
        // Nothing to remove or zero in a missing object.
        IoType::Unmap | IoType::WriteZeroes if enoent => 0,
        _ if r < 0 => -r as i32,
        _ => 0,
    };
    if err != 0 {
        let _ = (*req)
            .err
            .compare_exchange(0, err, Ordering::AcqRel, Ordering::Relaxed);
    }
    if (*req).left.fetch_sub(1, Ordering::AcqRel) == 1 {
        complete(Box::from_raw(req));
    }
}

/// A segment of a multi-segment read: its own result; past a short
/// object's end the rest is a hole.
fn read_seg(s: &Seg) -> i32 {
    if s.prval < 0 && s.prval != -libc::ENOENT {
        return -s.prval;
    }
    zero(s, if s.prval < 0 { 0 } else { s.bytes_read });
    0
}

/// Zeros `s` from byte `from` on (a hole).
fn zero(s: &Seg, from: usize) {
    if from < s.len {
        // SAFETY: the segment is the I/O's buffer, valid until it completes.
        unsafe { std::ptr::write_bytes(s.buf.add(from), 0, s.len - from) };
    }
}

/// Completes the I/O of a request whose pieces are all done, and gives the
/// request back to its pool.
fn complete(mut req: Box<Req>) {
    // Done: no cancel starts now; wait for one under way (see the module
    // doc), then the completions can go.
    req.deadline.store(0, Ordering::SeqCst);
    while req.cancelling.load(Ordering::SeqCst) {
        std::hint::spin_loop();
    }
    for p in req.pieces.iter_mut().filter(|p| !p.c.is_null()) {
        // SAFETY: made in `issue` for this piece, released once, here.
        unsafe { ffi::rados_aio_release(p.c) };
        p.c = std::ptr::null_mut();
    }
    // SAFETY: see `Req::image`.
    let img = unsafe { &*req.image };
    let err = req.err.load(Ordering::Acquire);
    let status = if err == 0 {
        img.health.succeeded(&img.name);
        Ok(())
    } else {
        img.health.failed(err, &img.name);
        Err(errno_err(err))
    };
    let io = req.io.take();
    // SAFETY: the pool outlives this call: the channel holds it until its
    // I/O (this one included) has completed, and a request in the pool
    // holds it too (a channel gone early leaves its pool to the requests
    // still in flight). The request goes back before the I/O completes;
    // once back it may be reused at once, so only `pool` is used after.
    let pool = unsafe { &*Arc::as_ptr(&req.pool) };
    let full = pool.free.push(req).err();
    if let Some(io) = io {
        pool.completer.complete(io, status);
    }
    // More than POOL were in flight a moment ago: this one is freed, after
    // the I/O completed (its `Arc` may be the pool's last).
    drop(full);
}

/// Whether [`submit`] takes an I/O of this kind (compare-and-write goes
/// through librbd).
pub(crate) fn takes(kind: IoType) -> bool {
    !matches!(kind, IoType::CompareAndWrite | IoType::Reset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_split_at_object_boundaries() {
        let o = 4 << 20;
        let v: Vec<_> = extents(o - 4096, 12288, o).collect();
        assert_eq!(
            v,
            [
                Extent {
                    objno: 0,
                    obj_off: o - 4096,
                    len: 4096,
                    req_off: 0
                },
                Extent {
                    objno: 1,
                    obj_off: 0,
                    len: 8192,
                    req_off: 4096
                },
            ]
        );
        assert_eq!(extents(0, 0, o).count(), 0);
        let whole: Vec<_> = extents(o, 2 * o, o)
            .map(|e| (e.objno, e.obj_off, e.len))
            .collect();
        assert_eq!(whole, [(1, 0, o), (2, 0, o)]);
    }

    #[test]
    fn segments_follow_the_extents() {
        let mut a = [0u8; 6000];
        let mut b = [0u8; 2192];
        let iov = [
            libc::iovec {
                iov_base: a.as_mut_ptr().cast(),
                iov_len: a.len(),
            },
            libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            },
        ];
        let o = 4096;
        let mut out = Vec::new();
        for e in extents(o - 1000, 8192, o) {
            split(&iov, e, &mut out);
        }
        let v: Vec<_> = out.iter().map(|s| (s.len, s.obj_off)).collect();
        // Object 0: 1000 bytes of a; object 1: 4096 of a; object 2: 904 of
        // a, then b's 2192.
        assert_eq!(v, [(1000, o - 1000), (4096, 0), (904, 0), (2192, 904)]);
        assert_eq!(out[3].buf, b.as_mut_ptr());
    }

    #[test]
    fn object_names_are_the_prefix_and_16_hex_digits() {
        let l = Layout {
            prefix: "rbd_data.1234abcd".into(),
            object_size: 4 << 20,
        };
        let mut b = [0u8; OID_MAX];
        assert_eq!(
            l.oid(0x2a, &mut b).to_str().unwrap(),
            "rbd_data.1234abcd.000000000000002a"
        );
        assert_eq!(
            l.oid(0x0123_4567_89ab_cdef, &mut b).to_str().unwrap(),
            "rbd_data.1234abcd.0123456789abcdef"
        );
    }
}

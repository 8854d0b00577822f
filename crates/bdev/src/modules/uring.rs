//! The uring bdev: a regular file or block device through io_uring.
//!
//! - O_DIRECT by default. The logical block size comes from the device
//!   (BLKSSZGET) or, for files, from statx's DIO alignment; the generic layer
//!   bounces any buffer that breaks it, because ext4 silently turns a
//!   misaligned O_DIRECT request into buffered I/O.
//! - By default I/O goes on the reactor's own ring with the file registered
//!   in the ring's file table: pool buffers as fixed buffers
//!   (READ_FIXED/WRITE_FIXED), other buffers as READV/WRITEV.
//! - `sqpoll` / `iopoll` give each channel a ring of its own with those
//!   flags, registered file and buffers, reaped by an active poller. IOPOLL
//!   is probed at create time: a device without poll queues answers
//!   EOPNOTSUPP, and the bdev falls back to interrupt completions and says so
//!   in its driver info and in the log.
//! - Discard and write-zeroes via fallocate (PUNCH_HOLE / ZERO_RANGE, which
//!   block devices implement as discard/zeroout); flush via fdatasync.

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::rc::Rc;
use std::sync::Arc;

use io_uring::{opcode, squeue, types, IoUring};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use ustor_runtime::{CqeHandler, HandlerId, PollStatus, PollerId};

use super::{check_block_size, parse_params};
use crate::device::{Bdev, BdevChannel, BdevModule, Extent};
use crate::error::{BdevError, ControlError};
use crate::io::IoHandle;
use crate::registry::{BdevEntry, Registry};
use crate::types::{BdevInfo, IoType};

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKSSZGET: libc::c_ulong = 0x1268;
const STATX_DIOALIGN: u32 = 0x2000;

/// `bdev_uring_create` parameters (SPDK's, plus ustor's ring options).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UringOpts {
    pub name: String,
    pub filename: String,
    /// 0: the device's logical block size.
    #[serde(default)]
    pub block_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<uuid::Uuid>,
    /// O_DIRECT (default true).
    #[serde(default = "yes")]
    pub direct: bool,
    /// A per-channel SQPOLL ring (a kernel thread polls submissions).
    #[serde(default)]
    pub sqpoll: bool,
    /// A per-channel IOPOLL ring (polled completions; needs NVMe poll queues).
    #[serde(default)]
    pub iopoll: bool,
}

fn yes() -> bool {
    true
}

pub struct UringBdev {
    info: BdevInfo,
    opts: UringOpts,
    file: Arc<File>,
    is_blockdev: bool,
    iopoll: bool,
    iopoll_note: Option<String>,
}

/// Facts read off the file or device.
struct Geometry {
    size: u64,
    logical: u32,
    mem_align: u32,
    is_blockdev: bool,
}

fn geometry(f: &File, direct: bool) -> std::io::Result<Geometry> {
    let md = f.metadata()?;
    let fd = f.as_raw_fd();
    if md.file_type().is_block_device() {
        let mut size: u64 = 0;
        let mut ss: libc::c_int = 0;
        // SAFETY: ioctls that write a u64 / int to the pointers we pass.
        unsafe {
            if libc::ioctl(fd, BLKGETSIZE64 as _, &mut size) != 0
                || libc::ioctl(fd, BLKSSZGET as _, &mut ss) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
        }
        return Ok(Geometry {
            size,
            logical: ss as u32,
            mem_align: ss as u32,
            is_blockdev: true,
        });
    }
    if !md.file_type().is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file or block device",
        ));
    }
    let (mut logical, mut mem_align) = (512u32, 512u32);
    if direct {
        // SAFETY: statx fills the struct we pass; empty path + AT_EMPTY_PATH
        // queries the fd itself.
        let mut stx: libc::statx = unsafe { std::mem::zeroed() };
        let r = unsafe {
            libc::statx(
                fd,
                c"".as_ptr(),
                libc::AT_EMPTY_PATH,
                STATX_DIOALIGN,
                &mut stx,
            )
        };
        if r == 0 && stx.stx_mask & STATX_DIOALIGN != 0 {
            if stx.stx_dio_offset_align == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::Unsupported,
                    "the file system does not support O_DIRECT on this file (use direct=false)",
                ));
            }
            logical = stx.stx_dio_offset_align;
            mem_align = stx.stx_dio_mem_align.max(1);
        }
    }
    Ok(Geometry {
        size: md.len(),
        logical,
        mem_align,
        is_blockdev: false,
    })
}

/// Reads block 0 and writes the same bytes back through an IOPOLL ring:
/// Ok(true) if polled reads and writes both work (some file systems poll
/// reads but answer EOPNOTSUPP to polled writes).
fn probe_iopoll(f: &File, bs: u32) -> Result<bool, String> {
    let mut ring =
        ustor_runtime::uring::probe_ring(4, true, None).map_err(|e| format!("IOPOLL ring: {e}"))?;
    let mut buf = ustor_runtime::IoBuf::heap(bs as usize);
    let fd = types::Fd(f.as_raw_fd());
    let read = opcode::Read::new(fd, buf.as_mut_ptr(), bs)
        .offset(0)
        .build();
    let write = opcode::Write::new(fd, buf.as_ptr(), bs).offset(0).build();
    for sqe in [read, write] {
        // SAFETY: buf outlives the wait below, which reaps this only SQE.
        unsafe { ring.submission().push(&sqe.user_data(1)) }
            .map_err(|_| "probe SQ full".to_string())?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        let res = loop {
            ring.submit_and_wait(1)
                .map_err(|e| format!("IOPOLL probe: {e}"))?;
            if let Some(c) = ring.completion().next() {
                break c.result();
            }
            if std::time::Instant::now() > deadline {
                return Err("IOPOLL probe: no completion within 2 s".into());
            }
        };
        match res {
            r if r == bs as i32 => {}
            r if -r == libc::EOPNOTSUPP || -r == libc::EINVAL => return Ok(false),
            r if r >= 0 => return Err(format!("IOPOLL probe: short transfer {r}")),
            r => {
                return Err(format!(
                    "IOPOLL probe failed: {}",
                    std::io::Error::from_raw_os_error(-r)
                ))
            }
        }
    }
    Ok(true)
}

impl Bdev for UringBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, t: IoType) -> bool {
        match t {
            IoType::Read | IoType::Write | IoType::Flush | IoType::Reset => true,
            IoType::Unmap | IoType::WriteZeroes => true,
            // A file has no atomic compare-and-write.
            IoType::CompareAndWrite => false,
        }
    }
    /// Writes carry `RWF_DSYNC` (the block layer turns it into REQ_FUA or
    /// a cache flush); fallocate has no such flag, so the generic layer
    /// flushes after a FUA unmap or write-zeroes.
    fn fua_supported(&self, t: IoType) -> bool {
        t == IoType::Write
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        UringChannel::new(self).map(|c| Box::new(c) as Box<dyn BdevChannel>)
    }
    fn config_json(&self) -> Value {
        json!({"method": "bdev_uring_create", "params": self.opts})
    }
    fn block_status(&self, offset_blocks: u64, num_blocks: u64) -> Option<Vec<Extent>> {
        if self.is_blockdev {
            return None;
        }
        file_extents(
            self.file.as_raw_fd(),
            u64::from(self.info.block_size),
            offset_blocks,
            num_blocks,
        )
    }
    fn driver_info(&self) -> Value {
        json!({"uring": {
            "filename": self.opts.filename,
            "block_device": self.is_blockdev,
            "direct": self.opts.direct,
            "sqpoll": self.opts.sqpoll,
            "iopoll_requested": self.opts.iopoll,
            "iopoll": self.iopoll,
            "iopoll_note": self.iopoll_note,
        }})
    }
}

/// Most extents one `block_status` call returns (bounds the work per call;
/// the caller asks again from where the answer ended).
const MAX_EXTENTS: usize = 64;

/// Holes and data of a regular file between two block offsets, by
/// `SEEK_DATA`/`SEEK_HOLE`. A hole reads as zeroes. A boundary inside a
/// block (file system blocks smaller than the bdev's) counts that block as
/// data, so a hole is never claimed for bytes that hold data. `None` if the
/// file system cannot answer.
fn file_extents(fd: RawFd, bs: u64, offset_blocks: u64, num_blocks: u64) -> Option<Vec<Extent>> {
    let end = offset_blocks.checked_add(num_blocks)?.checked_mul(bs)?;
    let mut pos = offset_blocks.checked_mul(bs)?;
    let mut v: Vec<Extent> = Vec::new();
    let seek = |at: u64, whence: i32| -> Result<u64, i32> {
        // SAFETY: lseek on a file descriptor this bdev owns; it only moves
        // the file offset, which no I/O here uses (reads and writes carry
        // their own offsets).
        let r = unsafe { libc::lseek(fd, at as libc::off_t, whence) };
        if r < 0 {
            Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
        } else {
            Ok(r as u64)
        }
    };
    fn push(v: &mut Vec<Extent>, blocks: u64, hole: bool) {
        if blocks == 0 {
            return;
        }
        match v.last_mut() {
            Some(l) if l.hole == hole => l.num_blocks += blocks,
            _ => v.push(Extent {
                num_blocks: blocks,
                hole,
                zero: hole,
            }),
        }
    }
    while pos < end && v.len() < MAX_EXTENTS {
        let data = match seek(pos, libc::SEEK_DATA) {
            Ok(d) => d.min(end),
            // No data from `pos` to the end of the file.
            Err(libc::ENXIO) => end,
            Err(_) => return None,
        };
        if data > pos {
            // A hole up to `data`; only whole blocks of it.
            let hole_end = data / bs * bs;
            if hole_end > pos {
                push(&mut v, (hole_end - pos) / bs, true);
                pos = hole_end;
                continue;
            }
        }
        let hole = match seek(pos, libc::SEEK_HOLE) {
            Ok(h) => h.min(end),
            Err(_) => return None,
        };
        // Data up to the hole, rounded up to a whole block (at least one).
        let data_end = hole.div_ceil(bs).max(pos / bs + 1) * bs;
        let data_end = data_end.min(end);
        push(&mut v, (data_end - pos) / bs, false);
        pos = data_end;
    }
    (!v.is_empty()).then_some(v)
}

/// Completes I/O from CQEs: token = IoHandle token.
struct Completer {
    bs: u64,
    inflight: Cell<usize>,
    resets: RefCell<Vec<IoHandle>>,
    /// For resubmitting on the reactor ring what an own ring refused.
    fd: RawFd,
    handler: Cell<Option<HandlerId>>,
    /// Polled I/Os the device refused (EOPNOTSUPP) and that were redone with
    /// interrupt completions.
    iopoll_fallbacks: Cell<u64>,
    /// Registered-file index on the reactor ring.
    fixed: Cell<Option<u32>>,
}

impl Completer {
    fn done(&self, token: u64, res: i32) {
        self.inflight.set(self.inflight.get() - 1);
        if let Some(io) = IoHandle::from_token(token) {
            let d = io.desc();
            let want = if d.kind.has_data() {
                d.num_blocks * self.bs
            } else {
                0
            };
            let status = if res < 0 {
                Err(BdevError::from_res(res))
            } else if d.kind.has_data() && res as u64 != want {
                // Short transfer inside a range the layer checked: the device
                // shrank or failed part-way. Report it, never return garbage.
                Err(BdevError::Io(libc::EIO))
            } else {
                Ok(())
            };
            io.complete(status);
        }
        if self.inflight.get() == 0 {
            let resets: Vec<IoHandle> = self.resets.borrow_mut().drain(..).collect();
            for r in resets {
                r.complete(Ok(()));
            }
        }
    }
}

impl CqeHandler for Completer {
    fn complete(&self, token: u64, res: i32, _flags: u32) {
        self.done(token, res);
    }
}

/// A per-channel ring (SQPOLL and/or IOPOLL) and the poller that reaps it.
struct OwnRing {
    ring: Rc<RefCell<IoUring>>,
    poller: PollerId,
}

struct UringChannel {
    file: Arc<File>,
    fd: RawFd,
    /// The file's slot in the reactor ring's registered-file table.
    fixed: Option<u32>,
    completer: Rc<Completer>,
    handler: HandlerId,
    own: Option<OwnRing>,
    is_blockdev: bool,
}

impl UringChannel {
    fn new(b: &UringBdev) -> Result<UringChannel, BdevError> {
        let completer = Rc::new(Completer {
            bs: b.info.block_size as u64,
            inflight: Cell::new(0),
            resets: RefCell::new(Vec::new()),
            fd: b.file.as_raw_fd(),
            handler: Cell::new(None),
            iopoll_fallbacks: Cell::new(0),
            fixed: Cell::new(None),
        });
        let handler = ustor_runtime::register_cqe_handler(completer.clone());
        completer.handler.set(Some(handler));
        let mut own = None;
        if b.opts.sqpoll || b.iopoll {
            let ring =
                ustor_runtime::uring::probe_ring(256, b.iopoll, b.opts.sqpoll.then_some(1000))
                    .map_err(|e| BdevError::Io(e.raw_os_error().unwrap_or(libc::EIO)))?;
            if let Some(region) = ustor_runtime::buf::pool_region() {
                // SAFETY: the pool region outlives every channel on this
                // reactor (the reactor drops channels before its pool).
                unsafe { ring.submitter().register_buffers(&[region]) }
                    .map_err(|e| BdevError::Io(e.raw_os_error().unwrap_or(libc::EIO)))?;
            }
            ring.submitter()
                .register_files(&[b.file.as_raw_fd()])
                .map_err(|e| BdevError::Io(e.raw_os_error().unwrap_or(libc::EIO)))?;
            let ring = Rc::new(RefCell::new(ring));
            let (r2, c2) = (ring.clone(), completer.clone());
            let poller = ustor_runtime::register_poller("uring_bdev", move || reap_own(&r2, &c2));
            own = Some(OwnRing { ring, poller });
        }
        let fixed = ustor_runtime::uring::register_file(b.file.as_raw_fd());
        completer.fixed.set(fixed);
        Ok(UringChannel {
            fd: b.file.as_raw_fd(),
            fixed,
            file: b.file.clone(),
            completer,
            handler,
            own,
            is_blockdev: b.is_blockdev,
        })
    }

    fn sqe(&self, io: &IoHandle) -> squeue::Entry {
        let target = if self.own.is_some() {
            Some(0)
        } else {
            self.fixed
        };
        build_sqe(self.fd, self.completer.bs, io, target)
    }
}

/// The SQE for `io`, naming the file by its registered index when it has
/// one (index 0 on a channel's own ring), else by fd.
fn build_sqe(fd_raw: RawFd, bs: u64, io: &IoHandle, fixed: Option<u32>) -> squeue::Entry {
    {
        let d = io.desc();
        let off = d.offset_blocks * bs;
        let len = d.num_blocks * bs;
        let fd = |f: RawFd, fixed: Option<u32>| match fixed {
            Some(i) => types::Fixed(i).into(),
            None => FdOrFixed::Fd(types::Fd(f)),
        };
        let target = fd(fd_raw, fixed);
        // SAFETY: reading the iovecs of an I/O we have not completed.
        let iov = unsafe { d.iovecs() };
        // FUA: durable on completion (only writes look the flag up).
        let rw = if d.kind == IoType::Write && io.flags().fua() {
            libc::RWF_DSYNC
        } else {
            0
        };
        match d.kind {
            IoType::Read | IoType::Write if d.fixed && d.iovcnt == 1 => {
                let (p, l) = (iov[0].iov_base as *mut u8, iov[0].iov_len as u32);
                match (d.kind, target) {
                    (IoType::Read, FdOrFixed::Fd(f)) => {
                        opcode::ReadFixed::new(f, p, l, 0).offset(off).build()
                    }
                    (IoType::Read, FdOrFixed::Fixed(f)) => {
                        opcode::ReadFixed::new(f, p, l, 0).offset(off).build()
                    }
                    (_, FdOrFixed::Fd(f)) => opcode::WriteFixed::new(f, p, l, 0)
                        .offset(off)
                        .rw_flags(rw)
                        .build(),
                    (_, FdOrFixed::Fixed(f)) => opcode::WriteFixed::new(f, p, l, 0)
                        .offset(off)
                        .rw_flags(rw)
                        .build(),
                }
            }
            IoType::Read => match target {
                FdOrFixed::Fd(f) => opcode::Readv::new(f, d.iov, d.iovcnt as u32)
                    .offset(off)
                    .build(),
                FdOrFixed::Fixed(f) => opcode::Readv::new(f, d.iov, d.iovcnt as u32)
                    .offset(off)
                    .build(),
            },
            IoType::Write => match target {
                FdOrFixed::Fd(f) => opcode::Writev::new(f, d.iov, d.iovcnt as u32)
                    .offset(off)
                    .rw_flags(rw)
                    .build(),
                FdOrFixed::Fixed(f) => opcode::Writev::new(f, d.iov, d.iovcnt as u32)
                    .offset(off)
                    .rw_flags(rw)
                    .build(),
            },
            IoType::Flush => match target {
                FdOrFixed::Fd(f) => opcode::Fsync::new(f)
                    .flags(types::FsyncFlags::DATASYNC)
                    .build(),
                FdOrFixed::Fixed(f) => opcode::Fsync::new(f)
                    .flags(types::FsyncFlags::DATASYNC)
                    .build(),
            },
            IoType::Unmap | IoType::WriteZeroes => {
                let mode = if d.kind == IoType::Unmap {
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
                } else {
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
                };
                // Fallocate is not an IOPOLL-able op: always on the reactor ring.
                opcode::Fallocate::new(types::Fd(fd_raw), len)
                    .offset(off)
                    .mode(mode)
                    .build()
            }
            IoType::Reset => unreachable!("reset never reaches the ring"),
            // Not supported: the generic layer never submits it.
            IoType::CompareAndWrite => unreachable!("no compare-and-write on files"),
        }
    }
}

enum FdOrFixed {
    Fd(types::Fd),
    Fixed(types::Fixed),
}

impl From<types::Fixed> for FdOrFixed {
    fn from(f: types::Fixed) -> Self {
        FdOrFixed::Fixed(f)
    }
}

fn reap_own(ring: &Rc<RefCell<IoUring>>, c: &Rc<Completer>) -> PollStatus {
    // Uninitialised: zeroing 1 KiB on every poll of a busy ring showed up
    // as memset in profiles; only the first `n` entries are read.
    let mut done = [std::mem::MaybeUninit::<(u64, i32)>::uninit(); 64];
    let n = {
        let mut r = ring.borrow_mut();
        if c.inflight.get() == 0 && r.submission().is_empty() {
            return PollStatus::Idle;
        }
        if let Err(e) = r.submit() {
            if e.raw_os_error() != Some(libc::EBUSY) && e.raw_os_error() != Some(libc::EAGAIN) {
                tracing::error!("uring bdev ring submit: {e}");
            }
        }
        let mut n = 0;
        for cqe in r.completion() {
            done[n].write((cqe.user_data(), cqe.result()));
            n += 1;
            if n == done.len() {
                break;
            }
        }
        n
    };
    for e in &done[..n] {
        // SAFETY: entries 0..n were written above.
        let (t, res) = unsafe { e.assume_init() };
        if res == -libc::EOPNOTSUPP && resubmit_plain(c, t) {
            continue;
        }
        c.done(t, res);
    }
    // Busy while anything is in flight: polled rings need the reactor awake.
    if n > 0 || c.inflight.get() > 0 {
        PollStatus::Busy
    } else {
        PollStatus::Idle
    }
}

/// Redoes on the reactor ring an I/O that a polled ring refused (IOPOLL on a
/// device or file system that cannot poll this request). Logged once.
fn resubmit_plain(c: &Completer, token: u64) -> bool {
    let (Some(io), Some(h)) = (IoHandle::from_token(token), c.handler.get()) else {
        return false;
    };
    let sqe = build_sqe(c.fd, c.bs, &io, c.fixed.get());
    let token = io.into_token();
    if c.iopoll_fallbacks.get() == 0 {
        tracing::warn!("polled I/O refused with EOPNOTSUPP (no poll queues for this request); using interrupt completions");
    }
    c.iopoll_fallbacks.set(c.iopoll_fallbacks.get() + 1);
    // SAFETY: the I/O's buffers stay in its slot until this completes.
    if unsafe { ustor_runtime::submit_sqe(sqe, h, token) }.is_err() {
        c.done(token, -libc::EAGAIN);
    }
    true
}

impl BdevChannel for UringChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        if d.kind == IoType::Reset {
            if self.completer.inflight.get() == 0 {
                io.complete(Ok(()));
            } else {
                self.completer.resets.borrow_mut().push(io);
            }
            return;
        }
        if d.kind == IoType::Unmap && self.is_blockdev && d.num_blocks == 0 {
            io.complete(Ok(()));
            return;
        }
        let sqe = self.sqe(&io);
        let on_own = self.own.is_some() && !matches!(d.kind, IoType::Unmap | IoType::WriteZeroes);
        let token = io.into_token();
        self.completer
            .inflight
            .set(self.completer.inflight.get() + 1);
        let pushed = if on_own {
            let own = self.own.as_ref().expect("checked");
            let mut r = own.ring.borrow_mut();
            // SAFETY: the iovecs/buffers belong to the I/O slot until the
            // completion for `token` is processed.
            let sqe = sqe.user_data(token);
            let mut ok = unsafe { r.submission().push(&sqe) }.is_ok();
            if !ok {
                let _ = r.submit();
                // SAFETY: as above.
                ok = unsafe { r.submission().push(&sqe) }.is_ok();
            }
            ok
        } else {
            // SAFETY: as above; the completion returns through `handler`.
            unsafe { ustor_runtime::submit_sqe(sqe, self.handler, token) }.is_ok()
        };
        if !pushed {
            self.completer.done(token, -libc::EAGAIN);
        }
    }

    fn outstanding(&self) -> usize {
        self.completer.inflight.get()
    }
}

impl Drop for UringChannel {
    fn drop(&mut self) {
        if let Some(own) = &self.own {
            ustor_runtime::unregister_poller(own.poller);
        }
        ustor_runtime::unregister_cqe_handler(self.handler);
        if let Some(i) = self.fixed {
            ustor_runtime::uring::unregister_file(i);
        }
        let _ = &self.file;
    }
}

/// `bdev_uring_create`.
pub fn create(reg: &Registry, mut opts: UringOpts) -> Result<Arc<BdevEntry>, ControlError> {
    if reg.get(&opts.name).is_some() {
        return Err(ControlError::Exists(opts.name.clone()));
    }
    let mut oo = std::fs::OpenOptions::new();
    oo.read(true).write(true);
    if opts.direct {
        oo.custom_flags(libc::O_DIRECT);
    }
    let file = oo.open(&opts.filename).map_err(|err| ControlError::Os {
        what: format!("opening {}", opts.filename),
        err,
    })?;
    let g = geometry(&file, opts.direct).map_err(|err| ControlError::Os {
        what: format!("inspecting {}", opts.filename),
        err,
    })?;
    let bs = if opts.block_size == 0 {
        g.logical.max(512)
    } else {
        opts.block_size
    };
    check_block_size(bs)?;
    if bs % g.logical != 0 {
        return Err(ControlError::invalid(
            "block_size",
            format!(
                "{bs} is not a multiple of {}'s logical block size {}",
                opts.filename, g.logical
            ),
        ));
    }
    let num_blocks = g.size / bs as u64;
    if num_blocks == 0 {
        return Err(ControlError::invalid(
            "filename",
            format!("{} is smaller than one block", opts.filename),
        ));
    }
    let (mut iopoll, mut note) = (false, None);
    if opts.iopoll {
        if !opts.direct {
            return Err(ControlError::invalid(
                "iopoll",
                "polled I/O needs direct=true",
            ));
        }
        match probe_iopoll(&file, bs) {
            Ok(true) => iopoll = true,
            Ok(false) => {
                let n = format!(
                    "{}: the device has no poll queues (polled I/O returned EOPNOTSUPP); using interrupt completions",
                    opts.filename
                );
                tracing::warn!("{n}");
                note = Some(n);
            }
            Err(e) => return Err(ControlError::invalid("iopoll", e)),
        }
    }
    let uuid = *opts.uuid.get_or_insert_with(uuid::Uuid::new_v4);
    let info = BdevInfo {
        name: opts.name.clone(),
        uuid,
        product_name: "URING bdev".into(),
        module: "uring",
        block_size: bs,
        num_blocks,
        required_alignment: if opts.direct { g.mem_align.max(1) } else { 1 },
        max_transfer_blocks: 0,
        optimal_boundary_blocks: 0,
        write_cache: true,
        // Unmap punches a hole: files read zeroes there, and a block device
        // turns the punch into a zero-out.
        unmap_reads_zero: true,
        memory_resident: false,
    };
    let b = UringBdev {
        info,
        opts,
        file: Arc::new(file),
        is_blockdev: g.is_blockdev,
        iopoll,
        iopoll_note: note,
    };
    reg.register(Arc::new(b))
}

/// The uring module: `bdev_uring_create` / `bdev_uring_delete`, and
/// `uring:PATH` for `ustor bench` (O_DIRECT, the device's block size).
pub struct UringModule;

impl BdevModule for UringModule {
    fn name(&self) -> &'static str {
        "uring"
    }
    fn create(&self, reg: &Registry, params: Value) -> Result<Arc<BdevEntry>, ControlError> {
        create(reg, parse_params(params)?)
    }
    fn inline_spec_syntax(&self) -> Option<&'static str> {
        Some("uring:PATH")
    }
    fn inline_spec(
        &self,
        reg: &Registry,
        arg: &str,
        _block_size: u32,
    ) -> Result<Arc<BdevEntry>, ControlError> {
        let o = UringOpts {
            name: "Uring0".into(),
            filename: arg.to_string(),
            block_size: 0,
            uuid: None,
            direct: true,
            sqpoll: false,
            iopoll: false,
        };
        create(reg, o)
    }
}

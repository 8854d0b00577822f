//! One client connection on one reactor: the shared-secret handshake
//! (Hello, then Auth: HMAC-SHA256 under the export's secret of the client's
//! nonce followed by the server's), under the listener's handshake timeout;
//! then requests on the connection driver with [`FsProto`].
//!
//! Zero copy: a write's header and 12-byte prefix are staged with one
//! receive and never more ([`LOOKAHEAD`]), its payload is received
//! straight into the region ranges
//! `Fs::begin_write` planned; a read's reply leaves with iovecs pointing
//! into the region (holes from a shared zero page). The driver reports any
//! payload it had to copy out of staging, counted in `copied_bytes`.
//!
//! Concurrency: a connection has many requests in flight and answers each
//! when it is done, tagged, in whatever order they finish (the client
//! matches replies by tag; requests in flight together have no order among
//! them, as with NFS: a client orders dependent requests by waiting for
//! the first reply). Lookups, getattr, readdir, readlink, statfs and read
//! planning answer at once on the reactor (memory only). Requests that
//! change the file system, fsync and a write's commit (each persists with
//! `msync`) run on the reactor too when the region lives in memory (tmpfs:
//! the msync does no I/O) and the volume is free; otherwise on the sync
//! pool ([`super::offload`]), so a slow persist never holds up the
//! reactor's other connections or this one's reads. A write to an inode
//! whose previous write on this connection is still committing on the
//! pool waits (the receiver parks) so the second one plans on top of the
//! first, never against a stale inode.
//!
//! A frame the decoder refuses (oversize, unknown op, malformed body) is
//! answered with its errno (EMSGSIZE, ENOSYS, EINVAL) and the connection
//! closes: the stream can no longer be trusted to be in step.

use std::cell::{Cell, RefCell};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard, OnceLock};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use ustor_net::driver::{self, DriverConfig, IoEvent, Protocol, Recv, RecvEvent, Via};
use ustor_net::listener::Accepted;
use ustor_net::recv::recv_exact;
use ustor_net::{PduGroup, Staging};
use ustor_runtime::IoBuf;

use super::offload::offload;
use super::{ExportSvc, Inner};
use crate::fs::{ReadSeg, WritePlan};
use crate::proto::{self, Header, Op, ProtoError, Request, HEADER_LEN, NONCE_LEN};
use crate::serve::{self, Reply};
use crate::{FsError, MAX_WRITE, NAME_MAX};

mod replay;
pub use replay::replay_session;

/// Bytes staged past a header with it: a write's prefix, so a write's
/// header and prefix come in one receive, and a read's whole body (as
/// long: [`proto::WRITE_PREFIX`]), so a read needs no second receive (one
/// ring round trip less per read). Never more: past any frame's header
/// follow its body (staged anyway, or a write's prefix) or the next
/// frame's header (24 bytes, longer than this), so a receive of a header
/// plus this never takes a payload byte into staging (which would have to
/// be copied).
const LOOKAHEAD: usize = proto::WRITE_PREFIX;

/// The staging buffer: a frame's body (all but a write's payload) must fit.
pub(crate) const STAGING_LEN: usize = 64 << 10;

/// Requests received and not yet answered, per connection.
const MAX_OUTSTANDING: usize = 128;
/// Largest Hello body: nonce, name length, name.
const MAX_HELLO: usize = NONCE_LEN + 2 + NAME_MAX;

fn driver_config() -> DriverConfig {
    DriverConfig {
        max_outstanding: MAX_OUTSTANDING,
        max_outstanding_bytes: 64 << 20,
        // Requests on the sync pool at once per connection.
        max_workers: 32,
        staging_len: STAGING_LEN,
        ..DriverConfig::default()
    }
}

/// Zeros for holes, shared by every connection (sent, never written).
fn zeros() -> &'static [u8] {
    static Z: OnceLock<Box<[u8]>> = OnceLock::new();
    Z.get_or_init(|| vec![0u8; MAX_WRITE].into_boxed_slice())
}

/// A reply header with a raw op byte (a refused frame's op may be unknown).
fn raw_header(len: u32, op: u8, tag: u64, errno: u64) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER_LEN + len as usize);
    f.extend_from_slice(&len.to_le_bytes());
    f.extend_from_slice(&[op, 0, 0, 0]);
    f.extend_from_slice(&tag.to_le_bytes());
    f.extend_from_slice(&errno.to_le_bytes());
    f
}

fn proto_errno(e: &ProtoError) -> u64 {
    (match e {
        ProtoError::Oversize(_) => libc::EMSGSIZE,
        ProtoError::UnknownOp(_) => libc::ENOSYS,
        ProtoError::Malformed { .. } => libc::EINVAL,
    }) as u64
}

/// Serves one admitted socket until it closes.
pub(crate) async fn serve(conn: Accepted, svc: Arc<ExportSvc>) {
    let fd = conn.fd.as_raw_fd();
    match conn.handshake(handshake(fd, &svc)).await {
        Some(Ok(true)) => {
            let Accepted { fd, guard, .. } = conn;
            let proto = FsProto {
                svc,
                st: RefCell::new(St::Idle),
                close_after: Cell::new(false),
                in_flight: Cell::new(0),
                align: Cell::new(false),
                committing: RefCell::new(Vec::new()),
            };
            driver::run(fd, proto, driver_config()).await;
            drop(guard);
        }
        Some(Ok(false)) => {}
        Some(Err(e)) => tracing::debug!("fs: handshake ended: {e}"),
        None => tracing::debug!("fs: handshake timed out"),
    }
}

async fn send(fd: RawFd, b: &[u8]) -> io::Result<()> {
    let mut buf = IoBuf::heap(b.len());
    buf.spare_mut()[..b.len()].copy_from_slice(b);
    buf.set_len(b.len());
    ustor_runtime::ops::send_all(fd, buf).await.0
}

/// Receives one handshake frame of `op` with a body of at most `max`;
/// anything else is answered with its errno (`Err` ends the connection).
async fn recv_frame(fd: RawFd, op: Op, max: usize) -> io::Result<(Header, Vec<u8>)> {
    let (r, mut b) = recv_exact(fd, IoBuf::heap(HEADER_LEN), 0, HEADER_LEN).await;
    r?;
    let raw: [u8; HEADER_LEN] = b.spare_mut()[..HEADER_LEN].try_into().expect("header");
    let tag = u64::from_le_bytes(raw[8..16].try_into().expect("tag"));
    let refuse = |errno: i32| raw_header(0, raw[4], tag, errno as u64);
    let h = match proto::decode_header(&raw) {
        Ok(h) if h.op == op && h.len as usize <= max => h,
        Ok(_) => {
            // Nothing but the handshake before it completes.
            send(fd, &refuse(libc::EACCES)).await?;
            return Err(io::Error::other("request before authentication"));
        }
        Err(e) => {
            send(fd, &refuse(proto_errno(&e) as i32)).await?;
            return Err(io::Error::other(e.to_string()));
        }
    };
    let n = h.len as usize;
    let (r, mut b) = recv_exact(fd, IoBuf::heap(n.max(1)), 0, n).await;
    r?;
    Ok((h, b.spare_mut()[..n].to_vec()))
}

/// Hello/Auth; `Ok(true)` when the client proved the secret.
async fn handshake(fd: RawFd, svc: &ExportSvc) -> io::Result<bool> {
    let (h, body) = recv_frame(fd, Op::Hello, MAX_HELLO).await?;
    let (cn, export) = match proto::decode_request(&h, &body) {
        Ok(Request::Hello { nonce, export }) => (nonce, export),
        _ => {
            send(fd, &raw_header(0, h.op as u8, h.tag, libc::EINVAL as u64)).await?;
            return Ok(false);
        }
    };
    if export != svc.vol.name.as_bytes() {
        send(fd, &raw_header(0, h.op as u8, h.tag, libc::ENOENT as u64)).await?;
        return Ok(false);
    }
    let sn = nonce()?;
    let mut r = raw_header(NONCE_LEN as u32, Op::Hello as u8, h.tag, 0);
    r.extend_from_slice(&sn);
    send(fd, &r).await?;
    let (h, body) = recv_frame(fd, Op::Auth, NONCE_LEN).await?;
    let ok = match proto::decode_request(&h, &body) {
        Ok(Request::Auth { mac }) => svc.secret.is_empty() || mac_ok(&svc.secret, &cn, &sn, &mac),
        _ => false,
    };
    let errno = if ok { 0 } else { libc::EACCES as u64 };
    if !ok {
        svc.auth_failures.fetch_add(1, Ordering::Relaxed);
    }
    send(fd, &raw_header(0, Op::Auth as u8, h.tag, errno)).await?;
    Ok(ok)
}

/// Checks the client's MAC in constant time.
pub(crate) fn mac_ok(
    secret: &[u8],
    cn: &[u8; NONCE_LEN],
    sn: &[u8; NONCE_LEN],
    mac: &[u8; NONCE_LEN],
) -> bool {
    let Ok(mut m) = Hmac::<Sha256>::new_from_slice(secret) else {
        return false;
    };
    m.update(cn);
    m.update(sn);
    m.verify_slice(mac).is_ok()
}

fn nonce() -> io::Result<[u8; NONCE_LEN]> {
    use std::io::Read;
    let mut n = [0u8; NONCE_LEN];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut n)?;
    Ok(n)
}

/// Where the receive state machine is.
enum St {
    Idle,
    /// The header is staged; the body prefix is being staged.
    Body(Header),
    /// A write's payload is being received into `plan.segs[seg..]`.
    Write {
        h: Header,
        plan: Box<WritePlan>,
        seg: usize,
    },
    /// A refused write's payload is being skipped; then this reply.
    Skip(FsReply),
}

/// A reply for the sender.
pub(crate) enum FsReply {
    /// Header and body (metadata).
    Bytes(Vec<u8>),
    /// A read: header, then region segments (`at` of them already sent).
    Data {
        head: Option<Vec<u8>>,
        segs: Vec<ReadSeg>,
        at: usize,
    },
}

/// The file service's requests on the connection driver.
pub(crate) struct FsProto {
    svc: Arc<ExportSvc>,
    st: RefCell<St>,
    /// A refused frame was answered: read no more.
    close_after: Cell<bool>,
    /// Requests received whose replies are not yet encoded for the socket.
    in_flight: Cell<u64>,
    /// The frame being received is a Read asking for aligned data
    /// ([`proto::FLAG_ALIGN`]).
    align: Cell<bool>,
    /// Inodes whose write on this connection is committing on the pool
    /// (once each per write in flight).
    committing: RefCell<Vec<u64>>,
}

/// Work for the sync pool.
pub(crate) enum Job {
    /// A request that changes the file system, fsync, or any request that
    /// found the volume busy: header, body, and a read reply's padding
    /// ([`proto::FLAG_ALIGN`]).
    Meta(Header, Vec<u8>, usize),
    /// A write whose payload is in place: persisted and committed.
    Commit(Header, Box<WritePlan>),
    /// A planned read whose pages must come in from the device first.
    Fault(FsReply),
}

/// Runs a job (on a pool thread) and builds its reply.
fn run_job(svc: &ExportSvc, job: Job) -> FsReply {
    match job {
        Job::Meta(h, body, pad) => {
            let rep = match proto::decode_request(&h, &body) {
                Ok(req) => {
                    let mut g = svc.vol.lock();
                    let inner = &mut *g;
                    let r = serve::handle(&mut inner.fs, svc.read_only, &mut inner.st, h.ino, &req);
                    reply(&mut inner.st, &h, r, pad)
                }
                // Decoded once already on the reactor: cannot happen.
                Err(_) => FsReply::Bytes(serve::encode_reply(h.tag, h.op, &Err(FsError::Invalid))),
            };
            fault_in(svc, rep)
        }
        Job::Commit(h, plan) => commit_write(svc, h, *plan),
        Job::Fault(rep) => fault_in(svc, rep),
    }
}

/// Encodes a request's result; a read's data is sent later, from the
/// region segments (counted here as the kernel's copy).
/// `pad` zero bytes go between a read reply's header and its data
/// ([`proto::FLAG_ALIGN`]).
fn reply(st: &mut serve::Stats, h: &Header, r: Result<Reply, FsError>, pad: usize) -> FsReply {
    match r {
        Ok(Reply::Data(segs)) => {
            let total: usize = segs.iter().map(serve::seg_len).sum();
            st.kernel_copied_bytes += total as u64;
            let mut head = serve::encode_reply(h.tag, h.op, &Ok(Reply::Data(Vec::new())));
            head[..4].copy_from_slice(&((total + pad) as u32).to_le_bytes());
            head[5] = pad as u8;
            head.resize(HEADER_LEN + pad, 0);
            FsReply::Data {
                head: Some(head),
                segs,
                at: 0,
            }
        }
        r => FsReply::Bytes(serve::encode_reply(h.tag, h.op, &r)),
    }
}

/// Brings a read's region pages into memory (on a pool thread) so the
/// reactor's send never waits for the device.
fn fault_in(svc: &ExportSvc, rep: FsReply) -> FsReply {
    if let FsReply::Data { segs, .. } = &rep {
        if svc.vol.may_fault {
            for s in segs {
                if let ReadSeg::Region { off, len } = *s {
                    // SAFETY: read_plan ranges lie inside the region.
                    crate::media::populate(unsafe { svc.vol.base.add(off) }, len);
                }
            }
        }
    }
    rep
}

/// Makes a received write durable (data, then the metadata pointing to
/// it) and answers the file's attributes.
fn commit_write(svc: &ExportSvc, h: Header, plan: WritePlan) -> FsReply {
    commit_locked(&mut svc.vol.lock(), h, plan)
}

/// [`commit_write`] with the volume's lock held.
fn commit_locked(inner: &mut Inner, h: Header, plan: WritePlan) -> FsReply {
    let len: usize = plan.segs.iter().map(|s| s.1).sum();
    let before = inner.fs.conflict_copied;
    let r = inner
        .fs
        .finish_write(plan)
        .and_then(|_| inner.fs.getattr(h.ino));
    inner.st.copied_bytes += inner.fs.conflict_copied - before;
    match &r {
        Ok(_) => {
            inner.st.bytes_written += len as u64;
            inner.st.kernel_copied_bytes += len as u64;
        }
        Err(_) => inner.st.errors += 1,
    }
    let r = r.map(Reply::Attr);
    FsReply::Bytes(serve::encode_reply(h.tag, h.op, &r))
}

impl FsProto {
    /// Answers a refused frame with its errno; the connection then closes
    /// (the stream is out of step).
    fn refuse(&self, raw: &[u8], e: &ProtoError) -> Recv<Self> {
        let tag = u64::from_le_bytes(raw[8..16].try_into().expect("tag"));
        tracing::debug!("fs: refused frame: {e}");
        self.close_after.set(true);
        *self.st.borrow_mut() = St::Idle;
        Recv::Reply(FsReply::Bytes(raw_header(0, raw[4], tag, proto_errno(e))))
    }

    /// A header is staged: decode it and stage the body prefix.
    fn header(&self, st: &mut Staging) -> Recv<Self> {
        // Every header gets exactly one reply (`encode` counts it down).
        let n = self.in_flight.get() + 1;
        self.in_flight.set(n);
        self.svc.max_in_flight.fetch_max(n, Ordering::Relaxed);
        let raw: [u8; HEADER_LEN] = st.peek(HEADER_LEN).try_into().expect("header");
        let h = match proto::decode_header(&raw) {
            Ok(h) => h,
            Err(e) => return self.refuse(&raw, &e),
        };
        self.align
            .set(h.op == Op::Read && proto::header_flags(&raw) & proto::FLAG_ALIGN != 0);
        let pre = proto::body_prefix(&h);
        if pre > STAGING_LEN {
            // Only a write's payload may be that long (received in place);
            // no other body comes near it.
            return self.refuse(&raw, &ProtoError::Oversize(h.len.into()));
        }
        st.consume(HEADER_LEN);
        *self.st.borrow_mut() = St::Body(h);
        if pre == 0 {
            return self.body(st);
        }
        Recv::Stage {
            need: pre,
            max: pre,
        }
    }

    /// The body prefix is staged: run the request (or plan the write).
    fn body(&self, st: &mut Staging) -> Recv<Self> {
        let St::Body(h) = std::mem::replace(&mut *self.st.borrow_mut(), St::Idle) else {
            return Recv::Close;
        };
        let pre = proto::body_prefix(&h);
        let req = match proto::decode_request(&h, st.peek(pre)) {
            Ok(r) => r,
            Err(e) => {
                let raw = proto::encode_header(&h);
                return self.refuse(&raw, &e);
            }
        };
        if let Request::Write { off, len } = req {
            if self.committing.borrow().contains(&h.ino) {
                // Its previous write is committing: plan on top of it.
                *self.st.borrow_mut() = St::Body(h);
                return Recv::Park;
            }
            st.consume(pre);
            return self.begin_write(h, off, len);
        }
        if serve::mutates(&req) || matches!(req, Request::Fsync) {
            if let Some(mut g) = self.quick() {
                let inner = &mut *g;
                let r = serve::handle(
                    &mut inner.fs,
                    self.svc.read_only,
                    &mut inner.st,
                    h.ino,
                    &req,
                );
                let rep = reply(&mut inner.st, &h, r, 0);
                drop(g);
                st.consume(pre);
                return Recv::Reply(rep);
            }
            let body = st.peek(pre).to_vec();
            st.consume(pre);
            return Recv::Dispatch(Job::Meta(h, body, 0));
        }
        let r = self.answer(h, &req, st.peek(pre));
        st.consume(pre);
        r
    }

    /// The volume's lock, for a commit or a metadata change to run here
    /// on the reactor: only on a region whose pages never leave memory
    /// (tmpfs, [`crate::media::may_fault`] false), where persisting is an
    /// msync that returns without I/O, and only when the lock is free
    /// now. The pool would cost two thread wake-ups per request (there and
    /// back), the larger part of a small request's latency; a region on a
    /// device or a disk file keeps its commits on the pool.
    fn quick(&self) -> Option<MutexGuard<'_, Inner>> {
        if self.svc.vol.may_fault {
            return None;
        }
        self.svc.vol.try_lock()
    }

    /// Lookups, getattr, readdir, readlink, statfs and reads answer here
    /// unless that could block the reactor: the volume is busy (a commit
    /// holds it: the pool runs the request) or a read's pages are not in
    /// memory (the pool brings them in). `raw` is the request's body.
    fn answer(&self, h: Header, req: &Request<'_>, raw: &[u8]) -> Recv<Self> {
        let is_read = matches!(req, Request::Read { .. });
        let pad = if is_read && self.align.get() {
            proto::READ_DATA_AT - HEADER_LEN
        } else {
            0
        };
        let Some(mut g) = self.svc.vol.try_lock() else {
            if is_read {
                self.svc.reads_offloaded.fetch_add(1, Ordering::Relaxed);
            }
            return Recv::Dispatch(Job::Meta(h, raw.to_vec(), pad));
        };
        let inner = &mut *g;
        let r = serve::handle(&mut inner.fs, self.svc.read_only, &mut inner.st, h.ino, req);
        let rep = reply(&mut inner.st, &h, r, pad);
        drop(g);
        if self.svc.vol.may_fault && !self.in_memory(&rep) {
            self.svc.reads_offloaded.fetch_add(1, Ordering::Relaxed);
            return Recv::Dispatch(Job::Fault(rep));
        }
        Recv::Reply(rep)
    }

    /// Whether a read's region segments are all in memory (sending them
    /// from the reactor cannot block on the device).
    fn in_memory(&self, rep: &FsReply) -> bool {
        let FsReply::Data { segs, .. } = rep else {
            return true;
        };
        segs.iter().all(|s| match *s {
            // SAFETY: read_plan ranges lie inside the region.
            ReadSeg::Region { off, len } => {
                crate::media::resident(unsafe { self.svc.vol.base.add(off) }, len)
            }
            ReadSeg::Zero(_) => true,
        })
    }

    fn begin_write(&self, h: Header, off: u64, len: u32) -> Recv<Self> {
        let vol = &self.svc.vol;
        let mut g = vol.lock();
        g.st.requests += 1;
        let plan = if self.svc.read_only {
            Err(FsError::ReadOnly)
        } else {
            g.fs.begin_write(h.ino, off, len as usize)
        };
        match plan {
            Ok(plan) => {
                drop(g);
                *self.st.borrow_mut() = St::Write {
                    h,
                    plan: Box::new(plan),
                    seg: 0,
                };
                self.next_seg()
            }
            Err(e) => {
                g.st.errors += 1;
                let r = FsReply::Bytes(serve::encode_reply(h.tag, h.op, &Err(e)));
                *self.st.borrow_mut() = St::Skip(r);
                Recv::Skip(len as u64)
            }
        }
    }

    /// The one-copy ablation: the payload of the range just received into
    /// `buf` is copied into the region (counted in `copied_bytes`).
    fn copy_in(&self, buf: &IoBuf) {
        let s = self.st.borrow();
        let St::Write { plan, seg, .. } = &*s else {
            return;
        };
        let Some(&(o, n)) = seg.checked_sub(1).and_then(|i| plan.segs.get(i)) else {
            return;
        };
        let n = n.min(buf.len());
        // SAFETY: the planned range `o..o + n` is this write's own (see
        // `next_seg`) and `buf` holds the `n` bytes just received.
        unsafe {
            std::ptr::copy_nonoverlapping(buf.as_ptr(), self.svc.vol.base.add(o), n);
        }
        self.svc.vol.lock().st.copied_bytes += n as u64;
    }

    /// Receives the next planned range, or finishes the write.
    fn next_seg(&self) -> Recv<Self> {
        let mut s = self.st.borrow_mut();
        let St::Write { plan, seg, .. } = &mut *s else {
            return Recv::Close;
        };
        if let Some(&(o, n)) = plan.segs.get(*seg) {
            *seg += 1;
            if self.svc.copy_writes {
                // The ablation: into a buffer first (`RecvEvent::Payload`
                // copies it into the region).
                return Recv::Payload {
                    buf: None,
                    off: 0,
                    len: n,
                    via: Via::Direct { tail: 0 },
                };
            }
            // SAFETY: `o..o + n` lies inside the region (planned by
            // begin_write, checked against the geometry), the mapping lives
            // as long as the volume this connection holds, and the planned
            // blocks are the write's own until finish/abort: freed blocks
            // are deferred while a write is planned, so nothing else is
            // handed these bytes meanwhile.
            let buf = unsafe {
                IoBuf::borrowed(NonNull::new_unchecked(self.svc.vol.base.add(o)), n as u32)
            };
            return Recv::Payload {
                buf: Some(buf),
                off: 0,
                len: n,
                via: Via::Direct { tail: 0 },
            };
        }
        let St::Write { h, plan, .. } = std::mem::replace(&mut *s, St::Idle) else {
            return Recv::Close;
        };
        drop(s);
        if let Some(mut g) = self.quick() {
            return Recv::Reply(commit_locked(&mut g, h, *plan));
        }
        self.committing.borrow_mut().push(h.ino);
        Recv::Dispatch(Job::Commit(h, plan))
    }
}

impl Protocol for FsProto {
    type Job = Job;
    type Reply = FsReply;

    fn apply(&self, ev: RecvEvent, st: &mut Staging) -> Recv<Self> {
        match ev {
            RecvEvent::Next if self.close_after.get() => Recv::Close,
            RecvEvent::Next => Recv::Stage {
                need: HEADER_LEN,
                max: HEADER_LEN + LOOKAHEAD,
            },
            RecvEvent::Staged => {
                if matches!(*self.st.borrow(), St::Body(_)) {
                    self.body(st)
                } else {
                    self.header(st)
                }
            }
            RecvEvent::Payload(buf) => {
                if self.svc.copy_writes {
                    self.copy_in(&buf);
                }
                self.next_seg()
            }
            RecvEvent::Skipped => match std::mem::replace(&mut *self.st.borrow_mut(), St::Idle) {
                St::Skip(r) => Recv::Reply(r),
                _ => Recv::Close,
            },
            // A write parked behind its inode's commit.
            RecvEvent::Resumed => self.body(st),
        }
    }

    fn may_resume(&self) -> bool {
        match &*self.st.borrow() {
            St::Body(h) => !self.committing.borrow().contains(&h.ino),
            _ => true,
        }
    }

    async fn execute(&self, job: Job) -> FsReply {
        let commit = match &job {
            Job::Commit(h, _) => Some(h.ino),
            Job::Meta(..) | Job::Fault(_) => None,
        };
        self.svc.offloaded.fetch_add(1, Ordering::Relaxed);
        let svc = self.svc.clone();
        let r = offload(move || run_job(&svc, job)).await;
        if let Some(ino) = commit {
            let mut c = self.committing.borrow_mut();
            if let Some(i) = c.iter().position(|&x| x == ino) {
                c.swap_remove(i);
            }
        }
        r
    }

    fn encode(&self, reply: FsReply, g: &mut PduGroup) -> Result<(), FsReply> {
        let r = match reply {
            FsReply::Bytes(b) => encode_bytes(b, g),
            FsReply::Data { head, segs, at } => self.encode_data(head, segs, at, g),
        };
        if r.is_ok() {
            self.in_flight.set(self.in_flight.get().saturating_sub(1));
        }
        r
    }

    fn on_close(&self) {
        // A client that vanished mid-write: its fresh blocks go back.
        if let St::Write { plan, .. } = std::mem::replace(&mut *self.st.borrow_mut(), St::Idle) {
            self.svc.vol.lock().fs.abort_write(*plan);
        }
    }

    fn zero_copy_done(&self) -> Option<ustor_net::zc::ZcSink> {
        super::zc::sink(&self.svc)
    }

    fn on_io(&self, ev: IoEvent) {
        if let IoEvent::Copied { bytes } = ev {
            self.svc.vol.lock().st.copied_bytes += bytes as u64;
        }
    }
}

impl FsProto {
    fn encode_data(
        &self,
        mut head: Option<Vec<u8>>,
        segs: Vec<ReadSeg>,
        mut at: usize,
        g: &mut PduGroup,
    ) -> Result<(), FsReply> {
        if let Some(h) = head.take() {
            if !g.fits(h.len(), 1, 1) {
                return Err(FsReply::Data {
                    head: Some(h),
                    segs,
                    at,
                });
            }
            g.push_bytes(&h);
        }
        // Zero copy (super::zc): this group then holds a pin until the
        // kernel's notification.
        if at < segs.len() && g.fits(0, 0, 1) {
            super::zc::hold(&self.svc, &segs[at..], g);
        }
        while at < segs.len() {
            if !g.fits(0, 0, 1) {
                // The rest goes first in the next group: the stream stays
                // in order.
                g.end_pdu(false);
                return Err(FsReply::Data { head, segs, at });
            }
            let (ptr, len) = match segs[at] {
                ReadSeg::Region { off, len } => {
                    // SAFETY: read_plan ranges lie inside the region.
                    (unsafe { self.svc.vol.base.add(off) } as *const u8, len)
                }
                ReadSeg::Zero(len) => (zeros().as_ptr(), len),
            };
            // SAFETY: the region stays mapped while this connection holds
            // its volume (the sender finishes before the protocol drops);
            // the zero page is static. A write racing this read on another
            // connection may show through, as with any shared file.
            unsafe { g.push_raw(ptr, len) };
            at += 1;
        }
        g.end_pdu(false);
        Ok(())
    }
}

fn encode_bytes(b: Vec<u8>, g: &mut PduGroup) -> Result<(), FsReply> {
    if b.is_empty() {
        return Ok(());
    }
    // Small replies go into the arena; a large body (readdir) by value.
    if b.len() <= 512 {
        if !g.fits(b.len(), 1, 0) {
            return Err(FsReply::Bytes(b));
        }
        g.push_bytes(&b);
    } else {
        if !g.fits(HEADER_LEN, 1, 1) {
            return Err(FsReply::Bytes(b));
        }
        g.push_bytes(&b[..HEADER_LEN]);
        let n = b.len() - HEADER_LEN;
        let mut buf = IoBuf::heap(n);
        buf.spare_mut()[..n].copy_from_slice(&b[HEADER_LEN..]);
        buf.set_len(n);
        g.push_data(buf, 0, n);
    }
    g.end_pdu(false);
    Ok(())
}

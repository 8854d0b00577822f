//! One client connection, owned by one reactor for its whole life.
//!
//! The handshake drives [`Negotiation`] with exact reads and full sends. In
//! transmission three kinds of task share the connection state:
//! - the receiver reads requests greedily into a staging buffer (one
//!   receive brings every header, and every small write payload, the client
//!   has sent), validates them and queues jobs. Small write payloads (up to
//!   [`COPY_MAX`]) are copied once from staging into a pool buffer (counted
//!   in `payload_copies`): a 4 KiB copy costs far less than the receive and
//!   the loop pass that receiving each payload on its own would. Larger
//!   payloads are received straight into the pool buffer the device writes
//!   from. The receiver stops reading while the outstanding-request or
//!   outstanding-byte budget is spent (backpressure, bounded memory);
//! - workers (spawned on demand, at most [`MAX_WORKERS`], then reused) run
//!   jobs against the device channel, so requests complete and are answered
//!   out of order;
//! - the sender gathers every reply queued since its last send (up to
//!   `BATCH_REPLIES`, 64) into one non-blocking `sendmsg`: read data goes out
//!   of the buffer the device filled. At QD1 a reply is sent in the loop pass
//!   that completed it; under load every reply completed in a pass leaves
//!   with one syscall.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::poll_fn;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Poll, Waker};

use ustor_runtime::{ops, spawn, IoBuf};

use super::backend::{Channel, ExportSource};
use super::io::{recv_exact, OutReply, SendBatch};
use super::stats::{bump, inc, Counters};
use super::Shared;
use crate::export::ExportFeatures;
use crate::negotiation::{Event, Negotiation, Step};
use crate::reply::{self, ReplyHeader};
use crate::request::{self, Command, RequestError, TransmissionParams};
use crate::wire::{self, BlockDescriptor, NbdErrno, REQUEST_HEADER_LEN};

/// Requests one connection may have received and not yet answered.
pub const MAX_OUTSTANDING: usize = 256;
/// Payload bytes one connection may hold in flight (reads and writes).
pub const MAX_OUTSTANDING_BYTES: u64 = 64 << 20;
/// Worker tasks per connection (concurrent device operations).
pub const MAX_WORKERS: usize = 128;
/// Extents returned in one BLOCK_STATUS reply.
const MAX_EXTENTS: usize = 64;
/// Write payloads up to this size are received through the staging buffer
/// and copied once into their pool buffer; larger ones are received in
/// place.
pub const COPY_MAX: usize = 32 << 10;

/// Serves one accepted socket until it closes.
pub(crate) async fn serve<S: ExportSource>(fd: OwnedFd, shared: Arc<Shared<S>>) {
    bump(|c| inc(&c.connections_served, 1));
    match handshake(fd.as_raw_fd(), &shared).await {
        Ok(Some((source, params))) => match source.source.channel() {
            Ok(channel) => transmission(fd, channel, params, source.features()).await,
            Err(e) => tracing::warn!("nbd: export {} has no channel: {e}", source.name),
        },
        Ok(None) => bump(|c| inc(&c.handshakes_failed, 1)),
        Err(e) => {
            tracing::debug!("nbd: handshake ended: {e}");
            bump(|c| inc(&c.handshakes_failed, 1));
        }
    }
    bump(|c| inc(&c.connections_closed, 1));
    shared.connection_closed();
}

type Chosen<S> = (Arc<super::ExportEntry<S>>, TransmissionParams);

/// Runs option haggling; `Ok(None)` when it ended without transmission.
async fn handshake<S: ExportSource>(
    fd: RawFd,
    shared: &Arc<Shared<S>>,
) -> io::Result<Option<Chosen<S>>> {
    let limits = shared.limits;
    let mut neg = Negotiation::new(limits);
    let mut out = Vec::with_capacity(1024);
    let mut inbuf = IoBuf::heap(limits.max_option_payload as usize);
    let mut step = neg.apply(&**shared, Event::Start, &mut out);
    let mut scratch = IoBuf::heap(64 << 10);
    loop {
        if !out.is_empty() {
            let mut sendbuf = IoBuf::heap(out.len());
            sendbuf.copy_from_slice(&out);
            out.clear();
            ustor_runtime::ops::send_all(fd, sendbuf).await.0?;
        }
        step = match step {
            Step::Read(n) => {
                let (res, b) = recv_exact(fd, inbuf, 0, n).await;
                inbuf = b;
                res?;
                neg.apply(&**shared, Event::Bytes(&inbuf.spare_mut()[..n]), &mut out)
            }
            Step::Discard(n) => {
                let (res, b) = super::io::discard(fd, scratch, u64::from(n)).await;
                scratch = b;
                res?;
                neg.apply(&**shared, Event::Discarded, &mut out)
            }
            Step::Transmission(n) => return Ok(Some((n.handle, n.params))),
            Step::Close(reason) => {
                tracing::debug!("nbd: handshake closed: {reason}");
                return Ok(None);
            }
        };
    }
}

/// A request handed from the receiver to a worker.
struct Job {
    cookie: u64,
    command: Command,
    /// Write payload, already received.
    payload: Option<IoBuf>,
}

/// State shared by the tasks of one connection (all on one reactor).
struct Conn<C> {
    fd: OwnedFd,
    channel: C,
    params: TransmissionParams,
    features: ExportFeatures,
    jobs: RefCell<VecDeque<Job>>,
    /// Parked workers, by index into `worker_slots`.
    idle_workers: RefCell<Vec<usize>>,
    worker_slots: Box<[WorkerSlot]>,
    workers: Cell<usize>,
    /// Block-status chunks are encoded here (no allocation per request).
    scratch: RefCell<Vec<u8>>,
    replies: RefCell<VecDeque<OutReply>>,
    /// Received and not yet answered on the wire.
    outstanding: Cell<usize>,
    outstanding_bytes: Cell<u64>,
    receiver: RefCell<Option<Waker>>,
    sender: RefCell<Option<Waker>>,
    /// No more requests will be read (DISC, EOF, protocol error).
    closing: Cell<bool>,
    /// The socket failed: replies can no longer be sent.
    dead: Cell<bool>,
}

/// A worker's parking place. A worker is in `idle_workers` exactly while
/// `parked` is set, so spurious polls (a device that completes inline wakes
/// its task while it is being polled) never enter it twice.
#[derive(Default)]
struct WorkerSlot {
    waker: RefCell<Option<Waker>>,
    parked: Cell<bool>,
}

fn wake(slot: &RefCell<Option<Waker>>) {
    if let Some(w) = slot.borrow_mut().take() {
        w.wake();
    }
}

impl<C: Channel> Conn<C> {
    fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    fn queue_reply(&self, reply: OutReply) {
        self.replies.borrow_mut().push_back(reply);
        wake(&self.sender);
    }

    /// `count` requests holding `bytes` of payload budget were answered
    /// (sent, or dropped with a dead socket).
    fn finished(&self, count: usize, bytes: u64) {
        debug_assert!(count <= self.outstanding.get() && bytes <= self.outstanding_bytes.get());
        self.outstanding.set(self.outstanding.get() - count);
        self.outstanding_bytes
            .set(self.outstanding_bytes.get() - bytes);
        wake(&self.receiver);
        if self.outstanding.get() == 0 {
            wake(&self.sender);
        }
    }

    fn queue_job(self: &Rc<Self>, job: Job) {
        self.jobs.borrow_mut().push_back(job);
        let idle = self.idle_workers.borrow_mut().pop();
        match idle {
            Some(i) => self.unpark(i),
            None if self.workers.get() < MAX_WORKERS => {
                let id = self.workers.get();
                self.workers.set(id + 1);
                spawn(worker(self.clone(), id));
            }
            // Every worker is busy; one takes this job when it finishes.
            None => {}
        }
    }

    /// Wakes worker `i`, already taken off the idle list.
    fn unpark(&self, i: usize) {
        let slot = &self.worker_slots[i];
        debug_assert!(slot.parked.get());
        slot.parked.set(false);
        let w = slot.waker.borrow_mut().take();
        if let Some(w) = w {
            w.wake();
        }
    }

    /// Parks worker `i` (idempotent).
    fn park(&self, i: usize, waker: &Waker) {
        let slot = &self.worker_slots[i];
        *slot.waker.borrow_mut() = Some(waker.clone());
        if !slot.parked.replace(true) {
            self.idle_workers.borrow_mut().push(i);
        }
    }

    /// Worker `i` found a job on its own (a spurious poll while parked):
    /// it leaves the idle list so no job is handed to a busy worker.
    fn unpark_self(&self, i: usize) {
        let slot = &self.worker_slots[i];
        if slot.parked.replace(false) {
            *slot.waker.borrow_mut() = None;
            let mut idle = self.idle_workers.borrow_mut();
            if let Some(pos) = idle.iter().position(|&w| w == i) {
                idle.swap_remove(pos);
            }
        }
    }

    fn wake_all_workers(&self) {
        loop {
            let Some(i) = self.idle_workers.borrow_mut().pop() else {
                break;
            };
            self.unpark(i);
        }
    }
}

fn payload_bytes(command: &Command) -> u64 {
    match *command {
        Command::Read { length, .. } | Command::Write { length, .. } => u64::from(length),
        _ => 0,
    }
}

async fn transmission<C: Channel>(
    fd: OwnedFd,
    channel: C,
    params: TransmissionParams,
    features: ExportFeatures,
) {
    let conn = Rc::new(Conn {
        fd,
        channel,
        params,
        features,
        jobs: RefCell::new(VecDeque::with_capacity(MAX_OUTSTANDING)),
        idle_workers: RefCell::new(Vec::with_capacity(MAX_WORKERS)),
        worker_slots: (0..MAX_WORKERS).map(|_| WorkerSlot::default()).collect(),
        workers: Cell::new(0),
        scratch: RefCell::new(Vec::with_capacity(
            wire::CHUNK_HEADER_LEN + 4 + MAX_EXTENTS * wire::BLOCK_DESCRIPTOR_LEN,
        )),
        replies: RefCell::new(VecDeque::with_capacity(MAX_OUTSTANDING)),
        outstanding: Cell::new(0),
        outstanding_bytes: Cell::new(0),
        receiver: RefCell::new(None),
        sender: RefCell::new(None),
        closing: Cell::new(false),
        dead: Cell::new(false),
    });
    let sender = spawn(sender(conn.clone()));
    receiver(&conn).await;
    conn.closing.set(true);
    conn.wake_all_workers();
    wake(&conn.sender);
    // The sender returns once every received request has been answered.
    sender.await;
    // SAFETY: plain shutdown(2) on a socket this connection owns.
    unsafe { libc::shutdown(conn.raw_fd(), libc::SHUT_RDWR) };
}

/// Bytes read from the socket but not yet consumed.
///
/// Receives are greedy (as much as the staging buffer holds) so that one
/// receive brings every request the client has sent: headers and small write
/// payloads alike. After a write larger than [`COPY_MAX`] the next receive
/// asks for exactly one header, so the following large payload is received
/// straight into its own pool buffer instead of being staged and copied.
struct Staging {
    /// Always `Some` except while a receive owns it.
    buf: Option<IoBuf>,
    start: usize,
    end: usize,
    /// The last request carried a large payload: receive headers exactly.
    exact: bool,
}

/// Staging capacity: a QD32 burst of 4 KiB writes or 2340 headers.
const STAGING_LEN: usize = 128 << 10;
const _: () = assert!(COPY_MAX + REQUEST_HEADER_LEN <= STAGING_LEN);

impl Staging {
    fn new() -> Self {
        Self {
            buf: Some(IoBuf::heap(STAGING_LEN)),
            start: 0,
            end: 0,
            exact: false,
        }
    }

    fn bytes(&mut self) -> &mut [u8] {
        self.buf.as_mut().map_or(&mut [], |b| b.spare_mut())
    }

    fn available(&self) -> usize {
        self.end - self.start
    }

    /// Receives until at least `need` bytes (at most `STAGING_LEN`) are
    /// staged; `greedy` takes whatever else the socket has too.
    async fn fill(&mut self, fd: RawFd, need: usize, greedy: bool) -> io::Result<()> {
        debug_assert!(need <= STAGING_LEN);
        while self.available() < need {
            if self.start > 0 {
                // Less than one request moves: a partial header or a partial
                // small payload (counted as a copy then).
                let (start, end) = (self.start, self.end);
                self.bytes().copy_within(start..end, 0);
                if end - start > REQUEST_HEADER_LEN {
                    bump(|c| inc(&c.payload_copied_bytes, (end - start) as u64));
                }
                self.end -= start;
                self.start = 0;
            }
            let max = if greedy {
                STAGING_LEN - self.end
            } else {
                need - self.end
            };
            let buf = self.buf.take().ok_or(io::ErrorKind::BrokenPipe)?;
            let (res, buf) = ops::recv(fd, buf, self.end, max).await;
            self.buf = Some(buf);
            bump(|c| inc(&c.recv_calls, 1));
            match res {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.end += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The next 28-byte header, receiving as needed.
    async fn header(&mut self, fd: RawFd) -> io::Result<[u8; REQUEST_HEADER_LEN]> {
        let greedy = !self.exact;
        self.fill(fd, REQUEST_HEADER_LEN, greedy).await?;
        let mut h = [0u8; REQUEST_HEADER_LEN];
        let start = self.start;
        h.copy_from_slice(&self.bytes()[start..start + REQUEST_HEADER_LEN]);
        self.start += REQUEST_HEADER_LEN;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        Ok(h)
    }

    /// Takes up to `dst.len()` already-staged payload bytes into `dst`;
    /// returns how many.
    fn take_into(&mut self, dst: &mut [u8]) -> usize {
        let n = dst.len().min(self.available());
        if n > 0 {
            let start = self.start;
            dst[..n].copy_from_slice(&self.bytes()[start..start + n]);
            self.start += n;
            bump(|c| {
                inc(&c.payload_copies, 1);
                inc(&c.payload_copied_bytes, n as u64);
            });
        }
        n
    }

    /// Drops `n` payload bytes, staged first, then received into staging.
    async fn discard(&mut self, fd: RawFd, mut n: u64) -> io::Result<()> {
        loop {
            let take = n.min(self.available() as u64) as usize;
            self.start += take;
            n -= take as u64;
            if n == 0 {
                return Ok(());
            }
            let want = n.min(STAGING_LEN as u64) as usize;
            self.fill(fd, want, false).await?;
        }
    }
}

/// Reads and dispatches requests until DISC, EOF or a fatal error.
async fn receiver<C: Channel>(conn: &Rc<Conn<C>>) {
    let fd = conn.raw_fd();
    let mut staging = Staging::new();
    loop {
        // Backpressure: stop reading while the budgets are spent.
        poll_fn(|cx| {
            if conn.dead.get()
                || (conn.outstanding.get() < MAX_OUTSTANDING
                    && conn.outstanding_bytes.get() < MAX_OUTSTANDING_BYTES)
            {
                Poll::Ready(())
            } else {
                *conn.receiver.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await;
        if conn.dead.get() {
            return;
        }
        let Ok(header) = staging.header(fd).await else {
            return;
        };
        match request::decode(&header, &conn.params) {
            Ok(req) => {
                staging.exact = matches!(req.command,
                    Command::Write { length, .. } if length as usize > COPY_MAX);
                if !dispatch(conn, req, &mut staging).await {
                    return;
                }
            }
            Err(RequestError::Refused {
                cookie,
                errno,
                discard: n,
                ..
            }) => {
                if n > 0 {
                    staging.exact = true;
                    bump(|c| inc(&c.bytes_discarded, u64::from(n)));
                    if staging.discard(fd, u64::from(n)).await.is_err() {
                        return;
                    }
                }
                bump(|c| inc(&c.refused, 1));
                // Under structured replies a refused READ must get an error
                // chunk; `reply::error` uses one for every command then.
                conn.outstanding.set(conn.outstanding.get() + 1);
                let header = reply::error(conn.params.structured, cookie, errno);
                conn.queue_reply(OutReply {
                    header,
                    data: None,
                    charge: 0,
                });
            }
            Err(e) => {
                tracing::debug!("nbd: closing connection: {e}");
                bump(|c| inc(&c.protocol_errors, 1));
                return;
            }
        }
    }
}

/// Queues one valid request; false when the connection must stop reading.
async fn dispatch<C: Channel>(
    conn: &Rc<Conn<C>>,
    req: request::Request,
    staging: &mut Staging,
) -> bool {
    let mut payload = None;
    match req.command {
        Command::Disconnect => return false,
        Command::Write { length, .. } if length > 0 => {
            let len = length as usize;
            let mut buf = IoBuf::alloc(len).await;
            buf.set_len(len);
            if len <= COPY_MAX {
                // Small: through staging, with the requests that follow it.
                if staging.fill(conn.raw_fd(), len, true).await.is_err() {
                    // Client vanished mid-write: nothing was written.
                    return false;
                }
                staging.take_into(&mut buf);
            } else {
                let staged = staging.take_into(&mut buf);
                // The rest lands in the buffer the device writes from.
                let (res, b) = recv_exact(conn.raw_fd(), buf, staged, len).await;
                buf = b;
                bump(|c| inc(&c.recv_calls, 1));
                if res.is_err() {
                    return false;
                }
            }
            payload = Some(buf);
        }
        _ => {}
    }
    conn.outstanding.set(conn.outstanding.get() + 1);
    conn.outstanding_bytes
        .set(conn.outstanding_bytes.get() + payload_bytes(&req.command));
    conn.queue_job(Job {
        cookie: req.cookie,
        command: req.command,
        payload,
    });
    true
}

async fn worker<C: Channel>(conn: Rc<Conn<C>>, id: usize) {
    loop {
        let job = poll_fn(|cx| {
            if let Some(job) = conn.jobs.borrow_mut().pop_front() {
                conn.unpark_self(id);
                return Poll::Ready(Some(job));
            }
            if conn.closing.get() {
                conn.unpark_self(id);
                return Poll::Ready(None);
            }
            conn.park(id, cx.waker());
            Poll::Pending
        })
        .await;
        let Some(job) = job else { break };
        let charge = payload_bytes(&job.command);
        let mut reply = execute(&conn, job).await;
        reply.charge = charge;
        conn.queue_reply(reply);
    }
    conn.workers.set(conn.workers.get() - 1);
}

/// Reply to a payload-less command whose device work gave `r`; `done`
/// bumps the command's counter, on success only.
fn outcome(
    structured: bool,
    cookie: u64,
    r: Result<(), NbdErrno>,
    done: impl FnOnce(&Counters),
) -> OutReply {
    let header = match r {
        Ok(()) => {
            bump(done);
            reply::ok(cookie)
        }
        Err(e) => {
            bump(|c| inc(&c.io_errors, 1));
            reply::error(structured, cookie, e)
        }
    };
    header_only(header)
}

fn header_only(header: ReplyHeader) -> OutReply {
    OutReply {
        header,
        data: None,
        charge: 0,
    }
}

/// Runs one job against the device and builds its reply.
async fn execute<C: Channel>(conn: &Conn<C>, job: Job) -> OutReply {
    let structured = conn.params.structured;
    let cookie = job.cookie;
    let ch = &conn.channel;
    match job.command {
        Command::Read { length: 0, .. } => OutReply {
            header: reply::read_empty(structured, cookie),
            data: None,
            charge: 0,
        },
        Command::Read { offset, length, .. } => {
            let mut buf = IoBuf::alloc(length as usize).await;
            buf.set_len(length as usize);
            let (r, buf) = ch.read(offset, buf).await;
            match r {
                Ok(()) => {
                    bump(|c| {
                        inc(&c.reads, 1);
                        inc(&c.bytes_read, u64::from(length));
                    });
                    OutReply {
                        header: reply::read_ok(structured, cookie, offset, length),
                        data: Some(buf),
                        charge: 0,
                    }
                }
                Err(e) => {
                    bump(|c| inc(&c.io_errors, 1));
                    header_only(reply::read_error(structured, cookie, offset, length, e))
                }
            }
        }
        Command::Write {
            offset,
            length,
            fua,
        } => {
            let r = match job.payload {
                Some(buf) => ch.write(offset, buf, fua).await.0,
                None => Ok(()),
            };
            outcome(structured, cookie, r, |c| {
                inc(&c.writes, 1);
                inc(&c.bytes_written, u64::from(length));
            })
        }
        Command::Flush => outcome(structured, cookie, ch.flush().await, |c| inc(&c.flushes, 1)),
        Command::Trim {
            offset,
            length,
            fua,
        } => {
            let mut r = if length > 0 {
                ch.trim(offset, u64::from(length)).await
            } else {
                Ok(())
            };
            if fua && r.is_ok() && conn.features.can_flush {
                r = ch.flush().await;
            }
            outcome(structured, cookie, r, |c| inc(&c.trims, 1))
        }
        Command::WriteZeroes {
            offset,
            length,
            fua,
            no_hole,
            fast,
        } => {
            // FAST_ZERO must fail fast, before touching the data, when
            // zeroing is no cheaper than writing (the device has no native
            // write-zeroes and the bdev layer would write zero buffers).
            if fast && !conn.features.fast_zero {
                bump(|c| inc(&c.refused, 1));
                return header_only(reply::error(structured, cookie, NbdErrno::NotSup));
            }
            let mut r = if length > 0 {
                ch.write_zeroes(offset, u64::from(length), no_hole).await
            } else {
                Ok(())
            };
            if fua && r.is_ok() && conn.features.can_flush {
                r = ch.flush().await;
            }
            outcome(structured, cookie, r, |c| inc(&c.write_zeroes, 1))
        }
        // Validated like a READ (in range, aligned; any length, as the
        // protocol gives clients no cache size limit to respect). Exports
        // that advertise SEND_CACHE keep all their data in memory, so there
        // is nothing to prefetch and success is the truth. Elsewhere the
        // hint is accepted unadvertised (clients send it anyway) and
        // ignored, which the protocol allows for a prefetch.
        Command::Cache { .. } => outcome(structured, cookie, Ok(()), |c| inc(&c.caches, 1)),
        Command::BlockStatus {
            offset,
            length,
            req_one,
            context_id,
        } => {
            bump(|c| inc(&c.block_status, 1));
            block_status(conn, cookie, offset, length, req_one, context_id).await
        }
        Command::Disconnect => outcome(structured, cookie, Ok(()), |_| {}),
    }
}

async fn block_status<C: Channel>(
    conn: &Conn<C>,
    cookie: u64,
    offset: u64,
    length: u32,
    req_one: bool,
    id: u32,
) -> OutReply {
    let mut extents = [BlockDescriptor {
        length: 0,
        flags: 0,
    }; MAX_EXTENTS];
    let max = if req_one { 1 } else { MAX_EXTENTS };
    let reported = conn
        .channel
        .block_status(offset, length, &mut extents[..max])
        .clamp(1, max);
    let n = allowed_extents(&mut extents[..reported], length, req_one);
    let len = wire::CHUNK_HEADER_LEN + 4 + n * wire::BLOCK_DESCRIPTOR_LEN;
    let mut buf = IoBuf::alloc(len).await;
    buf.set_len(len);
    {
        let mut chunk = conn.scratch.borrow_mut();
        chunk.clear();
        wire::put_block_status(&mut chunk, cookie, true, id, &extents[..n]);
        debug_assert_eq!(chunk.len(), len);
        buf.copy_from_slice(&chunk);
    }
    OutReply {
        header: ReplyHeader::EMPTY,
        data: Some(buf),
        charge: 0,
    }
}

/// Trims the extents a device reported for a BLOCK_STATUS of `length`
/// bytes to what the protocol allows in the reply, and returns how many to
/// send (at least one): every length nonzero (a zero-length extent ends the
/// list; if it is the first, the always-correct "allocated, contents
/// unknown" for the whole request is sent instead), the first N-1 summing to
/// less than `length` (the device may know more than was asked), and with
/// REQ_ONE a single extent no longer than `length`.
fn allowed_extents(extents: &mut [BlockDescriptor], length: u32, req_one: bool) -> usize {
    let mut n = 0;
    let mut covered = 0u64;
    for e in extents.iter() {
        if e.length == 0 || covered >= u64::from(length) {
            break;
        }
        covered += u64::from(e.length);
        n += 1;
    }
    if n == 0 {
        extents[0] = BlockDescriptor { length, flags: 0 };
        n = 1;
    }
    if req_one {
        extents[0].length = extents[0].length.min(length);
        n = 1;
    }
    n
}

/// Sends queued replies, many per `sendmsg` when they pile up.
async fn sender<C: Channel>(conn: Rc<Conn<C>>) {
    let fd = conn.raw_fd();
    let mut batch = SendBatch::new();
    loop {
        poll_fn(|cx| {
            let done = conn.closing.get() && conn.outstanding.get() == 0;
            if !conn.replies.borrow().is_empty() || done {
                Poll::Ready(())
            } else {
                *conn.sender.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await;
        let mut bytes = 0u64;
        {
            let mut q = conn.replies.borrow_mut();
            while !batch.is_full() {
                let Some(r) = q.pop_front() else { break };
                bytes += r.charge;
                batch.push(r);
            }
        }
        if batch.is_empty() {
            return;
        }
        if !conn.dead.get() && send_batch(fd, &mut batch).await.is_err() {
            conn.dead.set(true);
        }
        let n = batch.len();
        bump(|c| inc(&c.replies_sent, n as u64));
        batch.clear();
        conn.finished(n, bytes);
    }
}

/// Sends the whole batch: non-blocking `sendmsg` calls, waiting for
/// `POLLOUT` on the ring only when the socket buffer is full.
async fn send_batch(fd: RawFd, batch: &mut SendBatch) -> io::Result<()> {
    loop {
        let r = batch.send_nonblocking(fd);
        bump(|c| inc(&c.send_calls, 1));
        match r {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                if batch.advance(n) {
                    return Ok(());
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let (res, _) = ops::poll_ready(fd, libc::POLLOUT as u32).await;
                if res < 0 && res != -libc::EINTR {
                    return Err(io::Error::from_raw_os_error(-res));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_are_trimmed_to_the_request() {
        let e = |length, flags| BlockDescriptor { length, flags };
        let mut v = [e(512, 1), e(512, 0), e(512, 1)];
        assert_eq!(allowed_extents(&mut v, 1024, false), 2);
        let mut v = [e(512, 1), e(512, 0), e(512, 1)];
        assert_eq!(allowed_extents(&mut v, 1025, false), 3);
        let mut v = [e(4096, 3)];
        assert_eq!(allowed_extents(&mut v, 512, false), 1);
        assert_eq!(v[0], e(4096, 3), "the last extent may run past");
        let mut v = [e(0, 3), e(512, 3)];
        assert_eq!(allowed_extents(&mut v, 2048, false), 1);
        assert_eq!(v[0], e(2048, 0));
        let mut v = [e(512, 3), e(0, 0)];
        assert_eq!(allowed_extents(&mut v, 2048, false), 1);
        assert_eq!(v[0], e(512, 3));
        let mut v = [e(4096, 3)];
        assert_eq!(allowed_extents(&mut v, 1024, true), 1);
        assert_eq!(v[0], e(1024, 3));
    }

    #[test]
    fn payload_accounting() {
        assert_eq!(
            payload_bytes(&Command::Read {
                offset: 0,
                length: 4096,
                df: false
            }),
            4096
        );
        assert_eq!(payload_bytes(&Command::Flush), 0);
    }
}

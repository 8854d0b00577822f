//! NBD transmission as a sans-IO [`Protocol`] for the connection driver
//! (`ustor_net::driver`): the receive state machine (`apply`), the device
//! work of each request (`execute`) and the reply encoding (`encode`).
//!
//! Receive: each 28-byte request header is staged greedily (one receive
//! brings every request the client has sent), except after a write larger
//! than [`COPY_MAX`], when headers are read exactly so the next large
//! payload lands straight in its own buffer. Write payloads up to
//! [`COPY_MAX`] come through staging and are copied once (a 32 KiB copy
//! costs less than the receive and loop pass of receiving it alone);
//! larger ones are received in place, with the next header behind them in
//! the same `recvmsg`. A refused request's payload is skipped and answered
//! at once. Replies carry read data in the buffer the device filled.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ustor_net::driver::{IoEvent, Protocol, Recv, RecvEvent, Via};
use ustor_net::{PduGroup, Staging, COPY_MAX};
use ustor_runtime::IoBuf;

use super::bdev::BdevExportChannel;
use super::stats::{bump, in_flight_add, inc, ConnCounters, Counters};
use crate::export::ExportFeatures;
use crate::reply::{self, ReplyHeader};
use crate::request::{self, Command, RequestError, TransmissionParams};
use crate::wire::{self, BlockDescriptor, NbdErrno, REQUEST_HEADER_LEN};

/// Extents returned in one BLOCK_STATUS reply.
const MAX_EXTENTS: usize = 64;

/// A request handed from the receiver to a worker.
pub(crate) struct Job {
    cookie: u64,
    command: Command,
    /// Write payload, already received.
    payload: Option<IoBuf>,
}

/// One reply waiting to be sent.
pub(crate) struct OutReply {
    header: ReplyHeader,
    /// Bytes that follow the header: read data, or a block-status chunk.
    data: Option<IoBuf>,
}

/// What the receiver is in the middle of.
#[derive(Clone, Copy)]
enum Pending {
    None,
    /// A valid write whose payload is being received.
    Write(request::Request),
    /// A refused request whose payload is being skipped.
    Refused {
        cookie: u64,
        errno: NbdErrno,
    },
}

/// One connection in transmission.
pub(crate) struct Nbd {
    channel: BdevExportChannel,
    params: TransmissionParams,
    features: ExportFeatures,
    pending: Cell<Pending>,
    /// The last request carried a large payload: read headers exactly.
    exact: Cell<bool>,
    /// Block-status chunks are encoded here (no allocation per request).
    scratch: RefCell<Vec<u8>>,
    /// The server is draining: requests are answered `ESHUTDOWN` instead
    /// of executed (one relaxed load per request; the drain's reactor
    /// round-trip orders it against the in-flight count).
    draining: Arc<AtomicBool>,
    /// This connection's own counters (for `nbd_get_connections`).
    counters: Rc<ConnCounters>,
}

impl Nbd {
    pub(crate) fn new(
        channel: BdevExportChannel,
        params: TransmissionParams,
        features: ExportFeatures,
    ) -> Nbd {
        Nbd {
            channel,
            params,
            features,
            pending: Cell::new(Pending::None),
            exact: Cell::new(false),
            scratch: RefCell::new(Vec::with_capacity(
                wire::CHUNK_HEADER_LEN + 4 + MAX_EXTENTS * wire::BLOCK_DESCRIPTOR_LEN,
            )),
            draining: Arc::new(AtomicBool::new(false)),
            counters: Rc::default(),
        }
    }

    /// Counts this connection's requests into `counters`.
    pub(crate) fn counting(mut self, counters: Rc<ConnCounters>) -> Nbd {
        self.counters = counters;
        self
    }

    /// Watches the server's drain flag (see `NbdServer::drain`).
    pub(crate) fn draining_on(mut self, flag: Arc<AtomicBool>) -> Nbd {
        self.draining = flag;
        self
    }

    /// A decoded header: what to receive or run next.
    fn on_header(&self, header: &[u8]) -> Recv<Self> {
        match request::decode(header, &self.params) {
            Ok(req) => {
                self.exact.set(matches!(req.command,
                    Command::Write { length, .. } if length as usize > COPY_MAX));
                match req.command {
                    Command::Disconnect => Recv::Close,
                    Command::Write { length, .. } if length > 0 => {
                        let len = length as usize;
                        self.pending.set(Pending::Write(req));
                        let via = if len <= COPY_MAX {
                            Via::Staging
                        } else {
                            Via::Direct {
                                tail: REQUEST_HEADER_LEN,
                            }
                        };
                        Recv::Payload {
                            buf: None,
                            off: 0,
                            len,
                            via,
                        }
                    }
                    command => Recv::Dispatch(Job {
                        cookie: req.cookie,
                        command,
                        payload: None,
                    }),
                }
            }
            Err(RequestError::Refused {
                cookie,
                errno,
                discard: n,
                ..
            }) => {
                if n > 0 {
                    self.exact.set(true);
                    bump(|c| inc(&c.bytes_discarded, u64::from(n)));
                    self.pending.set(Pending::Refused { cookie, errno });
                    return Recv::Skip(u64::from(n));
                }
                self.refused(cookie, errno)
            }
            Err(e) => {
                tracing::debug!("nbd: closing connection: {e}");
                bump(|c| inc(&c.protocol_errors, 1));
                Recv::Close
            }
        }
    }

    /// Answers a refused request. Under structured replies a refused READ
    /// must get an error chunk; `reply::error` uses one for every command
    /// then.
    fn refused(&self, cookie: u64, errno: NbdErrno) -> Recv<Self> {
        bump(|c| inc(&c.refused, 1));
        Recv::Reply(header_only(reply::error(
            self.params.structured,
            cookie,
            errno,
        )))
    }
}

impl Nbd {
    /// The receive state machine proper (see [`Protocol::apply`]).
    fn step(&self, ev: RecvEvent, st: &mut Staging) -> Recv<Self> {
        match ev {
            RecvEvent::Next | RecvEvent::Resumed => Recv::Stage {
                need: REQUEST_HEADER_LEN,
                max: if self.exact.get() {
                    REQUEST_HEADER_LEN
                } else {
                    usize::MAX
                },
            },
            RecvEvent::Staged => {
                let mut h = [0u8; REQUEST_HEADER_LEN];
                h.copy_from_slice(st.peek(REQUEST_HEADER_LEN));
                st.consume(REQUEST_HEADER_LEN);
                self.on_header(&h)
            }
            RecvEvent::Payload(buf) => match self.pending.replace(Pending::None) {
                Pending::Write(req) => Recv::Dispatch(Job {
                    cookie: req.cookie,
                    command: req.command,
                    payload: Some(buf),
                }),
                _ => unreachable!("a payload only follows a write"),
            },
            RecvEvent::Skipped => match self.pending.replace(Pending::None) {
                Pending::Refused { cookie, errno } => self.refused(cookie, errno),
                _ => unreachable!("a skip only follows a refusal"),
            },
        }
    }
}

impl Protocol for Nbd {
    type Job = Job;
    type Reply = OutReply;

    fn apply(&self, ev: RecvEvent, st: &mut Staging) -> Recv<Self> {
        let mut r = self.step(ev, st);
        if let Recv::Dispatch(job) = &r {
            // A request complete after drain began is refused, never
            // executed: the final flush must cover every acknowledged write.
            if self.draining.load(Ordering::Relaxed) {
                r = self.refused(job.cookie, NbdErrno::Shutdown);
            }
        }
        if matches!(r, Recv::Dispatch(_) | Recv::Reply(_)) {
            in_flight_add(1);
        }
        r
    }

    fn charge(&self, job: &Job) -> u64 {
        payload_bytes(&job.command)
    }

    async fn execute(&self, job: Job) -> OutReply {
        let (read, written) = match job.command {
            Command::Read { length, .. } => (u64::from(length), 0),
            Command::Write { length, .. } => (0, u64::from(length)),
            _ => (0, 0),
        };
        let reply = execute(self, job).await;
        self.counters.note(read, written);
        reply
    }

    fn encode(&self, r: OutReply, g: &mut PduGroup) -> Result<(), OutReply> {
        let h = r.header.as_bytes();
        if !g.fits(h.len(), 1, usize::from(r.data.is_some())) {
            return Err(r);
        }
        g.push_bytes(h);
        if let Some(d) = r.data {
            let n = d.len();
            g.push_data(d, 0, n);
        }
        g.end_pdu(false);
        Ok(())
    }

    fn on_io(&self, ev: IoEvent) {
        match ev {
            IoEvent::Received { calls, moved } => bump(|c| {
                inc(&c.recv_calls, calls);
                // Less than one request moves: a partial header, or a
                // partial small payload (counted as a copy then).
                if moved > REQUEST_HEADER_LEN {
                    inc(&c.payload_copied_bytes, moved as u64);
                }
            }),
            IoEvent::Copied { bytes } => bump(|c| {
                inc(&c.payload_copies, 1);
                inc(&c.payload_copied_bytes, bytes as u64);
            }),
            IoEvent::Sent { replies, calls } => {
                in_flight_add(-i64::from(replies));
                bump(|c| {
                    inc(&c.replies_sent, u64::from(replies));
                    inc(&c.send_calls, calls);
                });
            }
        }
    }
}

pub(crate) fn payload_bytes(command: &Command) -> u64 {
    match *command {
        Command::Read { length, .. } | Command::Write { length, .. } => u64::from(length),
        _ => 0,
    }
}

fn header_only(header: ReplyHeader) -> OutReply {
    OutReply { header, data: None }
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

async fn read(conn: &Nbd, cookie: u64, offset: u64, length: u32) -> OutReply {
    let structured = conn.params.structured;
    if length == 0 {
        return header_only(reply::read_empty(structured, cookie));
    }
    let mut buf = IoBuf::alloc(length as usize).await;
    buf.set_len(length as usize);
    let (r, buf) = conn.channel.read(offset, buf).await;
    match r {
        Ok(()) => {
            bump(|c| {
                inc(&c.reads, 1);
                inc(&c.bytes_read, u64::from(length));
            });
            OutReply {
                header: reply::read_ok(structured, cookie, offset, length),
                data: Some(buf),
            }
        }
        Err(e) => {
            bump(|c| inc(&c.io_errors, 1));
            header_only(reply::read_error(structured, cookie, offset, length, e))
        }
    }
}

/// WRITE_ZEROES. FAST_ZERO must fail fast, before touching the data, when
/// zeroing is no cheaper than writing (the device has no native
/// write-zeroes and the bdev layer would write zero buffers).
async fn write_zeroes(
    conn: &Nbd,
    cookie: u64,
    offset: u64,
    length: u32,
    fua: bool,
    fast: bool,
) -> OutReply {
    let structured = conn.params.structured;
    if fast && !conn.features.fast_zero {
        bump(|c| inc(&c.refused, 1));
        return header_only(reply::error(structured, cookie, NbdErrno::NotSup));
    }
    let fua = fua && conn.features.can_flush;
    let r = if length > 0 {
        conn.channel
            .write_zeroes(offset, u64::from(length), fua)
            .await
    } else {
        Ok(())
    };
    outcome(structured, cookie, r, |c| inc(&c.write_zeroes, 1))
}

/// Runs one job against the device and builds its reply.
async fn execute(conn: &Nbd, job: Job) -> OutReply {
    let structured = conn.params.structured;
    let cookie = job.cookie;
    let ch = &conn.channel;
    match job.command {
        Command::Read { offset, length, .. } => read(conn, cookie, offset, length).await,
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
            let fua = fua && conn.features.can_flush;
            let r = if length > 0 {
                ch.trim(offset, u64::from(length), fua).await
            } else {
                Ok(())
            };
            outcome(structured, cookie, r, |c| inc(&c.trims, 1))
        }
        Command::WriteZeroes {
            offset,
            length,
            fua,
            no_hole: _,
            fast,
        } => write_zeroes(conn, cookie, offset, length, fua, fast).await,
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

async fn block_status(
    conn: &Nbd,
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

#[cfg(test)]
mod tests;

//! One client connection, owned by one reactor for its whole life: the
//! handshake (driving [`Negotiation`] with exact reads and full sends,
//! under the listener's handshake timeout), then transmission on the
//! connection driver (`ustor_net::driver`) with the [`Nbd`] protocol.
//!
//! Nothing large is allocated before the handshake completes: option
//! payloads are read into a buffer sized to the largest one seen so far,
//! and the transmission staging buffer, queues and reply group come with
//! the driver.

use std::cell::RefCell;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ustor_net::driver::{self, DriverConfig};
use ustor_net::listener::Accepted;
use ustor_net::recv::{discard, recv_exact};
use ustor_net::Rewind;
use ustor_runtime::IoBuf;

use super::proto::Nbd;
use super::stats::{bump, inc, ConnCounters, NbdConnection};
use super::{ExportEntry, Shared};
use crate::negotiation::{Event, Negotiation, Step};
use crate::request::TransmissionParams;

/// Requests one connection may have received and not yet answered.
pub const MAX_OUTSTANDING: usize = 256;
/// Payload bytes one connection may hold in flight (reads and writes).
pub const MAX_OUTSTANDING_BYTES: u64 = 64 << 20;
/// Worker tasks per connection (concurrent device operations).
pub const MAX_WORKERS: usize = 128;
/// Staging capacity: a QD32 burst of 4 KiB writes or 4681 headers.
const STAGING_LEN: usize = 128 << 10;
const _: () = assert!(ustor_net::COPY_MAX + crate::wire::REQUEST_HEADER_LEN <= STAGING_LEN);
/// Replies gathered into one `sendmsg` (two iovecs each).
const BATCH_REPLIES: u32 = 64;
/// First option buffer; grown to the largest option payload received.
const FIRST_OPTION_BUF: usize = 1024;
/// Landing area for discarded option payloads.
const DISCARD_BUF: usize = 4096;

fn driver_config() -> DriverConfig {
    DriverConfig {
        max_outstanding: MAX_OUTSTANDING,
        max_outstanding_bytes: MAX_OUTSTANDING_BYTES,
        max_workers: MAX_WORKERS,
        prespawn_workers: 0,
        staging_len: STAGING_LEN,
        rewind: Rewind::Eager,
        recv_mode: ustor_net::RecvMode::Ring,
        recv_budget: None,
        max_replies: BATCH_REPLIES,
        group_iov: 2 * BATCH_REPLIES as usize,
        group_arena: BATCH_REPLIES as usize * crate::reply::MAX_REPLY_HEADER_LEN,
        coalesce: None,
    }
}

thread_local! {
    // Sockets of the connections open on this reactor, with their server
    // (its `Shared` address), so a drain can end their reading. Touched
    // when a connection opens and closes, never per request.
    static OPEN: RefCell<Vec<(usize, RawFd)>> = const { RefCell::new(Vec::new()) };
}

/// A connection's entry in [`OPEN`], removed when dropped (while its
/// socket is still open, so a reused descriptor is never shut by mistake).
struct Registered(usize, RawFd);

impl Registered {
    fn new(server: usize, fd: RawFd) -> Registered {
        OPEN.with(|o| o.borrow_mut().push((server, fd)));
        Registered(server, fd)
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let me = (self.0, self.1);
        OPEN.with(|o| o.borrow_mut().retain(|e| *e != me));
    }
}

/// A connection in transmission, listed by `nbd_get_connections`.
struct LiveConn {
    server: usize,
    id: u64,
    export: String,
    bdev_name: String,
    peer: String,
    counters: Rc<ConnCounters>,
}

thread_local! {
    // This reactor's connections in transmission (added and removed once
    // per connection; their counters are bumped through their own `Rc`).
    static LIVE: RefCell<Vec<LiveConn>> = const { RefCell::new(Vec::new()) };
}

/// Ids for [`LiveConn`] (taken once per connection, never per request).
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// Removes its [`LiveConn`] when the connection ends.
struct Listed(u64);

impl Listed {
    fn new(server: usize, entry: &ExportEntry, peer: &str, counters: Rc<ConnCounters>) -> Listed {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        LIVE.with(|l| {
            l.borrow_mut().push(LiveConn {
                server,
                id,
                export: entry.name.clone(),
                bdev_name: entry.bdev_name.clone(),
                peer: peer.to_string(),
                counters,
            })
        });
        Listed(id)
    }
}

impl Drop for Listed {
    fn drop(&mut self) {
        LIVE.with(|l| l.borrow_mut().retain(|c| c.id != self.0));
    }
}

/// This reactor's (`reactor`) connections of `server`, with their counters.
pub(crate) fn live(server: usize, reactor: usize) -> Vec<NbdConnection> {
    LIVE.with(|l| {
        l.borrow()
            .iter()
            .filter(|c| c.server == server)
            .map(|c| NbdConnection {
                id: c.id,
                export: c.export.clone(),
                bdev_name: c.bdev_name.clone(),
                peer: c.peer.clone(),
                reactor,
                ops: c.counters.ops.get(),
                bytes_read: c.counters.bytes_read.get(),
                bytes_written: c.counters.bytes_written.get(),
            })
            .collect()
    })
}

/// Ends reading on this reactor's connections of `server` (drain): each
/// answers what it already holds (requests still buffered get
/// `ESHUTDOWN`), sends its replies, and closes. Returns how many.
pub(crate) fn shut_reading(server: usize) -> usize {
    OPEN.with(|o| {
        let o = o.borrow();
        let mine = o.iter().filter(|(s, _)| *s == server);
        for &(_, fd) in mine.clone() {
            // SAFETY: shutdown(2) on a socket registered as open (entries
            // leave before their descriptor is closed).
            unsafe { libc::shutdown(fd, libc::SHUT_RD) };
        }
        mine.count()
    })
}

/// Serves one admitted socket until it closes.
pub(crate) async fn serve(conn: Accepted, shared: Arc<Shared>) {
    bump(|c| inc(&c.connections_served, 1));
    let fd = conn.fd.as_raw_fd();
    let registered = Registered::new(Arc::as_ptr(&shared) as usize, fd);
    if shared.draining.load(Ordering::SeqCst) {
        // Accepted just before the drain stopped the listener.
        bump(|c| inc(&c.connections_closed, 1));
        return;
    }
    match conn.handshake(handshake(fd, &shared)).await {
        Some(Ok(Some((entry, params)))) => match entry.source.channel() {
            Ok(channel) => {
                let peer = conn.peer.map_or_else(|| "?".into(), |p| p.to_string());
                tracing::info!(
                    export = %entry.name,
                    bdev = %entry.bdev_name,
                    peer = %peer,
                    "nbd: export {} (bdev {}) opened by {peer}",
                    entry.name,
                    entry.bdev_name
                );
                let counters = Rc::new(ConnCounters::default());
                let server = Arc::as_ptr(&shared) as usize;
                let listed = Listed::new(server, &entry, &peer, counters.clone());
                let proto = Nbd::new(channel, params, entry.features())
                    .draining_on(shared.draining.clone())
                    .counting(counters);
                // The entry (and its bdev claim) lives as long as the
                // connection serving it.
                let Accepted { fd, guard, .. } = conn;
                driver::run(fd, proto, driver_config()).await;
                drop((listed, registered, entry, guard));
            }
            Err(e) => tracing::warn!(
                export = %entry.name,
                bdev = %entry.bdev_name,
                "nbd: export {} has no channel: {e}",
                entry.name
            ),
        },
        Some(Ok(None)) | None => bump(|c| inc(&c.handshakes_failed, 1)),
        Some(Err(e)) => {
            tracing::debug!("nbd: handshake ended: {e}");
            bump(|c| inc(&c.handshakes_failed, 1));
        }
    }
    bump(|c| inc(&c.connections_closed, 1));
}

type Chosen = (Arc<ExportEntry>, TransmissionParams);

/// Runs option haggling; `Ok(None)` when it ended without transmission.
async fn handshake(fd: RawFd, shared: &Arc<Shared>) -> io::Result<Option<Chosen>> {
    let limits = shared.limits;
    let mut neg = Negotiation::new(limits);
    let mut out = Vec::with_capacity(256);
    let mut inbuf = IoBuf::heap(FIRST_OPTION_BUF);
    let mut scratch: Option<IoBuf> = None;
    let mut step = neg.apply(&**shared, Event::Start, &mut out);
    // Budget: the negotiation caps the options per connection.
    loop {
        if !out.is_empty() {
            let mut sendbuf = IoBuf::heap(out.len());
            sendbuf.copy_from_slice(&out);
            out.clear();
            ustor_runtime::ops::send_all(fd, sendbuf).await.0?;
        }
        step = match step {
            Step::Read(n) => {
                if inbuf.capacity() < n {
                    inbuf = IoBuf::heap(n);
                }
                let (res, b) = recv_exact(fd, inbuf, 0, n).await;
                inbuf = b;
                res?;
                neg.apply(&**shared, Event::Bytes(&inbuf.spare_mut()[..n]), &mut out)
            }
            Step::Discard(n) => {
                let s = scratch.take().unwrap_or_else(|| IoBuf::heap(DISCARD_BUF));
                let (res, s) = discard(fd, s, u64::from(n)).await;
                scratch = Some(s);
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

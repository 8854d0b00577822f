//! The accept loop every network target runs: on one reactor, with a
//! connection cap, a handshake timeout and round-robin placement of the
//! accepted connections over the reactors.
//!
//! A protocol plugs in as a [`Service`]: the loop hands it each admitted
//! socket as an [`Accepted`] on the reactor it was placed on, where it
//! runs its handshake under [`Accepted::handshake`] (a peer that does not
//! finish in time is closed and counted) and then serves the connection.
//! The [`ConnGuard`] inside keeps the connection counted until it drops, so
//! the cap holds however a connection ends. The cap lives in a
//! [`ConnLimit`] that several listeners may share (one per target, not per
//! address). Nothing per connection is allocated by the loop beyond the
//! task the runtime spawns; the protocol allocates its staging after the
//! handshake.
//!
//! A connection beyond the cap may be handed to the protocol as a
//! [`Refused`] so it can say why in its own terms (an iSCSI Login reject)
//! before closing: at most [`MAX_REFUSING`] at a time, each within
//! [`REFUSE_TIMEOUT`]; the rest are closed at once.

use std::future::Future;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use ustor_runtime::{ops, RuntimeHandle};

/// Default handshake timeout: far beyond any live peer's round trips,
/// short enough that idle sockets cannot pile up.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections beyond the cap being answered at once (more are closed
/// without an answer): what a flood of them can hold is bounded.
pub const MAX_REFUSING: usize = 16;

/// Time a refused connection has to send what the protocol answers.
pub const REFUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// How a listener admits connections.
#[derive(Clone)]
pub struct ListenerConfig {
    /// The connection count and cap (may be shared by several listeners).
    pub limit: Arc<ConnLimit>,
    /// Time a peer has to finish its protocol's handshake.
    pub handshake_timeout: Duration,
    /// The reactor the accept loop runs on.
    pub accept_reactor: usize,
    /// Name in log lines ("nbd", "nvmf").
    pub name: &'static str,
}

impl ListenerConfig {
    pub fn new(name: &'static str, limit: Arc<ConnLimit>) -> ListenerConfig {
        ListenerConfig {
            limit,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            accept_reactor: 0,
            name,
        }
    }
}

/// Counters of a [`ConnLimit`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListenerStats {
    /// Admitted under the cap.
    pub accepted: u64,
    /// Closed at once: the cap was reached.
    pub rejected: u64,
    /// Closed: the handshake did not finish in time.
    pub handshake_timeouts: u64,
    /// Open now.
    pub open: usize,
}

/// A connection count with a cap, shared by the listeners of one target;
/// control-path only (touched once per connection, never per I/O).
pub struct ConnLimit {
    max: AtomicUsize,
    open: AtomicUsize,
    accepted: AtomicU64,
    rejected: AtomicU64,
    handshake_timeouts: AtomicU64,
    /// Refused connections being answered now ([`MAX_REFUSING`] at most).
    refusing: AtomicUsize,
    /// Signalled when a connection closes (for [`ConnLimit::wait_idle`]).
    closed: (Mutex<()>, Condvar),
}

impl ConnLimit {
    /// A cap of `max` connections (at least one).
    pub fn new(max: usize) -> Arc<ConnLimit> {
        Arc::new(ConnLimit {
            max: AtomicUsize::new(max.max(1)),
            open: AtomicUsize::new(0),
            accepted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            handshake_timeouts: AtomicU64::new(0),
            refusing: AtomicUsize::new(0),
            closed: (Mutex::new(()), Condvar::new()),
        })
    }

    pub fn set_max(&self, max: usize) {
        self.max.store(max.max(1), Ordering::Release);
    }

    pub fn max(&self) -> usize {
        self.max.load(Ordering::Acquire)
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    pub fn stats(&self) -> ListenerStats {
        ListenerStats {
            accepted: self.accepted.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            handshake_timeouts: self.handshake_timeouts.load(Ordering::Relaxed),
            open: self.open(),
        }
    }

    /// Counts one more connection unless the cap is reached.
    pub fn try_admit(self: &Arc<Self>) -> Option<ConnGuard> {
        if self.open.fetch_add(1, Ordering::AcqRel) >= self.max() {
            self.open.fetch_sub(1, Ordering::AcqRel);
            self.rejected.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        self.accepted.fetch_add(1, Ordering::Relaxed);
        Some(ConnGuard(self.clone(), None))
    }

    /// A place to answer one refused connection, unless [`MAX_REFUSING`]
    /// are being answered already.
    fn try_refuse(self: &Arc<Self>) -> Option<RefuseSlot> {
        if self.refusing.fetch_add(1, Ordering::AcqRel) >= MAX_REFUSING {
            self.refusing.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(RefuseSlot(self.clone()))
    }

    /// Waits (blocking, control thread) until no connection is open or
    /// `max_wait` passed; true when none is open.
    pub fn wait_idle(&self, max_wait: Duration) -> bool {
        let end = Instant::now() + max_wait;
        let (m, cv) = &self.closed;
        let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
        // Budget: bounded by `end`.
        while self.open() > 0 {
            let now = Instant::now();
            if now >= end {
                return false;
            }
            g = cv
                .wait_timeout(g, end - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }
}

/// Keeps one connection counted against its [`ConnLimit`] until dropped.
pub struct ConnGuard(Arc<ConnLimit>, Option<ConnLog>);

/// What the close of an accepted connection is logged with.
struct ConnLog {
    listener: &'static str,
    peer: SocketAddr,
    since: Instant,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        if let Some(l) = &self.1 {
            tracing::info!(
                listener = l.listener,
                peer = %l.peer,
                secs = l.since.elapsed().as_secs_f64(),
                "{}: connection from {} closed",
                l.listener,
                l.peer
            );
        }
        let prev = self.0.open.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(prev > 0, "connection count underflow");
        let (m, cv) = &self.0.closed;
        let _g = m.lock().unwrap_or_else(|p| p.into_inner());
        cv.notify_all();
    }
}

/// Holds one of the [`MAX_REFUSING`] places until the refused connection
/// is closed.
struct RefuseSlot(Arc<ConnLimit>);

impl Drop for RefuseSlot {
    fn drop(&mut self) {
        self.0.refusing.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A connection turned away at the cap, handed to [`Service::refuse`] on
/// the accepting reactor; not counted against the cap (its place among the
/// [`MAX_REFUSING`] is held until the future `refuse` returned ends). The
/// protocol reads at most what it needs to answer, within
/// [`Refused::timeout`], and drops it (closing the socket).
pub struct Refused {
    pub fd: OwnedFd,
    pub peer: Option<SocketAddr>,
    /// Time the peer has to send what the protocol answers.
    pub timeout: Duration,
}

/// An admitted connection, handed to [`Service::serve`] on its reactor.
pub struct Accepted {
    pub fd: OwnedFd,
    /// Drop it (with the connection) to free its place under the cap.
    pub guard: ConnGuard,
    /// The client's address (`None` if the socket could not say).
    pub peer: Option<SocketAddr>,
    handshake_timeout: Duration,
}

/// The address a target listens on, from the host and port its RPC names
/// (SPDK's `traddr`/`trsvcid`, an iSCSI portal): an IPv6 host may come with
/// or without brackets. `Err` carries the text that did not parse.
pub fn socket_addr(host: &str, port: impl std::fmt::Display) -> Result<SocketAddr, String> {
    let text = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    text.parse().map_err(|_| text)
}

/// The peer of a connected TCP socket (control path: one `getpeername`).
pub fn peer_addr(fd: std::os::fd::RawFd) -> Option<SocketAddr> {
    // SAFETY: the stream borrows `fd` only for `peer_addr` and is never
    // dropped (ManuallyDrop), so the caller's descriptor stays open.
    let s = std::mem::ManuallyDrop::new(unsafe { std::net::TcpStream::from_raw_fd(fd) });
    s.peer_addr().ok()
}

impl Accepted {
    /// Runs the protocol's handshake `f` under the listener's handshake
    /// timeout; `None` (counted, the socket shut down) when it ran out. The
    /// caller drops the connection then.
    pub async fn handshake<F: Future>(&self, f: F) -> Option<F::Output> {
        let r = crate::time::timeout(self.handshake_timeout, f).await;
        if r.is_none() {
            // A receive the dropped handshake left on the ring keeps the
            // socket open past its close: shut it down so the peer sees the
            // end now and the receive completes.
            crate::recv::shutdown(self.fd.as_raw_fd());
            self.guard
                .0
                .handshake_timeouts
                .fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    pub fn handshake_timeout(&self) -> Duration {
        self.handshake_timeout
    }
}

/// A protocol served on accepted connections.
pub trait Service: Send + Sync + 'static {
    type Fut: Future<Output = ()> + 'static;
    /// Serves one admitted connection; called on the reactor it was placed
    /// on, and the future runs there.
    fn serve(self: Arc<Self>, conn: Accepted) -> Self::Fut;
    /// Called on the accepting reactor when a connection was admitted.
    fn on_accept(&self) {}
    /// Called on the accepting reactor when the cap turned one away.
    fn on_reject(&self) {}
    /// Answers a connection the cap turned away, on the accepting reactor
    /// (for example with the protocol's "out of resources" status); `None`
    /// (the default) closes it at once.
    fn refuse(self: Arc<Self>, conn: Refused) -> Option<Self::Fut> {
        drop(conn);
        None
    }
}

/// A listening socket and its accept loop. Stops on [`Listener::stop`] or
/// drop; established connections run on.
pub struct Listener {
    /// Shared with the accept loop: the socket stays open while either
    /// holds it, so the `shutdown` that stops the loop never hits a reused
    /// fd number.
    fd: Arc<OwnedFd>,
    addr: SocketAddr,
    stopping: Arc<AtomicBool>,
}

/// Where the next connection goes (shared by a target's listeners).
#[derive(Default)]
pub struct Placement(AtomicUsize);

impl Placement {
    /// The next reactor of `n`, round robin.
    pub fn next(&self, n: usize) -> usize {
        self.0.fetch_add(1, Ordering::Relaxed) % n.max(1)
    }
}

impl Listener {
    /// Binds `addr` and starts accepting on `cfg.accept_reactor`. The loop
    /// holds `service` weakly: dropping the service's last owner ends it.
    pub fn bind<S: Service>(
        rt: &RuntimeHandle,
        addr: SocketAddr,
        cfg: ListenerConfig,
        placement: Arc<Placement>,
        service: &Arc<S>,
    ) -> io::Result<Listener> {
        let tcp = TcpListener::bind(addr)?;
        let bound = tcp.local_addr()?;
        let fd = Arc::new(OwnedFd::from(tcp));
        let stopping = Arc::new(AtomicBool::new(false));
        let l = AcceptLoop {
            fd: fd.clone(),
            rt: rt.clone(),
            cfg: cfg.clone(),
            placement,
            stopping: stopping.clone(),
            service: Arc::downgrade(service),
        };
        rt.spawn_on(cfg.accept_reactor, move || l.run())
            .map_err(|e| io::Error::other(e.to_string()))?;
        Ok(Listener {
            fd,
            addr: bound,
            stopping,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting (idempotent); established connections run on.
    pub fn stop(&self) {
        if !self.stopping.swap(true, Ordering::AcqRel) {
            // Wakes the pending accept, which then drops its reference.
            crate::recv::shutdown(self.fd.as_raw_fd());
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop();
    }
}

struct AcceptLoop<S> {
    fd: Arc<OwnedFd>,
    rt: RuntimeHandle,
    cfg: ListenerConfig,
    placement: Arc<Placement>,
    stopping: Arc<AtomicBool>,
    service: Weak<S>,
}

impl<S: Service> AcceptLoop<S> {
    async fn run(self) {
        loop {
            let accepted = ops::accept(self.fd.as_raw_fd()).await;
            if self.stopping.load(Ordering::Acquire) {
                break;
            }
            let Some(service) = self.service.upgrade() else {
                break;
            };
            let client = match accepted {
                // SAFETY: a fresh fd from accept(2), owned by nobody else.
                Ok(c) => unsafe { OwnedFd::from_raw_fd(c) },
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
                Err(e) => {
                    tracing::warn!("{}: accept failed: {e}", self.cfg.name);
                    // Out of fds and the like: back off instead of spinning.
                    ustor_runtime::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            self.admit(client, service);
        }
    }

    /// Counts `client` against the cap and places it on a reactor, or
    /// closes it (dropped) when the cap is reached.
    fn admit(&self, client: OwnedFd, service: Arc<S>) {
        let peer = peer_addr(client.as_raw_fd());
        let show = peer.map_or_else(|| "?".to_string(), |p| p.to_string());
        let Some(mut guard) = self.cfg.limit.try_admit() else {
            tracing::warn!(
                listener = self.cfg.name,
                peer = %show,
                max = self.cfg.limit.max(),
                "{}: connection from {show} refused: at the cap of {} connections",
                self.cfg.name,
                self.cfg.limit.max()
            );
            service.on_reject();
            self.refuse(client, peer, service);
            return;
        };
        tracing::info!(
            listener = self.cfg.name,
            peer = %show,
            "{}: connection from {show} accepted",
            self.cfg.name
        );
        guard.1 = peer.map(|peer| ConnLog {
            listener: self.cfg.name,
            peer,
            since: Instant::now(),
        });
        service.on_accept();
        let _ = ustor_runtime::net::set_nodelay(client.as_raw_fd());
        let target = self.placement.next(self.rt.num_reactors());
        let conn = Accepted {
            fd: client,
            guard,
            peer,
            handshake_timeout: self.cfg.handshake_timeout,
        };
        // On failure the message, with the socket and its guard inside,
        // was dropped: closed and uncounted.
        let _ = self.rt.spawn_on(target, move || service.serve(conn));
    }

    /// Hands a connection over the cap to the protocol to answer, on this
    /// reactor (no placement: it is short-lived), or closes it when
    /// [`MAX_REFUSING`] are being answered already.
    fn refuse(&self, client: OwnedFd, peer: Option<SocketAddr>, service: Arc<S>) {
        let Some(slot) = self.cfg.limit.try_refuse() else {
            return;
        };
        let conn = Refused {
            fd: client,
            peer,
            timeout: REFUSE_TIMEOUT.min(self.cfg.handshake_timeout),
        };
        let _ = self.rt.spawn_on(self.cfg.accept_reactor, move || {
            let fut = service.refuse(conn);
            async move {
                // Held here, not in `Refused`: the protocol's future may
                // keep only the fields it uses.
                let _slot = slot;
                if let Some(f) = fut {
                    f.await;
                }
            }
        });
    }
}

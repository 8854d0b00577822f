//! ustor's connection layer: what every network target and initiator needs
//! around its own protocol, written once.
//!
//! - [`listener`]: the accept loop on a reactor, with a connection cap, a
//!   handshake timeout and round-robin placement over the reactors.
//! - [`staging`]: the receive staging buffer (greedy receives, consume,
//!   rewind, payload receives that copy what is staged and take the rest
//!   straight into the caller's memory).
//! - [`recv`]: vectored and exact receives, readiness, shutdown.
//! - [`time`]: one `timeout` for any future.
//! - [`driver`]: runs the receiver, workers and sender of a connection for
//!   a sans-IO [`driver::Protocol`].
//! - [`group`], [`sender`], [`coalesce`]: the PDU group (one `sendmsg` of
//!   many replies), the loop that sends it, and LANoT, the load-aware policy
//!   deciding when a group leaves.
//! - [`xdp`]: AF_XDP sockets (UMEM over caller memory, the four rings) and
//!   the XDP program that steers one EtherType to them.
//!
//! Nothing here takes a lock, allocates or copies payload per I/O: staging
//! and groups are allocated once per connection, payload moves by value or
//! by pointer, and per-connection state lives on one reactor.

pub mod coalesce;
pub mod driver;
pub mod group;
pub mod listener;
pub mod recv;
pub mod sender;
pub mod staging;
pub mod time;
pub mod xdp;
pub mod zc;

pub use group::PduGroup;
pub use listener::{
    Accepted, ConnGuard, ConnLimit, Listener, ListenerConfig, ListenerStats, Placement, Service,
};
pub use recv::Seg;
pub use staging::{RecvMode, Rewind, Staging};
pub use time::timeout;

/// Payloads up to this size are received through the staging buffer (with
/// the headers around them) and copied once into their own buffer; larger
/// ones are received in place. A 32 KiB copy costs less than the receive
/// and the loop pass that receiving it on its own would.
pub const COPY_MAX: usize = 32 << 10;

/// Adds `n` to a counter that only one reactor writes and others read: a
/// relaxed load and store, no read-modify-write (no locked instruction on
/// the I/O path).
pub fn bump_relaxed(a: &std::sync::atomic::AtomicU64, n: u64) {
    use std::sync::atomic::Ordering;
    a.store(a.load(Ordering::Relaxed) + n, Ordering::Relaxed);
}

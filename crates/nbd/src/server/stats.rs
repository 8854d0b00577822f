//! Server counters: per reactor in thread-local `Cell`s (no atomics on the
//! I/O path), summed on demand by `nbd_get_stats`.

use std::cell::Cell;

use serde::{Deserialize, Serialize};

macro_rules! counters {
    ($($name:ident: $doc:literal),* $(,)?) => {
        /// One reactor's NBD counters.
        pub(crate) struct Counters { $(pub(crate) $name: Cell<u64>,)* }

        impl Counters {
            const fn new() -> Counters {
                Counters { $($name: Cell::new(0),)* }
            }
        }

        /// Counters summed over reactors (result of `nbd_get_stats`).
        #[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
        pub struct NbdStats { $(#[doc = $doc] pub $name: u64,)* }

        impl Counters {
            pub(crate) fn snapshot(&self) -> NbdStats {
                NbdStats { $($name: self.$name.get(),)* }
            }
        }

        impl NbdStats {
            pub(crate) fn add(&mut self, o: &NbdStats) {
                $(self.$name += o.$name;)*
            }
        }
    };
}

counters! {
    connections_accepted: "Connections accepted (counted on reactor 0, where accept runs).",
    connections_rejected: "Connections refused at the max_connections limit.",
    connections_served: "Connections run on this reactor (accepted ones are handed to the reactors round-robin and stay there).",
    connections_closed: "Connections finished (any reason).",
    handshakes_failed: "Connections that ended before transmission.",
    protocol_errors: "Connections dropped for a protocol violation (bad magic, oversized payload).",
    reads: "READ requests completed successfully.",
    writes: "WRITE requests completed successfully.",
    flushes: "FLUSH requests completed successfully.",
    trims: "TRIM requests completed successfully.",
    write_zeroes: "WRITE_ZEROES requests completed successfully.",
    caches: "CACHE requests completed successfully.",
    block_status: "BLOCK_STATUS requests completed.",
    bytes_read: "Bytes sent as read data.",
    bytes_written: "Bytes of successful WRITE requests.",
    refused: "Requests refused with an errno before reaching the device (validation; FAST_ZERO that cannot be fast).",
    io_errors: "Requests whose device I/O failed.",
    payload_copies: "Write payloads copied out of the receive staging buffer into their I/O buffer: one per write up to COPY_MAX (by design: cheaper than a receive per payload), plus one per larger write whose head arrived with a greedy receive. Reads are never copied.",
    payload_copied_bytes: "Bytes of payload copied: those of payload_copies, plus partial payloads moved within the staging buffer.",
    bytes_discarded: "Write payload bytes drained after a refusal.",
    send_calls: "sendmsg calls for replies.",
    replies_sent: "Replies sent (replies_sent / send_calls = batching).",
    recv_calls: "Receives for request headers and payloads.",
}

thread_local! {
    // `const`: no lazy-init check or registration call on each bump (several
    // per request).
    static COUNTERS: Counters = const { Counters::new() };
}

/// Adds to a counter of the current reactor.
pub(crate) fn bump(f: impl FnOnce(&Counters)) {
    COUNTERS.with(f);
}

pub(crate) fn inc(c: &Cell<u64>, n: u64) {
    c.set(c.get().wrapping_add(n));
}

thread_local! {
    // Requests received on this reactor and not yet answered (for drain).
    static IN_FLIGHT: Cell<u64> = const { Cell::new(0) };
}

/// `n` more requests received (positive) or answered (negative).
pub(crate) fn in_flight_add(n: i64) {
    IN_FLIGHT.with(|c| c.set(c.get().wrapping_add_signed(n)));
}

/// Requests in flight on this reactor.
pub(crate) fn in_flight() -> u64 {
    IN_FLIGHT.with(Cell::get)
}

/// This reactor's counters.
pub(crate) fn snapshot() -> NbdStats {
    COUNTERS.with(Counters::snapshot)
}

/// One connection's counters. Only the connection's reactor touches them
/// (plain `Cell`s, no atomics); `nbd_get_connections` reads them on that
/// reactor.
#[derive(Default)]
pub(crate) struct ConnCounters {
    pub(crate) ops: Cell<u64>,
    pub(crate) bytes_read: Cell<u64>,
    pub(crate) bytes_written: Cell<u64>,
}

impl ConnCounters {
    /// One request answered, with its read and written payload bytes.
    pub(crate) fn note(&self, read: u64, written: u64) {
        inc(&self.ops, 1);
        inc(&self.bytes_read, read);
        inc(&self.bytes_written, written);
    }
}

/// One connection in transmission, as `nbd_get_connections` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NbdConnection {
    /// Unique for the process's life (stable across samples, for rates).
    pub id: u64,
    pub export: String,
    pub bdev_name: String,
    /// The client's address (`ip:port`).
    pub peer: String,
    /// The reactor serving it.
    pub reactor: usize,
    /// Requests answered (any command, any outcome).
    pub ops: u64,
    /// Payload bytes of the READ and WRITE requests answered.
    pub bytes_read: u64,
    pub bytes_written: u64,
}

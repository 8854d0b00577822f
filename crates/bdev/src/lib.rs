//! ustor's block device layer.
//!
//! - [`device`]: the seams a driver fills ([`Bdev`], [`BdevChannel`],
//!   [`BdevModule`]), after SPDK's module table and `fn_table`.
//! - [`registry`]: names, aliases, UUIDs, descriptors, claims, hot-remove.
//! - [`channel`]: per-reactor channels and the generic I/O path (range and
//!   permission checks, alignment bounce, split, write-zeroes emulation,
//!   iostat).
//! - [`io`]: the per-reactor table of in-flight I/O that drivers complete;
//!   `submit`: the future of one submitted I/O and what it carries.
//! - [`child`]: child I/O of virtual bdevs on the parent's own buffers.
//! - [`modules`]: malloc, null and uring drivers.
//! - [`qos`]: rate limits on any bdev, shared by the reactors without a
//!   lock or atomic per I/O.
//!
//! # No lock, atomic RMW or allocation per I/O
//! A channel is `!Send` and lives in a thread-local cache on its reactor; the
//! I/O table is thread-local, preallocated and bounded; statistics are `Cell`s
//! and preallocated histograms; the only shared state an I/O reads is the
//! bdev's `removed` flag (an atomic *load*). Registry mutexes are taken by
//! control operations (create, open, delete), never by I/O. The
//! `alloc_guard` integration test runs I/O under a counting global allocator
//! and asserts zero allocations after warm-up.

pub mod channel;
pub mod child;
pub mod device;
pub mod error;
pub mod io;
pub mod modules;
pub mod qos;
pub mod registry;
pub mod remote;
mod rw;
pub mod stats;
mod submit;
pub mod types;

pub use channel::IoChannel;
pub use child::{Children, Watch, WatchFn};
pub use device::{Bdev, BdevChannel, BdevModule, Extent};
pub use error::{BdevError, ControlError};
pub use io::{IoDesc, IoHandle};
pub use qos::{QosLimits, QosUpdate};
pub use registry::{BdevEntry, Desc, Registry};
pub use rw::{RwNow, RwWait};
pub use stats::IoStat;
pub use types::{BdevEvent, BdevInfo, IoFlags, IoType};

/// Parses sizes like `4096`, `512K`, `256M`, `1G`, `2T` (binary units).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let unit = s[i..].to_ascii_uppercase();
            let m = match unit.trim_end_matches("IB").trim_end_matches('B') {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                "T" => 1u64 << 40,
                _ => return None,
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mult)
}

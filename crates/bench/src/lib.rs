//! `ustor bench`: drives bdevs from inside the reactors, like SPDK's
//! bdevperf, with no syscall of its own per I/O (TSC timestamps, pool
//! buffers reused per queue slot, per-reactor log-linear histograms).
//!
//! - [`spec`]: inline bdev specs (`null:1G`, `malloc:256M`, `uring:PATH`).
//! - [`workload`]: the per-queue-slot I/O loop, offsets and verification.
//! - [`report`]: per-core and total results, table and JSON.

mod hist;
pub mod report;
pub mod spec;
pub mod verify;
pub mod workload;

pub use report::{CoreResult, Report};
pub use workload::{run, BenchConfig, Pattern};

//! ustor's runtime: one reactor thread per core, each owning its io_uring,
//! an executor of `!Send` tasks, pollers, timers, a bounded inbox for
//! messages from other reactors, and a pool of aligned buffers registered
//! with its ring.
//!
//! # Model
//! A [`Runtime`] starts one pinned reactor per selected core. Everything that
//! touches I/O lives on exactly one reactor for its whole life: tasks
//! ([`spawn`]), pollers ([`register_poller`]), io_uring operations ([`ops`]),
//! buffers ([`buf::IoBuf`]). Reactors talk only through [`RuntimeHandle::send`]
//! (SPDK's `spdk_thread_send_msg`) and [`RuntimeHandle::for_each_reactor`]
//! (SPDK's `spdk_for_each_thread`).
//!
//! # Why the per-I/O path has no lock, atomic read-modify-write or allocation
//! - Per-reactor state is reached through a thread-local pointer and kept in
//!   `Cell`/`RefCell`: the borrow checker and `!Send` types (`IoBuf`, task
//!   futures, wakers that only pack integers) keep it on its thread.
//! - Task wakers carry (runtime, reactor, task) packed into the data word; a
//!   wake on the owning thread pushes an index on a preallocated ready queue.
//!   Only a wake from a foreign thread goes through the inbox (rare, control
//!   path).
//! - io_uring `user_data` is `owner << 48 | token`: the op slab (futures) or a
//!   registered completion handler (drivers). Slabs are preallocated and
//!   bounded; a full slab makes the submitter wait, it never grows.
//! - The inbox (crossbeam `ArrayQueue`), the sleep flag and the published
//!   sleep count are the only atomics, and they are touched by messages and
//!   sleep/wake, not by I/O.
//!
//! The `alloc_guard` test in `ustor-bdev` drives I/O through two reactors
//! under a counting global allocator and asserts zero allocations after
//! warm-up.

pub mod buf;
pub mod config;
mod depth;
pub mod doorbell;
pub mod executor;
pub mod msg;
mod nap;
pub mod net;
pub mod ops;
mod park;
pub mod poller;
pub mod reactor;
mod spin;
pub mod stats;
pub mod ticks;
pub mod timer;
pub mod uring;
pub mod workq;
pub mod zc;

pub use buf::{BufPoolConfig, IoBuf};
pub use config::{parse_cores, ConfigError, PollMode, RuntimeConfig};
pub use doorbell::Doorbell;
pub use executor::{spawn, yield_now, yield_while_busy, JoinHandle};
pub use msg::{Runtime, RuntimeHandle, SendError};
pub use poller::{register_poller, register_timed_poller, unregister_poller, PollStatus, PollerId};
pub use reactor::{
    is_reactor_thread, note_depth, on_reactor_exit, pass_ticks, poll_mode, reactor_id, request_stop,
};
pub use stats::ReactorStats;
pub use timer::{sleep, sleep_until};
pub use uring::{register_cqe_handler, submit_sqe, unregister_cqe_handler, CqeHandler, HandlerId};
pub use workq::WorkQueue;

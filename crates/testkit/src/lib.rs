//! Test support shared by the integration tests of every ustor crate.
//!
//! - [`wait`]: wait for a condition with a deadline and a message that says
//!   what never happened, instead of sleeping a guessed time and hoping.
//! - [`peer`]: the one rule for a peer program that is not installed (tgtd,
//!   QEMU, nbdkit, fio, SPDK's client, ...): outside CI the test prints
//!   `SKIPPED:` and returns; under `CI=true` it fails, saying what is
//!   missing and how to install it.
//!
//! - [`netns`]: two network namespaces over a veth pair, removed on drop.
//!
//! - [`alloc`]: a counting global allocator for the zero-allocation
//!   data-path tests.
//!
//! - [`ceph`]: a one-node Ceph cluster (`scripts/ceph-cluster.sh`) and the
//!   `rbd` CLI against it, for the rbd tests.
//!
//! It sits at the bottom of the workspace (no ustor dependency) so that any
//! crate, the runtime included, can use it as a dev-dependency.

pub mod alloc;
pub mod ceph;
pub mod netns;
pub mod peer;
pub mod wait;

pub use alloc::CountingAlloc;
pub use peer::{install_hint, missing, need, on_ci, program, SkipReturn};
pub use wait::{try_wait_for, wait_for, wait_until, wait_until_async};

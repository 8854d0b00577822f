//! ustor's Ceph RBD bdev.
//!
//! - [`ffi`]: the few librados/librbd calls used, declared by hand and
//!   loaded at run time (building needs no Ceph headers or libraries).
//! - [`cluster`]: registered clusters (one librados connection each, shared
//!   by their images) and where their threads run: off the reactor cores.
//! - [`image`]: an open image: open, close, header watch, health.
//! - [`bdev`]: the `rbd` bdev module (`bdev_rbd_create`), its channels and
//!   the completion path from librbd's threads to the owning reactor.
//! - [`events`]: librbd's event-socket completion mode, the alternative.
//! - [`direct`]: the data path straight over librados, for images that
//!   need nothing of librbd on it.

pub mod bdev;
pub mod cluster;
pub mod direct;
pub mod events;
pub mod ffi;
pub mod image;

use std::sync::Arc;

use ustor_bdev::{ControlError, Registry};
use ustor_runtime::RuntimeHandle;

pub use bdev::{RbdModule, RbdOpts};
pub use cluster::{ClusterOpts, Clusters};

/// Errors of the rbd module's control operations (its one error type; I/O
/// errors travel as `BdevError::Io(errno)`).
#[derive(Debug, thiserror::Error)]
pub enum RbdError {
    #[error("cluster `{0}` is not registered")]
    NoCluster(String),
    #[error("cluster `{0}` is already registered")]
    ClusterExists(String),
    #[error("cluster `{name}` is used by {users} bdev(s)")]
    ClusterBusy { name: String, users: usize },
    #[error("pool `{0}` does not exist")]
    NoPool(String),
    #[error("image `{0}` does not exist")]
    NoImage(String),
    #[error("bdev `{0}` already exists")]
    Exists(String),
    #[error("invalid parameter `{param}`: {why}")]
    Invalid { param: &'static str, why: String },
    #[error("{what}: {}", std::io::Error::from_raw_os_error(*errno))]
    Rados { what: String, errno: i32 },
    /// librados/librbd could not be loaded (the text names the package).
    #[error("{0}")]
    Library(String),
    #[error("the rbd module needs a running runtime")]
    NoRuntime,
    #[error(transparent)]
    Control(ControlError),
}

impl RbdError {
    /// The bdev layer's control error (RPC errors are made from it).
    pub fn into_control(self) -> ControlError {
        let os = |e: &RbdError, errno: i32| ControlError::Os {
            what: e.to_string(),
            err: std::io::Error::from_raw_os_error(errno),
        };
        match self {
            RbdError::Control(c) => c,
            RbdError::Exists(n) => ControlError::Exists(n),
            RbdError::Invalid { param, why } => ControlError::Invalid { param, why },
            RbdError::Rados { what, errno } => ControlError::Os {
                what,
                err: std::io::Error::from_raw_os_error(errno),
            },
            ref e @ (RbdError::NoCluster(_) | RbdError::NoPool(_) | RbdError::NoImage(_)) => {
                os(e, libc::ENOENT)
            }
            ref e @ RbdError::ClusterExists(_) => os(e, libc::EEXIST),
            ref e @ RbdError::ClusterBusy { .. } => os(e, libc::EBUSY),
            ref e @ RbdError::NoRuntime => os(e, libc::ENODEV),
            ref e @ RbdError::Library(_) => os(e, libc::ELIBACC),
        }
    }
}

/// Adds the rbd module to `reg`'s table; returns it (the cluster RPCs and
/// `bdev_rbd_resize` use it).
pub fn register(reg: &Registry, rt: Option<RuntimeHandle>) -> Result<Arc<RbdModule>, ControlError> {
    let m = Arc::new(RbdModule::new(rt));
    reg.add_module(m.clone())?;
    Ok(m)
}

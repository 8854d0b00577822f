//! ustor-fs-client: the client side of the remote zero-copy file service
//! (issue 23). `Client` speaks the wire protocol of `ustor_fs::proto` over
//! one TCP connection: the shared-secret handshake (Hello/Auth with
//! HMAC-SHA256), requests pipelined by tag (any number outstanding, replies
//! matched in any order), and reconnection when the server goes away.
//! `fuse` is the FUSE file system over any client, `session` runs it on
//! /dev/fuse or FUSE over io_uring, `mount` is `ustor fs mount`.
//! Programs that want no kernel crossing at all use `Client` directly.
//! `ll` is our own decoder of the kernel's FUSE requests and encoder of
//! the replies (for FUSE over io_uring, which fuser cannot do).
//! `remote::RemoteFs` is what the mount needs of a client (any transport).
//! `xdp::XdpClient` speaks the same requests over raw Ethernet (AF_XDP).

mod client;
mod conn;
pub mod fuse;
pub mod fuse_uring;
pub mod ll;
pub mod mount;
pub mod pagebuf;
pub mod remote;
pub mod session;
pub mod wire;
pub mod xdp;

use thiserror::Error;

pub use client::{Client, Config, Started};
pub use remote::RemoteFs;
pub use ustor_fs::{Attr, DirEntry, FileKind, SetAttr, StatFs};

/// Errors of the client layer; `errno` gives what a file system call
/// returns for each.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ClientError {
    /// The server answered the request with this errno.
    #[error("server answered errno {0}")]
    Errno(i32),
    /// The connection broke (or could not be made) and the request could
    /// not be retried.
    #[error("connection to the server lost: {0}")]
    Disconnected(String),
    /// No reply within the configured timeout; the connection is dropped.
    #[error("no reply within {0:?}")]
    Timeout(std::time::Duration),
    /// The server refused the secret.
    #[error("authentication refused by the server")]
    Auth,
    /// The server sent something the protocol does not allow.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// A bad argument caught before sending (name too long...).
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
}

impl ClientError {
    /// The errno a file system call reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Self::Errno(e) => *e,
            Self::Auth => libc::EACCES,
            Self::Invalid(_) => libc::EINVAL,
            Self::Timeout(_) => libc::ETIMEDOUT,
            Self::Disconnected(_) | Self::Protocol(_) => libc::EIO,
        }
    }
}

pub type Result<T> = std::result::Result<T, ClientError>;

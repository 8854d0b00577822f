//! ustor-fs: the remote zero-copy file service (issue 23). This crate owns
//! the file system that lives on a persistent-memory region (a file mapped
//! shared, or a DAX device): the layout (`layout`), inodes (`inode`), the
//! redo log that makes metadata changes atomic (`tx`), the data path that
//! plans reads and writes as byte ranges of the region (`fs`), the namespace
//! operations (`ns`), the offline checker (`check`) and the wire protocol's
//! frames (`proto`), the
//! transport-independent request handler (`serve`) and the TCP server on
//! the reactors with its control plane (`server`), and the frames of the
//! raw-Ethernet (AF_XDP) transport (`xdp_wire`).

pub mod check;
pub mod fs;
pub mod inode;
pub mod layout;
pub mod media;
pub mod ns;
pub mod proto;
pub mod serve;
pub mod server;
mod tx;
pub mod xdp_wire;

use thiserror::Error;

pub use check::check;
pub use fs::{Fs, ReadSeg, WritePlan, MAX_WRITE};
pub use inode::{Attr, FileKind, SetAttr, StatFs};
pub use layout::{format, Geometry, BLOCK_SIZE, MAGIC, ROOT_INO};
pub use media::{MappedFile, Media};
pub use ns::{DirEntry, NAME_MAX};

/// Errors of the file system; `errno` gives the POSIX code a client returns.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FsError {
    #[error("region of {0} bytes is too small")]
    TooSmall(usize),
    #[error("bad superblock magic")]
    BadMagic,
    #[error("superblock says {sb} blocks but the region holds {region}")]
    SizeMismatch { sb: u64, region: u64 },
    #[error("metadata block {0} is not marked in use in the bitmap")]
    MetaNotAllocated(u64),
    #[error("bitmap marks block {0}, beyond the end of the region")]
    BitBeyondEnd(u64),
    #[error("inconsistent: {0}")]
    Corrupt(String),
    #[error("transaction of {0} bytes does not fit the redo log")]
    LogFull(usize),
    #[error("no such file or directory")]
    NotFound,
    #[error("file exists")]
    Exists,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("directory not empty")]
    NotEmpty,
    #[error("no space left")]
    NoSpace,
    #[error("file name too long")]
    NameTooLong,
    #[error("file too large")]
    TooBig,
    #[error("invalid argument")]
    Invalid,
    #[error("operation not permitted")]
    Perm,
    #[error("read-only export")]
    ReadOnly,
    #[error("persisting the region failed: {0}")]
    Io(String),
}

impl From<std::io::Error> for FsError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e.to_string())
    }
}

impl FsError {
    /// The errno a client reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Self::NotFound => 2,
            Self::Perm => 1,
            Self::Exists => 17,
            Self::NotDir => 20,
            Self::IsDir => 21,
            Self::Invalid => 22,
            Self::TooBig => 27,
            Self::NoSpace => 28,
            Self::NameTooLong => 36,
            Self::NotEmpty => 39,
            Self::ReadOnly => 30,
            _ => 5,
        }
    }
}

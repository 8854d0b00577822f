//! The bdev layer's one error type. It is `Copy` so a completion can carry it
//! through a slot without allocation, and it keeps the errno so protocol
//! targets can map it to their own status (NBD errno, SCSI sense, NVMe status).

/// Why a bdev operation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BdevError {
    #[error("range {offset_blocks}+{num_blocks} is beyond the device's {size_blocks} blocks")]
    OutOfRange {
        offset_blocks: u64,
        num_blocks: u64,
        size_blocks: u64,
    },
    #[error("buffer length {got} does not match {want} bytes of I/O")]
    BadLength { got: u64, want: u64 },
    #[error("too many buffer segments ({0}); at most {max}", max = crate::io::MAX_SEGMENTS)]
    TooManySegments(usize),
    #[error("operation not supported by this bdev")]
    NotSupported,
    #[error("bdev was removed")]
    Removed,
    #[error("bdev is read-only through this descriptor")]
    ReadOnly,
    #[error("device I/O error (errno {0})")]
    Io(i32),
    /// A compare (compare-and-write) found different data and wrote
    /// nothing. `offset`: the first differing byte, counted from the start
    /// of the compared range (SCSI's sense INFORMATION), when the device
    /// says (NVMe does not).
    #[error("data miscompare{}", miscompare_at(offset))]
    Miscompare { offset: Option<u64> },
    #[error("I/O aborted")]
    Aborted,
}

impl BdevError {
    /// The closest errno, for protocols that speak errno (NBD) and RPC errors.
    pub fn errno(&self) -> i32 {
        match self {
            BdevError::OutOfRange { .. }
            | BdevError::BadLength { .. }
            | BdevError::TooManySegments(_) => libc::EINVAL,
            BdevError::NotSupported => libc::EOPNOTSUPP,
            BdevError::Removed => libc::ENODEV,
            BdevError::ReadOnly => libc::EPERM,
            BdevError::Io(e) => *e,
            BdevError::Miscompare { .. } => libc::EILSEQ,
            BdevError::Aborted => libc::ECANCELED,
        }
    }

    /// From a negative io_uring result.
    pub fn from_res(res: i32) -> BdevError {
        match -res {
            libc::EOPNOTSUPP => BdevError::NotSupported,
            libc::ECANCELED => BdevError::Aborted,
            e => BdevError::Io(e),
        }
    }
}

fn miscompare_at(offset: &Option<u64>) -> String {
    match offset {
        Some(o) => format!(" at byte {o} of the compared range"),
        None => String::new(),
    }
}

/// Errors of control operations (create, delete, open, claim).
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("bdev `{0}` already exists")]
    Exists(String),
    #[error("no bdev named `{0}`")]
    NotFound(String),
    #[error("bdev `{name}` is claimed by {by}")]
    Claimed { name: String, by: String },
    #[error("invalid parameter `{param}`: {why}")]
    Invalid { param: &'static str, why: String },
    #[error("{what}: {err}")]
    Os { what: String, err: std::io::Error },
    /// A module's create parameters did not decode (`path` locates the
    /// field, as serde_path_to_error prints it; `msg` is serde's message).
    #[error("invalid parameters at `{path}`: {msg}")]
    Params { path: String, msg: String },
}

impl ControlError {
    /// SPDK-style negative errno for JSON-RPC domain errors.
    pub fn errno(&self) -> i32 {
        match self {
            ControlError::Exists(_) => libc::EEXIST,
            ControlError::NotFound(_) => libc::ENODEV,
            ControlError::Claimed { .. } => libc::EBUSY,
            ControlError::Invalid { .. } | ControlError::Params { .. } => libc::EINVAL,
            ControlError::Os { err, .. } => err.raw_os_error().unwrap_or(libc::EIO),
        }
    }

    pub fn invalid(param: &'static str, why: impl Into<String>) -> ControlError {
        ControlError::Invalid {
            param,
            why: why.into(),
        }
    }
}

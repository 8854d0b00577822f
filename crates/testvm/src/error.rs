//! The rig's one error type. Every variant says which step failed and keeps
//! what is needed to debug it from a CI log alone: the command line and its
//! stderr, the errno, or the tail of the guest's serial log.

use std::path::PathBuf;
use std::time::Duration;

/// How many trailing lines of a serial log an error message carries; the full
/// log stays in the variant for callers that want it.
const LOG_TAIL_LINES: usize = 60;

/// Why the rig could not build or run a guest, or why the guest did not end
/// cleanly.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    /// A file-system or process operation failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A host command ran but exited unsuccessfully.
    #[error("command `{cmd}` failed ({status}): {stderr}")]
    Command {
        cmd: String,
        status: String,
        stderr: String,
    },
    /// A required host tool is missing (no QEMU, no apt-get, ...).
    #[error("host tool missing: {0}")]
    MissingTool(String),
    /// Building the kernel/initramfs assets failed for a reason that is not a
    /// single command (a module that does not exist, no compressed kernel in
    /// the image, ...).
    #[error("guest assets: {0}")]
    Asset(String),
    /// The caller asked for something the rig cannot do (bad env name, ...).
    #[error("invalid guest option: {0}")]
    Invalid(String),
    /// The guest did not power off within the timeout; QEMU was killed.
    #[error("guest timed out after {timeout:?} (serial log {log_path:?}); tail:\n{}", tail(.log))]
    Timeout {
        timeout: Duration,
        log: String,
        log_path: PathBuf,
    },
    /// QEMU exited but the guest never printed its exit marker: the kernel
    /// panicked, init died, or QEMU refused its command line.
    #[error("guest ended without exit marker (qemu {status}, serial log {log_path:?}); qemu stderr: {qemu_stderr}; serial tail:\n{}", tail(.log))]
    NoExitMarker {
        status: String,
        qemu_stderr: String,
        log: String,
        log_path: PathBuf,
    },
    /// The guest script ran to the end but exited non-zero (returned by
    /// [`crate::GuestOutcome::success`]).
    #[error("guest script exited with status {code}; serial tail:\n{}", tail(.log))]
    ScriptFailed { code: i32, log: String },
}

impl GuestError {
    /// Wraps an `io::Error` with what was being done.
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        GuestError::Io {
            what: what.into(),
            source,
        }
    }
}

/// The last [`LOG_TAIL_LINES`] lines of a log, for error messages.
pub(crate) fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    let start = lines.len().saturating_sub(LOG_TAIL_LINES);
    lines[start..].join("\n")
}

/// Shorthand used across the crate.
pub type Result<T, E = GuestError> = std::result::Result<T, E>;

//! The low-level driver (LLD) contract: what a host adapter driver (iSCSI
//! initiator, SG_IO passthrough, the emulated HBA, later VFIO HBAs)
//! implements so the mid-layer can drive it. See docs/writing-an-lld.md.
//!
//! An LLD lives on one reactor (it is `!Send`: it owns sockets, file
//! descriptors or rings of that reactor). The mid-layer calls every method
//! on that reactor:
//! - [`Lld::queuecommand`] never blocks: it starts the command or says the
//!   queue is full ([`QueueError`]), and the mid-layer retries later.
//! - [`Lld::poll`] reports completions; the mid-layer calls it from its
//!   poller on the owning reactor, every loop pass.
//! - scan and the error-handling task management functions are async and
//!   rare (control path), so they return boxed futures.

use std::future::Future;
use std::pin::Pin;

use serde::Serialize;

use crate::cdb::Cdb;
use crate::status::ScsiStatus;

/// Identifies one outstanding command of a host: slot index and generation,
/// chosen by the mid-layer. An LLD echoes it back in its [`Completion`].
pub type Tag = u32;

/// A boxed future of the control path (scan, TMFs), bound to the reactor.
pub type LocalFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// Direction of the data phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DataDir {
    None,
    /// Data-out: WRITE, UNMAP parameter lists, WRITE SAME's block.
    ToDevice,
    /// Data-in: READ, INQUIRY, ...
    FromDevice,
}

/// Where a command goes: the (channel, target, LUN) behind this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Nexus {
    pub channel: u32,
    pub target: u32,
    pub lun: u64,
}

/// One command handed to an LLD. The iovecs point into buffers the
/// mid-layer keeps alive until the command completes, is aborted, or is
/// cleared by a reset that the LLD reported as successful: an LLD may keep
/// `iov`/`iovcnt` (not the `ScsiCmd` itself) until then.
#[derive(Clone, Copy, Debug)]
pub struct ScsiCmd {
    pub tag: Tag,
    pub nexus: Nexus,
    pub cdb: Cdb,
    pub dir: DataDir,
    pub iov: *const libc::iovec,
    pub iovcnt: usize,
    /// Total bytes of the data phase (sum of the iovec lengths).
    pub data_len: u32,
}

impl ScsiCmd {
    /// The data segments.
    ///
    /// # Safety
    /// Only until the command completes, is aborted or reset away.
    pub unsafe fn iovecs(&self) -> &[libc::iovec] {
        if self.iovcnt == 0 || self.iov.is_null() {
            return &[];
        }
        std::slice::from_raw_parts(self.iov, self.iovcnt)
    }
}

/// Transport-level failures (the command may not have reached the device):
/// typed errors, unlike SCSI failures, which are a status with sense.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, thiserror::Error)]
#[serde(rename_all = "snake_case")]
pub enum TransportError {
    #[error("transport disconnected")]
    Disconnected,
    #[error("transport I/O error (errno {0})")]
    Io(i32),
    #[error("protocol error: {0}")]
    Protocol(&'static str),
    #[error("command aborted by the transport")]
    Aborted,
    #[error("no such target or logical unit")]
    NoDevice,
}

/// What an LLD reports for a finished command.
#[derive(Debug)]
pub struct Completion<'a> {
    pub tag: Tag,
    /// The device's status, or why the transport could not deliver one.
    pub status: Result<ScsiStatus, TransportError>,
    /// Sense data with CHECK CONDITION (may be empty or odd: it is decoded
    /// defensively).
    pub sense: &'a [u8],
    /// Bytes of the data phase not transferred.
    pub resid: u32,
}

/// Why `queuecommand` did not start a command; the mid-layer requeues it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    #[error("host queue is full")]
    HostBusy,
    #[error("device queue is full")]
    DeviceBusy,
    #[error("host is not connected")]
    NotConnected,
}

/// Outcome of a task management function or reset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TmfResult {
    /// Done: the affected commands will not complete and their buffers are
    /// released to the mid-layer.
    Success,
    /// Did not work; the mid-layer escalates.
    Failed,
}

/// What the mid-layer must respect when building commands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct HostLimits {
    /// Commands outstanding on the host at once.
    pub can_queue: u32,
    /// Commands outstanding per logical unit at once.
    pub cmd_per_lun: u32,
    /// Largest data phase of one command, bytes.
    pub max_transfer_bytes: u32,
    /// Most iovec segments in one command.
    pub max_sg_entries: u32,
    /// Buffer address alignment the LLD needs (1 = none).
    pub dma_alignment: u32,
}

impl Default for HostLimits {
    fn default() -> HostLimits {
        HostLimits {
            can_queue: 128,
            cmd_per_lun: 64,
            max_transfer_bytes: 1 << 20,
            max_sg_entries: 16,
            dma_alignment: 1,
        }
    }
}

/// A target behind a host, as a scan reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TargetAddr {
    pub channel: u32,
    pub target: u32,
    /// Transport name (an iSCSI IQN, a /dev/sg path, "emul").
    pub name: String,
    /// LUNs the transport already knows (SG_IO); empty means "ask REPORT
    /// LUNS" (the mid-layer falls back to LUN 0 if that fails).
    pub luns: Vec<u64>,
}

/// The contract of a SCSI low-level driver.
pub trait Lld {
    /// Driver name ("iscsi", "sg", "emul").
    fn name(&self) -> &str;

    fn limits(&self) -> HostLimits;

    /// Starts `cmd` without blocking, or says why not. A started command
    /// is reported exactly once by [`Lld::poll`], unless it is aborted or
    /// reset away first.
    fn queuecommand(&self, cmd: &ScsiCmd) -> Result<(), QueueError>;

    /// Reports up to `budget` finished commands to `done`; returns how many.
    fn poll(&self, budget: usize, done: &mut dyn FnMut(Completion<'_>)) -> usize;

    /// Finds the targets behind the host (connects, discovers, logs in).
    fn scan(&self) -> LocalFuture<'_, Result<Vec<TargetAddr>, TransportError>>;

    /// Aborts one command (ABORT TASK). A command the LLD no longer knows
    /// counts as aborted.
    fn abort(&self, tag: Tag, nexus: Nexus) -> LocalFuture<'_, TmfResult>;

    /// Resets one logical unit (LOGICAL UNIT RESET): every command to it is
    /// terminated.
    fn device_reset(&self, nexus: Nexus) -> LocalFuture<'_, TmfResult>;

    /// Resets the host (iSCSI: session reinstatement): every command is
    /// terminated.
    fn host_reset(&self) -> LocalFuture<'_, TmfResult>;

    /// Whether the transport reported targets or LUNs coming or going
    /// (a hot-plug event) since the last call; the mid-layer then rescans.
    /// Asked at the mid-layer's periodic check, not per command.
    fn take_rescan(&self) -> bool {
        false
    }

    /// Driver facts for `scsi_get_hosts`.
    fn info(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

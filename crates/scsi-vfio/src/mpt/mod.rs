//! The MPT Fusion SAS LLD (LSI SAS1068, QEMU's `mptsas1068`): IOC reset
//! and doorbell handshake at attach, SCSI IO request frames with 64-bit
//! SGEs in DMA memory posted to the request FIFO, the reply post FIFO
//! polled (no interrupts), sense and residuals from address replies, task
//! management (abort task, LUN and target reset) on the request FIFO,
//! event notification (device added or gone → rescan).

pub mod event;
pub mod wire;

mod ioc;
mod lld;
mod state;

pub use lld::MptSas;

/// Why attaching or driving an MPT IOC failed.
#[derive(Debug, thiserror::Error)]
pub enum MptError {
    #[error(transparent)]
    Vfio(#[from] ustor_vfio::VfioError),
    #[error("MPT IOC: {0}")]
    Ioc(String),
}

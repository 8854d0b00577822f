//! vhost-user-scsi on the SCSI target core: a controller serves several
//! targets, each one logical unit (LUN 0) over a bdev, to a frontend's
//! virtio-scsi driver.
//!
//! The vhost-user messages, memory table and ring set-up are shared with
//! vhost-user-blk ([`crate::backend`], [`crate::controller::Endpoint`]);
//! what is SCSI's own lives here: [`wire`] (virtio-scsi layouts and the
//! chain walker), [`device`] (targets, events, what queues share),
//! [`controller`] (create, add and remove targets, stop), [`target`]
//! (the vhost target's scsi controllers, for the RPCs), `ring` (what the
//! three ring kinds share on a reactor), `queue` (request queues: commands
//! on the target core), `ctrl` (control queue: TMFs; event queue:
//! hot-plug events), `tasks` (the commands running, by tag, for task
//! management) and [`fuzzing`] (the fuzz target's body).

pub mod controller;
mod ctrl;
pub mod device;
#[doc(hidden)]
pub mod fuzzing;
pub mod queue;
mod ring;
pub mod target;
mod tasks;
pub mod wire;

pub use controller::{ScsiController, ScsiControllerConfig};
pub use device::ScsiDevice;

//! ustor's virtual bdevs: bdevs built on other bdevs, each a
//! [`ustor_bdev::BdevModule`] with SPDK's RPC names and parameters, all on
//! the child-I/O seam ([`ustor_bdev::Children`]): a virtual bdev turns an
//! I/O into child I/Os on its bases' channels over the parent's own
//! buffers, so the data path neither copies nor allocates.
//!
//! - [`passthru`]: one base, same blocks (the template for new vbdevs).
//! - [`split`]: a base cut into equal parts (`bdev_split_create`).
//! - [`raid`]: raid0 (strips) and concat (linear) over several bases.
//! - [`error`]: a base with injectable failures (`bdev_error_*`).
//! - [`delay`]: a base with added read/write latency, timed on the reactor.
//!
//! [`base`] holds what they share: opening and claiming a base
//! exclusively, and following its hot-remove.

pub mod base;
pub mod delay;
pub mod error;
pub mod passthru;
pub mod raid;
pub mod split;

use std::sync::Arc;

use ustor_bdev::{ControlError, Registry};

/// Registers the virtual bdev modules in `reg`'s table (after
/// [`ustor_bdev::modules::register_builtin`]).
pub fn register(reg: &Arc<Registry>) -> Result<(), ControlError> {
    let w = Arc::downgrade(reg);
    reg.add_module(Arc::new(passthru::PassthruModule(w.clone())))?;
    reg.add_module(Arc::new(split::SplitModule(w.clone())))?;
    reg.add_module(Arc::new(raid::RaidModule(w.clone())))?;
    reg.add_module(Arc::new(error::ErrorModule(w.clone())))?;
    reg.add_module(Arc::new(delay::DelayModule(w)))
}

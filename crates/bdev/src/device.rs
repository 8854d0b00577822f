//! The two seams a bdev module fills, after SPDK's module table and
//! `fn_table`: [`BdevModule`] once per module, [`Bdev`] per device, and
//! [`BdevChannel`] per (device, reactor).

use std::sync::Arc;

use serde_json::Value;

use crate::error::{BdevError, ControlError};
use crate::io::IoHandle;
use crate::registry::{BdevEntry, Registry};
use crate::types::{BdevInfo, IoType};

/// One device. Shared by every reactor (`Send + Sync`); nothing on the I/O
/// path goes through it: I/O goes through the per-reactor channel it makes.
pub trait Bdev: Send + Sync + 'static {
    fn info(&self) -> &BdevInfo;

    /// Whether the driver implements `t` natively. The generic layer emulates
    /// `WriteZeroes` with writes when this says no.
    fn io_type_supported(&self, t: IoType) -> bool;

    /// Whether the driver makes an I/O of kind `t` carrying
    /// [`crate::types::IoFlags::FUA`] durable itself (io_uring's
    /// `RWF_DSYNC`, a device's FUA bit), or has no volatile cache to begin
    /// with. When it says no and the bdev has a write cache, the generic
    /// layer follows a FUA I/O with a flush of its range.
    fn fua_supported(&self, _t: IoType) -> bool {
        false
    }

    /// Most blocks one compare-and-write may cover (SPDK's `acwu`), for a
    /// driver that supports it; larger ones fail with `Io(EINVAL)` in the
    /// generic layer. librbd, for one, compares within one 512-byte
    /// sector only.
    fn max_compare_and_write_blocks(&self) -> u64 {
        u64::MAX
    }

    /// Makes this device's channel for the calling reactor (called on it,
    /// once, lazily).
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError>;

    /// The config call that recreates this bdev
    /// (`{"method": "bdev_malloc_create", "params": {...}}`).
    fn config_json(&self) -> Value;

    /// Driver-specific facts for `bdev_get_bdevs`' `driver_specific`.
    fn driver_info(&self) -> Value {
        Value::Null
    }

    /// Called once when the bdev is unregistered and every channel is gone.
    fn destruct(&self) {}

    /// Allocation status of the blocks from `offset_blocks` on, for drivers
    /// that can tell (NBD's `base:allocation`, `qemu-img map`): extents in
    /// order that cover at least the first block and at most `num_blocks`
    /// (a driver may stop early), or `None` when it cannot say. Runs on the
    /// caller's reactor, so it must be cheap and never wait for device I/O
    /// (a file's `SEEK_DATA`/`SEEK_HOLE` is a metadata lookup).
    fn block_status(&self, _offset_blocks: u64, _num_blocks: u64) -> Option<Vec<Extent>> {
        None
    }
}

/// A run of blocks with one allocation state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub num_blocks: u64,
    /// Not allocated (a hole in the backing file).
    pub hole: bool,
    /// Reads as zeroes.
    pub zero: bool,
}

/// A device's I/O queue on one reactor (`!Send`).
pub trait BdevChannel {
    /// Starts `io`. The driver completes it exactly once, now or later on this
    /// reactor, with [`IoHandle::complete`]. Never blocks; a driver out of
    /// resources completes with `BdevError::Io(EAGAIN)` or queues internally.
    fn submit(&self, io: IoHandle);

    /// I/Os submitted and not yet completed (for reset and drain).
    fn outstanding(&self) -> usize {
        0
    }

    /// Every I/O is completed inside [`BdevChannel::submit`] (an in-memory
    /// driver: null, malloc). Its I/O touches a buffer only while it is
    /// being started, so a caller may lend memory it must not have
    /// written once it gives the I/O up ([`crate::IoChannel::completes_in_submit`]).
    fn completes_in_submit(&self) -> bool {
        false
    }
}

/// A bdev module (driver), registered once in the [`Registry`]'s module
/// table: the RPC methods that create and delete its bdevs, the config dump,
/// the rollback of a failed config and `ustor bench`'s inline specs all read
/// the table, so adding a bdev kind means writing the module and
/// registering it ([`crate::modules::register_builtin`] for ustor's own).
pub trait BdevModule: Send + Sync {
    /// The module's name, as in [`BdevInfo::module`] (`malloc`).
    fn name(&self) -> &'static str;

    /// The RPC method that creates one of its bdevs from SPDK's JSON
    /// parameters; `None` for a module whose bdevs come another way.
    fn create_method(&self) -> Option<String> {
        Some(format!("bdev_{}_create", self.name()))
    }

    /// The RPC method that deletes one of its bdevs by `{"name": ...}`.
    fn delete_method(&self) -> Option<String> {
        Some(format!("bdev_{}_delete", self.name()))
    }

    /// Creates a bdev from the parameters of [`BdevModule::create_method`].
    fn create(&self, reg: &Registry, params: Value) -> Result<Arc<BdevEntry>, ControlError>;

    /// Deletes one of this module's bdevs by name (refused while claimed).
    fn delete(&self, reg: &Registry, name: &str) -> Result<(), ControlError> {
        reg.delete(name)
    }

    /// A bdev was registered (any module's): a virtual bdev module claims
    /// the bases its configuration waits for, as SPDK's examine does.
    fn examine(&self, _reg: &Registry, _bdev: &Arc<BdevEntry>) {}

    /// Module-level config calls that must precede the bdevs' (options).
    fn config_json(&self) -> Vec<Value> {
        Vec::new()
    }

    /// How `ustor bench --bdev` names a bdev of this module inline
    /// (`malloc:SIZE`); `None`: no inline spec.
    fn inline_spec_syntax(&self) -> Option<&'static str> {
        None
    }

    /// `ustor bench --bdev KIND:ARG` with KIND this module's name: creates
    /// the bdev ARG describes (`malloc:256M`, `uring:/dev/loop0`) with
    /// `block_size` where the module takes one.
    fn inline_spec(
        &self,
        _reg: &Registry,
        arg: &str,
        _block_size: u32,
    ) -> Result<Arc<BdevEntry>, ControlError> {
        Err(ControlError::invalid(
            "bdev",
            format!("module {} takes no inline spec (`{arg}`)", self.name()),
        ))
    }
}

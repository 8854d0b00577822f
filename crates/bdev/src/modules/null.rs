//! The null bdev: every I/O completes at once without touching data (reads
//! leave the buffer as it was). It measures the stack's own cost per I/O.

use std::sync::Arc;

use serde_json::{json, Value};

use super::{check_block_size, RamOpts};
use crate::device::{Bdev, BdevChannel};
use crate::error::{BdevError, ControlError};
use crate::io::IoHandle;
use crate::registry::{BdevEntry, Registry};
use crate::types::{BdevInfo, IoType};

pub struct NullBdev {
    info: BdevInfo,
    opts: RamOpts,
}

struct NullChannel;

impl BdevChannel for NullChannel {
    #[inline]
    fn submit(&self, io: IoHandle) {
        io.complete(Ok(()));
    }

    fn completes_in_submit(&self) -> bool {
        true
    }
}

impl Bdev for NullBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    /// Everything but compare-and-write (a null device has no data to
    /// compare with).
    fn io_type_supported(&self, t: IoType) -> bool {
        t != IoType::CompareAndWrite
    }
    /// No volatile cache: every completed write is as durable as it gets.
    fn fua_supported(&self, _t: IoType) -> bool {
        true
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        Ok(Box::new(NullChannel))
    }
    fn config_json(&self) -> Value {
        json!({"method": "bdev_null_create", "params": self.opts})
    }
}

/// `bdev_null_create`.
pub fn create(reg: &Registry, mut opts: RamOpts) -> Result<Arc<BdevEntry>, ControlError> {
    check_block_size(opts.block_size)?;
    if opts.num_blocks == 0 {
        return Err(ControlError::invalid("num_blocks", "must be > 0"));
    }
    let uuid = *opts.uuid.get_or_insert_with(uuid::Uuid::new_v4);
    let info = BdevInfo {
        name: opts.name.clone(),
        uuid,
        product_name: "Null disk".into(),
        module: "null",
        block_size: opts.block_size,
        num_blocks: opts.num_blocks,
        required_alignment: 1,
        max_transfer_blocks: opts.max_transfer_blocks,
        optimal_boundary_blocks: opts.optimal_io_boundary,
        write_cache: false,
        // Keeps no data: reads leave buffers as they were, and there is
        // nothing to read ahead.
        unmap_reads_zero: false,
        memory_resident: true,
    };
    reg.register(Arc::new(NullBdev { info, opts }))
}

/// The null module: `bdev_null_create` / `bdev_null_delete`, and
/// `null:SIZE` for `ustor bench`.
pub fn module() -> super::RamModule {
    super::RamModule {
        name: "null",
        prefix: "Null",
        spec: "null:SIZE",
        make: create,
        make_inline: create,
    }
}

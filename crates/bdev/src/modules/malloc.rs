//! The malloc bdev: a RAM disk in an anonymous mapping (no hugetlbfs),
//! faulted in 4 KiB at a time by the first write to each page, so memory is
//! used only as the disk is written and nothing is allocated at creation;
//! `ustor bench`'s `malloc:SIZE` is filled up front with transparent huge
//! pages instead (see `lazy_mem` for why each).
//!
//! Channels on several reactors copy to and from the same mapping without a
//! lock, as SPDK's malloc bdev does: ordering of overlapping writes is the
//! initiator's business, exactly as on a real disk.

use std::sync::Arc;

use serde_json::{json, Value};

use super::lazy_mem::{self, Mem, Resident};
use super::{check_block_size, copy_iov, RamOpts};
use crate::device::{Bdev, BdevChannel};
use crate::error::{BdevError, ControlError};
use crate::io::IoHandle;
use crate::registry::{BdevEntry, Registry};
use crate::types::{BdevInfo, IoType};

pub struct MallocBdev {
    info: BdevInfo,
    opts: RamOpts,
    mem: Arc<Mem>,
    /// Faulted in at creation (`prefault`), not by first writes.
    prefaulted: bool,
}

struct MallocChannel {
    mem: Arc<Mem>,
    bs: usize,
}

impl BdevChannel for MallocChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        let off = d.offset_blocks as usize * self.bs;
        let len = d.num_blocks as usize * self.bs;
        debug_assert!(off + len <= self.mem.len, "generic layer checked the range");
        match d.kind {
            IoType::Read => match self.mem.resident(off, len) {
                // Never written: zeros, without faulting the mapping in.
                // SAFETY: iovecs valid until completion, which is right here.
                Resident::None => unsafe { lazy_mem::zero_iov(d.iovecs()) },
                // Extents never written map the shared zero page on read
                // (no allocation, so no compaction).
                // SAFETY: range checked by the generic layer; iovecs valid
                // until completion, which happens right here.
                _ => unsafe { copy_iov(self.mem.ptr, off, d.iovecs(), false) },
            },
            IoType::Write => {
                self.mem.mark_written(off, len);
                // Pages never written fault in here, 4 KiB each (~1.5 µs;
                // the mapping has no huge pages to compact for).
                // SAFETY: as for reads.
                unsafe { copy_iov(self.mem.ptr, off, d.iovecs(), true) }
            }
            // SAFETY: [off, off+len) lies inside the mapping.
            IoType::Unmap | IoType::WriteZeroes => unsafe { self.mem.zero(off, len) },
            IoType::Flush | IoType::Reset => {}
            IoType::CompareAndWrite => return io.complete(Err(BdevError::NotSupported)),
        }
        io.complete(Ok(()));
    }

    fn completes_in_submit(&self) -> bool {
        true
    }
}

impl Bdev for MallocBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    /// Everything but compare-and-write: the memory is shared by the
    /// reactors without a lock, so a compare could not be atomic against
    /// another reactor's write.
    fn io_type_supported(&self, t: IoType) -> bool {
        t != IoType::CompareAndWrite
    }
    /// No volatile cache: every completed write is as durable as it gets.
    fn fua_supported(&self, _t: IoType) -> bool {
        true
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        Ok(Box::new(MallocChannel {
            mem: self.mem.clone(),
            bs: self.info.block_size as usize,
        }))
    }
    fn config_json(&self) -> Value {
        let mut c = json!({"method": "bdev_malloc_create", "params": self.opts});
        if self.prefaulted {
            c["params"]["prefault"] = true.into();
        }
        c
    }
    /// How much of the disk is in memory so far (it grows as it is written).
    fn driver_info(&self) -> Value {
        json!({"malloc": {"resident_bytes": self.mem.resident_bytes()}})
    }
}

/// `bdev_malloc_create`.
pub fn create(reg: &Registry, opts: RamOpts) -> Result<Arc<BdevEntry>, ControlError> {
    reg.register(Arc::new(build(reg, opts, false)?))
}

/// `malloc:SIZE` in `ustor bench` and `prefault: true`: the whole disk is
/// faulted in, with huge pages, before any I/O, as bdevperf's and
/// nvmf_tgt's hugepage malloc disks are, so a benchmark times the copies
/// and not first-touch allocation, on equal pages.
fn create_populated(reg: &Registry, opts: RamOpts) -> Result<Arc<BdevEntry>, ControlError> {
    let b = build(reg, opts, true)?;
    b.mem.populate_all().map_err(|err| ControlError::Os {
        what: format!("populating {}", b.info.name),
        err,
    })?;
    reg.register(Arc::new(b))
}

fn build(reg: &Registry, mut opts: RamOpts, populated: bool) -> Result<MallocBdev, ControlError> {
    check_block_size(opts.block_size)?;
    if opts.num_blocks == 0 {
        return Err(ControlError::invalid("num_blocks", "must be > 0"));
    }
    let len =
        opts.num_blocks
            .checked_mul(opts.block_size as u64)
            .filter(|l| *l <= isize::MAX as u64)
            .ok_or_else(|| ControlError::invalid("num_blocks", "size overflows"))? as usize;
    if reg.get(&opts.name).is_some() {
        return Err(ControlError::Exists(opts.name.clone()));
    }
    let mem = Mem::map(len, populated).map_err(|err| ControlError::Os {
        what: format!("mapping {len} bytes for {}", opts.name),
        err,
    })?;
    let uuid = *opts.uuid.get_or_insert_with(uuid::Uuid::new_v4);
    let info = BdevInfo {
        name: opts.name.clone(),
        uuid,
        product_name: "Malloc disk".into(),
        module: "malloc",
        block_size: opts.block_size,
        num_blocks: opts.num_blocks,
        required_alignment: 1,
        max_transfer_blocks: opts.max_transfer_blocks,
        optimal_boundary_blocks: opts.optimal_io_boundary,
        write_cache: false,
        // Unmap zeroes the range in memory.
        unmap_reads_zero: true,
        memory_resident: true,
    };
    Ok(MallocBdev {
        info,
        opts,
        mem: Arc::new(mem),
        prefaulted: populated,
    })
}

/// The malloc module: `bdev_malloc_create` / `bdev_malloc_delete`, and
/// `malloc:SIZE` for `ustor bench`.
pub fn module() -> super::RamModule {
    super::RamModule {
        name: "malloc",
        prefix: "Malloc",
        spec: "malloc:SIZE",
        make: create,
        make_inline: create_populated,
    }
}

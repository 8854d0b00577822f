//! The malloc bdev: a RAM disk in an anonymous mapping (transparent huge
//! pages when the kernel offers them; no hugetlbfs), faulted in 2 MiB at a
//! time on first write by a populator thread, so that memory is used only
//! as the disk is written and no reactor ever takes an allocating page
//! fault (see `lazy_mem`).
//!
//! Channels on several reactors copy to and from the same mapping without a
//! lock, as SPDK's malloc bdev does: ordering of overlapping writes is the
//! initiator's business, exactly as on a real disk.

use std::cell::Cell;
use std::rc::Rc;
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
}

struct MallocChannel {
    mem: Arc<Mem>,
    bs: usize,
    /// Writes waiting for the populator (for drain and reset).
    waiting: Rc<Cell<usize>>,
}

impl MallocChannel {
    /// A write that reaches an extent not yet populated: the populator
    /// thread faults it in, then this reactor copies and completes. Off a
    /// reactor (no executor to wait on) it populates in place.
    fn write_after_populate(&self, io: IoHandle, off: usize, len: usize) {
        if !ustor_runtime::is_reactor_thread() {
            let r = self.mem.populate(off, len);
            return finish_write(&self.mem, io, off, r);
        }
        let wait = lazy_mem::request(self.mem.clone(), off, len);
        let (mem, waiting) = (self.mem.clone(), self.waiting.clone());
        waiting.set(waiting.get() + 1);
        drop(ustor_runtime::spawn(async move {
            let r = wait.await;
            waiting.set(waiting.get() - 1);
            finish_write(&mem, io, off, r);
        }));
    }
}

/// Copies a write's data into populated memory and completes it.
fn finish_write(mem: &Mem, io: IoHandle, off: usize, populated: std::io::Result<()>) {
    if let Err(e) = populated {
        return io.complete(Err(BdevError::Io(e.raw_os_error().unwrap_or(libc::ENOMEM))));
    }
    let d = io.desc();
    // SAFETY: range checked by the generic layer and now populated; the
    // iovecs are valid until the completion below.
    unsafe { copy_iov(mem.ptr, off, d.iovecs(), true) };
    io.complete(Ok(()));
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
            IoType::Write if self.mem.resident(off, len) != Resident::All => {
                return self.write_after_populate(io, off, len);
            }
            // SAFETY: as for reads; every extent of the range is populated.
            IoType::Write => unsafe { copy_iov(self.mem.ptr, off, d.iovecs(), true) },
            // SAFETY: [off, off+len) lies inside the mapping.
            IoType::Unmap | IoType::WriteZeroes => unsafe { self.mem.zero(off, len) },
            IoType::Flush | IoType::Reset => {}
            IoType::CompareAndWrite => return io.complete(Err(BdevError::NotSupported)),
        }
        io.complete(Ok(()));
    }

    fn outstanding(&self) -> usize {
        self.waiting.get()
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
            waiting: Rc::default(),
        }))
    }
    fn config_json(&self) -> Value {
        json!({"method": "bdev_malloc_create", "params": self.opts})
    }
    /// How much of the disk is in memory so far (it grows as it is written).
    fn driver_info(&self) -> Value {
        json!({"malloc": {"resident_bytes": self.mem.resident_bytes()}})
    }
}

/// `bdev_malloc_create`.
pub fn create(reg: &Registry, opts: RamOpts) -> Result<Arc<BdevEntry>, ControlError> {
    reg.register(Arc::new(build(reg, opts)?))
}

/// `malloc:SIZE` in `ustor bench`: the whole disk is populated before the
/// run, as bdevperf's malloc disk is, so a benchmark times the copies and
/// not the kernel's first-touch allocation (milliseconds per 2 MiB extent on
/// a fragmented host: a fresh disk's random writes ran at ~400 IOPS).
fn create_populated(reg: &Registry, opts: RamOpts) -> Result<Arc<BdevEntry>, ControlError> {
    let b = build(reg, opts)?;
    b.mem
        .populate(0, b.mem.len)
        .map_err(|err| ControlError::Os {
            what: format!("populating {}", b.info.name),
            err,
        })?;
    reg.register(Arc::new(b))
}

fn build(reg: &Registry, mut opts: RamOpts) -> Result<MallocBdev, ControlError> {
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
    let mem = Mem::map(len).map_err(|err| ControlError::Os {
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

//! The malloc bdev: a RAM disk in an anonymous mapping (transparent huge
//! pages when the kernel offers them; no hugetlbfs), faulted in whole at
//! creation so that no I/O ever waits on a page fault.
//!
//! Channels on several reactors copy to and from the same mapping without a
//! lock, as SPDK's malloc bdev does: ordering of overlapping writes is the
//! initiator's business, exactly as on a real disk.

use std::sync::Arc;

use serde_json::{json, Value};

use super::{check_block_size, copy_iov, RamOpts};
use crate::device::{Bdev, BdevChannel};
use crate::error::{BdevError, ControlError};
use crate::io::IoHandle;
use crate::registry::{BdevEntry, Registry};
use crate::types::{BdevInfo, IoType};

struct Mem {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory valid for the bdev's life; concurrent
// access from several reactors is to disjoint or initiator-ordered ranges,
// with raw copies only (no references are formed across threads).
unsafe impl Send for Mem {}
unsafe impl Sync for Mem {}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: ptr/len come from our mmap.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

pub struct MallocBdev {
    info: BdevInfo,
    opts: RamOpts,
    mem: Arc<Mem>,
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
            // SAFETY: range checked by the generic layer; iovecs valid until
            // completion, which happens right here.
            IoType::Read => unsafe { copy_iov(self.mem.ptr, off, d.iovecs(), false) },
            IoType::Write => unsafe { copy_iov(self.mem.ptr, off, d.iovecs(), true) },
            // SAFETY: [off, off+len) lies inside the mapping.
            IoType::Unmap | IoType::WriteZeroes => unsafe {
                std::ptr::write_bytes(self.mem.ptr.add(off), 0, len)
            },
            IoType::Flush | IoType::Reset => {}
        }
        io.complete(Ok(()));
    }
}

impl Bdev for MallocBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, _t: IoType) -> bool {
        true
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
        json!({"method": "bdev_malloc_create", "params": self.opts})
    }
}

/// Linux 5.14's MADV_POPULATE_WRITE (not in every libc crate release).
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Faults the whole RAM disk in now, as SPDK's zeroed allocation does.
/// Left lazy, each first write to a 2 MiB extent faults on a reactor, and
/// with THP that fault may run direct compaction: stalls of 40 ms to over
/// a second were seen mid-I/O (NVMe/TCP randwrite QD128, an RPC waiting on
/// a reactor under NBD load). Up front, a disk larger than free memory
/// also fails at creation with ENOMEM instead of the OOM killer later.
fn populate(p: *mut libc::c_void, len: usize) -> std::io::Result<()> {
    // SAFETY: advice on a private anonymous mapping of `len` bytes that we
    // own; the kernel only faults pages in.
    if unsafe { libc::madvise(p, len, MADV_POPULATE_WRITE) } == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EINVAL) {
        return Err(err);
    }
    // Older kernel: touch one byte per page (the mapping is zero-filled, so
    // writing zero changes nothing but residency).
    let page = 4096;
    for off in (0..len).step_by(page) {
        // SAFETY: `off < len`, inside the writable mapping made above.
        unsafe { std::ptr::write_volatile(p.cast::<u8>().add(off), 0) };
    }
    Ok(())
}

/// `bdev_malloc_create`.
pub fn create(reg: &Registry, mut opts: RamOpts) -> Result<Arc<BdevEntry>, ControlError> {
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
    // SAFETY: anonymous private mapping, checked below; populated up front
    // (see `populate`).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(ControlError::Os {
            what: format!("mapping {len} bytes for {}", opts.name),
            err: std::io::Error::last_os_error(),
        });
    }
    // Transparent huge pages where the kernel offers them (no hugetlbfs, no
    // reservation): random 4 KiB I/O over a large disk otherwise pays a
    // TLB miss on nearly every copy. Advice only: failure is harmless.
    // SAFETY: advice on the mapping just made; no memory is accessed.
    unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
    if let Err(err) = populate(p, len) {
        // SAFETY: unmapping the mapping made above, which nothing else uses.
        unsafe { libc::munmap(p, len) };
        return Err(ControlError::Os {
            what: format!("populating {len} bytes of RAM for {}", opts.name),
            err,
        });
    }
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
    reg.register(Arc::new(MallocBdev {
        info,
        opts,
        mem: Arc::new(Mem { ptr: p.cast(), len }),
    }))
}

/// The malloc module: `bdev_malloc_create` / `bdev_malloc_delete`, and
/// `malloc:SIZE` for `ustor bench`.
pub fn module() -> super::RamModule {
    super::RamModule {
        name: "malloc",
        prefix: "Malloc",
        spec: "malloc:SIZE",
        make: create,
    }
}

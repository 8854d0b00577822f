//! Per-command memory of the sg LLD, preallocated per host slot: the
//! `sg_io_hdr` the kernel reads at `write()`, the CDB it points at, and
//! the sense buffer the kernel fills at `read()`. One slot per mid-layer
//! slot index (the tag's low 16 bits), so a command never allocates.

use std::cell::{Cell, UnsafeCell};

use super::hdr::{dxfer_direction, SgIoHdr, SG_FLAG_Q_AT_TAIL};
use crate::lld::{ScsiCmd, Tag, TransportError};
use crate::sense::SENSE_BUF_LEN;
use crate::status::ScsiStatus;

pub const SENSE_LEN: usize = SENSE_BUF_LEN;

pub struct Slot {
    hdr: UnsafeCell<SgIoHdr>,
    cdb: UnsafeCell<[u8; 16]>,
    sense: UnsafeCell<[u8; SENSE_LEN]>,
    pub tag: Cell<Tag>,
    /// With the kernel (or failed and waiting to be reported).
    pub busy: Cell<bool>,
    pub node: Cell<u16>,
    /// Bumped per command: ring completions of an older command are stale.
    pub seq: Cell<u16>,
    pub data_len: Cell<u32>,
    /// Outcome of a command the kernel never took.
    pub early: Cell<Result<ScsiStatus, TransportError>>,
}

impl Slot {
    pub fn new() -> Slot {
        Slot {
            hdr: UnsafeCell::new(SgIoHdr::zeroed()),
            cdb: UnsafeCell::new([0; 16]),
            sense: UnsafeCell::new([0; SENSE_LEN]),
            tag: Cell::new(0),
            busy: Cell::new(false),
            node: Cell::new(0),
            seq: Cell::new(0),
            data_len: Cell::new(0),
            early: Cell::new(Ok(ScsiStatus::Good)),
        }
    }

    /// Claims the slot for `cmd` (its bookkeeping only).
    pub fn begin(&self, cmd: &ScsiCmd, node: u16) {
        debug_assert!(!self.busy.get());
        self.busy.set(true);
        self.tag.set(cmd.tag);
        self.node.set(node);
        self.seq.set(self.seq.get().wrapping_add(1));
        self.data_len.set(cmd.data_len);
    }

    /// Claims the slot and fills its header for `cmd`; returns the header
    /// to hand to `write()`.
    pub fn fill(&self, cmd: &ScsiCmd, node: u16, idx: usize, timeout_ms: u32) -> *const SgIoHdr {
        self.begin(cmd, node);
        // SAFETY: the slot is not busy with the kernel (checked by the
        // caller, and `busy` was false), so neither the kernel nor a
        // reference of ours reads its CDB or header now.
        let (cdb, hdr) = unsafe { (&mut *self.cdb.get(), &mut *self.hdr.get()) };
        let bytes = cmd.cdb.as_bytes();
        cdb[..bytes.len()].copy_from_slice(bytes);
        // SAFETY: the mid-layer keeps `cmd`'s iovecs valid until the
        // command is reported or dropped.
        let iov = unsafe { cmd.iovecs() };
        let (dxferp, iovec_count) = match iov {
            [] => (std::ptr::null_mut(), 0),
            [one] => (one.iov_base, 0),
            many => (many.as_ptr() as *mut libc::c_void, many.len() as u16),
        };
        *hdr = SgIoHdr {
            interface_id: b'S' as i32,
            dxfer_direction: if cmd.data_len == 0 {
                dxfer_direction(crate::lld::DataDir::None)
            } else {
                dxfer_direction(cmd.dir)
            },
            cmd_len: bytes.len() as u8,
            mx_sb_len: SENSE_LEN as u8,
            iovec_count,
            dxfer_len: cmd.data_len,
            dxferp,
            cmdp: cdb.as_ptr(),
            sbp: self.sense.get().cast(),
            timeout: timeout_ms,
            flags: SG_FLAG_Q_AT_TAIL,
            pack_id: cmd.tag as i32,
            usr_ptr: idx as *mut libc::c_void,
            ..SgIoHdr::zeroed()
        };
        hdr as *const SgIoHdr
    }

    /// The sense buffer as the kernel left it.
    pub fn sense_bytes(&self) -> &[u8; SENSE_LEN] {
        // SAFETY: called only after the reply was read, when the kernel has
        // finished writing the buffer and no mutable reference exists.
        unsafe { &*self.sense.get() }
    }
}

//! The sg v3 interface's wire struct (`struct sg_io_hdr` of
//! `<scsi/sg.h>`), its constants, and the pure decoding of a reply header
//! the kernel hands back on `read()` into the LLD's [`Completion`] fields.
//! Nothing here touches a file descriptor.

use crate::lld::{DataDir, TransportError};
use crate::status::ScsiStatus;

/// `struct sg_io_hdr` (v3), x86_64/aarch64 layout.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SgIoHdr {
    /// Always `'S'`.
    pub interface_id: i32,
    /// `SG_DXFER_*`.
    pub dxfer_direction: i32,
    pub cmd_len: u8,
    /// Size of the sense buffer at `sbp`.
    pub mx_sb_len: u8,
    /// 0: `dxferp` is the buffer; n: `dxferp` points at n `sg_iovec`s.
    pub iovec_count: u16,
    pub dxfer_len: u32,
    pub dxferp: *mut libc::c_void,
    pub cmdp: *const u8,
    pub sbp: *mut u8,
    /// Kernel-side command timeout, milliseconds.
    pub timeout: u32,
    pub flags: u32,
    /// Echoed back: the mid-layer's tag.
    pub pack_id: i32,
    /// Echoed back: the LLD's slot index.
    pub usr_ptr: *mut libc::c_void,
    // ---- written by the kernel ----
    pub status: u8,
    pub masked_status: u8,
    pub msg_status: u8,
    /// Sense bytes actually written to `sbp`.
    pub sb_len_wr: u8,
    /// `DID_*` of the kernel's HBA driver.
    pub host_status: u16,
    /// `DRIVER_*`.
    pub driver_status: u16,
    pub resid: i32,
    pub duration: u32,
    pub info: u32,
}

// The kernel reads and writes exactly this many bytes.
pub const SG_IO_HDR_LEN: usize = 88;
const _: () = assert!(std::mem::size_of::<SgIoHdr>() == SG_IO_HDR_LEN);
const _: () = assert!(std::mem::offset_of!(SgIoHdr, usr_ptr) == 56);
const _: () = assert!(std::mem::offset_of!(SgIoHdr, status) == 64);
const _: () = assert!(std::mem::offset_of!(SgIoHdr, resid) == 72);

pub const SG_DXFER_NONE: i32 = -1;
pub const SG_DXFER_TO_DEV: i32 = -2;
pub const SG_DXFER_FROM_DEV: i32 = -3;
/// Queue at the tail of the device queue (sg's default is the head, which
/// would reorder our commands).
pub const SG_FLAG_Q_AT_TAIL: u32 = 0x10;
/// Commands in flight per sg file descriptor (`SG_MAX_QUEUE`).
pub const SG_MAX_QUEUE: u32 = 16;

// ioctls of <scsi/sg.h>.
pub const SG_SET_COMMAND_Q: libc::c_ulong = 0x2271;
pub const SG_GET_RESERVED_SIZE: libc::c_ulong = 0x2272;
pub const SG_SET_RESERVED_SIZE: libc::c_ulong = 0x2275;
pub const SG_GET_SCSI_ID: libc::c_ulong = 0x2276;
pub const SG_GET_SG_TABLESIZE: libc::c_ulong = 0x227f;
pub const SG_GET_VERSION_NUM: libc::c_ulong = 0x2282;
pub const SG_SCSI_RESET: libc::c_ulong = 0x2284;
pub const SG_SCSI_RESET_DEVICE: i32 = 1;
pub const SG_SCSI_RESET_BUS: i32 = 2;
pub const SG_SCSI_RESET_HOST: i32 = 3;

/// `struct sg_scsi_id` (SG_GET_SCSI_ID).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SgScsiId {
    pub host_no: i32,
    pub channel: i32,
    pub scsi_id: i32,
    pub lun: i32,
    pub scsi_type: i32,
    pub h_cmd_per_lun: i16,
    pub d_queue_depth: i16,
    pub unused: [i32; 2],
}
const _: () = assert!(std::mem::size_of::<SgScsiId>() == 32);

impl SgIoHdr {
    pub const fn zeroed() -> SgIoHdr {
        SgIoHdr {
            interface_id: b'S' as i32,
            dxfer_direction: SG_DXFER_NONE,
            cmd_len: 0,
            mx_sb_len: 0,
            iovec_count: 0,
            dxfer_len: 0,
            dxferp: std::ptr::null_mut(),
            cmdp: std::ptr::null(),
            sbp: std::ptr::null_mut(),
            timeout: 0,
            flags: 0,
            pack_id: -1,
            usr_ptr: std::ptr::null_mut(),
            status: 0,
            masked_status: 0,
            msg_status: 0,
            sb_len_wr: 0,
            host_status: 0,
            driver_status: 0,
            resid: 0,
            duration: 0,
            info: 0,
        }
    }
}

/// `SG_DXFER_*` for a data direction.
pub fn dxfer_direction(dir: DataDir) -> i32 {
    match dir {
        DataDir::None => SG_DXFER_NONE,
        DataDir::ToDevice => SG_DXFER_TO_DEV,
        DataDir::FromDevice => SG_DXFER_FROM_DEV,
    }
}

/// The kernel-supplied outcome fields of a reply header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply {
    pub pack_id: i32,
    pub slot: u64,
    pub status: u8,
    pub sb_len_wr: u8,
    pub host_status: u16,
    pub driver_status: u16,
    pub resid: i32,
}

impl Reply {
    pub fn of(h: &SgIoHdr) -> Reply {
        Reply {
            pack_id: h.pack_id,
            slot: h.usr_ptr as usize as u64,
            status: h.status,
            sb_len_wr: h.sb_len_wr,
            host_status: h.host_status,
            driver_status: h.driver_status,
            resid: h.resid,
        }
    }

    /// Decodes the 88 bytes of a reply header (the fuzz target's input).
    pub fn decode(b: &[u8]) -> Option<Reply> {
        let b: &[u8; SG_IO_HDR_LEN] = b.get(..SG_IO_HDR_LEN)?.try_into().ok()?;
        let u16_at = |o: usize| u16::from_ne_bytes([b[o], b[o + 1]]);
        let i32_at = |o: usize| i32::from_ne_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let mut p = [0u8; 8];
        p.copy_from_slice(&b[56..64]);
        Some(Reply {
            pack_id: i32_at(48),
            slot: u64::from_ne_bytes(p),
            status: b[64],
            sb_len_wr: b[67],
            host_status: u16_at(68),
            driver_status: u16_at(70),
            resid: i32_at(72),
        })
    }

    /// The device's status, or the transport failure the kernel's HBA
    /// driver reported (`host_status`, Linux's `DID_*`).
    pub fn status(&self) -> Result<ScsiStatus, TransportError> {
        match self.host_status {
            0x00 => Ok(ScsiStatus::from_u8(self.status)),
            // DID_NO_CONNECT, DID_BAD_TARGET
            0x01 | 0x04 => Err(TransportError::NoDevice),
            // DID_BUS_BUSY, DID_SOFT_ERROR, DID_IMM_RETRY, DID_REQUEUE,
            // DID_TRANSPORT_DISRUPTED: worth a retry.
            0x02 | 0x0b | 0x0c | 0x0d | 0x0e => Err(TransportError::Disconnected),
            // DID_TIME_OUT
            0x03 => Err(TransportError::Io(libc::ETIMEDOUT)),
            // DID_ABORT, DID_RESET
            0x05 | 0x08 => Err(TransportError::Aborted),
            // DID_TRANSPORT_FAILFAST, DID_TRANSPORT_MARGINAL
            0x0f | 0x14 => Err(TransportError::Disconnected),
            _ => Err(TransportError::Io(libc::EIO)),
        }
    }

    /// Sense bytes to hand on, capped by the buffer we gave the kernel.
    pub fn sense_len(&self, buf_len: usize) -> usize {
        (self.sb_len_wr as usize).min(buf_len)
    }

    /// Bytes not transferred, clamped to the data phase.
    pub fn resid(&self, data_len: u32) -> u32 {
        (self.resid.max(0) as u32).min(data_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(h: &SgIoHdr) -> Vec<u8> {
        let mut v = vec![0u8; SG_IO_HDR_LEN];
        v[48..52].copy_from_slice(&h.pack_id.to_ne_bytes());
        v[56..64].copy_from_slice(&(h.usr_ptr as usize as u64).to_ne_bytes());
        v[64] = h.status;
        v[67] = h.sb_len_wr;
        v[68..70].copy_from_slice(&h.host_status.to_ne_bytes());
        v[70..72].copy_from_slice(&h.driver_status.to_ne_bytes());
        v[72..76].copy_from_slice(&h.resid.to_ne_bytes());
        v
    }

    #[test]
    fn decode_matches_the_struct() {
        let mut h = SgIoHdr::zeroed();
        h.pack_id = 0x1_0007;
        h.usr_ptr = 7usize as *mut libc::c_void;
        h.status = 2;
        h.sb_len_wr = 18;
        h.resid = 512;
        let r = Reply::decode(&bytes(&h)).unwrap();
        assert_eq!(r, Reply::of(&h));
        assert_eq!(r.status(), Ok(ScsiStatus::CheckCondition));
        assert_eq!((r.sense_len(96), r.sense_len(8)), (18, 8));
        assert_eq!((r.resid(4096), r.resid(100)), (512, 100));
        assert!(Reply::decode(&[0u8; 87]).is_none());
    }

    #[test]
    fn host_status_maps_to_transport_errors() {
        let mut r = Reply::decode(&[0u8; SG_IO_HDR_LEN]).unwrap();
        assert_eq!(r.status(), Ok(ScsiStatus::Good));
        for (did, want) in [
            (0x01, TransportError::NoDevice),
            (0x03, TransportError::Io(libc::ETIMEDOUT)),
            (0x08, TransportError::Aborted),
            (0x0e, TransportError::Disconnected),
            (0x07, TransportError::Io(libc::EIO)),
        ] {
            r.host_status = did;
            assert_eq!(r.status(), Err(want), "DID {did:#x}");
        }
        r.host_status = 0;
        r.resid = -5;
        assert_eq!(r.resid(4096), 0);
    }

    proptest::proptest! {
        #[test]
        fn reply_decoding_never_panics(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..120)) {
            crate::fuzz::sg_reply(&data);
        }
    }
}

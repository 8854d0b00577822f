//! virtio-scsi's request, response and task-management layouts (virtio
//! 1.x, section 5.6), encoded into and decoded from DMA memory as plain
//! little-endian bytes. Decoding never panics on any input.

use ustor_scsi::lld::{Nexus, TransportError};
use ustor_scsi::ScsiStatus;

/// Response codes (`VIRTIO_SCSI_S_*`).
pub const S_OK: u8 = 0;
pub const S_OVERRUN: u8 = 1;
pub const S_ABORTED: u8 = 2;
pub const S_BAD_TARGET: u8 = 3;
pub const S_RESET: u8 = 4;
pub const S_BUSY: u8 = 5;
pub const S_FUNCTION_SUCCEEDED: u8 = 10;
pub const S_INCORRECT_LUN: u8 = 12;

pub const T_TMF: u32 = 0;
pub const TMF_ABORT_TASK: u32 = 0;
pub const TMF_LOGICAL_UNIT_RESET: u32 = 5;
/// `struct virtio_scsi_ctrl_tmf_req`.
pub const TMF_REQ_LEN: usize = 24;
/// `struct virtio_scsi_event`.
pub const EVENT_LEN: usize = 16;
/// Event types: a target or LUN was added or removed (reason: 1 rescan,
/// 2 removed), a parameter changed (an ASC/ASCQ such as REPORTED LUNS DATA
/// HAS CHANGED); the flag says events were lost.
pub const T_TRANSPORT_RESET: u32 = 1;
pub const T_PARAM_CHANGE: u32 = 3;
pub const T_EVENTS_MISSED: u32 = 0x8000_0000;

/// Whether a `virtio_scsi_event` means the set of targets or LUNs may have
/// changed, so the mid-layer should rescan.
pub fn event_wants_rescan(ev: &[u8]) -> bool {
    let Some(t) = ev.get(0..4) else {
        return false;
    };
    let t = u32::from_le_bytes([t[0], t[1], t[2], t[3]]);
    t & T_EVENTS_MISSED != 0 || matches!(t, T_TRANSPORT_RESET | T_PARAM_CHANGE)
}

/// The 8-byte virtio-scsi LUN: 1, target, then the SAM flat-space LUN.
pub fn lun_bytes(n: Nexus) -> [u8; 8] {
    // Flat addressing (0x40 in the top bits), as Linux sends it; QEMU
    // masks it off again.
    let [hi, lo] = ((n.lun as u16 & 0x3fff) | 0x4000).to_be_bytes();
    [1, n.target as u8, hi, lo, 0, 0, 0, 0]
}

/// Writes `virtio_scsi_cmd_req` (lun, tag, SIMPLE, cdb zero-padded to
/// `cdb_size`) into `out`; returns its length.
pub fn encode_cmd(out: &mut [u8], n: Nexus, tag: u64, cdb: &[u8], cdb_size: usize) -> usize {
    let len = 19 + cdb_size;
    out[..len].fill(0);
    out[..8].copy_from_slice(&lun_bytes(n));
    out[8..16].copy_from_slice(&tag.to_le_bytes());
    let c = cdb.len().min(cdb_size);
    out[19..19 + c].copy_from_slice(&cdb[..c]);
    len
}

/// Writes `virtio_scsi_ctrl_tmf_req`.
pub fn encode_tmf(out: &mut [u8], subtype: u32, n: Nexus, tag: u64) {
    out[..TMF_REQ_LEN].fill(0);
    out[0..4].copy_from_slice(&T_TMF.to_le_bytes());
    out[4..8].copy_from_slice(&subtype.to_le_bytes());
    out[8..16].copy_from_slice(&lun_bytes(n));
    out[16..24].copy_from_slice(&tag.to_le_bytes());
}

/// A decoded `virtio_scsi_cmd_resp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmdResp {
    pub response: u8,
    pub status: u8,
    pub sense_len: usize,
    pub resid: u32,
}

/// Decodes a response of `12 + sense_size` bytes; a short one is a
/// transport failure, a sense length past the buffer is clipped.
pub fn decode_resp(b: &[u8]) -> CmdResp {
    if b.len() < 12 {
        return CmdResp {
            response: 9,
            status: 0,
            sense_len: 0,
            resid: 0,
        };
    }
    let sense_len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    CmdResp {
        resid: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        status: b[10],
        response: b[11],
        sense_len: sense_len.min(b.len() - 12),
    }
}

/// The mid-layer's view of a response code.
pub fn outcome(r: &CmdResp) -> Result<ScsiStatus, TransportError> {
    match r.response {
        S_OK => Ok(ScsiStatus::from_u8(r.status)),
        S_BUSY => Ok(ScsiStatus::Busy),
        S_ABORTED | S_RESET => Err(TransportError::Aborted),
        S_BAD_TARGET | S_INCORRECT_LUN => Err(TransportError::NoDevice),
        S_OVERRUN => Err(TransportError::Protocol("data overrun")),
        _ => Err(TransportError::Io(libc::EIO)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nx(target: u32, lun: u64) -> Nexus {
        Nexus {
            channel: 0,
            target,
            lun,
        }
    }

    #[test]
    fn luns_use_the_flat_format() {
        assert_eq!(lun_bytes(nx(3, 0)), [1, 3, 0x40, 0, 0, 0, 0, 0]);
        assert_eq!(lun_bytes(nx(3, 2)), [1, 3, 0x40, 2, 0, 0, 0, 0]);
        assert_eq!(lun_bytes(nx(1, 300)), [1, 1, 0x41, 0x2c, 0, 0, 0, 0]);
    }

    #[test]
    fn requests_and_responses_round_trip() {
        let mut b = [0xffu8; 64];
        let n = encode_cmd(&mut b, nx(2, 1), 7, &[0x28, 0, 0, 0, 0, 8, 0, 0, 1, 0], 32);
        assert_eq!(n, 51);
        assert_eq!(&b[..4], &[1, 2, 0x40, 1]);
        assert_eq!(b[8], 7);
        assert_eq!(b[19], 0x28);
        assert_eq!(b[50], 0);
        let mut r = [0u8; 108];
        r[0] = 200; // sense_len past the buffer
        r[4] = 5;
        r[10] = 2;
        let d = decode_resp(&r);
        assert_eq!(d.sense_len, 96);
        assert_eq!(d.resid, 5);
        assert_eq!(outcome(&d), Ok(ScsiStatus::CheckCondition));
        assert_eq!(decode_resp(&r[..5]).response, 9);
        r[11] = S_BAD_TARGET;
        assert_eq!(outcome(&decode_resp(&r)), Err(TransportError::NoDevice));
    }

    #[test]
    fn decoding_never_panics() {
        for len in 0..40 {
            for fill in [0u8, 0x55, 0xff] {
                let b = vec![fill; len];
                let _ = outcome(&decode_resp(&b));
            }
        }
    }

    #[test]
    fn hotplug_events_ask_for_a_rescan() {
        let ev = |t: u32, reason: u32| {
            let mut b = [0u8; EVENT_LEN];
            b[0..4].copy_from_slice(&t.to_le_bytes());
            b[4..12].copy_from_slice(&[1, 2, 0x40, 0, 0, 0, 0, 0]);
            b[12..16].copy_from_slice(&reason.to_le_bytes());
            b
        };
        // Unplugged (reason 2), plugged (1), LUNs changed, events lost.
        assert!(event_wants_rescan(&ev(T_TRANSPORT_RESET, 2)));
        assert!(event_wants_rescan(&ev(T_TRANSPORT_RESET, 1)));
        assert!(event_wants_rescan(&ev(T_PARAM_CHANGE, 0x3f0e)));
        assert!(event_wants_rescan(&ev(T_EVENTS_MISSED, 0)));
        // No event (an unused buffer) and short input.
        assert!(!event_wants_rescan(&ev(0, 0)));
        assert!(!event_wants_rescan(&[1, 0]));
    }
}

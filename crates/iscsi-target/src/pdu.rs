//! Target PDUs (RFC 7143 §11): builders for the responses the target
//! sends, with the sequence numbers the session hands in ([`Seq`]).
//! Everything here is header bytes; data segments, padding and digests are
//! the connection's ([`crate::io`]).

use ustor_iscsi::wire::{opcode, Bhs, RESERVED_TAG};

/// Sequence numbers stamped on every response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Seq {
    pub statsn: u32,
    pub exp_cmdsn: u32,
    pub max_cmdsn: u32,
}

impl Seq {
    fn stamp(&self, b: &mut Bhs) {
        b.set_u32(24, self.statsn)
            .set_u32(28, self.exp_cmdsn)
            .set_u32(32, self.max_cmdsn);
    }
}

/// Reject reasons (§11.17.1).
pub mod reject {
    pub const DIGEST: u8 = 0x02;
    pub const SNACK: u8 = 0x03;
    pub const PROTOCOL: u8 = 0x04;
    pub const NOT_SUPPORTED: u8 = 0x05;
    pub const INVALID_FIELD: u8 = 0x09;
    pub const NEGOTIATION_RESET: u8 = 0x0b;
}

/// SCSI Response; `resid` with `over` (overflow) or not (underflow).
pub fn scsi_response(itt: u32, status: u8, resid: Option<(bool, u32)>, seq: &Seq) -> Bhs {
    let mut b = Bhs::new(opcode::SCSI_RESP, false, 0x80 | resid_flags(resid));
    b.set_u8(3, status).set_itt(itt);
    seq.stamp(&mut b);
    b.set_u32(44, resid.map_or(0, |r| r.1));
    b
}

fn resid_flags(resid: Option<(bool, u32)>) -> u8 {
    match resid {
        Some((true, n)) if n > 0 => 0x04,
        Some((false, n)) if n > 0 => 0x02,
        _ => 0,
    }
}

/// Data-In; `status` set for phase collapse (then `statsn` is consumed).
#[allow(clippy::too_many_arguments)]
pub fn data_in(
    lun: [u8; 8],
    itt: u32,
    final_: bool,
    status: Option<(u8, Option<(bool, u32)>)>,
    datasn: u32,
    offset: u32,
    len: usize,
    seq: &Seq,
) -> Bhs {
    let mut flags = if final_ { 0x80 } else { 0 };
    if let Some((_, r)) = status {
        flags |= 0x01 | resid_flags(r);
    }
    let mut b = Bhs::new(opcode::DATA_IN, false, flags);
    b.set_lun(lun).set_itt(itt).set_u32(20, RESERVED_TAG);
    seq.stamp(&mut b);
    if status.is_none() {
        b.set_u32(24, 0);
    }
    if let Some((s, r)) = status {
        b.set_u8(3, s).set_u32(44, r.map_or(0, |r| r.1));
    }
    b.set_u32(36, datasn).set_u32(40, offset).set_data_len(len);
    b
}

/// Ready To Transfer `len` bytes at `offset`.
pub fn r2t(lun: [u8; 8], itt: u32, ttt: u32, r2tsn: u32, offset: u32, len: u32, seq: &Seq) -> Bhs {
    let mut b = Bhs::new(opcode::R2T, false, 0x80);
    b.set_lun(lun).set_itt(itt).set_u32(20, ttt);
    seq.stamp(&mut b);
    b.set_u32(36, r2tsn).set_u32(40, offset).set_u32(44, len);
    b
}

/// NOP-In: an answer (`itt` of the NOP-Out) or a ping (`itt` reserved,
/// `ttt` ours).
pub fn nop_in(lun: [u8; 8], itt: u32, ttt: u32, len: usize, seq: &Seq) -> Bhs {
    let mut b = Bhs::new(opcode::NOP_IN, false, 0x80);
    b.set_lun(lun).set_itt(itt).set_u32(20, ttt);
    seq.stamp(&mut b);
    b.set_data_len(len);
    b
}

/// Async Message asking the initiator to log out within `secs` seconds
/// (RFC 7143 §11.9.1, AsyncEvent 1, Parameter3).
pub fn logout_request(secs: u16, seq: &Seq) -> Bhs {
    let mut b = Bhs::new(opcode::ASYNC, false, 0x80);
    b.set_itt(RESERVED_TAG);
    seq.stamp(&mut b);
    b.set_u8(36, 1).set_u16(42, secs);
    b
}

/// Text Response (final unless `more`).
pub fn text(itt: u32, more: bool, ttt: u32, len: usize, seq: &Seq) -> Bhs {
    let mut b = Bhs::new(opcode::TEXT_RESP, false, if more { 0x40 } else { 0x80 });
    b.set_itt(itt).set_u32(20, ttt);
    seq.stamp(&mut b);
    b.set_data_len(len);
    b
}

/// Logout Response: connection or session closed.
pub fn logout(itt: u32, response: u8, time2wait: u16, time2retain: u16, seq: &Seq) -> Bhs {
    let mut b = Bhs::new(opcode::LOGOUT_RESP, false, 0x80);
    b.set_u8(2, response).set_itt(itt);
    seq.stamp(&mut b);
    b.set_u16(40, time2wait).set_u16(42, time2retain);
    b
}

/// Task Management Function Response.
pub fn tmf(itt: u32, response: u8, seq: &Seq) -> Bhs {
    let mut b = Bhs::new(opcode::TMF_RESP, false, 0x80);
    b.set_u8(2, response).set_itt(itt);
    seq.stamp(&mut b);
    b
}

/// Reject of the PDU whose header is `bad` (sent as data).
pub fn reject(reason: u8, seq: &Seq) -> Bhs {
    let mut b = Bhs::new(opcode::REJECT, false, 0x80);
    b.set_u8(2, reason).set_itt(RESERVED_TAG);
    seq.stamp(&mut b);
    b.set_data_len(ustor_iscsi::wire::BHS_LEN);
    b
}

/// Asynchronous Message: the target asks for a logout within
/// `wait` seconds (event 1).
pub fn async_logout(wait: u16, seq: &Seq) -> Bhs {
    let mut b = Bhs::new(opcode::ASYNC, false, 0x80);
    b.set_itt(RESERVED_TAG);
    seq.stamp(&mut b);
    b.set_u8(36, 1).set_u16(40, 0).set_u16(42, wait);
    b
}

/// TMF response codes (§11.6.1).
pub mod tmf_response {
    pub const COMPLETE: u8 = 0;
    pub const NO_TASK: u8 = 1;
    pub const NO_LUN: u8 = 2;
    pub const NO_REASSIGN: u8 = 4;
    pub const NOT_SUPPORTED: u8 = 5;
}

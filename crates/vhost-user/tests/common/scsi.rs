//! virtio-scsi requests as a driver builds them (virtio 1.2, 5.6.6), on
//! the test frontend ([`super::frontend`]): commands with their data, and
//! task management functions on the control queue.

#![allow(dead_code)]

use super::frontend::{Fe, HDR_BASE, HDR_SLOT, QSIZE};

pub const CTRL: usize = 0;
pub const EVENTS: usize = 1;
/// The first request queue.
pub const REQ0: usize = 2;

pub const CMD_REQ: u32 = 51;
pub const CMD_RESP: u32 = 108;

pub const S_OK: u8 = 0;
pub const S_BAD_TARGET: u8 = 3;
pub const S_ABORTED: u8 = 2;
pub const S_FUNCTION_SUCCEEDED: u8 = 10;
pub const S_FUNCTION_REJECTED: u8 = 11;

pub const TMF_ABORT_TASK: u32 = 0;
pub const TMF_ABORT_TASK_SET: u32 = 1;
pub const TMF_LUN_RESET: u32 = 5;
pub const TMF_QUERY_TASK: u32 = 6;
pub const TMF_QUERY_TASK_SET: u32 = 7;

/// Where request slot `slot` of ring `q` keeps its header and response.
pub fn hdr(q: usize, slot: usize) -> u64 {
    assert!(slot < QSIZE as usize);
    HDR_BASE + (q as u64 * QSIZE as u64 + slot as u64) * HDR_SLOT
}

/// The response area of a slot (after a 64-byte request area).
pub fn resp_at(q: usize, slot: usize) -> u64 {
    hdr(q, slot) + 64
}

/// LUN 0 of `target`, as Linux addresses it.
pub fn lun(target: u8) -> [u8; 8] {
    [1, target, 0, 0, 0, 0, 0, 0]
}

/// A `virtio_scsi_cmd_resp`, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resp {
    pub response: u8,
    pub status: u8,
    pub resid: u32,
    pub sense: Vec<u8>,
}

impl Resp {
    pub fn good(&self) -> bool {
        self.response == S_OK && self.status == 0
    }
}

/// Sends a command on request ring `q` from header slot `slot`; `out` and
/// `inn` are data buffers `(gpa, len)`. Returns the chain's head.
#[allow(clippy::too_many_arguments)] // a request's fields, as a driver fills them
pub fn cmd(
    f: &mut Fe,
    q: usize,
    slot: usize,
    target: u8,
    tag: u64,
    cdb: &[u8],
    out: &[(u64, u32)],
    inn: &[(u64, u32)],
) -> u16 {
    let mut req = [0u8; CMD_REQ as usize];
    req[0..8].copy_from_slice(&lun(target));
    req[8..16].copy_from_slice(&tag.to_le_bytes());
    req[19..19 + cdb.len()].copy_from_slice(cdb);
    let h = hdr(q, slot);
    f.mem.write(h, &req);
    f.mem.write(resp_at(q, slot), &[0xee; CMD_RESP as usize]);
    let mut bufs = vec![(h, CMD_REQ, false)];
    bufs.extend(out.iter().map(|&(a, l)| (a, l, false)));
    bufs.push((resp_at(q, slot), CMD_RESP, true));
    bufs.extend(inn.iter().map(|&(a, l)| (a, l, true)));
    f.add(q, &bufs)
}

/// The response a command from slot `slot` of ring `q` got.
pub fn resp(f: &Fe, q: usize, slot: usize) -> Resp {
    let b = f.mem.bytes(resp_at(q, slot), CMD_RESP as usize);
    let n = (u32::from_le_bytes(b[0..4].try_into().unwrap()) as usize).min(96);
    Resp {
        response: b[11],
        status: b[10],
        resid: u32::from_le_bytes(b[4..8].try_into().unwrap()),
        sense: b[12..12 + n].to_vec(),
    }
}

/// Sends a task management function on the control queue from slot
/// `slot`; returns the head. Its answer is [`tmf_resp`].
pub fn tmf(f: &mut Fe, slot: usize, subtype: u32, target: u8, tag: u64) -> u16 {
    let mut req = [0u8; 24];
    req[4..8].copy_from_slice(&subtype.to_le_bytes());
    req[8..16].copy_from_slice(&lun(target));
    req[16..24].copy_from_slice(&tag.to_le_bytes());
    let h = hdr(CTRL, slot);
    f.mem.write(h, &req);
    f.mem.write(resp_at(CTRL, slot), &[0xee]);
    f.add(CTRL, &[(h, 24, false), (resp_at(CTRL, slot), 1, true)])
}

pub fn tmf_resp(f: &Fe, slot: usize) -> u8 {
    f.mem.bytes(resp_at(CTRL, slot), 1)[0]
}

/// READ(10) / WRITE(10) of `blocks` at `lba`.
pub fn rw10(write: bool, lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = if write { 0x2a } else { 0x28 };
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

pub const TEST_UNIT_READY: [u8; 6] = [0; 6];

/// Sends TEST UNIT READY on ring `q` until it answers GOOD (the unit
/// attention a new unit raises is consumed), 10 tries at most.
pub fn ready(f: &mut Fe, q: usize, target: u8) {
    for _ in 0..10 {
        let head = cmd(f, q, 0, target, 1, &TEST_UNIT_READY, &[], &[]);
        let got = f.wait_n(q, 1);
        assert_eq!(got[0].0, head);
        if resp(f, q, 0).good() {
            return;
        }
    }
    panic!("target {target} never became ready on ring {q}");
}

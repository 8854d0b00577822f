//! REPORT SUPPORTED OPERATION CODES (SPC-4 §6.35): the commands this core
//! executes (what `Command::parse` accepts), listed all at once or one at a
//! time with its CDB usage data, with command timeouts descriptors on
//! request (RCTD).

use ustor_scsi_proto::cdb::op;

/// One supported command: opcode, service action (for opcodes that have
/// them) and CDB length.
struct Supported {
    opcode: u8,
    service_action: Option<u8>,
    cdb_len: u8,
}

const fn cmd(opcode: u8, cdb_len: u8) -> Supported {
    Supported {
        opcode,
        service_action: None,
        cdb_len,
    }
}

const fn sa(opcode: u8, service_action: u8, cdb_len: u8) -> Supported {
    Supported {
        opcode,
        service_action: Some(service_action),
        cdb_len,
    }
}

/// Every command `Command::parse` accepts, in opcode order.
const SUPPORTED: [Supported; 56] = [
    cmd(op::TEST_UNIT_READY, 6),
    cmd(op::REQUEST_SENSE, 6),
    cmd(op::READ_6, 6),
    cmd(op::WRITE_6, 6),
    cmd(op::INQUIRY, 6),
    cmd(op::MODE_SELECT_6, 6),
    cmd(op::RESERVE_6, 6),
    cmd(op::RELEASE_6, 6),
    cmd(op::MODE_SENSE_6, 6),
    cmd(op::START_STOP_UNIT, 6),
    cmd(op::READ_CAPACITY_10, 10),
    cmd(op::READ_10, 10),
    cmd(op::WRITE_10, 10),
    cmd(op::WRITE_AND_VERIFY_10, 10),
    cmd(op::VERIFY_10, 10),
    cmd(op::PRE_FETCH_10, 10),
    cmd(op::SYNCHRONIZE_CACHE_10, 10),
    cmd(op::READ_DEFECT_DATA_10, 10),
    cmd(op::WRITE_SAME_10, 10),
    cmd(op::UNMAP, 10),
    cmd(op::MODE_SELECT_10, 10),
    cmd(op::RESERVE_10, 10),
    cmd(op::RELEASE_10, 10),
    cmd(op::MODE_SENSE_10, 10),
    sa(op::PERSISTENT_RESERVE_IN, 0, 10),
    sa(op::PERSISTENT_RESERVE_IN, 1, 10),
    sa(op::PERSISTENT_RESERVE_IN, 2, 10),
    sa(op::PERSISTENT_RESERVE_IN, 3, 10),
    sa(op::PERSISTENT_RESERVE_OUT, 0, 10),
    sa(op::PERSISTENT_RESERVE_OUT, 1, 10),
    sa(op::PERSISTENT_RESERVE_OUT, 2, 10),
    sa(op::PERSISTENT_RESERVE_OUT, 3, 10),
    sa(op::PERSISTENT_RESERVE_OUT, 4, 10),
    sa(op::PERSISTENT_RESERVE_OUT, 5, 10),
    sa(op::PERSISTENT_RESERVE_OUT, 6, 10),
    sa(op::EXTENDED_COPY, 0, 16),
    sa(op::RECEIVE_COPY_RESULTS, 0, 16),
    sa(op::RECEIVE_COPY_RESULTS, 3, 16),
    cmd(op::READ_16, 16),
    cmd(op::COMPARE_AND_WRITE, 16),
    cmd(op::WRITE_16, 16),
    cmd(op::ORWRITE_16, 16),
    cmd(op::WRITE_AND_VERIFY_16, 16),
    cmd(op::VERIFY_16, 16),
    cmd(op::PRE_FETCH_16, 16),
    cmd(op::SYNCHRONIZE_CACHE_16, 16),
    cmd(op::WRITE_SAME_16, 16),
    sa(op::SERVICE_ACTION_IN_16, op::SA_READ_CAPACITY_16, 16),
    sa(op::SERVICE_ACTION_IN_16, op::SA_GET_LBA_STATUS, 16),
    cmd(op::REPORT_LUNS, 12),
    sa(op::MAINTENANCE_IN, op::SA_REPORT_SUPPORTED_OPCODES, 12),
    cmd(op::READ_12, 12),
    cmd(op::WRITE_12, 12),
    cmd(op::WRITE_AND_VERIFY_12, 12),
    cmd(op::VERIFY_12, 12),
    cmd(op::READ_DEFECT_DATA_12, 12),
];

/// Bytes of one command timeouts descriptor.
const TIMEOUTS_LEN: usize = 12;
/// Bytes of one command descriptor in the all-commands list.
const DESC_LEN: usize = 8;
/// The largest answer: the header and every descriptor with timeouts.
pub(crate) const MAX_LEN: usize = 4 + SUPPORTED.len() * (DESC_LEN + TIMEOUTS_LEN);

/// A command timeouts descriptor: no nominal or recommended timeout (0).
fn timeouts(out: &mut [u8]) {
    out[..TIMEOUTS_LEN].fill(0);
    out[1] = (TIMEOUTS_LEN - 2) as u8;
}

/// Fills `out` (at least [`MAX_LEN`] bytes) with the answer; `None` for
/// an invalid field in the CDB.
pub(crate) fn report(
    rctd: bool,
    options: u8,
    opcode: u8,
    service_action: u16,
    out: &mut [u8],
) -> Option<usize> {
    match options {
        0 => Some(all(rctd, out)),
        1..=3 => one(rctd, options, opcode, service_action, out),
        _ => None,
    }
}

fn all(rctd: bool, out: &mut [u8]) -> usize {
    let mut at = 4;
    for c in &SUPPORTED {
        let d = &mut out[at..at + DESC_LEN];
        d.fill(0);
        d[0] = c.opcode;
        d[2..4].copy_from_slice(&u16::from(c.service_action.unwrap_or(0)).to_be_bytes());
        d[5] = u8::from(c.service_action.is_some()) | u8::from(rctd) << 1;
        d[6..8].copy_from_slice(&u16::from(c.cdb_len).to_be_bytes());
        at += DESC_LEN;
        if rctd {
            timeouts(&mut out[at..]);
            at += TIMEOUTS_LEN;
        }
    }
    out[..4].copy_from_slice(&((at - 4) as u32).to_be_bytes());
    at
}

/// One command (reporting options 1: by opcode, 2: opcode and service
/// action, 3: either). Asking 1 for an opcode with service actions, or 2
/// for one without, is an invalid field (SPC-4 table 262).
fn one(rctd: bool, options: u8, opcode: u8, sa_asked: u16, out: &mut [u8]) -> Option<usize> {
    let has_sa = SUPPORTED
        .iter()
        .any(|c| c.opcode == opcode && c.service_action.is_some());
    match (options, has_sa) {
        (1, true) | (2, false) => return None,
        _ => {}
    }
    let found = SUPPORTED.iter().find(|c| {
        c.opcode == opcode && (!has_sa || c.service_action.map(u16::from) == Some(sa_asked))
    });
    out[..4].fill(0);
    let Some(c) = found else {
        out[1] = 0x01; // SUPPORT: not supported
        return Some(4);
    };
    let len = c.cdb_len as usize;
    out[1] = 0x03 | u8::from(rctd) << 7; // SUPPORT: as the standard says
    out[2..4].copy_from_slice(&(len as u16).to_be_bytes());
    usage(c, &mut out[4..4 + len]);
    let mut at = 4 + len;
    if rctd {
        timeouts(&mut out[at..]);
        at += TIMEOUTS_LEN;
    }
    Some(at)
}

/// CDB usage data: the opcode, then every bit of the fields the parser
/// may read; the CONTROL byte (NACA, LINK) is not used.
fn usage(c: &Supported, out: &mut [u8]) {
    out.fill(0xff);
    out[0] = c.opcode;
    if let Some(sa) = c.service_action {
        out[1] = 0xe0 | sa;
    }
    if let Some(last) = out.last_mut() {
        *last = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_and_single_commands() {
        let mut b = [0u8; MAX_LEN];
        let n = report(false, 0, 0, 0, &mut b).unwrap();
        assert_eq!(n, 4 + SUPPORTED.len() * DESC_LEN);
        assert_eq!(
            u32::from_be_bytes(b[..4].try_into().unwrap()) as usize,
            n - 4
        );
        let n = report(true, 0, 0, 0, &mut b).unwrap();
        assert_eq!(n, MAX_LEN);
        assert_eq!(b[4 + 5], 0x02, "CTDP set, no SERVACTV for TUR");
        // READ(10) by opcode: supported, 10-byte usage data.
        let n = report(false, 1, op::READ_10, 0, &mut b).unwrap();
        assert_eq!((n, b[1], b[4], b[13]), (14, 0x03, op::READ_10, 0));
        // An opcode with service actions needs options 2 (or 3).
        assert_eq!(
            report(false, 1, op::SERVICE_ACTION_IN_16, 0x10, &mut b),
            None
        );
        assert_eq!(report(false, 2, op::READ_10, 0, &mut b), None);
        let n = report(true, 2, op::SERVICE_ACTION_IN_16, 0x10, &mut b).unwrap();
        assert_eq!((n, b[1], b[5]), (4 + 16 + 12, 0x83, 0xf0));
        // Not supported: SUPPORT 1, no usage data.
        let n = report(false, 3, 0xff, 0, &mut b).unwrap();
        assert_eq!((n, b[1]), (4, 0x01));
        assert_eq!(report(false, 5, 0, 0, &mut b), None);
    }
}

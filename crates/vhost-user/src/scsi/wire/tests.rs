//! The virtio-scsi chain walker and layouts on well-formed and malformed
//! chains: headers split across descriptors, wrong order, memory bounds,
//! short requests, LUN decoding, response and event encoding.

use super::*;
use vm_memory::{GuestAddress as GA, GuestMemoryMmap};

const MEM: u64 = 1 << 20;

fn mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GA(0), MEM as usize)]).unwrap()
}

fn cmd(m: &GuestMemoryMmap, at: u64, lun: [u8; 8], tag: u64, cdb: &[u8]) {
    let mut b = [0u8; CMD_REQ_LEN as usize];
    b[..8].copy_from_slice(&lun);
    b[8..16].copy_from_slice(&tag.to_le_bytes());
    b[19..19 + cdb.len()].copy_from_slice(cdb);
    m.write_slice(&b, GA(at)).unwrap();
}

#[test]
fn command_split_anywhere_is_read_whole() {
    let m = mem();
    cmd(
        &m,
        0x1000,
        [1, 3, 0x40, 0, 0, 0, 0, 0],
        77,
        &[0x28, 0, 0, 0, 0, 8],
    );
    let mut c = Chain::default();
    // Header in two pieces (10 + 41 bytes), 512 bytes of data-out, then
    // the response split in two.
    let descs = [
        (0x1000, 10, false),
        (0x100a, 41, false),
        (0x4000, 512, false),
        (0x8000, 8, true),
        (0x9000, 100, true),
    ];
    c.fill(5, descs, &m).unwrap();
    assert_eq!((c.head, c.rd_len, c.wr_len), (5, 51 + 512, 108));
    let h = cmd_header(&c, &m).unwrap();
    assert_eq!(h.tag, 77);
    assert_eq!(&h.cdb[..6], &[0x28, 0, 0, 0, 0, 8]);
    assert_eq!(decode_lun(&h.lun), Some(Address { target: 3, lun: 0 }));
    // Data-out is the readable stream after the header.
    m.write_slice(&[9u8; 512], GA(0x4000)).unwrap();
    let mut out = [0u8; 600];
    assert_eq!(c.read(&m, CMD_REQ_LEN, &mut out), 512);
    assert!(out[..512].iter().all(|&b| b == 9));
    // A response written across the two writable pieces.
    let sense = [0x70, 0, 5, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x24, 0, 0, 0, 0, 0];
    let r = CmdResp {
        response: resp::OK,
        status: 2,
        resid: 4,
        sense: &sense,
    };
    assert_eq!(c.write(&m, 0, &r.encode()), 108);
    let mut back = [0u8; 12];
    m.read_slice(&mut back[..8], GA(0x8000)).unwrap();
    m.read_slice(&mut back[8..], GA(0x9000)).unwrap();
    assert_eq!(&back, &[18, 0, 0, 0, 4, 0, 0, 0, 0, 0, 2, 0]);
    let mut s = [0u8; 18];
    m.read_slice(&mut s, GA(0x9004)).unwrap();
    assert_eq!(s, sense);
}

#[test]
fn malformed_chains_are_refused() {
    let m = mem();
    let mut c = Chain::default();
    assert_eq!(
        c.fill(0, [(0, 108, true), (0x1000, 51, false)], &m),
        Err(ChainError::Order)
    );
    assert_eq!(
        c.fill(0, [(MEM - 8, 51, false)], &m),
        Err(ChainError::OutOfMemory)
    );
    assert_eq!(
        c.fill(0, [(u64::MAX - 4, 51, false)], &m),
        Err(ChainError::OutOfMemory)
    );
    // A data buffer outside memory: refused, but the response area
    // before it stays usable, and one after a bad data-in piece is gone.
    let bad_out = [(0, 51, false), (MEM, 512, false), (0x1000, 108, true)];
    assert_eq!(c.fill(0, bad_out, &m), Err(ChainError::OutOfMemory));
    assert_eq!((c.rd_len, c.wr_len), (51, 108));
    let bad_in = [
        (0, 51, false),
        (0x1000, 108, true),
        (MEM, 8, true),
        (0x2000, 8, true),
    ];
    assert_eq!(c.fill(0, bad_in, &m), Err(ChainError::OutOfMemory));
    assert_eq!(c.wr_len, 108);
    // A readable piece after a writable one that was itself refused.
    let order = [(MEM, 108, true), (0, 51, false)];
    assert_eq!(c.fill(0, order, &m), Err(ChainError::Order));
    let long = (0..CHAIN_MAX as u64 + 1).map(|i| (i * 64, 64, false));
    assert_eq!(c.fill(0, long, &m), Err(ChainError::TooLong));
    // A header too short, or no room for the response: no command.
    c.fill(0, [(0, 50, false), (0x1000, 108, true)], &m)
        .unwrap();
    assert!(cmd_header(&c, &m).is_none());
    c.fill(0, [(0, 51, false), (0x1000, 107, true)], &m)
        .unwrap();
    assert!(cmd_header(&c, &m).is_none());
    // Zero-length descriptors are skipped.
    c.fill(0, [(0, 51, false), (0, 0, false), (0x1000, 108, true)], &m)
        .unwrap();
    assert!(cmd_header(&c, &m).is_some());
}

#[test]
fn luns_outside_our_targets_are_refused() {
    assert_eq!(
        decode_lun(&[1, 7, 0x40, 2, 0, 0, 0, 0]),
        Some(Address { target: 7, lun: 2 })
    );
    assert_eq!(
        decode_lun(&[1, 0, 0, 0, 0, 0, 0, 0]),
        Some(Address { target: 0, lun: 0 })
    );
    assert_eq!(decode_lun(&[0, 0, 0, 0, 0, 0, 0, 0]), None);
    assert_eq!(decode_lun(&[1, MAX_TARGETS as u8, 0, 0, 0, 0, 0, 0]), None);
    assert_eq!(decode_lun(&[1, 0, 0x80, 0, 0, 0, 0, 0]), None);
    assert_eq!(decode_lun(&[1, 0, 0x40, 0, 0, 1, 0, 0]), None);
}

#[test]
fn control_requests_decode_and_need_room_for_answers() {
    let m = mem();
    let mut tmf = [0u8; TMF_REQ_LEN];
    tmf[4] = vs::VIRTIO_SCSI_T_TMF_LOGICAL_UNIT_RESET as u8;
    tmf[8..12].copy_from_slice(&[1, 2, 0x40, 0]);
    tmf[16] = 9;
    m.write_slice(&tmf, GA(0)).unwrap();
    let mut c = Chain::default();
    c.fill(0, [(0, 24, false), (0x1000, 1, true)], &m).unwrap();
    assert_eq!(
        ctrl_req(&c, &m),
        CtrlReq::Tmf {
            subtype: vs::VIRTIO_SCSI_T_TMF_LOGICAL_UNIT_RESET,
            lun: [1, 2, 0x40, 0, 0, 0, 0, 0],
            tag: 9
        }
    );
    c.fill(0, [(0, 24, false)], &m).unwrap();
    assert_eq!(ctrl_req(&c, &m), CtrlReq::Bad);
    c.fill(0, [(0, 20, false), (0x1000, 1, true)], &m).unwrap();
    assert_eq!(ctrl_req(&c, &m), CtrlReq::Bad);
    m.write_slice(&vs::VIRTIO_SCSI_T_AN_QUERY.to_le_bytes(), GA(0))
        .unwrap();
    c.fill(0, [(0, 16, false), (0x1000, 5, true)], &m).unwrap();
    assert!(matches!(ctrl_req(&c, &m), CtrlReq::An { .. }));
    m.write_slice(&77u32.to_le_bytes(), GA(0)).unwrap();
    assert_eq!(ctrl_req(&c, &m), CtrlReq::Bad);
}

#[test]
fn events_and_config_layout() {
    let b = Event::removed(4).encode(true);
    assert_eq!(
        u32::from_le_bytes(b[0..4].try_into().unwrap()),
        vs::VIRTIO_SCSI_T_TRANSPORT_RESET | vs::VIRTIO_SCSI_T_EVENTS_MISSED
    );
    assert_eq!(&b[4..12], &[1, 4, 0, 0, 0, 0, 0, 0]);
    assert_eq!(
        u32::from_le_bytes(b[12..16].try_into().unwrap()),
        vs::VIRTIO_SCSI_EVT_RESET_REMOVED
    );
    let c = config(4);
    assert_eq!(u32::from_le_bytes(c[0..4].try_into().unwrap()), 4);
    assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 96);
    assert_eq!(u32::from_le_bytes(c[24..28].try_into().unwrap()), 32);
    assert_eq!(u16::from_le_bytes(c[30..32].try_into().unwrap()), 7);
    assert_ne!(features() & (1 << vs::VIRTIO_SCSI_F_HOTPLUG), 0);
}

/// A data range lies in guest memory as one run only when one piece holds
/// all of it (the zero-copy data-out path hands that run to the bdev).
#[test]
fn span_is_one_piece_or_none() {
    let m = mem();
    let mut c = Chain::default();
    let descs = [
        (0x1000, 51, false),
        (0x4000, 4096, false),
        (0x6000, 1024, false),
        (0x8000, 108, true),
        (0x9000, 512, true),
    ];
    c.fill(0, descs, &m).unwrap();
    assert_eq!(c.span(false, 51, 4096), Some(GA(0x4000)));
    assert_eq!(c.span(false, 51 + 512, 512), Some(GA(0x4200)));
    assert_eq!(c.span(false, 51 + 4096, 1024), Some(GA(0x6000)));
    // Across two pieces, past the end, or the header and data together.
    assert_eq!(c.span(false, 51 + 4000, 512), None);
    assert_eq!(c.span(false, 51 + 4096 + 512, 1024), None);
    assert_eq!(c.span(false, 0, 100), None);
    assert_eq!(c.span(true, 108, 512), Some(GA(0x9000)));
    assert_eq!(c.span(true, 108, 513), None);
}

/// A response is written as its fixed fields and its sense bytes; the
/// rest of the sense area is not the driver's to read.
#[test]
fn a_response_carries_its_fields_and_sense_bytes_only() {
    let sense = [0x70, 0, 6, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x29, 0];
    let r = CmdResp {
        response: resp::OK,
        status: 2,
        resid: 512,
        sense: &sense,
    };
    assert_eq!(r.used_bytes(), RESP_FIXED + sense.len());
    let b = r.encode();
    assert_eq!(&b[0..4], &(sense.len() as u32).to_le_bytes());
    assert_eq!(&b[4..8], &512u32.to_le_bytes());
    assert_eq!((b[10], b[11]), (2, resp::OK));
    assert_eq!(&b[RESP_FIXED..r.used_bytes()], &sense);
    assert_eq!(
        CmdResp::transport(resp::BAD_TARGET).used_bytes(),
        RESP_FIXED
    );
}

//! Dataset Management, and PDUs received in small pieces.

use super::*;

// ---------------------------------------------------------------------
// 9. Dataset Management
// ---------------------------------------------------------------------

fn dsm_range(slba: u64, nlb: u32) -> [u8; 16] {
    let mut r = [0u8; 16];
    r[4..8].copy_from_slice(&nlb.to_le_bytes());
    r[8..16].copy_from_slice(&slba.to_le_bytes());
    r
}

fn dsm(q: &mut Client, ranges: &[[u8; 16]], attrs: u32) -> Status {
    let data: Vec<u8> = ranges.iter().flatten().copied().collect();
    let mut s = Sqe::default();
    s.set_opcode(io::DSM)
        .set_nsid(1)
        .set_cdw(10, ranges.len() as u32 - 1)
        .set_cdw(11, attrs)
        .set_sgl(SglDesc::in_capsule(data.len() as u32));
    q.cmd(&mut s, &data).1.status()
}

/// Deallocate (DSM AD, CDW11 bit 2) on the malloc bdev, which zeroes
/// unmapped blocks, as Identify Namespace DLFEAT (byte 33) bits 2:0 = 001b
/// promise ("deallocated blocks read as 00h"); ONCS bit 2 advertises DSM.
/// Without AD nothing changes; a bad range fails the command before any
/// range is deallocated.
#[test]
fn dsm_deallocate_reads_zeroes() {
    let e = env();
    let (mut a, cntlid) = Client::admin(e.port, Digests::default());
    let (id, _) = identify(&mut a, 1, 0, 0);
    assert_eq!(le16(&id, 520) & 1 << 2, 1 << 2, "ONCS.DSM");
    let (ns, _) = identify(&mut a, 0, 1, 0);
    assert_eq!(ns[33] & 7, 1, "DLFEAT: deallocated blocks read as zeroes");
    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    let data = pattern(8192, 7);
    assert_eq!(write_incapsule(&mut q, 200, &data), Status::SUCCESS);
    // Attributes without AD (integral read + write): no change.
    assert_eq!(dsm(&mut q, &[dsm_range(200, 16)], 0b011), Status::SUCCESS);
    assert_eq!(q.read(200, 16).0, data);
    // Two ranges, the second out of bounds: LBA Out of Range, nothing
    // deallocated.
    assert_eq!(
        dsm(&mut q, &[dsm_range(200, 4), dsm_range(32768 - 2, 4)], 4),
        Status::LBA_OUT_OF_RANGE
    );
    assert_eq!(q.read(200, 16).0, data);
    // Blocks 204..208 and 210..212 (plus an empty range).
    assert_eq!(
        dsm(
            &mut q,
            &[dsm_range(204, 4), dsm_range(0, 0), dsm_range(210, 2)],
            4
        ),
        Status::SUCCESS
    );
    let (got, c) = q.read(200, 16);
    assert!(c.status().is_success());
    let mut want = data.clone();
    want[4 * 512..8 * 512].fill(0);
    want[10 * 512..12 * 512].fill(0);
    assert!(got == want, "deallocated blocks must read as zeroes");
}

// ---------------------------------------------------------------------
// 10. PDUs received in pieces
// ---------------------------------------------------------------------

fn capsule_bytes(dg: Digests, sqe: &Sqe, data: &[u8]) -> Vec<u8> {
    let mut h = [0u8; 80];
    let n = encode_capsule_cmd(&mut h, sqe, dg, data.len());
    let mut v = h[..n].to_vec();
    v.extend_from_slice(data);
    if dg.data && !data.is_empty() {
        v.extend_from_slice(&crc(data).to_le_bytes());
    }
    v
}

/// Writes `bytes` in pieces whose sizes cycle through `sizes`, pausing
/// between them so each piece is its own segment.
fn send_in_pieces(c: &mut Client, bytes: &[u8], sizes: &[usize], pause: Duration) {
    let mut at = 0;
    let mut i = 0;
    while at < bytes.len() {
        let n = sizes[i % sizes.len()].min(bytes.len() - at);
        c.s.write_all(&bytes[at..at + n]).unwrap();
        at += n;
        i += 1;
        if !pause.is_zero() {
            // Part of the workload: the gap makes each piece its own segment.
            std::thread::sleep(pause);
        }
    }
}

/// A write capsule with in-capsule data arriving 1, 3, 7 bytes at a time
/// (the first two pieces split the 8-byte common header), with and without
/// digests; a read capsule arriving byte by byte; both complete and the
/// data reads back.
#[test]
fn capsules_received_in_small_pieces() {
    let e = env();
    for dg in [Digests::default(), DG] {
        let (_a, cntlid) = Client::admin(e.port, dg);
        let mut q = Client::io_queue(e.port, dg, cntlid, 1);
        let data = pattern(2048, 11);
        let mut w = Client::rw_sqe(io::WRITE, 40, 4, true);
        let cid = q.next_cid();
        w.set_cid(cid).set_sgl_psdt();
        let bytes = capsule_bytes(dg, &w, &data);
        send_in_pieces(&mut q, &bytes, &[1, 3, 7], Duration::from_micros(300));
        let (_, c) = q.wait(cid);
        assert!(c.status().is_success(), "{dg:?}: {}", c.status());
        let mut r = Client::rw_sqe(io::READ, 40, 4, false);
        let cid = q.next_cid();
        r.set_cid(cid).set_sgl_psdt();
        let bytes = capsule_bytes(dg, &r, &[]);
        send_in_pieces(&mut q, &bytes, &[1], Duration::from_micros(300));
        let (got, c) = q.wait(cid);
        assert!(c.status().is_success());
        assert!(got == data, "{dg:?}: data read back differs");
    }
}

/// Several PDUs in one stream cut at odd places (a piece holds the end of
/// one PDU and the start of the next): an 8 KiB in-capsule write, an
/// H2CData PDU for an R2T, and reads, all with digests.
#[test]
fn pdus_split_across_boundaries() {
    let e = env();
    let (_a, cntlid) = Client::admin(e.port, DG);
    let mut q = Client::io_queue(e.port, DG, cntlid, 1);
    // Two in-capsule writes and a read back to back, cut into 5-byte and
    // 1000-byte pieces.
    let d1 = pattern(8192, 21);
    let d2 = pattern(1024, 22);
    let mut stream = Vec::new();
    let mut cids = Vec::new();
    for (slba, d) in [(0u64, &d1[..]), (100, &d2[..])] {
        let mut w = Client::rw_sqe(io::WRITE, slba, (d.len() / 512) as u32, true);
        let cid = q.next_cid();
        w.set_cid(cid).set_sgl_psdt();
        stream.extend(capsule_bytes(DG, &w, d));
        cids.push(cid);
    }
    send_in_pieces(&mut q, &stream, &[5, 1000, 13], Duration::from_micros(100));
    for _ in 0..2 {
        let c = q.recv().unwrap().cqe();
        assert!(c.status().is_success());
        assert!(cids.contains(&c.cid));
    }
    assert_eq!(q.read(0, 16).0, d1);
    assert_eq!(q.read(100, 2).0, d2);
    // R2T write whose H2CData PDU arrives in 3-byte and 501-byte pieces.
    let d3 = pattern(16384, 23);
    let mut w = Client::rw_sqe(io::WRITE, 300, 32, false);
    let cid = q.next_cid();
    w.set_cid(cid).set_sgl_psdt();
    q.send_cmd(&w, &[]);
    let p = q.recv().unwrap();
    assert_eq!(p.ty, PduType::R2T as u8, "{p:?}");
    let r2t = DataHdr::decode(&p.hdr).unwrap();
    let mut h = [0u8; 32];
    let hd = DataHdr {
        cccid: cid,
        ttag: r2t.ttag,
        offset: 0,
        length: d3.len() as u32,
    };
    let n = encode_data_hdr(&mut h, PduType::H2CData, &hd, flags::LAST_PDU, DG);
    let mut v = h[..n].to_vec();
    v.extend_from_slice(&d3);
    v.extend_from_slice(&crc(&d3).to_le_bytes());
    send_in_pieces(&mut q, &v, &[3, 501], Duration::ZERO);
    assert!(q.wait(cid).1.status().is_success());
    assert!(q.read(300, 32).0 == d3, "R2T data read back differs");
}

/// A bdev resize (`BdevEntry::resize`, what the rbd bdev calls when its
/// image is resized by `bdev_rbd_resize` or by another client) raises the
/// namespace-attribute-changed event; Identify Namespace then reports the
/// new size, and I/O is checked against it.
#[test]
fn bdev_resize_raises_event_and_shows_new_size() {
    let e = env();
    let (mut a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    assert!(set_feature(&mut a, FID_ASYNC_EVENT, 1 << 8)
        .status()
        .is_success());
    let entry = e.registry.get("Malloc0").unwrap();
    let before = entry.num_blocks();
    let (d, _) = identify(&mut a, 0, 1, 0);
    assert_eq!(le64(&d, 0), before);
    post_aer(&mut a, 930);
    expect_quiet(&mut a, 50);
    // Shrinking keeps a malloc bdev's memory valid.
    let after = before / 2;
    assert!(entry.resize(after));
    let c = a.wait(930).1;
    assert!(c.status().is_success());
    assert_eq!(c.dw0, AEN_NS_ATTR_CHANGED);
    let (d, _) = get_log(&mut a, LID_CHANGED_NS, 4096, 0, false);
    assert_eq!((le32(&d, 0), le32(&d, 4)), (1, 0));
    let (d, _) = identify(&mut a, 0, 1, 0);
    assert_eq!(
        (le64(&d, 0), le64(&d, 8), le64(&d, 16)),
        (after, after, after)
    );
    assert!(q.read(after - 1, 1).1.status().is_success());
    assert_eq!(q.read(after, 1).1.status(), Status::LBA_OUT_OF_RANGE);
    // The same size again is no change and no event.
    assert!(!entry.resize(after));
}

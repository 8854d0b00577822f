//! The target over raw TCP: the Fabrics/admin flow, verified I/O (in-capsule,
//! R2T, digests), and bad input (each answered by the right status or
//! termination request, other queues undisturbed).

mod common;

use common::*;
use ustor_nvme::wire::*;

const DG: Digests = Digests {
    header: true,
    data: true,
};

#[test]
fn admin_identify_and_verified_io() {
    let e = env();
    for dg in [Digests::default(), DG] {
        let (mut a, cntlid) = Client::admin(e.port, dg);
        let cap = a.prop_get(prop::CAP, true);
        assert_eq!(cap & 0xffff, 127);
        assert_eq!(a.prop_get(prop::VS, false), 0x10300);
        let mut id = Sqe::default();
        id.set_opcode(admin::IDENTIFY)
            .set_cdw(10, 1)
            .set_sgl(SglDesc::transport(4096));
        let (d, c) = a.cmd(&mut id, &[]);
        assert!(c.status().is_success());
        assert_eq!(u16::from_le_bytes([d[78], d[79]]), cntlid);
        assert_eq!(get_cstr(&d[768..1024]), Some(NQN));
        assert_eq!(&d[24..34], b"ustor test");
        let mut ns = Sqe::default();
        ns.set_opcode(admin::IDENTIFY)
            .set_nsid(1)
            .set_cdw(10, 0)
            .set_sgl(SglDesc::transport(4096));
        let (d, c) = a.cmd(&mut ns, &[]);
        assert!(c.status().is_success());
        assert_eq!(u64::from_le_bytes(d[..8].try_into().unwrap()), 32768);
        let mut list = Sqe::default();
        list.set_opcode(admin::IDENTIFY)
            .set_cdw(10, 2)
            .set_sgl(SglDesc::transport(4096));
        let (d, _) = a.cmd(&mut list, &[]);
        assert_eq!(&d[..8], &[1, 0, 0, 0, 0, 0, 0, 0]);
        let mut ka = Sqe::default();
        ka.set_opcode(admin::KEEP_ALIVE);
        assert!(a.cmd(&mut ka, &[]).1.status().is_success());

        let mut q = Client::io_queue(e.port, dg, cntlid, 1);
        // In-capsule write (4 KiB), R2T write (160 KiB split by MAXH2CDATA
        // is beyond MDTS, so 128 KiB), reads back, compare, write zeroes.
        let a4 = pattern(4096, 1);
        let mut w = Client::rw_sqe(io::WRITE, 8, 8, true);
        assert!(q.cmd(&mut w, &a4).1.status().is_success());
        let big = pattern(128 << 10, 2);
        assert!(q.write_r2t(100, &big).status().is_success());
        let (d, c) = q.read(8, 8);
        assert!(c.status().is_success());
        assert_eq!(d, a4);
        let (d, c) = q.read(100, 256);
        assert!(c.status().is_success());
        assert!(d == big, "R2T data read back differs");
        let mut cmp = Client::rw_sqe(io::COMPARE, 8, 8, true);
        assert!(q.cmd(&mut cmp, &a4).1.status().is_success());
        let mut cmp = Client::rw_sqe(io::COMPARE, 8, 8, true);
        assert_eq!(
            q.cmd(&mut cmp, &big[..4096]).1.status(),
            Status::COMPARE_FAILURE
        );
        let mut wz = Sqe::default();
        wz.set_opcode(io::WRITE_ZEROES)
            .set_nsid(1)
            .set_slba(8)
            .set_cdw(12, 7);
        assert!(q.cmd(&mut wz, &[]).1.status().is_success());
        assert_eq!(q.read(8, 8).0, vec![0; 4096]);
        let mut fl = Sqe::default();
        fl.set_opcode(io::FLUSH).set_nsid(1);
        assert!(q.cmd(&mut fl, &[]).1.status().is_success());
        // DSM deallocate of one range.
        let mut r = [0u8; 16];
        r[4..8].copy_from_slice(&8u32.to_le_bytes());
        r[8..16].copy_from_slice(&100u64.to_le_bytes());
        let mut dsm = Sqe::default();
        dsm.set_opcode(io::DSM)
            .set_nsid(1)
            .set_cdw(10, 0)
            .set_cdw(11, 4)
            .set_sgl(SglDesc::in_capsule(16));
        assert!(q.cmd(&mut dsm, &r).1.status().is_success());
    }
}

#[test]
fn command_errors_keep_the_queue() {
    let e = env();
    let (mut a, cntlid) = Client::admin(e.port, DG);
    let mut q = Client::io_queue(e.port, DG, cntlid, 1);
    let mut bad = Sqe::default();
    bad.set_opcode(0x7e).set_nsid(1);
    assert_eq!(q.cmd(&mut bad, &[]).1.status(), Status::INVALID_OPCODE);
    let mut bad = Sqe::default();
    bad.set_opcode(0xc1);
    assert_eq!(a.cmd(&mut bad, &[]).1.status(), Status::INVALID_OPCODE);
    assert_eq!(q.read(32768 - 4, 8).1.status(), Status::LBA_OUT_OF_RANGE);
    let mut r = Client::rw_sqe(io::READ, 0, 8, false);
    r.set_nsid(9);
    assert_eq!(q.cmd(&mut r, &[]).1.status(), Status::INVALID_NAMESPACE);
    // A keyed SGL descriptor.
    let mut r = Client::rw_sqe(io::READ, 0, 8, false);
    r.set_sgl(SglDesc {
        address: 0,
        length: 4096,
        id: 0x40,
    });
    assert_eq!(q.cmd(&mut r, &[]).1.status(), Status::SGL_TYPE_INVALID);
    // Unknown log page, bad identify CNS.
    let mut lp = Sqe::default();
    lp.set_opcode(admin::GET_LOG_PAGE)
        .set_cdw(10, 0x42 | 127 << 16)
        .set_sgl(SglDesc::transport(512));
    assert_eq!(a.cmd(&mut lp, &[]).1.status(), Status::INVALID_LOG_PAGE);
    // Still fine afterwards.
    let (_, c) = q.read(0, 8);
    assert!(c.status().is_success());
}

#[test]
fn connect_refusals() {
    let e = env();
    let mut c = Client::connect_raw(e.port, Digests::default());
    let r = c.fabrics_connect(0, 0xffff, "nqn.2024-01.io.ustor:nope", HOSTNQN);
    assert_eq!(r.status(), Status::CONNECT_INVALID_PARAM);
    assert_eq!(r.dw0, 1 | 256 << 16);
    e.target
        .nvmf_subsystem_allow_any_host(&ustor_nvme::nvmf::AllowAnyHostParams {
            nqn: NQN.into(),
            allow_any_host: false,
        })
        .unwrap();
    let mut c = Client::connect_raw(e.port, Digests::default());
    assert_eq!(
        c.fabrics_connect(0, 0xffff, NQN, HOSTNQN).status(),
        Status::CONNECT_INVALID_HOST
    );
    e.target
        .nvmf_subsystem_add_host(&ustor_nvme::nvmf::HostParams {
            nqn: NQN.into(),
            host: HOSTNQN.into(),
        })
        .unwrap();
    let mut c = Client::connect_raw(e.port, Digests::default());
    assert!(c
        .fabrics_connect(0, 0xffff, NQN, HOSTNQN)
        .status()
        .is_success());
    // I/O queue for a controller that does not exist.
    let mut q = Client::connect_raw(e.port, Digests::default());
    assert_eq!(
        q.fabrics_connect(1, 999, NQN, HOSTNQN).status(),
        Status::CONNECT_INVALID_PARAM
    );
    // Commands before Connect.
    let mut q = Client::connect_raw(e.port, Digests::default());
    let mut ka = Sqe::default();
    ka.set_opcode(admin::KEEP_ALIVE);
    assert_eq!(q.cmd(&mut ka, &[]).1.status(), Status::COMMAND_SEQUENCE);
}

fn expect_term(c: &mut Client, fes: u16) {
    let p = c.recv().expect("termination request");
    assert_eq!(p.ty, PduType::C2HTermReq as u8, "{p:?}");
    let t = TermReq::decode(&p.hdr).unwrap();
    assert_eq!(t.fes, fes, "{t:?}");
    // Then the target closes.
    assert!(c.recv().is_err());
}

#[test]
fn bad_pdus_get_termination_requests() {
    let e = env();
    let (_a, cntlid) = Client::admin(e.port, DG);
    let mut good = Client::io_queue(e.port, DG, cntlid, 1);
    use std::io::Write;
    // Wrong PDU type for the direction (a CapsuleResp from a host).
    let mut q = Client::io_queue(e.port, DG, cntlid, 3);
    let mut h = [0u8; 32];
    let n = encode_capsule_resp(&mut h, &Cqe::default(), DG);
    q.s.write_all(&h[..n]).unwrap();
    expect_term(&mut q, fes::PDU_SEQUENCE_ERROR);
    // Bad HLEN.
    let mut q = Client::io_queue(e.port, DG, cntlid, 4);
    let mut b = [0u8; 80];
    let n = encode_capsule_cmd(&mut b, &Sqe::default(), DG, 0);
    b[2] = 60;
    q.s.write_all(&b[..n]).unwrap();
    expect_term(&mut q, fes::INVALID_HEADER_FIELD);
    // Bad PDO / PLEN.
    let mut q = Client::io_queue(e.port, DG, cntlid, 5);
    let mut b = [0u8; 80];
    let n = encode_capsule_cmd(&mut b, &Sqe::default(), DG, 100);
    b[3] = 10;
    q.s.write_all(&b[..n]).unwrap();
    expect_term(&mut q, fes::INVALID_HEADER_FIELD);
    let mut q = Client::io_queue(e.port, DG, cntlid, 6);
    let mut b = [0u8; 80];
    let n = encode_capsule_cmd(&mut b, &Sqe::default(), DG, 1 << 20);
    q.s.write_all(&b[..n]).unwrap();
    expect_term(&mut q, fes::DATA_LIMIT_EXCEEDED);
    // Header digest mismatch.
    let mut q = Client::io_queue(e.port, DG, cntlid, 7);
    let mut b = [0u8; 80];
    let n = encode_capsule_cmd(&mut b, &Client::rw_sqe(io::READ, 0, 1, false), DG, 0);
    b[72] ^= 0xff;
    q.s.write_all(&b[..n]).unwrap();
    expect_term(&mut q, fes::HEADER_DIGEST_ERROR);
    // H2CData with an unknown transfer tag, and beyond its R2T.
    let mut q = Client::io_queue(e.port, DG, cntlid, 8);
    q.send_h2c(1, 200, 0, &[0; 512], true);
    expect_term(&mut q, fes::INVALID_HEADER_FIELD);
    let mut q = Client::io_queue(e.port, DG, cntlid, 9);
    let mut w = Client::rw_sqe(io::WRITE, 0, 8, false);
    let cid = q.next_cid();
    w.set_cid(cid).set_sgl_psdt();
    q.send_cmd(&w, &[]);
    let r = q.recv().unwrap();
    assert_eq!(r.ty, PduType::R2T as u8);
    let ttag = DataHdr::decode(&r.hdr).unwrap().ttag;
    q.send_h2c(cid, ttag, 4096, &[0; 512], true);
    expect_term(&mut q, fes::DATA_OUT_OF_RANGE);
    // The other queue never noticed.
    let data = pattern(4096, 9);
    let mut w = Client::rw_sqe(io::WRITE, 0, 8, true);
    assert!(good.cmd(&mut w, &data).1.status().is_success());
    assert_eq!(good.read(0, 8).0, data);
}

#[test]
fn data_digest_error_fails_only_the_command() {
    let e = env();
    let (_a, cntlid) = Client::admin(e.port, DG);
    let mut q = Client::io_queue(e.port, DG, cntlid, 1);
    use std::io::Write;
    let mut w = Client::rw_sqe(io::WRITE, 0, 8, true);
    w.set_cid(77).set_sgl_psdt();
    let data = pattern(4096, 3);
    let mut h = [0u8; 80];
    let n = encode_capsule_cmd(&mut h, &w, DG, 4096);
    let mut v = h[..n].to_vec();
    v.extend_from_slice(&data);
    v.extend_from_slice(&(crc(&data) ^ 1).to_le_bytes());
    q.s.write_all(&v).unwrap();
    let c = q.wait(77).1;
    assert_eq!(c.status(), Status::TRANSIENT_TRANSPORT);
    assert_eq!(
        q.read(0, 8).0,
        vec![0; 4096],
        "a write with a bad digest must not land"
    );
}

#[test]
fn client_that_stops_reading_disturbs_nobody() {
    let e = env();
    let (_a, cntlid) = Client::admin(e.port, Digests::default());
    let mut stuck = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    // Queue many 64 KiB reads and never read the answers.
    for i in 0..100u16 {
        let mut r = Client::rw_sqe(io::READ, 0, 128, false);
        r.set_cid(1000 + i).set_sgl_psdt();
        stuck.send_cmd(&r, &[]);
    }
    let mut good = Client::io_queue(e.port, Digests::default(), cntlid, 2);
    let t = std::time::Instant::now();
    for i in 0..50 {
        let data = pattern(4096, i);
        let mut w = Client::rw_sqe(io::WRITE, 64 + i * 8, 8, true);
        assert!(good.cmd(&mut w, &data).1.status().is_success());
        assert_eq!(good.read(64 + i * 8, 8).0, data);
    }
    assert!(t.elapsed() < std::time::Duration::from_secs(10));
    drop(stuck);
}

#[test]
fn discovery_log_and_hot_add_event() {
    let e = env();
    let mut d = Client::connect_raw(e.port, Digests::default());
    let r = d.fabrics_connect(0, 0xffff, DISCOVERY_NQN, HOSTNQN);
    assert!(r.status().is_success());
    let mut lp = Sqe::default();
    lp.set_opcode(admin::GET_LOG_PAGE)
        .set_cdw(10, 0x70 | (2048 / 4 - 1) << 16)
        .set_sgl(SglDesc::transport(2048));
    let (log, c) = d.cmd(&mut lp, &[]);
    assert!(c.status().is_success());
    assert_eq!(u64::from_le_bytes(log[8..16].try_into().unwrap()), 1);
    assert_eq!(get_cstr(&log[1024 + 256..1024 + 512]), Some(NQN));
    assert_eq!(
        get_cstr(&log[1024 + 32..1024 + 64]),
        Some(e.port.to_string().as_str())
    );

    // AEN on namespace hot-add.
    let (mut a, _) = Client::admin(e.port, Digests::default());
    let mut aec = Sqe::default();
    aec.set_opcode(admin::SET_FEATURES)
        .set_cdw(10, 0x0b)
        .set_cdw(11, 1 << 8);
    assert!(a.cmd(&mut aec, &[]).1.status().is_success());
    let mut aer = Sqe::default();
    aer.set_opcode(admin::ASYNC_EVENT_REQUEST)
        .set_cid(500)
        .set_sgl_psdt();
    a.send_cmd(&aer, &[]);
    ustor_bdev::modules::malloc::create(
        &e.registry,
        ustor_bdev::modules::RamOpts {
            name: "Malloc1".into(),
            num_blocks: 2048,
            block_size: 512,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .unwrap();
    let nsid = e
        .target
        .nvmf_subsystem_add_ns(&ustor_nvme::nvmf::AddNsParams {
            nqn: NQN.into(),
            namespace: ustor_nvme::nvmf::NamespaceParams {
                bdev_name: "Malloc1".into(),
                nsid: 0,
                uuid: None,
                nguid: None,
            },
        })
        .unwrap();
    assert_eq!(nsid, 2);
    let c = a.wait(500).1;
    assert!(c.status().is_success());
    assert_eq!(c.dw0, 0x0004_0002);
    let mut lp = Sqe::default();
    lp.set_opcode(admin::GET_LOG_PAGE)
        .set_cdw(10, 0x04 | 1023 << 16)
        .set_sgl(SglDesc::transport(4096));
    let (log, _) = a.cmd(&mut lp, &[]);
    assert_eq!(&log[..8], &[2, 0, 0, 0, 0, 0, 0, 0]);
    let subs = e.target.nvmf_get_subsystems();
    assert_eq!(subs.len(), 2);
    assert_eq!(subs[1].namespaces.as_ref().unwrap().len(), 2);
    let stats = e.target.nvmf_get_stats().unwrap();
    assert_eq!(stats.poll_groups.len(), 2);
    let cfg = e.target.config_json();
    assert!(cfg.iter().any(|c| c["method"] == "nvmf_subsystem_add_ns"));
}

#[test]
fn keep_alive_timeout_closes_the_controller() {
    let e = env();
    let mut c = Client::connect_raw(e.port, Digests::default());
    let mut sqe = Sqe::default();
    ConnectCmd {
        recfmt: 0,
        qid: 0,
        sqsize: 31,
        cattr: 0,
        kato_ms: 1000,
    }
    .encode(&mut sqe);
    sqe.set_sgl(SglDesc::in_capsule(1024));
    let mut d = [0u8; 1024];
    ConnectData {
        hostid: [1; 16],
        cntlid: 0xffff,
        subnqn: NQN.into(),
        hostnqn: HOSTNQN.into(),
    }
    .encode(&mut d);
    assert!(c.cmd(&mut sqe, &d).1.status().is_success());
    let t = std::time::Instant::now();
    c.s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    assert!(c.recv().is_err(), "connection must close");
    let el = t.elapsed();
    assert!(
        el >= std::time::Duration::from_millis(900) && el < std::time::Duration::from_secs(4),
        "{el:?}"
    );
}

fn expect_term_at(c: &mut Client, fes: u16, fei: u32) {
    let p = c.recv().expect("termination request");
    assert_eq!(p.ty, PduType::C2HTermReq as u8, "{p:?}");
    let t = TermReq::decode(&p.hdr).unwrap();
    assert_eq!((t.fes, t.fei), (fes, fei), "{t:?}");
    assert!(
        c.recv().is_err(),
        "the target must close after a C2HTermReq"
    );
}

/// The rest of the bad-input list: a PDU type wrong for the connection's
/// state (a second ICReq), an unknown PDU type, PLEN below the header,
/// H2CData naming another command, LAST_PDU before the R2T's data is in
/// (fatal, with FES and FEI); a data digest error on H2CData (fails only
/// that command). Other queues keep working.
#[test]
fn more_bad_pdus_and_h2c_data_errors() {
    use std::io::Write;
    let e = env();
    let (_a, cntlid) = Client::admin(e.port, DG);
    let mut good = Client::io_queue(e.port, DG, cntlid, 1);
    // A second ICReq after initialization.
    let mut q = Client::io_queue(e.port, DG, cntlid, 2);
    let ic = IcReq {
        pfv: 0,
        hpda: 0,
        digests: DG,
        maxr2t: 0,
    };
    q.s.write_all(&ic.encode()).unwrap();
    expect_term_at(&mut q, fes::PDU_SEQUENCE_ERROR, ch_off::PDU_TYPE);
    // Unknown PDU type.
    let mut q = Client::io_queue(e.port, DG, cntlid, 3);
    q.s.write_all(&[0x77, 0, 8, 0, 8, 0, 0, 0]).unwrap();
    expect_term_at(&mut q, fes::INVALID_HEADER_FIELD, ch_off::PDU_TYPE);
    // PLEN smaller than the header.
    let mut q = Client::io_queue(e.port, DG, cntlid, 4);
    let mut b = [0u8; 80];
    let n = encode_capsule_cmd(&mut b, &Client::rw_sqe(io::READ, 0, 1, false), DG, 0);
    b[4..8].copy_from_slice(&40u32.to_le_bytes());
    q.s.write_all(&b[..n]).unwrap();
    expect_term_at(&mut q, fes::INVALID_HEADER_FIELD, ch_off::PLEN);
    // H2CData whose CCCID is not the command its transfer tag belongs to,
    // and LAST_PDU before all of the R2T's data arrived.
    for (wrong_cid, fes_want, fei) in [
        (true, fes::INVALID_HEADER_FIELD, 8),
        (false, fes::PDU_SEQUENCE_ERROR, ch_off::FLAGS),
    ] {
        let mut q = Client::io_queue(e.port, DG, cntlid, 5);
        let mut w = Client::rw_sqe(io::WRITE, 0, 32, false);
        w.set_cid(11).set_sgl_psdt();
        q.send_cmd(&w, &[]);
        let r = q.recv().unwrap();
        assert_eq!(r.ty, PduType::R2T as u8);
        let ttag = DataHdr::decode(&r.hdr).unwrap().ttag;
        let cid = if wrong_cid { 12 } else { 11 };
        q.send_h2c(cid, ttag, 0, &[0; 4096], true);
        expect_term_at(&mut q, fes_want, fei);
        drop(q);
        // Let the target retire queue 5 before it is connected again.
        testkit::wait_until(
            "the target to retire queue 5",
            std::time::Duration::from_secs(5),
            || e.target.connections() <= 2,
        );
    }
    // A data digest error in H2CData fails just that command: 16 KiB data
    // (copied out of the target's staging buffer) and 64 KiB data
    // (received into the command's buffer, the digest and the next header
    // behind it in the same receive).
    let mut q = Client::io_queue(e.port, DG, cntlid, 6);
    for (cid, lba, len) in [(21u16, 256u64, 16384usize), (22, 1024, 65536)] {
        let data = pattern(len, 4 + u64::from(cid));
        let nlb = (len / 512) as u32;
        let mut w = Client::rw_sqe(io::WRITE, lba, nlb, false);
        w.set_cid(cid).set_sgl_psdt();
        q.send_cmd(&w, &[]);
        let r = q.recv().unwrap();
        let ttag = DataHdr::decode(&r.hdr).unwrap().ttag;
        let mut h = [0u8; 32];
        let d = DataHdr {
            cccid: cid,
            ttag,
            offset: 0,
            length: data.len() as u32,
        };
        let n = encode_data_hdr(&mut h, PduType::H2CData, &d, flags::LAST_PDU, DG);
        let mut v = h[..n].to_vec();
        v.extend_from_slice(&data);
        v.extend_from_slice(&(crc(&data) ^ 1).to_le_bytes());
        q.s.write_all(&v).unwrap();
        assert_eq!(q.wait(cid).1.status(), Status::TRANSIENT_TRANSPORT);
        assert_eq!(q.read(lba, nlb).0, vec![0; len], "bad-digest data landed");
        assert!(q.write_r2t(lba, &data).status().is_success());
        assert_eq!(q.read(lba, nlb).0, data);
    }
    // Queue 1 never noticed.
    let d1 = pattern(4096, 10);
    let mut w = Client::rw_sqe(io::WRITE, 8, 8, true);
    assert!(good.cmd(&mut w, &d1).1.status().is_success());
    assert_eq!(good.read(8, 8).0, d1);
}

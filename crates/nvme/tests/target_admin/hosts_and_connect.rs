//! Host removal, discovery filtered by host, and Connect checks.

use super::*;

// ---------------------------------------------------------------------
// 6. Host removal / 7. discovery by host / 8. Connect checks
// ---------------------------------------------------------------------

/// `nvmf_subsystem_remove_host` on a subsystem without allow_any_host:
/// like SPDK (nvmf_rpc.c rpc_nvmf_subsystem_remove_host then
/// spdk_nvmf_subsystem_disconnect_host), the host's controllers are
/// disconnected (admin and I/O queues closed), other hosts keep theirs,
/// and a new Connect from the removed host gets Connect Invalid Host.
#[test]
fn remove_host_disconnects_it_and_refuses_reconnect() {
    let e = env();
    second_subsystem(&e, false, &[HOST_A, HOST_B], (1, 0xffef));
    let (mut a, ca) = admin_as(e.port, NQN2, HOST_A);
    let mut qa = io_as(e.port, NQN2, HOST_A, ca, 1);
    let (mut b, cb) = admin_as(e.port, NQN2, HOST_B);
    let mut qb = io_as(e.port, NQN2, HOST_B, cb, 1);
    assert_eq!(
        write_incapsule(&mut qa, 0, &pattern(512, 3)),
        Status::SUCCESS
    );
    // A on the open subsystem too: not affected by NQN2's host list.
    let (mut open, _) = admin_as(e.port, NQN, HOST_A);
    e.target
        .nvmf_subsystem_remove_host(&HostParams {
            nqn: NQN2.into(),
            host: HOST_A.into(),
        })
        .unwrap();
    expect_closed(&mut a);
    expect_closed(&mut qa);
    assert_eq!(keep_alive(&mut b), Status::SUCCESS);
    assert_eq!(qb.read(0, 1).0, pattern(512, 3));
    assert_eq!(keep_alive(&mut open), Status::SUCCESS);
    let mut c = Client::connect_raw(e.port, Digests::default());
    assert_eq!(
        c.fabrics_connect(0, 0xffff, NQN2, HOST_A).status(),
        Status::CONNECT_INVALID_HOST
    );
    // Nor may A attach an I/O queue to B's controller.
    let mut c = Client::connect_raw(e.port, Digests::default());
    assert_eq!(
        c.fabrics_connect(2, cb, NQN2, HOST_A).status(),
        Status::CONNECT_INVALID_HOST
    );
}

/// The discovery log page (70h) a host reads lists only the subsystems that
/// host may connect to. Header: GENCTR (7:0), NUMREC (15:8), RECFMT
/// (17:16); 1024-byte entries from byte 1024: TRTYPE 3 (TCP), ADRFAM 1
/// (IPv4), SUBTYPE 2 (NVM), PORTID, CNTLID FFFFh (dynamic), ASQSZ,
/// TRSVCID (63:32), SUBNQN (511:256), TRADDR (767:512).
#[test]
fn discovery_log_is_filtered_by_host() {
    let e = env();
    second_subsystem(&e, false, &[HOST_A], (1, 0xffef));
    let discover = |host: &str| {
        let mut d = Client::connect_raw(e.port, Digests::default());
        let r = d.fabrics_connect(0, 0xffff, DISCOVERY_NQN, host);
        assert!(r.status().is_success());
        // Header first (as hosts do), then the whole page.
        let (h, c) = get_log(&mut d, LID_DISCOVERY, 32, 0, false);
        assert!(c.status().is_success());
        let n = le64(&h, 8) as usize;
        let (log, c) = get_log(&mut d, LID_DISCOVERY, (1024 * (n + 1)) as u32, 0, false);
        assert!(c.status().is_success());
        assert_eq!(le64(&log, 0), le64(&h, 0), "GENCTR");
        assert_eq!(le16(&log, 16), 0, "RECFMT");
        let mut subs = Vec::new();
        for i in 0..n {
            let ent = &log[1024 * (i + 1)..1024 * (i + 2)];
            assert_eq!((ent[0], ent[1], ent[2]), (3, 1, 2), "entry {i}");
            assert_eq!(le16(ent, 6), 0xffff, "CNTLID");
            assert!(le16(ent, 8) >= 32, "ASQSZ");
            assert_eq!(get_cstr(&ent[32..64]), Some(e.port.to_string().as_str()));
            assert_eq!(get_cstr(&ent[512..768]), Some("127.0.0.1"));
            subs.push(get_cstr(&ent[256..512]).unwrap().to_string());
        }
        subs.sort();
        (le64(&h, 0), subs)
    };
    let (g_a, subs_a) = discover(HOST_A);
    assert_eq!(subs_a, [NQN2, NQN], "sorted: ...:second < ...:test");
    let (g_b, subs_b) = discover(HOST_B);
    assert_eq!(subs_b, [NQN]);
    assert_eq!(g_a, g_b);
    // Allowing B changes what B sees, and the generation counter.
    e.target
        .nvmf_subsystem_add_host(&HostParams {
            nqn: NQN2.into(),
            host: HOST_B.into(),
        })
        .unwrap();
    let (g2, subs_b) = discover(HOST_B);
    assert_eq!(subs_b, [NQN2, NQN]);
    assert!(g2 > g_b, "GENCTR must change");
}

/// Admin Connects get distinct cntlids within [min_cntlid, max_cntlid]
/// (Connect response DW0, Identify Controller CNTLID bytes 79:78); with
/// the range used up a Connect is refused; a freed id is reused.
#[test]
fn connect_cntlids_within_range() {
    let e = env();
    second_subsystem(&e, true, &[], (5, 6));
    let (mut a1, c1) = admin_as(e.port, NQN2, HOST_A);
    let (mut a2, c2) = admin_as(e.port, NQN2, HOST_B);
    assert_ne!(c1, c2);
    for (a, c) in [(&mut a1, c1), (&mut a2, c2)] {
        assert!((5..=6).contains(&c), "cntlid {c}");
        let (id, _) = identify(a, 1, 0, 0);
        assert_eq!(le16(&id, 78), c);
        assert_eq!(get_cstr(&id[768..1024]), Some(NQN2));
    }
    let mut x = Client::connect_raw(e.port, Digests::default());
    let r = x.fabrics_connect(0, 0xffff, NQN2, HOST_A);
    assert_eq!(r.status(), Status::CONNECT_CTRL_BUSY);
    drop(x);
    drop(a1);
    eventually("first controller gone", || e.target.connections() == 1);
    let (_a3, c3) = admin_as(e.port, NQN2, HOST_A);
    assert_eq!(c3, c1, "the freed cntlid is the only one left");
    drop(a2);
}

/// An I/O queue Connect must come from the host that owns the controller
/// (same Host NQN as its admin queue): otherwise Connect Invalid Host (the
/// host "is not allowed to establish an association to the specified
/// controller"). An unknown cntlid is Connect Invalid Parameters naming
/// the CNTLID field of the Connect data (IATTR 1, IPO 16).
#[test]
fn connect_io_queue_checks_host_and_cntlid() {
    let e = env();
    let (_a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q = Client::connect_raw(e.port, Digests::default());
    let r = q.fabrics_connect(1, cntlid, NQN, HOST_B);
    assert_eq!(r.status(), Status::CONNECT_INVALID_HOST);
    // The queue id was not taken by the refused Connect.
    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    assert_eq!(write_incapsule(&mut q, 0, &[5; 512]), Status::SUCCESS);
    // The same qid twice: refused (IATTR 0, IPO 42 = QID).
    let mut d = Client::connect_raw(e.port, Digests::default());
    let r = d.fabrics_connect(1, cntlid, NQN, HOSTNQN);
    assert_eq!(r.status(), Status::CONNECT_INVALID_PARAM);
    assert_eq!(r.dw0, 42 << 16);
    let mut u = Client::connect_raw(e.port, Digests::default());
    let r = u.fabrics_connect(1, cntlid.wrapping_add(100), NQN, HOSTNQN);
    assert_eq!(r.status(), Status::CONNECT_INVALID_PARAM);
    assert_eq!(r.dw0, 1 | 16 << 16);
}

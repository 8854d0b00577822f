//! Sessions and their connections, with raw-socket clients (libiscsi
//! has no MC/S or reinstatement to drive): session reinstatement (a
//! login with the same initiator port and TSIH 0 ends the old session,
//! its pending task aborted, before the new one is up), the non-zero TSIH
//! rules (unknown session, MaxConnections), MC/S (two connections of one
//! session, commands ordered by CmdSN across them, each answered on its
//! own connection; logout of a connection by another one; connection
//! reinstatement by CID; a failed connection ends the session at ERL 0),
//! and task management reaching other sessions (LUN RESET and CLEAR TASK
//! SET abort their tasks and give them a unit attention; ABORT TASK SET
//! does not touch them); COMPARE AND WRITE atomic against another
//! session's WRITE (a delay bdev makes the race certain); max_sessions
//! per node (0x0302 over it, libiscsi refused too); unit attentions
//! once per session when its connections run on two reactors. Data is
//! checked in the bdev.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use ustor_iscsi::wire::{build, encode_text, opcode, pad4, parse_text, Bhs, BHS_LEN};

const INITIATOR: &str = "iqn.2026-11.io.ustor:sessions";
const ISID: [u8; 6] = [0x80, 0, 0, 0, 0, 0x21];

fn recv_pdu(s: &mut TcpStream) -> std::io::Result<(Bhs, Vec<u8>)> {
    let mut h = [0u8; BHS_LEN];
    s.read_exact(&mut h)?;
    let b = Bhs(h);
    let mut d = vec![0u8; pad4(b.data_len())];
    s.read_exact(&mut d)?;
    d.truncate(b.data_len());
    Ok((b, d))
}

fn pdu_bytes(mut b: Bhs, data: &[u8]) -> Vec<u8> {
    b.set_data_len(data.len());
    let mut v = b.0.to_vec();
    v.extend_from_slice(data);
    v.resize(BHS_LEN + pad4(data.len()), 0);
    v
}

const SLOW: &str = "iqn.2016-06.io.spdk:slow";

/// A login's outcome: the socket, status class and detail, TSIH, keys.
struct Login {
    s: TcpStream,
    status: (u8, u8),
    tsih: u16,
    keys: Vec<(String, String)>,
}

/// Logs in to `disk1` straight to full feature phase as `initiator` with
/// `isid`, asking for session `tsih` (0: a new one) with connection `cid`.
fn login_as(
    port: u16,
    initiator: &str,
    isid: [u8; 6],
    tsih: u16,
    cid: u16,
    extra: &[(&str, &str)],
) -> Login {
    login_to(port, NODE, initiator, isid, tsih, cid, extra)
}

fn login_to(
    port: u16,
    node: &str,
    initiator: &str,
    isid: [u8; 6],
    tsih: u16,
    cid: u16,
    extra: &[(&str, &str)],
) -> Login {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut keys = vec![
        ("InitiatorName", initiator),
        ("TargetName", node),
        ("SessionType", "Normal"),
    ];
    keys.extend_from_slice(extra);
    let mut b = build::login(isid, tsih, 0x100 + cid as u32, 1, 0, 1, 3, true);
    b.set_u16(20, cid);
    s.write_all(&pdu_bytes(b, &encode_text(&keys))).unwrap();
    let (r, d) = recv_pdu(&mut s).unwrap();
    assert_eq!(r.opcode(), opcode::LOGIN_RESP);
    Login {
        s,
        status: (r.u8_at(36), r.u8_at(37)),
        tsih: r.u16_at(14),
        keys: parse_text(&d),
    }
}

fn login(port: u16, isid: [u8; 6]) -> Login {
    let l = login_as(port, INITIATOR, isid, 0, 0, &[]);
    assert_eq!(l.status, (0, 0), "login failed");
    l
}

fn cdb10(op: u8, lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = op;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

/// A 4 KiB WRITE(10) at `lba` (512-byte blocks) with immediate data.
fn write_cmd(itt: u32, cmdsn: u32, lba: u32, data: &[u8]) -> Vec<u8> {
    let b = build::scsi_cmd(
        [0; 8],
        itt,
        &cdb10(0x2a, lba, 8),
        false,
        true,
        4096,
        cmdsn,
        0,
    );
    pdu_bytes(b, data)
}

/// A 4 KiB WRITE(10) without data: the target asks for it with an R2T
/// and the task waits for Data-Out that never comes.
fn pending_write(itt: u32, cmdsn: u32, lba: u32) -> Vec<u8> {
    let b = build::scsi_cmd(
        [0; 8],
        itt,
        &cdb10(0x2a, lba, 8),
        false,
        true,
        4096,
        cmdsn,
        0,
    );
    pdu_bytes(b, &[])
}

/// A READ(10) of 4 KiB, ORDERED: it runs after every earlier command.
fn read_cmd(itt: u32, cmdsn: u32, lba: u32) -> Vec<u8> {
    let mut b = build::scsi_cmd(
        [0; 8],
        itt,
        &cdb10(0x28, lba, 8),
        true,
        false,
        4096,
        cmdsn,
        0,
    );
    b.0[1] = (b.0[1] & !0x07) | 2;
    pdu_bytes(b, &[])
}

fn tur(itt: u32, cmdsn: u32) -> Vec<u8> {
    let b = build::scsi_cmd([0; 8], itt, &[0u8; 6], false, false, 0, cmdsn, 0);
    pdu_bytes(b, &[])
}

/// The next PDU, which must be for `itt`.
fn expect(s: &mut TcpStream, op: u8, itt: u32) -> (Bhs, Vec<u8>) {
    let (b, d) = recv_pdu(s).unwrap();
    assert_eq!((b.opcode(), b.itt()), (op, itt), "unexpected PDU");
    (b, d)
}

/// Status and data of one command (Data-In with status, or a Response).
fn status_of(s: &mut TcpStream, itt: u32) -> (u8, Vec<u8>, Vec<u8>) {
    let mut data = Vec::new();
    loop {
        let (b, d) = recv_pdu(s).unwrap();
        assert_eq!(b.itt(), itt, "PDU {:#x} of another task", b.opcode());
        match b.opcode() {
            opcode::DATA_IN => {
                data.extend_from_slice(&d);
                if b.flags() & 0x01 != 0 {
                    return (b.u8_at(3), data, Vec::new());
                }
            }
            opcode::SCSI_RESP => return (b.u8_at(3), data, d),
            op => panic!("unexpected opcode {op:#x}"),
        }
    }
}

/// The statuses of the next `n` SCSI Responses, in whatever order they
/// come, by ITT.
fn responses(s: &mut TcpStream, n: usize) -> std::collections::BTreeMap<u32, u8> {
    let mut m = std::collections::BTreeMap::new();
    while m.len() < n {
        let (b, _) = recv_pdu(s).unwrap();
        assert_eq!(b.opcode(), opcode::SCSI_RESP, "ITT {:#x}", b.itt());
        m.insert(b.itt(), b.u8_at(3));
    }
    m
}

/// Reads until the connection ends; every PDU seen must pass `ok`.
fn until_closed(s: &mut TcpStream, ok: impl Fn(&Bhs) -> bool) {
    loop {
        match recv_pdu(s) {
            Ok((b, _)) => assert!(ok(&b), "PDU {:#x} for {:#x}", b.opcode(), b.itt()),
            Err(e) => {
                assert_ne!(e.kind(), std::io::ErrorKind::WouldBlock, "still open");
                return;
            }
        }
    }
}

fn logout(reason: u8, itt: u32, cmdsn: u32, cid: u16) -> Vec<u8> {
    let mut b = build::logout(itt, cmdsn, 0);
    b.0[1] = 0x80 | reason;
    b.set_u16(20, cid);
    pdu_bytes(b, &[])
}

fn tmf(function: u8, itt: u32, cmdsn: u32) -> Vec<u8> {
    pdu_bytes(
        build::tmf(function, [0; 8], itt, 0xffff_ffff, cmdsn, 0, 0),
        &[],
    )
}

/// The sense key and ASC/ASCQ of a CHECK CONDITION's data segment.
fn sense(d: &[u8]) -> (u8, u8, u8) {
    let s = &d[2..];
    (s[2] & 0x0f, s[12], s[13])
}

#[test]
fn session_reinstatement_ends_the_old_session() {
    let f = start(16 << 20, 512);
    let mut a = login(f.port, ISID);
    // A task of the old session that waits for Data-Out forever.
    a.s.write_all(&pending_write(1, 1, 64)).unwrap();
    expect(&mut a.s, opcode::R2T, 1);

    let t0 = Instant::now();
    let mut b = login(f.port, ISID);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_ne!(b.tsih, a.tsih);
    // The old connection ended before the new session was up, its write
    // never answered (and never written).
    a.s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    until_closed(&mut a.s, |_| false);
    assert_eq!(f.read_bdev("Malloc0", 64 * 512, 4096), vec![0u8; 4096]);
    testkit::wait_until(
        "only the new session listed",
        Duration::from_secs(5),
        || {
            let c = f.target.get_connections();
            c.len() == 1 && c[0].tsih == b.tsih
        },
    );

    // The new session works.
    b.s.write_all(&write_cmd(2, 1, 8, &pattern(2, 4096)))
        .unwrap();
    assert_eq!(status_of(&mut b.s, 2).0, 0);
    assert_eq!(f.read_bdev("Malloc0", 8 * 512, 4096), pattern(2, 4096));

    // Another ISID is another session: both stay.
    let other = login(f.port, [0x80, 0, 0, 0, 0, 0x22]);
    b.s.write_all(&tur(3, 2)).unwrap();
    assert_eq!(status_of(&mut b.s, 3).0, 0);
    testkit::wait_until("both sessions listed", Duration::from_secs(5), || {
        f.target.get_connections().len() == 2
    });
    drop(other);
}

#[test]
fn non_zero_tsih_joins_only_an_existing_session() {
    let f = start(16 << 20, 512);
    // No session has this TSIH: "session does not exist".
    let l = login_as(f.port, INITIATOR, ISID, 0x7777, 1, &[]);
    assert_eq!(l.status, (2, 0x0a));
    // MaxConnections not negotiated (1): a second connection is refused.
    let a = login(f.port, ISID);
    let l = login_as(f.port, INITIATOR, ISID, a.tsih, 1, &[]);
    assert_eq!(l.status, (2, 0x06), "too many connections");
    // Another initiator port may not join it.
    let l = login_as(f.port, INITIATOR, [0x80, 0, 0, 0, 0, 0x23], a.tsih, 1, &[]);
    assert_eq!(l.status, (2, 0x0a));
    // The session was not disturbed.
    let mut a = a;
    a.s.write_all(&tur(1, 1)).unwrap();
    assert_eq!(status_of(&mut a.s, 1).0, 0);
}

#[test]
fn two_connections_share_one_session() {
    let f = start(16 << 20, 512);
    let mc = [("MaxConnections", "4")];
    let mut a = login_as(f.port, INITIATOR, ISID, 0, 0, &mc);
    assert_eq!(a.status, (0, 0));
    let got = a.keys.iter().find(|(k, _)| k == "MaxConnections");
    assert_eq!(got.map(|(_, v)| v.as_str()), Some("2"), "our limit");
    let mut b = login_as(f.port, INITIATOR, ISID, a.tsih, 1, &mc);
    assert_eq!(b.status, (0, 0));
    assert_eq!(b.tsih, a.tsih);
    let got = b.keys.iter().find(|(k, _)| k == "MaxConnections");
    assert_eq!(got.map(|(_, v)| v.as_str()), Some("Irrelevant"));
    // A third is one too many.
    let l = login_as(f.port, INITIATOR, ISID, a.tsih, 2, &[]);
    assert_eq!(l.status, (2, 0x06));
    testkit::wait_until("both connections listed", Duration::from_secs(5), || {
        f.target.get_connections().len() == 2
    });

    // CmdSN 2 (an ORDERED READ) on B may arrive before CmdSN 1 (the
    // WRITE) on A: it waits for it and reads what it wrote.
    b.s.write_all(&read_cmd(20, 2, 0)).unwrap();
    a.s.write_all(&write_cmd(10, 1, 0, &pattern(10, 4096)))
        .unwrap();
    let (st, _, _) = status_of(&mut a.s, 10);
    assert_eq!(st, 0);
    let (st, data, _) = status_of(&mut b.s, 20);
    assert_eq!(st, 0);
    assert!(data == pattern(10, 4096), "READ on B ran before WRITE on A");

    // A closes B (logout reason 1 with B's CID); the session goes on.
    // (Logouts are immediate: ExpCmdSN stays 3.)
    a.s.write_all(&logout(1, 11, 3, 1)).unwrap();
    let (r, _) = expect(&mut a.s, opcode::LOGOUT_RESP, 11);
    assert_eq!(r.u8_at(2), 0, "connection closed");
    until_closed(&mut b.s, |_| false);
    // Removing a connection for recovery needs ERL 2.
    a.s.write_all(&logout(2, 12, 3, 0)).unwrap();
    let (r, _) = expect(&mut a.s, opcode::LOGOUT_RESP, 12);
    assert_eq!(r.u8_at(2), 2, "connection recovery is not supported");
    // A logout for a CID that is not there.
    a.s.write_all(&logout(1, 13, 3, 9)).unwrap();
    let (r, _) = expect(&mut a.s, opcode::LOGOUT_RESP, 13);
    assert_eq!(r.u8_at(2), 1, "CID not found");

    // Connection reinstatement: a login with A's CID replaces A; the
    // session's CmdSN goes on where it was.
    let mut c = login_as(f.port, INITIATOR, ISID, a.tsih, 0, &[]);
    assert_eq!(c.status, (0, 0));
    a.s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    until_closed(&mut a.s, |_| false);
    c.s.write_all(&read_cmd(30, 3, 0)).unwrap();
    let (st, data, _) = status_of(&mut c.s, 30);
    assert_eq!(st, 0);
    assert!(data == pattern(10, 4096));

    // A second connection whose loss ends the session (ERL 0): C's end
    // ends D too.
    let mut d = login_as(f.port, INITIATOR, ISID, a.tsih, 3, &[]);
    assert_eq!(d.status, (0, 0));
    testkit::wait_until("C and D listed", Duration::from_secs(5), || {
        f.target.get_connections().len() == 2
    });
    drop(c);
    until_closed(&mut d.s, |_| false);
    testkit::wait_until("the session ended", Duration::from_secs(10), || {
        f.target.get_connections().is_empty()
    });
    // Its TSIH is gone with it.
    let l = login_as(f.port, INITIATOR, ISID, a.tsih, 0, &[]);
    assert_eq!(l.status, (2, 0x0a));
}

/// Two sessions (two initiator ports) on one LUN; session 2 has a WRITE
/// (ITT 1) waiting for its data, asked for by an R2T with this TTT.
fn two_sessions(f: &Fixture) -> (Login, Login, u32) {
    let s1 = login(f.port, ISID);
    let mut s2 = login(f.port, [0x80, 0, 0, 0, 0, 0x31]);
    s2.s.write_all(&pending_write(1, 1, 128)).unwrap();
    let (r2t, _) = expect(&mut s2.s, opcode::R2T, 1);
    assert_eq!((r2t.u32_at(40), r2t.u32_at(44)), (0, 4096));
    (s1, s2, r2t.u32_at(20))
}

#[test]
fn lun_reset_and_clear_task_set_reach_other_sessions() {
    let f = start(16 << 20, 512);

    // ABORT TASK SET is the session's own: session 2's WRITE goes on.
    let (mut s1, mut s2, ttt) = two_sessions(&f);
    s1.s.write_all(&tmf(2, 5, 1)).unwrap();
    let (r, _) = expect(&mut s1.s, opcode::TMF_RESP, 5);
    assert_eq!(r.u8_at(2), 0);
    let out = build::data_out([0; 8], 1, ttt, 0, 0, 0, 4096, true);
    s2.s.write_all(&pdu_bytes(out, &pattern(7, 4096))).unwrap();
    assert_eq!(status_of(&mut s2.s, 1).0, 0);
    assert_eq!(f.read_bdev("Malloc0", 128 * 512, 4096), pattern(7, 4096));
    s2.s.write_all(&tur(2, 2)).unwrap();
    assert_eq!(status_of(&mut s2.s, 2).0, 0, "no unit attention");
    drop((s1, s2));

    // LUN RESET: session 2's task is aborted (no answer), the reset is
    // answered once it has ended, and session 2 sees POWER ON, RESET.
    let (mut s1, mut s2, _) = two_sessions(&f);
    s1.s.write_all(&tmf(5, 6, 1)).unwrap();
    let (r, _) = expect(&mut s1.s, opcode::TMF_RESP, 6);
    assert_eq!(r.u8_at(2), 0);
    s2.s.write_all(&tur(2, 2)).unwrap();
    let (st, _, d) = status_of(&mut s2.s, 2);
    assert_eq!(st, 2, "CHECK CONDITION");
    assert_eq!(sense(&d), (6, 0x29, 0x00));
    assert_eq!(f.read_bdev("Malloc0", 128 * 512, 4096), pattern(7, 4096));
    drop((s1, s2));

    // CLEAR TASK SET: the same, with COMMANDS CLEARED BY ANOTHER
    // INITIATOR.
    let (mut s1, mut s2, _) = two_sessions(&f);
    s1.s.write_all(&tmf(3, 7, 1)).unwrap();
    let (r, _) = expect(&mut s1.s, opcode::TMF_RESP, 7);
    assert_eq!(r.u8_at(2), 0);
    s2.s.write_all(&tur(2, 2)).unwrap();
    let (st, _, d) = status_of(&mut s2.s, 2);
    assert_eq!(st, 2, "CHECK CONDITION");
    assert_eq!(sense(&d), (6, 0x2f, 0x00));
}

/// COMPARE AND WRITE of one 512-byte block at LBA 0 (compare `old`,
/// write `new`, both as immediate data).
fn compare_and_write(itt: u32, cmdsn: u32, old: &[u8], new: &[u8]) -> Vec<u8> {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x89;
    cdb[13] = 1;
    let b = build::scsi_cmd([0; 8], itt, &cdb, false, true, 1024, cmdsn, 0);
    pdu_bytes(b, &[old, new].concat())
}

/// One 512-byte WRITE(10) at LBA 0.
fn write_block(itt: u32, cmdsn: u32, data: &[u8]) -> Vec<u8> {
    let b = build::scsi_cmd([0; 8], itt, &cdb10(0x2a, 0, 1), false, true, 512, cmdsn, 0);
    pdu_bytes(b, data)
}

/// Session 2 WRITEs the block session 1's COMPARE AND WRITE works on;
/// the delay bdev takes 600 ms to get a write to the medium and none for
/// a read. Session 2's WRITE goes first: the COMPARE AND WRITE waits for
/// it, then compares (and fails). Without the gate it would read the old
/// data and compare, and its write would land after session 2's: lost.
/// Should the COMPARE AND WRITE reach the target first, session 2's
/// WRITE waits for it. Either way the block ends with session 2's data.
/// Node `slow` on `Delay0`, a delay bdev over `Malloc1` (1 MiB of 512-byte
/// blocks) whose writes take `write_us` and reads about none.
fn slow_node(f: &Fixture, write_us: u64) {
    use std::sync::Arc;
    use ustor_bdev::modules::{malloc, RamOpts};
    use ustor_vbdev::delay::{self, DelayParams};
    let opts = RamOpts {
        name: "Malloc1".into(),
        num_blocks: 2048,
        block_size: 512,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    };
    malloc::create(&f.registry, opts).expect("malloc");
    let p = DelayParams {
        base_bdev_name: "Malloc1".into(),
        name: "Delay0".into(),
        avg_read_latency: 1,
        p99_read_latency: 1,
        avg_write_latency: write_us,
        p99_write_latency: write_us,
        uuid: None,
    };
    delay::create(&f.registry, &Arc::downgrade(&f.registry), p).expect("delay bdev");
    f.target
        .create_target_node(&node_params("slow", "Delay0"))
        .expect("node");
}

#[test]
fn compare_and_write_is_atomic_against_other_sessions() {
    let f = start(16 << 20, 512);
    slow_node(&f, 600_000);
    let mut s1 = login_to(f.port, SLOW, INITIATOR, ISID, 0, 0, &[]);
    let mut s2 = login_to(f.port, SLOW, INITIATOR, [0x80, 0, 0, 0, 0, 0x41], 0, 0, &[]);
    assert_eq!((s1.status, s2.status), ((0, 0), (0, 0)));
    let (a, b, c) = (pattern(1, 512), pattern(2, 512), pattern(3, 512));
    s1.s.write_all(&write_block(1, 1, &a)).unwrap();
    assert_eq!(status_of(&mut s1.s, 1).0, 0);

    s2.s.write_all(&write_block(1, 1, &c)).unwrap();
    s1.s.write_all(&compare_and_write(2, 2, &a, &b)).unwrap();
    assert_eq!(status_of(&mut s2.s, 1).0, 0);
    let (caw, _, sense_data) = status_of(&mut s1.s, 2);
    match caw {
        0 => {}
        2 => assert_eq!(sense(&sense_data), (0x0e, 0x1d, 0x00), "MISCOMPARE"),
        s => panic!("COMPARE AND WRITE status {s:#x}"),
    }
    assert!(
        f.read_bdev("Malloc1", 0, 512) == c,
        "a write of another session was lost under COMPARE AND WRITE (status {caw})"
    );
}

/// TARGET COLD RESET is answered, then every session of the node ends.
#[test]
fn target_cold_reset_ends_every_session() {
    let f = start(16 << 20, 512);
    let (mut s1, mut s2, _) = two_sessions(&f);
    s1.s.write_all(&tmf(7, 9, 1)).unwrap();
    let (r, _) = expect(&mut s1.s, opcode::TMF_RESP, 9);
    assert_eq!(r.u8_at(2), 0);
    until_closed(&mut s1.s, |_| false);
    until_closed(&mut s2.s, |_| false);
    testkit::wait_until("no session left", Duration::from_secs(10), || {
        f.target.get_connections().is_empty()
    });
}

/// `max_sessions` caps each node's normal sessions: a login over it gets
/// "out of resources" (0x0302) and the close, and disturbs nothing; a
/// login that reinstates its own session, a connection joining a
/// session (MC/S), a discovery session and another node's sessions do
/// not count against it. libiscsi's login is refused as well.
#[test]
fn max_sessions_caps_the_sessions_of_a_node() {
    use ustor_bdev::modules::{malloc, RamOpts};
    let f = start_full(
        16 << 20,
        512,
        |_| {},
        |t| {
            let o = ustor_iscsi_target::IscsiOptions {
                max_sessions: 2,
                ..Default::default()
            };
            t.set_options(o).expect("options");
        },
    );
    let mc = [("MaxConnections", "2")];
    let mut a = login_as(f.port, INITIATOR, ISID, 0, 0, &mc);
    assert_eq!(a.status, (0, 0));
    let mut b = login(f.port, [0x80, 0, 0, 0, 0, 0x51]);
    // A third session of the node: out of resources, TSIH 0, closed.
    let mut c = login_as(f.port, INITIATOR, [0x80, 0, 0, 0, 0, 0x52], 0, 0, &[]);
    assert_eq!(c.status, (3, 2), "out of resources");
    assert_eq!(c.tsih, 0);
    until_closed(&mut c.s, |_| false);
    // A and B were not disturbed.
    a.s.write_all(&write_cmd(1, 1, 0, &pattern(51, 4096)))
        .unwrap();
    assert_eq!(status_of(&mut a.s, 1).0, 0);
    b.s.write_all(&tur(1, 1)).unwrap();
    assert_eq!(status_of(&mut b.s, 1).0, 0);
    // A second connection of A's session is no new session.
    let j = login_as(f.port, INITIATOR, ISID, a.tsih, 1, &mc);
    assert_eq!(j.status, (0, 0), "joining connection");
    assert_eq!(j.tsih, a.tsih);
    // libiscsi's login (another initiator port) is refused too.
    if have("iscsi-inq") {
        let out = std::process::Command::new("iscsi-inq")
            .arg(f.url(0))
            .output()
            .expect("iscsi-inq");
        assert!(!out.status.success(), "iscsi-inq logged in over the cap");
        // Discovery sessions do not count.
        let out = stdout(&run("iscsi-ls", &[&format!("iscsi://{}", f.portal())]));
        assert!(out.contains(NODE), "{out}");
    }
    // Another node has places of its own.
    let opts = RamOpts {
        name: "Malloc1".into(),
        num_blocks: 2048,
        block_size: 512,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    };
    malloc::create(&f.registry, opts).expect("malloc");
    f.target
        .create_target_node(&node_params("other", "Malloc1"))
        .expect("node");
    let other = "iqn.2016-06.io.spdk:other";
    let o = login_to(
        f.port,
        other,
        INITIATOR,
        [0x80, 0, 0, 0, 0, 0x53],
        0,
        0,
        &[],
    );
    assert_eq!(o.status, (0, 0), "another node");
    // Reinstating B's initiator port at the cap: B ends, the new one is
    // in (the cap counts sessions besides the one it replaces).
    let b2 = login(f.port, [0x80, 0, 0, 0, 0, 0x51]);
    b.s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    until_closed(&mut b.s, |_| false);
    drop(b2);
    // Once a session has gone, a new one (libiscsi's) fits.
    testkit::wait_until("B's successor gone", Duration::from_secs(10), || {
        f.target
            .get_connections()
            .iter()
            .filter(|c| c.target_node_name == NODE)
            .count()
            == 2
    });
    if have("iscsi-inq") {
        let out = stdout(&run("iscsi-inq", &[&f.url(0)]));
        assert!(out.contains("Vendor:USTOR"), "{out}");
    }
    // A's data is there, and A still answers.
    assert_eq!(f.read_bdev("Malloc0", 0, 4096), pattern(51, 4096));
    a.s.write_all(&tur(2, 2)).unwrap();
    assert_eq!(status_of(&mut a.s, 2).0, 0);
}

/// MC/S spread over reactors: the two connections of one session run on
/// two reactors (the listener's round robin), and still share one CmdSN
/// window and one task order: an ORDERED READ on one waits for the slow
/// WRITE sent before it on the other (300 ms writes: without the order
/// across reactors it would read the old data), WRITEs sent ahead of
/// their turn on alternate connections all land, ABORT TASK on one
/// connection aborts a task of the other, and a session logout from one
/// ends both.
#[test]
fn a_sessions_connections_run_on_two_reactors() {
    let f = start(16 << 20, 512);
    slow_node(&f, 300_000);
    let mc = [("MaxConnections", "2")];
    let mut a = login_to(f.port, SLOW, INITIATOR, ISID, 0, 0, &mc);
    assert_eq!(a.status, (0, 0));
    let mut b = login_to(f.port, SLOW, INITIATOR, ISID, a.tsih, 1, &mc);
    assert_eq!(b.status, (0, 0));
    testkit::wait_until("both connections listed", Duration::from_secs(5), || {
        f.target.get_connections().len() == 2
    });
    let threads: std::collections::BTreeSet<String> = f
        .target
        .get_connections()
        .into_iter()
        .map(|c| c.thread_name)
        .collect();
    assert_eq!(threads.len(), 2, "both on one reactor: {threads:?}");

    // CmdSN 2, ORDERED, on B before CmdSN 1 on A.
    b.s.write_all(&read_cmd(20, 2, 0)).unwrap();
    a.s.write_all(&write_cmd(10, 1, 0, &pattern(61, 4096)))
        .unwrap();
    assert_eq!(status_of(&mut a.s, 10).0, 0);
    let (st, data, _) = status_of(&mut b.s, 20);
    assert_eq!(st, 0);
    assert!(data == pattern(61, 4096), "the READ passed the WRITE");

    // Eight WRITEs, CmdSN 3 to 10, alternating connections, each pair's
    // second one sent first (it waits for its turn on the other reactor).
    for pair in 0..4u32 {
        let (n1, n2) = (3 + 2 * pair, 4 + 2 * pair);
        let (l1, l2) = (8 + 16 * pair, 16 + 16 * pair);
        b.s.write_all(&write_cmd(n2, n2, l2, &pattern(n2 as u64, 4096)))
            .unwrap();
        a.s.write_all(&write_cmd(n1, n1, l1, &pattern(n1 as u64, 4096)))
            .unwrap();
    }
    // They run at once: answered in any order.
    let all_good = |m: std::collections::BTreeMap<u32, u8>| m.values().all(|s| *s == 0);
    let on_a = responses(&mut a.s, 4);
    assert_eq!(on_a.keys().copied().collect::<Vec<_>>(), [3, 5, 7, 9]);
    let on_b = responses(&mut b.s, 4);
    assert_eq!(on_b.keys().copied().collect::<Vec<_>>(), [4, 6, 8, 10]);
    assert!(all_good(on_a) && all_good(on_b), "a WRITE failed");
    for n in 3..=10u32 {
        let lba = 8 * (n - 2) as u64;
        let got = f.read_bdev("Malloc1", lba * 512, 4096);
        assert!(got == pattern(n as u64, 4096), "WRITE {n} at LBA {lba}");
    }

    // B's WRITE waits for its data; A aborts it (ABORT TASK is
    // immediate: CmdSN 12 is the next one).
    b.s.write_all(&pending_write(30, 11, 512)).unwrap();
    expect(&mut b.s, opcode::R2T, 30);
    let abort = build::tmf(1, [0; 8], 31, 30, 12, 0, 11);
    a.s.write_all(&pdu_bytes(abort, &[])).unwrap();
    let (r, _) = expect(&mut a.s, opcode::TMF_RESP, 31);
    assert_eq!(r.u8_at(2), 0, "task aborted");
    // B's next answer is for its next command: the WRITE never is.
    b.s.write_all(&tur(32, 12)).unwrap();
    assert_eq!(status_of(&mut b.s, 32).0, 0);
    assert_eq!(f.read_bdev("Malloc1", 512 * 512, 4096), vec![0u8; 4096]);

    // A logs the session out: B ends too.
    a.s.write_all(&logout(0, 33, 13, 0)).unwrap();
    let (r, _) = expect(&mut a.s, opcode::LOGOUT_RESP, 33);
    assert_eq!(r.u8_at(2), 0, "session closed");
    b.s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    until_closed(&mut b.s, |_| false);
    testkit::wait_until("the session ended", Duration::from_secs(10), || {
        f.target.get_connections().is_empty()
    });
}

/// Sends a TEST UNIT READY and returns its status and, for a CHECK
/// CONDITION, the sense key and ASC/ASCQ.
fn tur_status(s: &mut TcpStream, itt: u32, cmdsn: u32) -> (u8, Option<(u8, u8, u8)>) {
    s.write_all(&tur(itt, cmdsn)).unwrap();
    let (st, _, d) = status_of(s, itt);
    (st, (st == 2).then(|| sense(&d)))
}

/// Unit attentions are per I_T nexus (SAM-5), whichever reactors a
/// session's connections run on: after a LUN RESET and a TARGET WARM
/// RESET, a session with connections on two reactors reports POWER ON,
/// RESET once (on the connection whose command comes first, the other's
/// next command is GOOD), and so does another session (once, not once from
/// its part and again from the unit's shared state); a CLEAR TASK SET
/// that aborts the session's tasks on both reactors owes it COMMANDS
/// CLEARED BY ANOTHER INITIATOR once.
#[test]
fn unit_attentions_are_reported_once_per_session() {
    const POWER_ON: Option<(u8, u8, u8)> = Some((6, 0x29, 0x00));
    const CLEARED: Option<(u8, u8, u8)> = Some((6, 0x2f, 0x00));
    let f = start(16 << 20, 512);
    let mc = [("MaxConnections", "2")];
    let mut a = login_as(f.port, INITIATOR, ISID, 0, 0, &mc);
    assert_eq!(a.status, (0, 0));
    let mut b = login_as(f.port, INITIATOR, ISID, a.tsih, 1, &mc);
    assert_eq!(b.status, (0, 0));
    let mut y = login(f.port, [0x80, 0, 0, 0, 0, 0x41]);
    testkit::wait_until("three connections listed", Duration::from_secs(5), || {
        f.target.get_connections().len() == 3
    });
    let threads: std::collections::BTreeSet<String> = f
        .target
        .get_connections()
        .into_iter()
        .filter(|c| c.tsih == a.tsih)
        .map(|c| c.thread_name)
        .collect();
    assert_eq!(threads.len(), 2, "both on one reactor: {threads:?}");
    let (mut xsn, mut ysn) = (1u32, 1u32);
    fn next(sn: &mut u32) -> u32 {
        *sn += 1;
        *sn - 1
    }

    // LUN RESET from A (immediate: CmdSN stays).
    a.s.write_all(&tmf(5, 100, xsn)).unwrap();
    let (r, _) = expect(&mut a.s, opcode::TMF_RESP, 100);
    assert_eq!(r.u8_at(2), 0);
    assert_eq!(tur_status(&mut b.s, 101, next(&mut xsn)), (2, POWER_ON));
    assert_eq!(tur_status(&mut a.s, 102, next(&mut xsn)), (0, None));
    assert_eq!(tur_status(&mut b.s, 103, next(&mut xsn)), (0, None));
    assert_eq!(tur_status(&mut y.s, 104, next(&mut ysn)), (2, POWER_ON));
    assert_eq!(tur_status(&mut y.s, 105, next(&mut ysn)), (0, None));

    // TARGET WARM RESET from B.
    b.s.write_all(&tmf(6, 110, xsn)).unwrap();
    let (r, _) = expect(&mut b.s, opcode::TMF_RESP, 110);
    assert_eq!(r.u8_at(2), 0);
    assert_eq!(tur_status(&mut a.s, 111, next(&mut xsn)), (2, POWER_ON));
    assert_eq!(tur_status(&mut b.s, 112, next(&mut xsn)), (0, None));
    assert_eq!(tur_status(&mut a.s, 113, next(&mut xsn)), (0, None));
    assert_eq!(tur_status(&mut y.s, 114, next(&mut ysn)), (2, POWER_ON));
    assert_eq!(tur_status(&mut y.s, 115, next(&mut ysn)), (0, None));

    // CLEAR TASK SET from Y while the session has a WRITE waiting for
    // its data on each connection: both aborted (never answered), one
    // attention for the session, none for Y.
    a.s.write_all(&pending_write(120, next(&mut xsn), 64))
        .unwrap();
    expect(&mut a.s, opcode::R2T, 120);
    b.s.write_all(&pending_write(121, next(&mut xsn), 72))
        .unwrap();
    expect(&mut b.s, opcode::R2T, 121);
    y.s.write_all(&tmf(3, 122, ysn)).unwrap();
    let (r, _) = expect(&mut y.s, opcode::TMF_RESP, 122);
    assert_eq!(r.u8_at(2), 0);
    assert_eq!(tur_status(&mut y.s, 123, next(&mut ysn)), (0, None));
    assert_eq!(tur_status(&mut b.s, 124, next(&mut xsn)), (2, CLEARED));
    assert_eq!(tur_status(&mut a.s, 125, next(&mut xsn)), (0, None));
    assert_eq!(tur_status(&mut b.s, 126, next(&mut xsn)), (0, None));
    assert_eq!(f.read_bdev("Malloc0", 64 * 512, 8192), vec![0u8; 8192]);
}

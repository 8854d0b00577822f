//! Bad input in the full feature phase from a raw client: a PDU the
//! target does not take is rejected, a data segment beyond
//! MaxRecvDataSegmentLength ends the connection; another session on the
//! same target is not disturbed.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use ustor_iscsi::wire::{build, encode_text, opcode, pad4, Bhs, BHS_LEN};
use ustor_iscsi_target::IscsiOptions;

fn recv_pdu(s: &mut TcpStream) -> std::io::Result<(Bhs, Vec<u8>)> {
    let mut h = [0u8; BHS_LEN];
    s.read_exact(&mut h)?;
    let b = Bhs(h);
    let mut d = vec![0u8; pad4(b.data_len())];
    s.read_exact(&mut d)?;
    d.truncate(b.data_len());
    Ok((b, d))
}

fn send_pdu(s: &mut TcpStream, mut b: Bhs, data: &[u8]) {
    b.set_data_len(data.len());
    let mut v = b.0.to_vec();
    v.extend_from_slice(data);
    v.resize(BHS_LEN + pad4(data.len()), 0);
    s.write_all(&v).unwrap();
}

/// A normal session logged in straight from the operational stage, each
/// with an ISID of its own (the same ISID would reinstate the session
/// before it).
fn login(port: u16) -> TcpStream {
    static NEXT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(7);
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let text = encode_text(&[
        ("InitiatorName", "iqn.2026-11.io.ustor:raw"),
        ("TargetName", NODE),
        ("SessionType", "Normal"),
    ]);
    let b = build::login([0x80, 0, 0, 0, 0, id], 0, 1, 0, 0, 1, 3, true);
    send_pdu(&mut s, b, &text);
    let (r, _) = recv_pdu(&mut s).unwrap();
    assert_eq!(r.opcode(), opcode::LOGIN_RESP);
    assert_eq!((r.u8_at(36), r.u8_at(37)), (0, 0), "login failed");
    assert_eq!(r.flags() & 0x83, 0x83, "not in full feature phase");
    s
}

#[test]
fn unknown_pdu_is_rejected_and_oversize_data_closes() {
    let f = start(16 << 20, 512);
    let mut s = login(f.port);
    // SNACK (ERL 0 offers none): a Reject carrying our header.
    let mut snack = Bhs::new(0x10, false, 0x80);
    snack.set_itt(0x55);
    send_pdu(&mut s, snack, &[]);
    let (r, d) = recv_pdu(&mut s).unwrap();
    assert_eq!(r.opcode(), opcode::REJECT);
    assert_eq!(&d[..BHS_LEN], &snack.0[..]);
    // NOP-Out ping still answered on the same connection.
    send_pdu(
        &mut s,
        build::nop_out([0; 8], 9, 0xffff_ffff, 0, 0),
        b"ping",
    );
    let (r, d) = recv_pdu(&mut s).unwrap();
    assert_eq!(
        (r.opcode(), r.itt(), &d[..]),
        (opcode::NOP_IN, 9, &b"ping"[..])
    );

    // Another session, in parallel, stays good through what follows.
    let mut other = login(f.port);
    // A data segment far beyond what we declared: the connection ends.
    let mut big = build::scsi_cmd(
        [0; 8],
        2,
        &[0x2a, 0, 0, 0, 0, 0, 0, 0, 1, 0],
        false,
        true,
        512,
        0,
        0,
    );
    big.set_data_len(8 << 20);
    s.write_all(&big.0).unwrap();
    let mut buf = [0u8; 64];
    let closed = match s.read(&mut buf) {
        Ok(0) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(_) => false,
    };
    assert!(closed, "oversize data segment did not end the connection");
    send_pdu(
        &mut other,
        build::nop_out([0; 8], 11, 0xffff_ffff, 0, 0),
        b"alive",
    );
    let (r, d) = recv_pdu(&mut other).unwrap();
    assert_eq!(
        (r.opcode(), r.itt(), &d[..]),
        (opcode::NOP_IN, 11, &b"alive"[..])
    );
}

#[test]
fn unanswered_nop_in_ping_ends_the_connection() {
    let f = start_full(
        16 << 20,
        512,
        |_| {},
        |t| {
            t.set_options(IscsiOptions {
                nop_in_interval: 1,
                nop_timeout: 1,
                ..t.get_options()
            })
            .unwrap()
        },
    );
    let mut s = login(f.port);
    // An idle session is pinged; an answered ping keeps it, and the next
    // ping comes with another tag.
    let mut ttts = Vec::new();
    for _ in 0..2 {
        let (p, d) = recv_pdu(&mut s).unwrap();
        assert_eq!(p.opcode(), opcode::NOP_IN);
        assert_eq!(p.itt(), 0xffff_ffff, "a ping has no initiator task");
        assert!(d.is_empty());
        let ttt = p.u32_at(20);
        assert_ne!(ttt, 0xffff_ffff, "a ping asks for an answer");
        ttts.push(ttt);
        let mut a = Bhs::new(opcode::NOP_OUT, true, 0x80);
        a.set_itt(0xffff_ffff)
            .set_u32(20, ttt)
            .set_u32(24, p.u32_at(28))
            .set_u32(28, p.u32_at(24));
        send_pdu(&mut s, a, &[]);
    }
    assert_ne!(ttts[0], ttts[1]);
    // Unanswered: the target ends the connection a timeout later.
    let (p, _) = recv_pdu(&mut s).unwrap();
    assert_eq!(p.opcode(), opcode::NOP_IN);
    let t0 = std::time::Instant::now();
    let mut b = [0u8; 48];
    let n = s.read(&mut b);
    assert!(matches!(n, Ok(0)), "connection still open: {n:?}");
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t0.elapsed()
    );
    assert!(f.target.wait_idle(Duration::from_secs(5)));
}

#[test]
fn drain_asks_for_logout_and_cuts_the_silent() {
    let f = start(16 << 20, 512);
    let mut polite = login(f.port);
    let mut silent = login(f.port);
    std::thread::scope(|sc| {
        let drained = sc.spawn(|| f.target.drain(Duration::from_secs(2)));
        // Both are asked to log out (Async Message, AsyncEvent 1, Parameter3
        // the grace time).
        let mut statsn = 0;
        for s in [&mut polite, &mut silent] {
            let (a, _) = recv_pdu(s).unwrap();
            assert_eq!(a.opcode(), opcode::ASYNC);
            assert_eq!(a.itt(), 0xffff_ffff);
            assert_eq!((a.u8_at(36), a.u16_at(42)), (1, 2), "logout request");
            statsn = a.u32_at(24);
        }
        // One logs out and gets its answer.
        let mut l = Bhs::new(opcode::LOGOUT_REQ, true, 0x80);
        l.set_itt(9)
            .set_u32(24, 1)
            .set_u32(28, statsn.wrapping_add(1));
        send_pdu(&mut polite, l, &[]);
        let (r, _) = recv_pdu(&mut polite).unwrap();
        assert_eq!(
            (r.opcode(), r.itt(), r.u8_at(2)),
            (opcode::LOGOUT_RESP, 9, 0)
        );
        // The other is cut when the grace time is over.
        let t0 = std::time::Instant::now();
        let mut b = [0u8; 48];
        assert!(matches!(silent.read(&mut b), Ok(0)), "silent one kept");
        assert!(
            t0.elapsed() >= Duration::from_millis(1500),
            "{:?}",
            t0.elapsed()
        );
        assert!(drained.join().unwrap(), "connections left after the drain");
    });
    // Nobody new gets in.
    assert!(TcpStream::connect(("127.0.0.1", f.port)).is_err());
}

/// A TEST UNIT READY with `cmdsn`.
fn tur(s: &mut TcpStream, itt: u32, cmdsn: u32) {
    let mut c = Bhs::new(opcode::SCSI_CMD, false, 0x80);
    c.set_itt(itt).set_u32(24, cmdsn);
    send_pdu(s, c, &[]);
}

#[test]
fn commands_outside_the_window_and_stray_data_out_are_dropped() {
    let f = start(16 << 20, 512);
    let mut s = login(f.port);
    let mut nop = Bhs::new(opcode::NOP_OUT, true, 0x80);
    nop.set_itt(1).set_u32(20, 0xffff_ffff);
    send_pdu(&mut s, nop, &[]);
    let (r, _) = recv_pdu(&mut s).unwrap();
    assert_eq!((r.opcode(), r.itt()), (opcode::NOP_IN, 1));
    let (exp, max) = (r.u32_at(28), r.u32_at(32));
    assert!(max.wrapping_sub(exp) < 1 << 31, "window {exp}..={max}");
    // Beyond MaxCmdSN, and below ExpCmdSN (RFC 7143 §4.2.2.1): dropped
    // without an answer.
    tur(&mut s, 2, max.wrapping_add(5));
    tur(&mut s, 3, exp.wrapping_sub(1));
    // Data-Out for a task and a Target Transfer Tag nobody gave out.
    let mut d = Bhs::new(opcode::DATA_OUT, false, 0x80);
    d.set_itt(0x77).set_u32(20, 0x1234);
    send_pdu(&mut s, d, &[0xab; 512]);
    // The session goes on: the next command in the window is answered,
    // and it is the first answer.
    tur(&mut s, 4, exp);
    let (r, _) = recv_pdu(&mut s).unwrap();
    assert_eq!((r.opcode(), r.itt()), (opcode::SCSI_RESP, 4));
    assert_eq!((r.u8_at(2), r.u8_at(3)), (0, 0), "response, status");
    assert_eq!(r.u32_at(28), exp.wrapping_add(1), "ExpCmdSN");
    // Nothing of the stray Data-Out was written.
    assert_eq!(f.read_bdev("Malloc0", 0, 512), vec![0u8; 512]);
}

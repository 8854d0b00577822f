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

/// A normal session logged in straight from the operational stage.
fn login(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let text = encode_text(&[
        ("InitiatorName", "iqn.2026-11.io.ustor:raw"),
        ("TargetName", NODE),
        ("SessionType", "Normal"),
    ]);
    let b = build::login([0x80, 0, 0, 0, 0, 7], 0, 1, 0, 0, 1, 3, true);
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

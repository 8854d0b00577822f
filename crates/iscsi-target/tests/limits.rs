//! The connection layer's limits as the iSCSI target sets them: a login
//! that never finishes is cut at the login timeout, a login beyond the
//! connection cap is answered "out of resources" (status 0x0302) and
//! closed, and both leave the target serving others.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use ustor_iscsi::wire::{build, encode_text, opcode, pad4, BHS_LEN};

/// Reads until EOF (the target closed the connection) or the deadline.
fn closed_within(s: &mut TcpStream, max: Duration) -> bool {
    s.set_read_timeout(Some(max)).unwrap();
    let mut b = [0u8; 64];
    matches!(s.read(&mut b), Ok(0))
        || matches!(s.read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset)
}

#[test]
fn silent_login_is_cut_at_the_timeout() {
    let f = start_full(
        16 << 20,
        512,
        |_| {},
        |t| t.set_login_timeout(Duration::from_millis(300)),
    );
    let t0 = Instant::now();
    let mut s = TcpStream::connect(("127.0.0.1", f.port)).unwrap();
    assert!(closed_within(&mut s, Duration::from_secs(5)), "still open");
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t0.elapsed()
    );
    assert!(f.target.wait_idle(Duration::from_secs(5)));
    // A real login works afterwards.
    if have("iscsi-inq") {
        let out = stdout(&run("iscsi-inq", &[&f.url(0)]));
        assert!(out.contains("Vendor:USTOR"), "{out}");
    }
}

#[test]
fn connections_beyond_the_cap_are_closed() {
    let f = start_full(16 << 20, 512, |_| {}, |t| t.set_max_connections(2));
    let a = TcpStream::connect(("127.0.0.1", f.port)).unwrap();
    let b = TcpStream::connect(("127.0.0.1", f.port)).unwrap();
    testkit::wait_until("two connections admitted", Duration::from_secs(5), || {
        f.target.connections() == 2
    });
    // The third one's Login Request gets the protocol's answer, then the
    // close.
    let mut c = TcpStream::connect(("127.0.0.1", f.port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let text = encode_text(&[("InitiatorName", "iqn.2026-11.io.ustor:third")]);
    let mut req = build::login([0x80, 0, 0, 0, 0, 3], 0, 5, 0, 0, 1, 3, true);
    req.set_data_len(text.len());
    let mut pdu = req.0.to_vec();
    pdu.extend_from_slice(&text);
    pdu.resize(BHS_LEN + pad4(text.len()), 0);
    c.write_all(&pdu).unwrap();
    let mut h = [0u8; BHS_LEN];
    c.read_exact(&mut h).expect("login response");
    assert_eq!(h[0] & 0x3f, opcode::LOGIN_RESP);
    assert_eq!((h[36], h[37]), (3, 2), "out of resources");
    assert_eq!(u32::from_be_bytes([h[16], h[17], h[18], h[19]]), 5, "ITT");
    assert!(
        closed_within(&mut c, Duration::from_secs(10)),
        "third connection kept"
    );
    assert_eq!(f.target.listener_stats().rejected, 1);
    drop((a, b));
    assert!(
        f.target.wait_idle(Duration::from_secs(20)),
        "connections linger"
    );
    if have("iscsi-inq") {
        let out = stdout(&run("iscsi-inq", &[&f.url(0)]));
        assert!(out.contains("Vendor:USTOR"), "{out}");
    }
}

//! The connection layer's limits as the iSCSI target sets them: a login
//! that never finishes is cut at the login timeout, connections beyond the
//! cap are closed at once, and both leave the target serving others.

mod common;

use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;

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
    let mut c = TcpStream::connect(("127.0.0.1", f.port)).unwrap();
    assert!(
        closed_within(&mut c, Duration::from_secs(5)),
        "third connection kept"
    );
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

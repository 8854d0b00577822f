//! The connection limits of the NVMe/TCP transport (`max_connections`,
//! `icreq_timeout_ms`), with real sockets: a peer that connects and sends
//! no ICReq is closed after the timeout, and so is one that sends ICReq
//! but never a Fabrics Connect; a connection over the cap is
//! closed as it is accepted, and one is admitted again once another closes.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use testkit::wait_until;
use ustor_nvme::nvmf::TransportOpts;
use ustor_nvme::wire::*;

fn tcp(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// Reads until the target closes the socket; what it sent before.
fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut b = [0u8; 256];
    loop {
        match s.read(&mut b) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return got,
            Err(e) => panic!("socket still open: {e}"),
        }
    }
}

/// Sends an ICReq and reads the ICResp: the connection was admitted.
fn ic_exchange(s: &mut TcpStream) -> std::io::Result<IcResp> {
    let req = IcReq {
        pfv: 0,
        hpda: 0,
        digests: Digests::default(),
        maxr2t: 0,
    };
    s.write_all(&req.encode())?;
    let mut b = [0u8; IC_LEN];
    s.read_exact(&mut b)?;
    IcResp::decode(&b).map_err(|_| std::io::Error::other("bad ICResp"))
}

#[test]
fn a_silent_peer_is_closed_after_the_icreq_timeout() {
    let e = env_opts(
        1024,
        TransportOpts {
            icreq_timeout_ms: 300,
            ..TransportOpts::default()
        },
    );
    let t0 = Instant::now();
    let mut silent = tcp(e.port);
    // Meanwhile a live host connects and works as usual.
    let (mut admin, _) = Client::admin(e.port, Digests::default());
    assert_eq!(admin.prop_get(prop::CSTS, false) & 1, 1, "CSTS.RDY");
    let got = read_to_close(&mut silent);
    let waited = t0.elapsed();
    assert!(got.is_empty(), "nothing is sent to a peer without an ICReq");
    assert!(
        waited >= Duration::from_millis(300),
        "closed after {waited:?}, before the timeout"
    );
    let st = e.target.nvmf_get_stats().unwrap().connections;
    assert_eq!(st.handshake_timeouts, 1);
    assert_eq!(st.accepted, 2);
    // The admin queue is still served.
    assert_eq!(admin.prop_get(prop::CSTS, false) & 1, 1, "CSTS.RDY");
    wait_until(
        "the silent connection uncounted",
        Duration::from_secs(5),
        || e.target.connections() == 1,
    );
}

#[test]
fn a_peer_that_never_connects_is_closed_after_the_icreq_timeout() {
    let e = env_opts(
        1024,
        TransportOpts {
            icreq_timeout_ms: 300,
            ..TransportOpts::default()
        },
    );
    // Before the ICReq: the target's clock starts at its ICResp.
    let t0 = Instant::now();
    let mut mute = tcp(e.port);
    ic_exchange(&mut mute).expect("ICReq answered");
    // A host that connects in time is left alone past the timeout.
    let (mut admin, _) = Client::admin(e.port, Digests::default());
    let got = read_to_close(&mut mute);
    let waited = t0.elapsed();
    assert!(got.is_empty(), "nothing is sent to a queue without Connect");
    assert!(
        waited >= Duration::from_millis(300),
        "closed after {waited:?}, before the timeout"
    );
    assert_eq!(admin.prop_get(prop::CSTS, false) & 1, 1, "CSTS.RDY");
    wait_until(
        "the mute connection uncounted",
        Duration::from_secs(5),
        || e.target.connections() == 1,
    );
    assert_eq!(admin.prop_get(prop::CSTS, false) & 1, 1, "CSTS.RDY");
}

#[test]
fn a_connection_over_the_cap_is_refused() {
    let e = env_opts(
        1024,
        TransportOpts {
            max_connections: 2,
            ..TransportOpts::default()
        },
    );
    let (mut admin, cntlid) = Client::admin(e.port, Digests::default());
    let mut io1 = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    assert_eq!(e.target.connections(), 2);
    // Connection 3: accepted by the kernel, closed by the target at once,
    // before any ICReq is read.
    let mut third = tcp(e.port);
    let got = read_to_close(&mut third);
    assert!(got.is_empty(), "the refused connection gets nothing");
    let st = e.target.nvmf_get_stats().unwrap().connections;
    assert_eq!((st.accepted, st.rejected, st.open), (2, 1, 2));
    // The admitted queues work on: a write and its read back.
    let data = pattern(4096, 7);
    assert!(io1.write_r2t(0, &data).status().is_success());
    let (back, c) = io1.read(0, 8);
    assert!(c.status().is_success());
    assert_eq!(back, data);
    // One closes: a new connection is admitted (ICReq answered).
    drop(io1);
    wait_until("I/O queue closed", Duration::from_secs(5), || {
        e.target.connections() == 1
    });
    let mut again = tcp(e.port);
    let r = ic_exchange(&mut again).expect("admitted after a close");
    assert_eq!(r.maxh2cdata, TransportOpts::default().max_h2c_data);
    assert_eq!(admin.prop_get(prop::CSTS, false) & 1, 1, "CSTS.RDY");
    assert_eq!(e.target.nvmf_get_stats().unwrap().connections.rejected, 1);
}

#[test]
fn limits_are_transport_options() {
    let e = env();
    let t = &e.target.nvmf_get_transports()[0];
    assert_eq!(t.opts.max_connections, 1024);
    assert_eq!(t.opts.icreq_timeout_ms, 10_000);
    let v = serde_json::to_value(t).unwrap();
    assert_eq!(v["max_connections"], 1024);
    assert_eq!(v["icreq_timeout_ms"], 10_000);
    let p: ustor_nvme::nvmf::CreateTransportParams = serde_json::from_value(serde_json::json!({
        "trtype": "TCP", "max_connections": 0
    }))
    .unwrap();
    let t2 = ustor_nvme::nvmf::Target::new(e.rt.handle(), e.registry.clone());
    let err = t2.nvmf_create_transport(&p).unwrap_err();
    assert_eq!(err.code(), -libc::EINVAL);
}

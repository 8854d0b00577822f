//! The connection layer's limits as NBD applies them: a client that stops
//! haggling is closed after the handshake timeout (counted as a failed
//! handshake, its place under `max_connections` freed), while others are
//! served.

mod common;

use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::client::Client;
use ustor_nbd::server::{ListenAddress, ServerStartParams};

#[test]
fn silent_client_is_closed_after_the_handshake_timeout() {
    const TIMEOUT: Duration = Duration::from_millis(200);
    let f = common::start(1 << 20, 1);
    f.server.stop();
    f.server.set_handshake_timeout(TIMEOUT);
    let r = f
        .server
        .start(&ServerStartParams {
            listen_address: ListenAddress {
                traddr: "127.0.0.1".into(),
                trsvcid: "0".into(),
            },
            max_connections: 2,
        })
        .expect("restarts");
    let port: u16 = r.trsvcid.parse().unwrap();
    let t0 = Instant::now();
    let mut silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    // The greeting comes, then nothing more is said: the server gives up.
    let mut greeting = [0u8; 18];
    silent.read_exact(&mut greeting).expect("greeting");
    let mut rest = Vec::new();
    let _ = silent.read_to_end(&mut rest);
    assert!(t0.elapsed() >= TIMEOUT, "closed before the timeout");
    assert!(rest.is_empty());
    let end = Instant::now() + Duration::from_secs(10);
    while f.server.get_stats().unwrap().handshakes_failed < 1 || f.server.connections() > 0 {
        assert!(Instant::now() < end, "{:?}", f.server.get_stats());
        std::thread::yield_now();
    }
    // Both places under the cap are free again.
    let mut a = Client::connect(port, "mem", false);
    let mut b = Client::connect(port, "mem", true);
    assert_eq!(a.read_ok(0, 512, 1), vec![0u8; 512]);
    assert_eq!(b.read_ok(512, 512, 2), vec![0u8; 512]);
    a.disconnect();
    b.disconnect();
}

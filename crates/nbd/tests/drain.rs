//! `NbdServer::drain`: it stops accepting, answers requests that arrive
//! after it began with `ESHUTDOWN` (never executing them), returns once
//! every request received before has been answered (here a read the device
//! holds back), and closes the connections then.

mod common;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::client::Client;
use common::start_slow_reads;
use ustor_nbd::wire::{cmd, NbdErrno};

#[test]
fn drain_waits_for_the_request_in_flight() {
    const DELAY: Duration = Duration::from_millis(300);
    let (f, probe) = start_slow_reads(DELAY);
    let mut c = Client::connect(f.port, "fault", true);
    let data: Vec<u8> = (0..4096).map(|i| (i % 251) as u8).collect();
    assert_eq!(c.write_wait(0, 0, &data, 1), 0);
    // The slow read is in flight when the drain starts.
    c.request(cmd::READ, 0, 0, 4096, 2);
    let t0 = Instant::now();
    while common::fault::Probe::get(&probe.reads) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the read never reached the device"
        );
        std::thread::yield_now();
    }
    let server = f.server.clone();
    let drained = std::thread::spawn(move || {
        let t = Instant::now();
        (server.drain(Duration::from_secs(10)), t.elapsed())
    });
    // Once the listener is gone the drain has begun: a write sent now is
    // refused with ESHUTDOWN and never reaches the device.
    let t0 = Instant::now();
    while f.server.local_addr().is_some() {
        assert!(t0.elapsed() < Duration::from_secs(10), "drain never began");
        std::thread::yield_now();
    }
    let writes = common::fault::Probe::get(&probe.writes);
    let late: Vec<u8> = vec![0xa5; 4096];
    c.write(0, 4096, &late, 4);
    let mut replies = [c.reply(), c.reply()];
    replies.sort_by_key(|r| r.cookie);
    let [r, w] = replies;
    assert_eq!((r.cookie, r.error), (2, 0));
    assert_eq!(r.data, data, "read data");
    assert_eq!((w.cookie, w.error), (4, NbdErrno::Shutdown.code()));
    let (r, took) = drained.join().unwrap();
    assert!(r.expect("drain"), "drained in time");
    // The read was held for DELAY from when it reached the device.
    assert!(
        took >= DELAY / 3,
        "drain did not wait for the read ({took:?})"
    );
    // No longer listening; the open connection still serves.
    assert!(f.server.local_addr().is_none());
    let refused = TcpStream::connect(("127.0.0.1", f.port))
        .map(|s| {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut b = [0u8; 1];
            matches!(std::io::Read::read(&mut &s, &mut b), Ok(0) | Err(_))
        })
        .unwrap_or(true);
    assert!(refused, "a new connection was served after drain");
    // The drained connection was closed by the server.
    assert!(c.closed(), "the connection stayed open after drain");
    assert_eq!(
        common::fault::Probe::get(&probe.writes),
        writes,
        "a write was executed after drain began"
    );
    // Nothing in flight, nothing open: drain returns at once.
    assert!(f.server.drain(Duration::from_millis(1)).unwrap());
}

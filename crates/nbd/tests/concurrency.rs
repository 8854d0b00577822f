//! Concurrency on bdev exports: a pipelined burst on one connection is
//! answered in full and its replies leave in batches; replies overtake each
//! other when the device completes out of order; connections spread over
//! reactors.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::client::Client;
use common::{start_bdev, start_slow_reads};
use ustor_nbd::wire::cmd;

const BURST: u64 = 200;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed as usize * 7 + i / 512) as u8)
        .collect()
}

/// All requests of a burst go out in one `write`; every reply must come
/// back with its own cookie, and far fewer sends than replies are needed.
fn burst(structured: bool) {
    let f = start_bdev(8 << 20, 512, 1);
    let mut c = Client::connect(f.port, "malloc", structured);
    // Writes: one 4 KiB payload per cookie, each at its own offset.
    let mut m = Vec::new();
    for i in 0..BURST {
        m.extend_from_slice(&c.header(cmd::WRITE, 0, i * 4096, 4096, i));
        m.extend_from_slice(&pattern(i, 4096));
    }
    let before = f.server.get_stats().unwrap();
    c.send(&m);
    let mut seen = HashSet::new();
    for _ in 0..BURST {
        let r = c.reply();
        assert_eq!(r.error, 0, "write {} failed", r.cookie);
        assert!(
            r.cookie < BURST && seen.insert(r.cookie),
            "cookie {}",
            r.cookie
        );
    }
    let writes = f.server.get_stats().unwrap();
    // Reads of what each write put there, also one burst, cookies offset.
    let mut m = Vec::new();
    for i in 0..BURST {
        m.extend_from_slice(&c.header(cmd::READ, 0, i * 4096, 4096, 1000 + i));
    }
    c.send(&m);
    let mut seen = HashSet::new();
    for _ in 0..BURST {
        let r = c.reply();
        let i = r.cookie - 1000;
        assert!(i < BURST && seen.insert(i), "cookie {}", r.cookie);
        assert_eq!(r.error, 0);
        assert_eq!(r.data, pattern(i, 4096), "read {i} returned other data");
    }
    let reads = f.server.get_stats().unwrap();
    c.disconnect();
    for (what, a, b) in [("writes", &before, &writes), ("reads", &writes, &reads)] {
        let replies = b.replies_sent - a.replies_sent;
        let sends = b.send_calls - a.send_calls;
        assert_eq!(replies, BURST, "{what}: {b:?}");
        // Replies completed in one loop pass leave with one sendmsg.
        assert!(
            sends < replies,
            "{what}: {sends} sends for {replies} replies"
        );
        eprintln!("{what}: {replies} replies in {sends} sends");
    }
    assert_eq!((reads.writes, reads.reads), (BURST, BURST));
}

#[test]
fn pipelined_burst_simple_replies() {
    burst(false);
}

#[test]
fn pipelined_burst_structured_replies() {
    burst(true);
}

/// A read the device completes late is overtaken by later requests: their
/// replies come first, each with its own cookie.
#[test]
fn replies_overtake_a_slow_read() {
    const DELAY: Duration = Duration::from_millis(300);
    let (f, _probe) = start_slow_reads(DELAY);
    let mut c = Client::connect(f.port, "fault", true);
    let data = pattern(3, 4096);
    assert_eq!(c.write_wait(0, 0, &data, 1), 0);
    let t0 = Instant::now();
    let mut m = c.header(cmd::READ, 0, 0, 4096, 10).to_vec(); // slow
    m.extend_from_slice(&c.header(cmd::READ, 0, 64 << 10, 4096, 11));
    m.extend_from_slice(&c.header(cmd::WRITE, 0, 128 << 10, 512, 12));
    m.extend_from_slice(&[0x5a; 512]);
    c.send(&m);
    let first = c.reply();
    let second = c.reply();
    let fast_done = t0.elapsed();
    let last = c.reply();
    let fast: HashSet<u64> = [first.cookie, second.cookie].into();
    assert_eq!(
        fast,
        [11, 12].into(),
        "the fast requests are answered first"
    );
    assert!(fast_done < DELAY, "fast replies waited {fast_done:?}");
    assert_eq!((last.cookie, last.error), (10, 0));
    assert_eq!(last.data, data);
    assert!(t0.elapsed() >= DELAY);
    c.disconnect();
}

/// Four connections on a two-reactor server: accepted on reactor 0, handed
/// round-robin, two served by each reactor, all doing I/O at once.
#[test]
fn connections_spread_over_reactors() {
    let f = start_bdev(8 << 20, 512, 2);
    let mut clients: Vec<Client> = (0..4)
        .map(|_| Client::connect(f.port, "malloc", true))
        .collect();
    // Pipeline on all four before reading any reply.
    for (k, c) in clients.iter_mut().enumerate() {
        let k = k as u64;
        let mut m = Vec::new();
        for i in 0..8 {
            let off = (k * 8 + i) * 4096;
            m.extend_from_slice(&c.header(cmd::WRITE, 0, off, 4096, i));
            m.extend_from_slice(&pattern(k * 8 + i, 4096));
        }
        c.send(&m);
    }
    for c in &mut clients {
        for _ in 0..8 {
            assert_eq!(c.reply().error, 0);
        }
    }
    for (k, c) in clients.iter_mut().enumerate() {
        let k = k as u64;
        for i in 0..8 {
            let off = (k * 8 + i) * 4096;
            assert_eq!(c.read_ok(off, 4096, 100 + i), pattern(k * 8 + i, 4096));
        }
    }
    let per = f.server.get_stats_per_reactor().unwrap();
    assert_eq!(per.len(), 2);
    for (r, s) in per.iter().enumerate() {
        assert_eq!(s.connections_served, 2, "reactor {r}: {s:?}");
        assert_eq!((s.writes, s.reads), (16, 16), "reactor {r}: {s:?}");
    }
    // Accepting happens on reactor 0 only.
    assert_eq!(
        (per[0].connections_accepted, per[1].connections_accepted),
        (4, 0)
    );
    for c in clients {
        c.disconnect();
    }
}

//! Write payloads of every size class through the receiver's staging
//! buffer, pipelined so that headers, small payloads (copied out of
//! staging) and large ones (received in place, after which headers are read
//! exactly) arrive in every mix: the data read back must be what was
//! written, over simple and structured replies.

mod common;

use common::raw::RawClient;
use ustor_nbd::server::COPY_MAX;

const DEPTH: usize = 4;
const MAX: usize = 1 << 20;

/// Sizes around the copy threshold and the staging buffer (128 KiB).
fn sizes() -> Vec<usize> {
    vec![
        512,
        4096,
        COPY_MAX - 512,
        COPY_MAX,
        COPY_MAX + 512,
        64 << 10,
        (128 << 10) + 512,
        MAX,
    ]
}

fn pattern(seed: usize, i: usize) -> u8 {
    (seed.wrapping_mul(31).wrapping_add(i / 512) % 251) as u8
}

fn run(structured: bool) {
    let f = common::start(64 << 20, 1);
    let mut c = RawClient::connect(f.port, "mem", structured, DEPTH, MAX).expect("connect");
    // Each request writes `size` bytes at its own 1 MiB-aligned offset.
    let plan: Vec<(usize, u64)> = (0..3)
        .flat_map(|round| {
            sizes()
                .into_iter()
                .enumerate()
                .map(move |(i, s)| (s, ((round * 8 + i) as u64) << 20))
        })
        .collect();
    let mut next = 0;
    let mut done = 0;
    let mut free: Vec<usize> = (0..DEPTH).collect();
    while done < plan.len() {
        while next < plan.len() {
            let Some(slot) = free.pop() else { break };
            let (size, offset) = plan[next];
            for (i, b) in c.data(slot)[..size].iter_mut().enumerate() {
                *b = pattern(next, i);
            }
            c.write(slot, offset, size).expect("send write");
            next += 1;
        }
        let (slot, err) = c.complete().expect("reply");
        assert_eq!(err, 0);
        free.push(slot);
        done += 1;
    }
    // Read back, also pipelined (greedy receives of read headers).
    let mut pending = [usize::MAX; DEPTH];
    let mut next = 0;
    let mut done = 0;
    while done < plan.len() {
        while next < plan.len() {
            let Some(slot) = free.pop() else { break };
            let (size, offset) = plan[next];
            c.read(slot, offset, size).expect("send read");
            pending[slot] = next;
            next += 1;
        }
        let (slot, err) = c.complete().expect("reply");
        assert_eq!(err, 0);
        let k = pending[slot];
        let size = plan[k].0;
        let bad = c.data(slot)[..size]
            .iter()
            .enumerate()
            .position(|(i, b)| *b != pattern(k, i));
        assert_eq!(bad, None, "request {k} ({size} bytes) read back wrong");
        free.push(slot);
        done += 1;
    }
    c.disconnect().expect("disconnect");
    let stats = f.server.get_stats().expect("stats");
    assert_eq!(stats.writes, plan.len() as u64, "{stats:?}");
    // Every payload up to COPY_MAX was copied once; larger ones at most
    // for their staged head.
    assert!(stats.payload_copies <= stats.writes, "{stats:?}");
}

#[test]
fn mixed_write_sizes_simple_replies() {
    run(false);
}

#[test]
fn mixed_write_sizes_structured_replies() {
    run(true);
}

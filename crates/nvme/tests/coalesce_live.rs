//! LANoT on a live queue: QD1 never waits for the timer; a burst of
//! pipelined reads leaves in fewer sendmsg calls than responses; each
//! queue's own counters are in `nvmf_get_stats` while it lives and move
//! into the poll group's sum when it closes.

mod common;

use common::*;
use ustor_net::coalesce::{CoalesceConfig, Mode};
use ustor_nvme::nvmf::NvmfStats;
use ustor_nvme::wire::*;

fn totals(s: &NvmfStats) -> (u64, u64, u64, u64) {
    s.poll_groups.iter().fold((0, 0, 0, 0), |a, g| {
        (
            a.0 + g.sendmsg_calls,
            a.1 + g.coalesce.timer_expiries,
            a.2 + g.coalesce.full_groups,
            a.3 + g.coalesce.pdus,
        )
    })
}

#[test]
fn qd1_pays_no_timer_and_bursts_coalesce() {
    let cfg = CoalesceConfig {
        mode: Mode::Fixed,
        degree: 8,
        timer_us: 50,
        ..Default::default()
    };
    let e = env_with(32768, cfg);
    let (_a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    let data = pattern(4096, 5);
    let mut w = Client::rw_sqe(io::WRITE, 0, 8, true);
    assert!(q.cmd(&mut w, &data).1.status().is_success());

    let before = totals(&e.target.nvmf_get_stats().unwrap());
    for _ in 0..50 {
        let (d, c) = q.read(0, 8);
        assert!(c.status().is_success());
        assert_eq!(d, data);
    }
    let after = totals(&e.target.nvmf_get_stats().unwrap());
    assert_eq!(after.1, before.1, "QD1 must never wait for the timer");
    // One sendmsg per response (give or take the flush still being counted at either snapshot).
    assert!(
        (49..=50).contains(&(after.0 - before.0)),
        "{}",
        after.0 - before.0
    );

    // Bursts of 32 pipelined reads.
    let rounds = 20u64;
    for _ in 0..rounds {
        let mut cids = Vec::new();
        let mut burst = Vec::new();
        for _ in 0..32 {
            let mut r = Client::rw_sqe(io::READ, 0, 8, false);
            let cid = q.next_cid();
            r.set_cid(cid).set_sgl_psdt();
            let mut h = [0u8; 80];
            let n = encode_capsule_cmd(&mut h, &r, Digests::default(), 0);
            burst.extend_from_slice(&h[..n]);
            cids.push(cid);
        }
        use std::io::Write;
        q.s.write_all(&burst).unwrap();
        let mut done = 0;
        while done < 32 {
            let p = q.recv().unwrap();
            if p.ty == PduType::C2HData as u8 {
                assert_eq!(p.data, data);
            } else {
                assert!(p.cqe().status().is_success());
                done += 1;
            }
        }
    }
    let end = totals(&e.target.nvmf_get_stats().unwrap());
    let sends = end.0 - after.0;
    eprintln!(
        "bursts: {} responses in {sends} sendmsg, full groups {}",
        rounds * 32,
        end.2 - after.2
    );
    assert!(
        sends < rounds * 32,
        "no coalescing: {sends} sendmsg for {} responses",
        rounds * 32
    );
    assert!(end.2 > after.2, "no full groups");

    // Per queue: the I/O queue is listed with its owner and carries this
    // test's PDUs (the write's response, and at least one PDU per read: a
    // C2HData with SUCCESS set, or C2HData + CapsuleResp).
    let st = e.target.nvmf_get_stats().unwrap();
    let qps: Vec<_> = st
        .poll_groups
        .iter()
        .flat_map(|g| g.qpairs.iter())
        .collect();
    let io = qps
        .iter()
        .find(|q| q.qid == 1)
        .expect("I/O queue listed in nvmf_get_stats");
    assert_eq!(io.cntlid, cntlid);
    assert_eq!(io.subnqn, NQN);
    assert_eq!(io.hostnqn, HOSTNQN);
    assert_eq!(io.outstanding, 0);
    assert!(io.coalesce.pdus > 1 + 50 + rounds * 32, "{:?}", io.coalesce);
    assert_eq!(io.coalesce.degree, 8);
    assert_eq!(io.coalesce.timer_us, 50);
    assert!(io.coalesce.groups < io.coalesce.pdus);
    assert_eq!(
        io.coalesce.groups,
        io.coalesce.full_groups + io.coalesce.small_groups + io.coalesce.timer_expiries
    );
    assert!(qps.iter().any(|q| q.qid == 0 && q.cntlid == cntlid));
    let sum = |s: &NvmfStats| s.poll_groups.iter().map(|g| g.coalesce.pdus).sum::<u64>();
    let total = sum(&st);
    let io_pdus = io.coalesce.pdus;

    // Closing the I/O queue takes it off the list; its PDUs stay counted.
    drop(q);
    let st = testkit::wait_for(
        "the closed queue to leave the stats",
        std::time::Duration::from_secs(5),
        || {
            let st = e.target.nvmf_get_stats().unwrap();
            let listed = st
                .poll_groups
                .iter()
                .flat_map(|g| g.qpairs.iter())
                .any(|q| q.qid == 1);
            (!listed).then_some(st)
        },
    );
    assert!(sum(&st) >= total, "{} < {total}", sum(&st));
    assert!(sum(&st) >= io_pdus);
}

/// Adaptive mode on a live queue: bursts that fill groups raise the degree
/// and the timer window by window up to the configured bounds, and the
/// queue's current setting is what `nvmf_get_stats` shows for it.
#[test]
fn adaptive_raises_degree_to_its_bound_under_bursts() {
    let cfg = CoalesceConfig {
        mode: Mode::Adaptive,
        degree: 2,
        timer_us: 100,
        min_degree: 1,
        max_degree: 8,
        min_timer_us: 50,
        max_timer_us: 400,
        window: 4,
        ..Default::default()
    };
    let e = env_with(32768, cfg);
    let (_a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    let data = pattern(4096, 9);
    let mut w = Client::rw_sqe(io::WRITE, 0, 8, true);
    assert!(q.cmd(&mut w, &data).1.status().is_success());
    for _ in 0..30 {
        let mut burst = Vec::new();
        for _ in 0..32 {
            let mut r = Client::rw_sqe(io::READ, 0, 8, false);
            let cid = q.next_cid();
            r.set_cid(cid).set_sgl_psdt();
            let mut h = [0u8; 80];
            let n = encode_capsule_cmd(&mut h, &r, Digests::default(), 0);
            burst.extend_from_slice(&h[..n]);
        }
        use std::io::Write;
        q.s.write_all(&burst).unwrap();
        let mut done = 0;
        while done < 32 {
            let p = q.recv().unwrap();
            if p.ty == PduType::C2HData as u8 {
                assert_eq!(p.data, data);
                if p.flags & 0x08 != 0 {
                    done += 1; // SUCCESS: no CapsuleResp follows.
                }
            } else {
                assert!(p.cqe().status().is_success());
                done += 1;
            }
        }
    }
    let st = e.target.nvmf_get_stats().unwrap();
    let io = st
        .poll_groups
        .iter()
        .flat_map(|g| g.qpairs.iter())
        .find(|x| x.qid == 1)
        .expect("I/O queue listed")
        .coalesce;
    eprintln!("adaptive queue: {io:?}");
    assert!(io.full_groups > io.timer_expiries, "{io:?}");
    assert!(io.raises >= 2, "degree never raised: {io:?}");
    assert_eq!(io.degree, 8, "degree must stop at max_degree: {io:?}");
    assert_eq!(io.timer_us, 400, "timer must stop at max_timer_us: {io:?}");
    assert_eq!(io.lowers, 0, "{io:?}");
}

/// R2Ts coalesce like responses. A write whose data is not in its capsule
/// waits for an R2T; while other writes of the queue still await their
/// data, a new R2T is held for the group (degree or timer) instead of
/// leaving in a `sendmsg` of its own, so a busy queue's R2Ts (and then the
/// host's H2CData) travel together. A lone R2T write (QD1) never waits for
/// the timer. Every write's data reads back.
#[test]
fn r2ts_coalesce_while_writes_await_data() {
    const N: usize = 8;
    let cfg = CoalesceConfig {
        mode: Mode::Fixed,
        degree: N as u32,
        // Long enough that any wait for it shows in the elapsed time.
        timer_us: 300_000,
        ..Default::default()
    };
    let e = env_with(32768, cfg);
    let (_a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);

    // QD1: each R2T leaves at once.
    let before = totals(&e.target.nvmf_get_stats().unwrap());
    let t0 = std::time::Instant::now();
    for i in 0..10u64 {
        let c = q.write_r2t(i * 8, &pattern(4096, 100 + i));
        assert!(c.status().is_success(), "{}", c.status());
    }
    let after = totals(&e.target.nvmf_get_stats().unwrap());
    assert_eq!(after.1, before.1, "a lone R2T waited for the timer");
    assert!(t0.elapsed() < std::time::Duration::from_millis(1500));

    // (cid, ttag, slba) of every write still awaiting its data.
    let mut writes: Vec<(u16, u16, u64)> = Vec::new();
    let send_capsule = |q: &mut Client, slba: u64| {
        let mut w = Client::rw_sqe(io::WRITE, slba, 8, false);
        let cid = q.next_cid();
        w.set_cid(cid).set_sgl_psdt();
        q.send_cmd(&w, &[]);
        cid
    };
    let recv_r2t = |q: &mut Client| {
        let p = q.recv().unwrap();
        assert_eq!(p.ty, PduType::R2T as u8, "{p:?}");
        let r = DataHdr::decode(&p.hdr).unwrap();
        assert_eq!((r.offset, r.length), (0, 4096));
        (r.cccid, r.ttag)
    };
    // N writes get their R2Ts; their data is held back, so they stay in
    // flight.
    for i in 0..N as u64 {
        let slba = 1000 + 8 * i;
        let cid = send_capsule(&mut q, slba);
        let (c, ttag) = recv_r2t(&mut q);
        assert_eq!(c, cid);
        writes.push((cid, ttag, slba));
    }
    // N more, one at a time: each finds the first N awaiting data, so the
    // target holds their R2Ts until the group has N of them.
    let mid = totals(&e.target.nvmf_get_stats().unwrap());
    let commands = || -> u64 {
        let st = e.target.nvmf_get_stats().unwrap();
        st.poll_groups.iter().map(|g| g.commands).sum()
    };
    let mut second = Vec::new();
    for i in 0..N as u64 {
        let slba = 2000 + 8 * i;
        let before = commands();
        second.push((send_capsule(&mut q, slba), slba));
        // One at a time: the target has taken this capsule before the next.
        testkit::wait_until(
            "the target to take the capsule",
            std::time::Duration::from_secs(5),
            || commands() > before,
        );
    }
    for (cid, slba) in second {
        let (c, ttag) = recv_r2t(&mut q);
        assert_eq!(c, cid, "R2Ts in command order");
        writes.push((cid, ttag, slba));
    }
    let end = totals(&e.target.nvmf_get_stats().unwrap());
    assert_eq!(end.0 - mid.0, 1, "{N} R2Ts in {} sendmsg", end.0 - mid.0);
    assert_eq!(end.2 - mid.2, 1, "one full group");
    assert_eq!(end.1, mid.1, "the degree, not the timer, sent them");

    // The data of all 2N writes, then every one completes and reads back.
    for &(cid, ttag, slba) in &writes {
        q.send_h2c(cid, ttag, 0, &pattern(4096, slba), true);
    }
    let mut done: Vec<u16> = (0..2 * N)
        .map(|_| {
            let c = q.recv().unwrap().cqe();
            assert!(c.status().is_success(), "{}", c.status());
            c.cid
        })
        .collect();
    done.sort_unstable();
    let mut want: Vec<u16> = writes.iter().map(|w| w.0).collect();
    want.sort_unstable();
    assert_eq!(done, want);
    for &(_, _, slba) in &writes {
        assert_eq!(q.read(slba, 8).0, pattern(4096, slba));
    }
}

//! The initiator bdev's promises, checked against the ustor target in one
//! process (two reactors, malloc namespace, data verified): digests really
//! negotiated, keep-alive holding an idle controller past the target's
//! KATO, one I/O queue per reactor that uses the bdev, and its own LANoT
//! coalescer batching pipelined commands.

mod common;

use std::time::Duration;

use common::*;
use ustor_bdev::BdevError;
use ustor_net::coalesce::{CoalesceConfig, Mode};
use ustor_nvme::initiator::{
    attach_controller, detach_controller, get_controllers, io_queue_stats, AttachParams,
    DetachParams, GetControllersParams,
};
use ustor_nvme::nvmf::NvmfStats;
use ustor_runtime::IoBuf;

fn params(e: &Env, name: &str) -> AttachParams {
    let mut p = AttachParams::tcp(name, "127.0.0.1", &e.port.to_string(), NQN);
    p.hostnqn = Some(HOSTNQN.into());
    p
}

fn seeded(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// On `reactor`: `qd` concurrent 4 KiB writes to blocks `base..`, then `qd`
/// concurrent reads of them, compared.
fn round_on(
    e: &Env,
    reactor: usize,
    bdev: &str,
    base: u64,
    qd: usize,
    seed: u64,
) -> Result<(), BdevError> {
    let reg = e.registry.clone();
    let name = bdev.to_string();
    e.rt.handle()
        .block_on(reactor, move || async move {
            let d = reg.open(&name, true, |_| {}).expect("open");
            let ch = d.channel()?;
            let nb = 4096 / u64::from(ch.block_size());
            let mut hs = Vec::new();
            for i in 0..qd {
                let ch = ch.clone();
                hs.push(ustor_runtime::spawn(async move {
                    let mut b = IoBuf::alloc(4096).await;
                    b.copy_from_slice(&seeded(seed + i as u64, 4096));
                    ch.write(base + i as u64 * nb, nb, b).await.0
                }));
            }
            for h in hs {
                h.await?;
            }
            let mut hs = Vec::new();
            for i in 0..qd {
                let ch = ch.clone();
                hs.push(ustor_runtime::spawn(async move {
                    let mut b = IoBuf::alloc(4096).await;
                    b.fill(0xee);
                    let (r, b) = ch.read(base + i as u64 * nb, nb, b).await;
                    r?;
                    assert!(
                        b[..] == seeded(seed + i as u64, 4096)[..],
                        "data mismatch at {i}"
                    );
                    Ok::<(), BdevError>(())
                }));
            }
            for h in hs {
                h.await?;
            }
            Ok(())
        })
        .expect("reactor")
}

fn sum(s: &NvmfStats, f: impl Fn(&ustor_nvme::nvmf::stats::PollGroupStats) -> u64) -> u64 {
    s.poll_groups.iter().map(f).sum()
}

fn resets(name: &str) -> u64 {
    get_controllers(&GetControllersParams {
        name: Some(name.into()),
    })
    .unwrap()[0]
        .ctrlrs[0]
        .resets
}

#[test]
fn digests_requested_are_digests_negotiated() {
    for (hdgst, ddgst) in [(false, false), (true, true)] {
        let e = env();
        let name = format!("Dg{}", u8::from(hdgst));
        let mut p = params(&e, &name);
        p.hdgst = hdgst;
        p.ddgst = ddgst;
        let bdev = attach_controller(&e.rt.handle(), &e.registry, &p).unwrap()[0].clone();
        round_on(&e, 1, &bdev, 0, 8, 3).unwrap();
        let st = e.target.nvmf_get_stats().unwrap();
        // The target counts queue pairs that run with both digests on: the
        // admin queue and the I/O queue, or none.
        let want = if hdgst { 2 } else { 0 };
        assert_eq!(sum(&st, |g| g.digest_qpairs), want, "{st:?}");
        assert_eq!(sum(&st, |g| g.digest_errors), 0);
        detach_controller(&DetachParams { name }).unwrap();
    }
}

#[test]
fn keep_alive_holds_an_idle_controller_past_kato() {
    let e = env();
    let mut p = params(&e, "Ka");
    // The target drops a controller that sends nothing for KATO; the
    // initiator must keep it alive through an idle stretch of 3x KATO.
    p.keep_alive_timeout_ms = 1000;
    p.ctrlr_loss_timeout_sec = 10;
    p.reconnect_delay_sec = 1;
    let bdev = attach_controller(&e.rt.handle(), &e.registry, &p).unwrap()[0].clone();
    round_on(&e, 1, &bdev, 0, 4, 11).unwrap();
    // The workload: an idle stretch of more than 3x KATO.
    std::thread::sleep(Duration::from_millis(3200));
    let st = e.target.nvmf_get_stats().unwrap();
    assert_eq!(
        sum(&st, |g| g.current_admin_qpairs),
        1,
        "the target dropped the idle controller: {st:?}"
    );
    round_on(&e, 1, &bdev, 64, 4, 12).unwrap();
    assert_eq!(resets("Ka"), 0, "the controller had to be reconnected");
    detach_controller(&DetachParams { name: "Ka".into() }).unwrap();
}

#[test]
fn one_io_queue_per_reactor_that_uses_the_bdev() {
    let e = env();
    let p = params(&e, "Pq");
    let bdev = attach_controller(&e.rt.handle(), &e.registry, &p).unwrap()[0].clone();
    round_on(&e, 1, &bdev, 0, 8, 21).unwrap();
    assert_eq!(
        io_queue_stats("Pq").unwrap().len(),
        1,
        "only reactor 1 used it so far"
    );
    round_on(&e, 0, &bdev, 256, 8, 22).unwrap();
    round_on(&e, 1, &bdev, 512, 8, 23).unwrap();
    let qs = io_queue_stats("Pq").unwrap();
    assert_eq!(qs.len(), 2, "{qs:?}");
    assert!(qs.iter().all(|q| q.ios >= 16), "{qs:?}");
    let st = e.target.nvmf_get_stats().unwrap();
    assert_eq!(sum(&st, |g| g.current_io_qpairs), 2, "{st:?}");
    detach_controller(&DetachParams { name: "Pq".into() }).unwrap();
}

#[test]
fn initiator_coalescer_batches_pipelined_commands() {
    let e = env();
    let mut p = params(&e, "Co");
    p.coalesce = CoalesceConfig {
        mode: Mode::Fixed,
        degree: 8,
        timer_us: 200,
        ..Default::default()
    };
    let bdev = attach_controller(&e.rt.handle(), &e.registry, &p).unwrap()[0].clone();
    for r in 0..8 {
        round_on(&e, 1, &bdev, r * 512, 32, 100 + r).unwrap();
    }
    let qs = io_queue_stats("Co").unwrap();
    let c = qs[0].coalesce;
    assert_eq!((c.degree, c.timer_us), (8, 200), "{c:?}");
    // 8 rounds x 64 commands (plus the connect): fewer sends than PDUs, and
    // groups that filled to the degree.
    assert!(c.pdus >= 8 * 64, "{c:?}");
    assert!(c.groups * 2 < c.pdus, "no batching: {c:?}");
    assert!(c.full_groups > 0, "{c:?}");
    assert_eq!(c.groups, c.full_groups + c.small_groups + c.timer_expiries);
    assert!(qs[0].sendmsg_calls <= c.groups, "{:?}", qs[0]);
    detach_controller(&DetachParams { name: "Co".into() }).unwrap();
}

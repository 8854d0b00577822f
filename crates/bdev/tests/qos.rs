//! QoS limits (SPDK's `bdev_set_qos_limit`, `Registry::set_qos_limits`)
//! measured: I/O per second and MB/s over two reactors sharing one limit
//! land within ±10% of it; removing the limit releases every queued I/O
//! at once; deleting the bdev completes its queued I/O (failed, never
//! lost); written data read back intact.
//!
//! The windows are short (1.5 s) to keep the suite fast; the limits are
//! far below what a null or malloc bdev does here, so a busy machine does
//! not drag the rate under the limit.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use testkit::wait_until;
use ustor_bdev::modules::{malloc, null, RamOpts};
use ustor_bdev::{BdevError, Desc, QosLimits, QosUpdate, Registry};
use ustor_runtime::{IoBuf, RuntimeHandle};

const WINDOW: Duration = Duration::from_millis(1500);

fn ram(name: &str, blocks: u64) -> RamOpts {
    RamOpts {
        name: name.into(),
        num_blocks: blocks,
        block_size: 512,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    }
}

fn ios(v: u64) -> QosUpdate {
    QosUpdate {
        rw_ios_per_sec: Some(v),
        ..Default::default()
    }
}

/// `qd` I/Os at a time of `blocks` blocks each on reactor `r` until
/// `until`; returns how many completed (successfully) by then. Each task
/// keeps to its own LBAs.
fn load(
    h: &RuntimeHandle,
    desc: Desc,
    r: usize,
    qd: u64,
    blocks: u64,
    write: bool,
    until: Instant,
) -> u64 {
    h.block_on(r, move || async move {
        let desc = Arc::new(desc);
        let mut tasks = Vec::new();
        for t in 0..qd {
            let desc = desc.clone();
            tasks.push(ustor_runtime::spawn(async move {
                let ch = desc.channel().unwrap();
                let bs = ch.block_size() as u64;
                let slots = ch.num_blocks() / blocks / (2 * qd);
                let mut buf = IoBuf::alloc((blocks * bs) as usize).await;
                let mut n = 0u64;
                let mut i = 0;
                while Instant::now() < until {
                    let lba = ((r as u64 * qd + t) * slots + i % slots) * blocks;
                    i += 1;
                    let (res, b) = ch.rw_stamped(write, 0, lba, blocks, buf).await;
                    buf = b;
                    res.unwrap();
                    if Instant::now() <= until {
                        n += 1;
                    }
                }
                n
            }));
        }
        let mut n = 0;
        for t in tasks {
            n += t.await;
        }
        n
    })
    .unwrap()
}

/// Runs [`load`] on reactors 0 and 1 at once for [`WINDOW`]; returns each
/// reactor's count.
fn load_both(h: &RuntimeHandle, reg: &Registry, name: &str, blocks: u64, write: bool) -> [u64; 2] {
    let until = Instant::now() + WINDOW;
    std::thread::scope(|s| {
        let j: Vec<_> = (0..2)
            .map(|r| {
                let desc = reg.open(name, true, |_| {}).unwrap();
                let h = h.clone();
                s.spawn(move || load(&h, desc, r, 16, blocks, write, until))
            })
            .collect();
        let v: Vec<u64> = j.into_iter().map(|j| j.join().unwrap()).collect();
        [v[0], v[1]]
    })
}

fn within_10pct(what: &str, got: f64, limit: f64) {
    eprintln!("{what}: {got:.1}/s, limit {limit:.0}/s");
    assert!(
        (got - limit).abs() <= limit * 0.10,
        "{what}: measured {got:.0}/s against a limit of {limit:.0}/s"
    );
}

#[test]
fn iops_limit_shared_by_two_reactors() {
    let rt = runtime(2);
    let reg = registry(&rt);
    null::create(&reg, ram("n0", 1 << 21)).unwrap();
    let l = reg.set_qos_limits("n0", &ios(4000)).unwrap();
    assert_eq!(l.rw_ios_per_sec, 4000);
    assert_eq!(reg.get("n0").unwrap().qos_limits(), l);
    let n = load_both(&rt.handle(), &reg, "n0", 8, false);
    let total = (n[0] + n[1]) as f64 / WINDOW.as_secs_f64();
    within_10pct("read IOPS", total, 4000.0);
    // One limit, shared: each reactor got a fair part of it.
    for (r, &c) in n.iter().enumerate() {
        assert!(
            c * 10 >= (n[0] + n[1]) * 3,
            "reactor {r} got {c} of {n:?} I/Os"
        );
    }
}

#[test]
fn mbytes_limits_read_write_and_both() {
    let rt = runtime(2);
    let reg = registry(&rt);
    let h = rt.handle();
    null::create(&reg, ram("n1", 1 << 21)).unwrap();
    // rw: 32 MiB/s of 64 KiB writes over both reactors.
    let u = QosUpdate {
        rw_mbytes_per_sec: Some(32),
        ..Default::default()
    };
    reg.set_qos_limits("n1", &u).unwrap();
    let n = load_both(&h, &reg, "n1", 128, true);
    let mib = (n[0] + n[1]) as f64 * 65536.0 / (1 << 20) as f64 / WINDOW.as_secs_f64();
    within_10pct("write MiB", mib, 32.0);
    // r only: reads held to 16 MiB/s; the rw limit removed, others kept
    // as they were (absent = unchanged).
    let u = QosUpdate {
        rw_mbytes_per_sec: Some(0),
        r_mbytes_per_sec: Some(16),
        ..Default::default()
    };
    let l = reg.set_qos_limits("n1", &u).unwrap();
    assert_eq!(
        l,
        QosLimits {
            r_mbytes_per_sec: 16,
            ..Default::default()
        }
    );
    let n = load_both(&h, &reg, "n1", 128, false);
    let mib = (n[0] + n[1]) as f64 * 65536.0 / (1 << 20) as f64 / WINDOW.as_secs_f64();
    within_10pct("read MiB", mib, 16.0);
    // ... and writes not limited by it: far above 16 MiB/s in a short run.
    let until = Instant::now() + Duration::from_millis(300);
    let desc = reg.open("n1", true, |_| {}).unwrap();
    let w = load(&h, desc, 0, 16, 128, true, until);
    let wmib = w as f64 * 65536.0 / (1 << 20) as f64 / 0.3;
    assert!(
        wmib > 64.0,
        "writes held to {wmib:.0} MiB/s by a read limit"
    );
}

#[test]
fn bad_limits_refused() {
    let rt = runtime(1);
    let reg = registry(&rt);
    null::create(&reg, ram("n2", 1024)).unwrap();
    assert!(reg.set_qos_limits("n2", &ios(1500)).is_err());
    assert!(reg.set_qos_limits("n2", &QosUpdate::default()).is_err());
    assert!(reg.set_qos_limits("nope", &ios(1000)).is_err());
    assert!(reg.get("n2").unwrap().qos_limits().is_unlimited());
}

/// Starts `n` writes of 4 KiB on reactor 0 (LBA `8 * i`, pattern seed 5)
/// as separate tasks; `done` counts those that succeeded, `failed` those
/// that failed with `Removed`.
fn start_writes(
    h: &RuntimeHandle,
    desc: Arc<Desc>,
    n: u64,
    done: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
) {
    h.send(0, move || {
        for i in 0..n {
            let (desc, done, failed) = (desc.clone(), done.clone(), failed.clone());
            ustor_runtime::spawn(async move {
                let ch = desc.channel().unwrap();
                let mut b = IoBuf::alloc(4096).await;
                pattern(&mut b, i * 8, 5);
                match ch.write(i * 8, 8, b).await.0 {
                    Ok(()) => done.fetch_add(1, Ordering::Relaxed),
                    Err(BdevError::Removed) => failed.fetch_add(1, Ordering::Relaxed),
                    Err(e) => panic!("write {i}: {e}"),
                };
            });
        }
    })
    .unwrap();
}

fn queued(h: &RuntimeHandle, reg: &Registry, name: &str) -> usize {
    let desc = reg.open(name, false, |_| {}).unwrap();
    h.call(0, move || desc.channel().map_or(0, |c| c.qos_queued()))
        .unwrap()
}

#[test]
fn removing_the_limit_releases_queued_io_with_data_intact() {
    let rt = runtime(1);
    let reg = registry(&rt);
    let h = rt.handle();
    malloc::create(&reg, ram("m0", 8192)).unwrap();
    reg.set_qos_limits("m0", &ios(1000)).unwrap();
    let desc = Arc::new(reg.open("m0", true, |_| {}).unwrap());
    let (done, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    start_writes(&h, desc, 256, done.clone(), failed.clone());
    wait_until("writes queued by QoS", Duration::from_secs(10), || {
        queued(&h, &reg, "m0") > 100
    });
    let before = done.load(Ordering::Relaxed);
    assert!(
        before < 200,
        "{before} writes passed a 1000/s limit at once"
    );
    let t = Instant::now();
    reg.set_qos_limits("m0", &ios(0)).unwrap();
    assert!(reg.get("m0").unwrap().qos_limits().is_unlimited());
    wait_until("every write done", Duration::from_secs(10), || {
        done.load(Ordering::Relaxed) == 256
    });
    // Released at once, not at 1000/s (that would take 0.1 s and more).
    assert!(
        t.elapsed() < Duration::from_millis(100),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(failed.load(Ordering::Relaxed), 0);
    assert_eq!(queued(&h, &reg, "m0"), 0);
    let desc = reg.open("m0", false, |_| {}).unwrap();
    let bad = h
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            let mut bad = 0;
            for i in 0..256u64 {
                let (r, b) = ch.read(i * 8, 8, IoBuf::alloc(4096).await).await;
                r.unwrap();
                let mut want = vec![0u8; 4096];
                pattern(&mut want, i * 8, 5);
                bad += (b[..] != want[..]) as u32;
            }
            bad
        })
        .unwrap();
    assert_eq!(bad, 0, "blocks differ after the queue drained");
}

#[test]
fn deleting_a_limited_bdev_completes_its_queued_io() {
    let rt = runtime(1);
    let reg = registry(&rt);
    let h = rt.handle();
    malloc::create(&reg, ram("m1", 8192)).unwrap();
    reg.set_qos_limits("m1", &ios(1000)).unwrap();
    let desc = Arc::new(reg.open("m1", true, |_| {}).unwrap());
    let (done, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    start_writes(&h, desc, 128, done.clone(), failed.clone());
    wait_until("writes queued by QoS", Duration::from_secs(10), || {
        queued(&h, &reg, "m1") > 64
    });
    reg.delete("m1").unwrap();
    wait_until("every write completed", Duration::from_secs(10), || {
        done.load(Ordering::Relaxed) + failed.load(Ordering::Relaxed) == 128
    });
    assert!(failed.load(Ordering::Relaxed) >= 64);
}

//! LANoT through the initiator bdev: the target runs in a runtime on core 0,
//! the initiator bdev and an in-reactor load generator in a second runtime
//! on core 1, both in this process, over 127.0.0.1. The same coalescing mode is set
//! on both sides. Prints IOPS, mean/p99 latency, sendmsg calls per I/O and
//! CPU time per I/O on each side.
//!
//! `nvmf_initiator_load MODE RW BS QD SECS [RATE]`
//! MODE = off | fixed | adaptive (fixed = degree 16, timer 50 µs);
//! RW = randread | randwrite; RATE (IOPS, QD 1) paces the load for the
//! low-load latency test.
//! Env: `POLL` = adaptive (default) | poll | interrupt, the reactors' poll
//! mode on both sides, `IDLE_US` their adaptive idle period (1000), and
//! `QUEUES` (1) the number of I/O queues: that many controllers attached to
//! the one subsystem, each with its own connection and one I/O queue, all
//! driven from the initiator's reactor and all served by the target's one
//! reactor; QD is per queue. Several queues per target reactor is where
//! per-pass groups get small (the PDUs of a pass are spread over sockets)
//! and waiting for a fuller group has the most to win.
//!
//! Latencies are kept as raw samples (10 ns units) in a vector reserved up
//! front, so percentiles are exact and nothing caps them (the first version
//! binned 0.1 µs steps into 65536 bins: every sample above 6553.5 µs landed
//! in the last bin, which is why p99 read "6553.5" whenever more than 1% of
//! the samples were slower). Paced runs also report how late the pacer's
//! timer fired (`pace_late_*`), and every run the reactors' sleeps per I/O:
//! the two things a low-rate latency depends on besides the I/O itself.
//! Every run also prints the target reactor's busy time, task polls, loop
//! passes and ring submits per I/O (`tgt_busy_ns_per_io`, ...): with
//! sendmsg and recv per I/O, the structure of the target's cost, which a
//! loaded machine changes less than it changes IOPS.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use ustor_bdev::{modules, Registry};
use ustor_net::coalesce::{CoalesceConfig, Mode};
use ustor_nvme::initiator::{attach_controller, io_queue_stats, AttachParams};
use ustor_nvme::nvmf::{CreateTransportParams, Target, TransportOpts};
use ustor_runtime::{ticks, IoBuf, PollMode, Runtime, RuntimeConfig};

const NQN: &str = "nqn.2024-01.io.ustor:bench";

fn cpu_ns(tid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap_or_default();
    let rest = s.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let t = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // utime, stime (fields 14, 15; index 11, 12 after the comm).
    let hz = 100u64;
    (t(11) + t(12)) * 1_000_000_000 / hz
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let mode = match a.get(1).map(String::as_str) {
        Some("off") => Mode::Off,
        Some("fixed") => Mode::Fixed,
        _ => Mode::Adaptive,
    };
    let write = a.get(2).map(String::as_str) == Some("randwrite");
    let bs: usize = a.get(3).and_then(|v| v.parse().ok()).unwrap_or(4096);
    let qd: usize = a.get(4).and_then(|v| v.parse().ok()).unwrap_or(1);
    let secs: u64 = a.get(5).and_then(|v| v.parse().ok()).unwrap_or(2);
    let rate: u64 = a.get(6).and_then(|v| v.parse().ok()).unwrap_or(0);
    let poll_mode: PollMode = std::env::var("POLL")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(PollMode::Adaptive);
    let idle_us: u64 = std::env::var("IDLE_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let queues: usize = std::env::var("QUEUES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        .max(1);
    let base = CoalesceConfig {
        mode,
        degree: 16,
        timer_us: 50,
        ..Default::default()
    };
    // COALESCE='{"degree": 8, "max_timer_us": 400}': fields merged over the
    // bench's settings (the same names as nvmf_create_transport's
    // `coalesce`), to compare fixed settings or adaptive bounds in one run.
    let coal = match std::env::var("COALESCE") {
        Ok(j) => {
            let mut v = serde_json::to_value(base).expect("config");
            let o: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(&j).expect("COALESCE: a JSON object");
            v.as_object_mut().expect("object").extend(o);
            serde_json::from_value(v).expect("COALESCE: coalesce fields")
        }
        Err(_) => base,
    };
    // Two runtimes: the target's on core 0, the initiator's on core 1.
    let start = |core: usize| {
        Runtime::start(RuntimeConfig {
            cores: vec![core],
            pin: true,
            poll_mode,
            idle_period: Duration::from_micros(idle_us),
            ..RuntimeConfig::default()
        })
        .expect("runtime")
    };
    let trt = start(0);
    let irt = start(1);
    let reg = Registry::new(Some(trt.handle()));
    let ireg = Registry::new(Some(irt.handle()));
    // Faulted in at creation with huge pages (`prefault`), as nvmf_tgt's
    // disk is: the run times the target, not first-touch page faults.
    use ustor_bdev::BdevModule;
    modules::malloc::module()
        .create(
            &reg,
            serde_json::json!({"name": "Malloc0", "num_blocks": 262144,
                "block_size": 512, "prefault": true}),
        )
        .expect("malloc");
    let t = Target::new(trt.handle(), reg.clone());
    t.nvmf_create_transport(&CreateTransportParams {
        trtype: "TCP".into(),
        opts: TransportOpts {
            coalesce: coal,
            ..TransportOpts::default()
        },
    })
    .unwrap();
    let port = t
        .export_local(NQN, "BENCH", "ustor bench", "Malloc0", "0")
        .unwrap();
    let ctrls: Vec<String> = (0..queues).map(|i| format!("Bench{i}")).collect();
    let bdevs: Vec<String> = ctrls
        .iter()
        .map(|c| {
            let mut p = AttachParams::tcp(c, "127.0.0.1", &port, NQN);
            p.coalesce = coal;
            p.io_queue_size = 128;
            attach_controller(&irt.handle(), &ireg, &p).expect("attach")[0].clone()
        })
        .collect();
    let qstats = |name: &str| io_queue_stats(name).unwrap_or_default();
    let tids = [trt.thread_ids()[0], irt.thread_ids()[0]];
    // Target (sendmsg calls, recv calls, payload copies).
    let tstats = |t: &Target| {
        t.nvmf_get_stats()
            .map(|s| {
                s.poll_groups.iter().fold((0, 0, 0), |a, g| {
                    (
                        a.0 + g.sendmsg_calls,
                        a.1 + g.recv_calls,
                        a.2 + g.payload_copies,
                    )
                })
            })
            .unwrap_or((0, 0, 0))
    };
    let reg2 = ireg.clone();
    // Warm-up + measurement on reactor 1.
    let run = move |secs: u64| {
        let reg = reg2.clone();
        let bdevs = bdevs.clone();
        move || async move {
            let descs: Vec<_> = bdevs
                .iter()
                .map(|b| reg.open(b, true, |_| {}).unwrap())
                .collect();
            let chans: Vec<_> = descs.iter().map(|d| d.channel().unwrap()).collect();
            let nb = (bs / 512) as u64;
            let slots = chans[0].num_blocks() / nb;
            let end = ticks::now() + ticks::from_duration(Duration::from_secs(secs));
            // Raw samples in 10 ns units; the capacity covers ~5 M IOPS for
            // `secs`, so a push never reallocates inside the timed loop.
            let cap = (secs as usize * 5_000_000).min(1 << 26);
            let lat: Rc<RefCell<Vec<u32>>> = Rc::new(RefCell::new(Vec::with_capacity(cap)));
            let late: Rc<RefCell<Vec<u32>>> = Rc::new(RefCell::new(Vec::with_capacity(
                (rate as usize * secs as usize + 16).min(1 << 20),
            )));
            let mut hs = Vec::new();
            for w in 0..qd * chans.len() {
                let ch = chans[w % chans.len()].clone();
                let (lat, late) = (lat.clone(), late.clone());
                hs.push(ustor_runtime::spawn(async move {
                    let mut b = IoBuf::alloc(bs).await;
                    b.fill(w as u8);
                    let mut x = (w as u64 + 1) * 0x9e37_79b9_7f4a_7c15;
                    let gap = 1_000_000_000u64
                        .checked_div(rate)
                        .map(|ns| ticks::from_duration(Duration::from_nanos(ns)))
                        .unwrap_or(0);
                    let mut next = ticks::now();
                    while ticks::now() < end {
                        if gap > 0 {
                            next += gap;
                            ustor_runtime::sleep_until(next).await;
                            let l = ticks::to_ns(ticks::now().saturating_sub(next)) / 10;
                            let mut v = late.borrow_mut();
                            if v.len() < v.capacity() {
                                v.push(l.min(u64::from(u32::MAX)) as u32);
                            }
                        }
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let off = (x % slots) * nb;
                        let t0 = ticks::now();
                        let (r, bb) = if write {
                            ch.write(off, nb, b).await
                        } else {
                            ch.read(off, nb, b).await
                        };
                        b = bb;
                        r.expect("I/O");
                        let t = ticks::to_ns(ticks::now() - t0) / 10;
                        let mut l = lat.borrow_mut();
                        if l.len() < l.capacity() {
                            l.push(t.min(u64::from(u32::MAX)) as u32);
                        }
                    }
                }));
            }
            for h in hs {
                h.await;
            }
            let summary = |v: &mut Vec<u32>| {
                v.sort_unstable();
                let n = v.len();
                if n == 0 {
                    return (0.0, 0.0, 0.0);
                }
                let mean = v.iter().map(|&x| u64::from(x)).sum::<u64>() as f64 / n as f64;
                let pct = |p: usize| f64::from(v[((n * p).div_ceil(100)).clamp(1, n) - 1]);
                (mean / 100.0, pct(50) / 100.0, pct(99) / 100.0)
            };
            let n = lat.borrow().len() as u64;
            let l = summary(&mut lat.borrow_mut());
            let p = summary(&mut late.borrow_mut());
            (n, l, p)
        }
    };
    let h = irt.handle();
    h.block_on(0, run(1)).unwrap();
    let isends = || -> u64 {
        ctrls
            .iter()
            .flat_map(|c| qstats(c))
            .map(|s| s.sendmsg_calls)
            .sum()
    };
    let s0 = isends();
    let t0s = tstats(&t);
    let c0: Vec<u64> = tids.iter().map(|t| cpu_ns(*t)).collect();
    let sleeps = || -> Vec<u64> {
        [&trt, &irt]
            .iter()
            .map(|r| r.handle().stats().map(|s| s[0].sleeps).unwrap_or(0))
            .collect()
    };
    // What each reactor did (busy time, task polls, passes), for the
    // per-I/O cost of the target's task structure.
    let rstats = || -> Vec<ustor_runtime::ReactorStats> {
        [&trt, &irt]
            .iter()
            .map(|r| {
                r.handle()
                    .stats()
                    .map(|mut s| s.swap_remove(0))
                    .unwrap_or_default()
            })
            .collect()
    };
    let r0 = rstats();
    let z0 = sleeps();
    let (n, (avg, p50, p99), (late_avg, _, late_p99)) = h.block_on(0, run(secs)).unwrap();
    let z1 = sleeps();
    let r1 = rstats();
    let c1: Vec<u64> = tids.iter().map(|t| cpu_ns(*t)).collect();
    let isend = isends() - s0;
    let t1s = tstats(&t);
    let n1 = n.max(1) as f64;
    let cpu = |i: usize| {
        c1.get(i)
            .unwrap_or(&0)
            .saturating_sub(*c0.get(i).unwrap_or(&0)) as f64
            / n1
    };
    let cs = qstats(&ctrls[0])
        .first()
        .map(|s| s.coalesce)
        .unwrap_or_default();
    // The target's setting on its first I/O queue (adaptive moves it).
    let ts = t
        .nvmf_get_stats()
        .ok()
        .and_then(|s| {
            s.poll_groups
                .iter()
                .flat_map(|g| g.qpairs.iter())
                .find(|q| q.qid > 0)
                .map(|q| q.coalesce)
        })
        .unwrap_or_default();
    println!(
        "mode={mode:?} poll={poll_mode} rw={} bs={bs} queues={queues} qd={qd} rate={rate} iops={:.0} avg_lat_us={avg:.1} p50_lat_us={p50:.1} p99_lat_us={p99:.1} \
         pace_late_avg_us={late_avg:.1} pace_late_p99_us={late_p99:.1} tgt_sleeps_per_io={:.2} ini_sleeps_per_io={:.2} ini_sendmsg_per_io={:.3} tgt_sendmsg_per_io={:.3} tgt_recv_per_io={:.3} tgt_copies_per_io={:.3} tgt_cpu_ns_per_io={:.0} ini_cpu_ns_per_io={:.0} ini_degree={} ini_timer_us={} tgt_degree={} tgt_timer_us={} \
         tgt_busy_ns_per_io={:.0} ini_busy_ns_per_io={:.0} tgt_polls_per_io={:.2} tgt_loops_per_io={:.3} tgt_submits_per_io={:.3}",
        if write { "randwrite" } else { "randread" },
        n as f64 / secs as f64,
        (z1[0] - z0[0]) as f64 / n1,
        (z1[1] - z0[1]) as f64 / n1,
        isend as f64 / n1,
        (t1s.0 - t0s.0) as f64 / n1,
        (t1s.1 - t0s.1) as f64 / n1,
        (t1s.2 - t0s.2) as f64 / n1,
        cpu(0),
        cpu(1),
        cs.degree,
        cs.timer_us,
        ts.degree,
        ts.timer_us,
        (r1[0].busy_ns - r0[0].busy_ns) as f64 / n1,
        (r1[1].busy_ns - r0[1].busy_ns) as f64 / n1,
        (r1[0].tasks_polled - r0[0].tasks_polled) as f64 / n1,
        (r1[0].loops - r0[0].loops) as f64 / n1,
        (r1[0].submits - r0[0].submits) as f64 / n1,
    );
    std::process::exit(0);
}

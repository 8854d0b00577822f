//! The delay bdev: reads and writes take their set latency (measured at
//! QD1, within tolerance: never less, not much more), an update applies to
//! the next I/O, data passes through intact, other kinds are not held.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use ustor_runtime::IoBuf;

/// The latencies of `n` QD1 reads and writes of 4 KiB, sorted (after
/// checking the data of each write reads back).
fn measure(
    rt: &ustor_runtime::Runtime,
    reg: &ustor_bdev::Registry,
    n: u64,
) -> (Vec<Duration>, Vec<Duration>) {
    let d = reg.open("d", true, |_| {}).unwrap();
    rt.handle()
        .block_on(0, move || async move {
            let ch = d.channel().unwrap();
            let (mut r, mut w) = (Vec::new(), Vec::new());
            for i in 0..n {
                let mut b = IoBuf::alloc(4096).await;
                pattern(&mut b, i, 7);
                let want = b[..].to_vec();
                let t = Instant::now();
                ch.write(i * 8, 8, b).await.0.unwrap();
                w.push(t.elapsed());
                let t = Instant::now();
                let (res, got) = ch.read(i * 8, 8, IoBuf::alloc(4096).await).await;
                r.push(t.elapsed());
                res.unwrap();
                assert!(got[..] == want[..], "block {i} read back wrong");
            }
            // Not delayed: flush and unmap complete at once. The fastest
            // of several, so a preempted reactor does not fail the check.
            let mut fastest = Duration::MAX;
            for _ in 0..8 {
                let t = Instant::now();
                ch.flush(0, 8).await.unwrap();
                ch.unmap(0, 8).await.unwrap();
                fastest = fastest.min(t.elapsed());
            }
            assert!(fastest < Duration::from_millis(1), "{fastest:?}");
            r.sort();
            w.sort();
            (r, w)
        })
        .unwrap()
}

/// Every sample took at least the set latency (asserted on every run),
/// and in some run of 20 samples the fastest was not much more. On a loaded
/// machine a whole run can wait for the CPU (a fastest read of 3.6 ms for a
/// set 0.5 ms was seen beside busy loops), which says nothing about the
/// delay the bdev adds, so up to 10 runs are measured before failing. The
/// slack (half the latency and 0.5 ms) stays under the first latencies set
/// here, so the second check still shows that the update applied.
fn takes_latency(
    rt: &ustor_runtime::Runtime,
    reg: &ustor_bdev::Registry,
    read_us: u64,
    write_us: u64,
) {
    let bound = |us: u64| {
        let want = Duration::from_micros(us);
        (want, want + want / 2 + Duration::from_micros(500))
    };
    let ((rmin, rmax), (wmin, wmax)) = (bound(read_us), bound(write_us));
    let mut last = (Duration::ZERO, Duration::ZERO);
    for _ in 0..10 {
        let (r, w) = measure(rt, reg, 20);
        assert!(
            r[0] >= rmin,
            "read {:?} is less than the set {rmin:?}",
            r[0]
        );
        assert!(
            w[0] >= wmin,
            "write {:?} is less than the set {wmin:?}",
            w[0]
        );
        if r[0] <= rmax && w[0] <= wmax {
            return;
        }
        last = (r[0], w[0]);
    }
    panic!("the fastest read/write {last:?} stayed well over the set {rmin:?}/{wmin:?}");
}

#[test]
fn reads_and_writes_take_their_latency_and_updates_apply() {
    let rt = runtime(1);
    let reg = registry(&rt);
    ram(&reg, "m", 1 << 20);
    create(
        &reg,
        "delay",
        json!({"base_bdev_name": "m", "name": "d", "avg_read_latency": 2000, "p99_read_latency": 2000,
            "avg_write_latency": 1000, "p99_write_latency": 1000}),
    )
    .unwrap();
    takes_latency(&rt, &reg, 2000, 1000);
    for (t, us) in [
        ("avg_read", 500),
        ("p99_read", 500),
        ("avg_write", 300),
        ("p99_write", 300),
    ] {
        ustor_vbdev::delay::update_latency(
            &reg,
            serde_json::from_value(
                json!({"delay_bdev_name": "d", "latency_type": t, "latency_us": us}),
            )
            .unwrap(),
        )
        .unwrap();
    }
    takes_latency(&rt, &reg, 500, 300);
    let cfg = reg.get("d").unwrap().bdev().config_json();
    assert_eq!(cfg["params"]["avg_read_latency"], 500, "{cfg}");
    let e = create(
        &reg,
        "delay",
        json!({"base_bdev_name": "m", "name": "d2", "avg_read_latency": 20, "p99_read_latency": 10,
            "avg_write_latency": 1, "p99_write_latency": 1}),
    )
    .unwrap_err();
    assert!(e.to_string().contains("p99"), "{e}");
    assert!(reg.get("m").unwrap().claimed_by().is_some());
    reg.delete("d").unwrap();
    assert!(reg.get("m").unwrap().claimed_by().is_none());
}

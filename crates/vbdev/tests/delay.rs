//! The delay bdev: reads and writes take their set latency (measured at
//! QD1, within tolerance: never less, not much more), an update applies to
//! the next I/O, data passes through intact, other kinds are not held.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use ustor_runtime::IoBuf;

/// Mean latency of `n` QD1 reads and writes of 4 KiB (after checking the
/// data of each write reads back).
fn measure(
    rt: &ustor_runtime::Runtime,
    reg: &ustor_bdev::Registry,
    n: u64,
) -> (Duration, Duration) {
    let d = reg.open("d", true, |_| {}).unwrap();
    rt.handle()
        .block_on(0, move || async move {
            let ch = d.channel().unwrap();
            let (mut r, mut w) = (Duration::ZERO, Duration::ZERO);
            for i in 0..n {
                let mut b = IoBuf::alloc(4096).await;
                pattern(&mut b, i, 7);
                let want = b[..].to_vec();
                let t = Instant::now();
                ch.write(i * 8, 8, b).await.0.unwrap();
                w += t.elapsed();
                let t = Instant::now();
                let (res, got) = ch.read(i * 8, 8, IoBuf::alloc(4096).await).await;
                r += t.elapsed();
                res.unwrap();
                assert!(got[..] == want[..], "block {i} read back wrong");
            }
            // Not delayed: flush and unmap complete at once.
            let t = Instant::now();
            ch.flush(0, 8).await.unwrap();
            ch.unmap(0, 8).await.unwrap();
            assert!(t.elapsed() < Duration::from_millis(1), "{:?}", t.elapsed());
            (r / n as u32, w / n as u32)
        })
        .unwrap()
}

fn within(got: Duration, us: u64) {
    let want = Duration::from_micros(us);
    assert!(got >= want, "{got:?} is less than the set {want:?}");
    assert!(
        got <= want + want / 4 + Duration::from_micros(300),
        "{got:?} is well over the set {want:?}"
    );
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
    let (r, w) = measure(&rt, &reg, 20);
    within(r, 2000);
    within(w, 1000);
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
    let (r, w) = measure(&rt, &reg, 20);
    within(r, 500);
    within(w, 300);
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

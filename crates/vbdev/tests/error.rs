//! The error bdev: injected failures hit exactly `num` I/Os of their kind,
//! pending I/Os wait until a reset aborts them, corrupt_data changes the
//! written bytes on the base, clear disarms; untouched I/O passes through.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use ustor_bdev::BdevError;
use ustor_runtime::IoBuf;
use ustor_vbdev::error::{inject, InjectParams};

fn arm(reg: &ustor_bdev::Registry, p: serde_json::Value) {
    inject(reg, serde_json::from_value::<InjectParams>(p).unwrap()).unwrap();
}

#[test]
fn failures_pending_and_corruption_hit_exactly_what_was_injected() {
    let rt = runtime(1);
    let reg = registry(&rt);
    ram(&reg, "m", 1 << 20);
    assert_eq!(
        create(&reg, "error", json!({"base_name": "m"})).unwrap(),
        "EE_m"
    );
    arm(
        &reg,
        json!({"name": "EE_m", "io_type": "write", "error_type": "failure", "num": 2}),
    );
    let d = reg.open("EE_m", true, |_| {}).unwrap();
    let results = rt
        .handle()
        .block_on(0, move || async move {
            let ch = d.channel().unwrap();
            let mut r = Vec::new();
            for i in 0..3u64 {
                let mut b = IoBuf::alloc(4096).await;
                pattern(&mut b, i, 1);
                r.push(ch.write(i * 8, 8, b).await.0);
            }
            r.push(ch.read(0, 8, IoBuf::alloc(4096).await).await.0);
            r
        })
        .unwrap();
    assert_eq!(
        results,
        [
            Err(BdevError::Io(libc::EIO)),
            Err(BdevError::Io(libc::EIO)),
            Ok(()),
            Ok(())
        ]
    );
    // Only the third write reached the base.
    let raw = read_all(&rt, &reg, "m");
    let mut want = vec![0u8; 4096];
    pattern(&mut want, 2, 1);
    assert!(raw[..16 * 512].iter().all(|b| *b == 0));
    assert_eq!(&raw[16 * 512..24 * 512], &want[..]);

    // corrupt_data: the write lands with byte 100 changed.
    arm(
        &reg,
        json!({"name": "EE_m", "io_type": "write", "error_type": "corrupt_data",
        "num": 1, "corrupt_offset": 100, "corrupt_value": 0x5a}),
    );
    let mut model = vec![0u8; 1 << 20];
    write_ranges(&rt, &reg, "EE_m", &[(40, 8)], 2, &mut model);
    let raw = read_all(&rt, &reg, "m");
    assert_eq!(raw[40 * 512 + 100], model[40 * 512 + 100] ^ 0x5a);
    model[40 * 512 + 100] ^= 0x5a;
    assert_eq!(&raw[40 * 512..48 * 512], &model[40 * 512..48 * 512]);

    // pending: the read waits until a reset aborts it.
    arm(
        &reg,
        json!({"name": "EE_m", "io_type": "read", "error_type": "pending", "num": 1}),
    );
    let d = reg.open("EE_m", true, |_| {}).unwrap();
    let r =
        rt.handle()
            .block_on(0, move || async move {
                let ch = d.channel().unwrap();
                let ch2 = ch.clone();
                let held = ustor_runtime::spawn(async move {
                    ch2.read(0, 8, IoBuf::alloc(4096).await).await.0
                });
                let t0 = Instant::now();
                while ch.outstanding() == 0 {
                    assert!(t0.elapsed() < Duration::from_secs(5));
                    ustor_runtime::yield_now().await;
                }
                let after = ch.read(8, 8, IoBuf::alloc(4096).await).await.0;
                ch.reset().await.unwrap();
                (held.await, after)
            })
            .unwrap();
    assert_eq!(r, (Err(BdevError::Aborted), Ok(())));
    // clear disarms everything.
    arm(
        &reg,
        json!({"name": "EE_m", "io_type": "all", "error_type": "failure", "num": 5}),
    );
    arm(
        &reg,
        json!({"name": "EE_m", "io_type": "clear", "error_type": "failure"}),
    );
    let mut model = vec![0u8; 1 << 20];
    write_ranges(&rt, &reg, "EE_m", &[(0, 8)], 3, &mut model);
    let bad = inject(
        &reg,
        serde_json::from_value(json!({"name": "m", "io_type": "read", "error_type": "failure"}))
            .unwrap(),
    );
    assert!(
        bad.is_err(),
        "injected into a bdev that is not an error bdev"
    );
}

//! FUA as a bdev I/O flag: the generic layer follows a FUA write, unmap or
//! write-zeroes with a flush of its range on a write-cached device whose
//! driver has no native FUA (once, after every split child); drivers with
//! native FUA (uring's RWF_DSYNC) or no volatile cache get no flush; a
//! write without FUA or a failed one is never flushed.

mod common;

use common::*;
use ustor_bdev::modules::{malloc, uring, RamOpts};
use ustor_bdev::{BdevError, IoFlags, IoType};
use ustor_runtime::IoBuf;

fn take(ops: &Ops) -> Vec<(IoType, u64, u64, bool)> {
    std::mem::take(&mut *ops.lock().unwrap())
}

#[test]
fn fua_is_a_flush_after_the_io_on_a_write_cached_bdev() {
    let rt = runtime(1);
    let reg = registry(&rt);
    let ops = TraceBdev::create(&reg, "t0", 1024, true, 0);
    let desc = reg.open("t0", true, |_| {}).unwrap();
    let (data_ok, seen) = rt
        .handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            let mut seen = Vec::new();
            let mut b = IoBuf::alloc(1024).await;
            pattern(&mut b, 16, 1);
            let (r, _) = ch.write(16, 2, b).await;
            r.unwrap();
            seen.push(take(&ops));

            let mut b = IoBuf::alloc(1024).await;
            pattern(&mut b, 32, 2);
            let (r, _) = ch.write_flagged(32, 2, b, IoFlags::FUA).await;
            r.unwrap();
            seen.push(take(&ops));

            let mut v = vec![IoBuf::alloc(512).await, IoBuf::alloc(1024).await];
            pattern(&mut v[0], 64, 3);
            pattern(&mut v[1], 65, 3);
            let (r, _) = ch.writev_flagged(64, 3, v, IoFlags::FUA).await;
            r.unwrap();
            seen.push(take(&ops));

            // Out of range: fails before the driver, and is not flushed.
            let (r, _) = ch
                .write_flagged(1023, 2, IoBuf::alloc(1024).await, IoFlags::FUA)
                .await;
            assert!(matches!(r, Err(BdevError::OutOfRange { .. })), "{r:?}");
            seen.push(take(&ops));

            ch.write_zeroes_flagged(100, 4, IoFlags::FUA).await.unwrap();
            seen.push(take(&ops));
            ch.unmap_flagged(200, 8, IoFlags::FUA).await.unwrap();
            seen.push(take(&ops));
            ch.unmap_flagged(200, 8, IoFlags::NONE).await.unwrap();
            seen.push(take(&ops));

            // The data written with FUA reads back.
            let (r, got) = ch.read(32, 2, IoBuf::alloc(1024).await).await;
            r.unwrap();
            let mut want = vec![0u8; 1024];
            pattern(&mut want, 32, 2);
            let mut ok = got[..] == want[..];
            let (r, got) = ch.read(64, 3, IoBuf::alloc(1536).await).await;
            r.unwrap();
            pattern(&mut want[..512], 64, 3);
            ok &= got[..512] == want[..512];
            pattern(&mut want, 65, 3);
            ok &= got[512..] == want[..];
            (ok, seen)
        })
        .unwrap();
    assert!(data_ok, "FUA-written data reads back");
    use IoType::*;
    assert_eq!(seen[0], vec![(Write, 16, 2, false)], "no FUA: no flush");
    assert_eq!(seen[1], vec![(Write, 32, 2, true), (Flush, 32, 2, false)]);
    assert_eq!(seen[2], vec![(Write, 64, 3, true), (Flush, 64, 3, false)]);
    assert_eq!(seen[3], vec![], "a failed write is not flushed");
    assert_eq!(
        seen[4],
        vec![(WriteZeroes, 100, 4, true), (Flush, 100, 4, false)]
    );
    assert_eq!(seen[5], vec![(Unmap, 200, 8, true), (Flush, 200, 8, false)]);
    assert_eq!(seen[6], vec![(Unmap, 200, 8, false)]);
}

#[test]
fn a_split_fua_write_is_flushed_once_after_every_child() {
    let rt = runtime(1);
    let reg = registry(&rt);
    let ops = TraceBdev::create(&reg, "t1", 1024, true, 4);
    let desc = reg.open("t1", true, |_| {}).unwrap();
    let seen = rt
        .handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            let mut b = IoBuf::alloc(10 * 512).await;
            pattern(&mut b, 0, 9);
            let (r, _) = ch.write_flagged(0, 10, b, IoFlags::FUA).await;
            r.unwrap();
            take(&ops)
        })
        .unwrap();
    use IoType::*;
    assert_eq!(
        seen,
        vec![
            (Write, 0, 4, true),
            (Write, 4, 4, true),
            (Write, 8, 2, true),
            (Flush, 0, 10, false)
        ]
    );
}

#[test]
fn no_volatile_cache_or_native_fua_means_no_flush() {
    let path = temp_file("fua", 1 << 20);
    let rt = runtime(1);
    let reg = registry(&rt);
    let ops = TraceBdev::create(&reg, "t2", 1024, false, 0);
    malloc::create(
        &reg,
        RamOpts {
            name: "m".into(),
            num_blocks: 1024,
            block_size: 512,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .unwrap();
    uring::create(
        &reg,
        uring::UringOpts {
            name: "u".into(),
            filename: path.to_string_lossy().into(),
            block_size: 0,
            uuid: None,
            direct: true,
            sqpoll: false,
            iopoll: false,
        },
    )
    .unwrap();
    for name in ["t2", "m", "u"] {
        let desc = reg.open(name, true, |_| {}).unwrap();
        let ok = rt
            .handle()
            .block_on(0, move || async move {
                let ch = desc.channel().unwrap();
                let bs = ch.block_size() as usize;
                let mut b = IoBuf::alloc(8 * bs).await;
                pattern(&mut b, 8, 4);
                let (r, _) = ch.write_flagged(8, 8, b, IoFlags::FUA).await;
                r.unwrap();
                let (r, got) = ch.read(8, 8, IoBuf::alloc(8 * bs).await).await;
                r.unwrap();
                let mut want = vec![0u8; 8 * bs];
                pattern(&mut want, 8, 4);
                got[..] == want[..]
            })
            .unwrap();
        assert!(ok, "{name}: FUA-written data reads back");
        let flushes = reg.iostat(name).unwrap().get(IoType::Flush).ops;
        assert_eq!(flushes, 0, "{name}: FUA write needs no flush");
    }
    assert_eq!(
        take(&ops),
        vec![(IoType::Write, 8, 8, true), (IoType::Read, 8, 8, false)]
    );
    // uring: RWF_DSYNC covers writes; fallocate has no FUA, so a FUA
    // write-zeroes is followed by one flush of its range.
    let desc = reg.open("u", true, |_| {}).unwrap();
    rt.handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            ch.write_zeroes_flagged(0, 8, IoFlags::FUA).await.unwrap();
        })
        .unwrap();
    assert_eq!(reg.iostat("u").unwrap().get(IoType::Flush).ops, 1);
    let _ = std::fs::remove_file(&path);
}

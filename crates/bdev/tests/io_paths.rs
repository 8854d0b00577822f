//! The generic I/O path on real drivers: data verified for read/write,
//! vectored I/O, splits, bounce, write-zeroes (native and emulated), unmap,
//! flush, reset, range checks, claims, hot-remove and iostat.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use ustor_bdev::modules::{malloc, null, uring, RamOpts};
use ustor_bdev::{BdevError, BdevEvent, ControlError, IoType};
use ustor_runtime::IoBuf;

fn ram(name: &str, blocks: u64, bs: u32) -> RamOpts {
    RamOpts {
        name: name.into(),
        num_blocks: blocks,
        block_size: bs,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    }
}

#[test]
fn malloc_data_round_trips_on_two_reactors() {
    let rt = runtime(2);
    let reg = registry(&rt);
    malloc::create(&reg, ram("m0", 2048, 512)).unwrap();
    let h = rt.handle();
    // Reactor 0 writes the first half, reactor 1 the second; each reads the
    // other's half back.
    for r in 0..2u64 {
        let desc = reg.open("m0", true, |_| {}).unwrap();
        h.block_on(r as usize, move || async move {
            let ch = desc.channel().unwrap();
            for lba in (r * 1024..(r + 1) * 1024).step_by(8) {
                let mut b = IoBuf::alloc(4096).await;
                pattern(&mut b, lba, 7);
                let (res, _) = ch.write(lba, 8, b).await;
                res.unwrap();
            }
        })
        .unwrap();
    }
    for r in 0..2u64 {
        let desc = reg.open("m0", false, |_| {}).unwrap();
        let bad = h
            .block_on(r as usize, move || async move {
                let ch = desc.channel().unwrap();
                let mut bad = 0;
                for lba in ((1 - r) * 1024..(2 - r) * 1024).step_by(8) {
                    let b = IoBuf::alloc(4096).await;
                    let (res, b) = ch.read(lba, 8, b).await;
                    res.unwrap();
                    let mut want = vec![0u8; 4096];
                    pattern(&mut want, lba, 7);
                    if b[..] != want[..] {
                        bad += 1;
                    }
                }
                bad
            })
            .unwrap();
        assert_eq!(bad, 0, "reactor {r} read back corrupted blocks");
    }
}

#[test]
fn range_permission_and_length_errors() {
    let rt = runtime(1);
    let reg = registry(&rt);
    malloc::create(&reg, ram("m1", 64, 512)).unwrap();
    let ro = reg.open("m1", false, |_| {}).unwrap();
    let errs = rt
        .handle()
        .block_on(0, move || async move {
            let ch = ro.channel().unwrap();
            let (e1, _) = ch.read(60, 8, IoBuf::alloc(4096).await).await;
            let (e2, _) = ch.write(0, 8, IoBuf::alloc(4096).await).await;
            let (e3, _) = ch.read(0, 8, IoBuf::alloc(512).await).await;
            let (e4, _) = ch.read(u64::MAX, 2, IoBuf::alloc(1024).await).await;
            (e1, e2, e3, e4)
        })
        .unwrap();
    assert!(
        matches!(errs.0, Err(BdevError::OutOfRange { .. })),
        "{errs:?}"
    );
    assert_eq!(errs.1, Err(BdevError::ReadOnly));
    assert!(matches!(errs.2, Err(BdevError::BadLength { .. })));
    assert!(matches!(errs.3, Err(BdevError::OutOfRange { .. })));
}

#[test]
fn uring_file_direct_io_verified_with_bounce_and_vectored() {
    let path = temp_file("uring", 8 << 20);
    let rt = runtime(1);
    let reg = registry(&rt);
    let e = uring::create(
        &reg,
        uring::UringOpts {
            name: "u0".into(),
            filename: path.to_string_lossy().into(),
            block_size: 0,
            uuid: None,
            direct: true,
            sqpoll: false,
            iopoll: false,
        },
    )
    .unwrap();
    let bs = e.info().block_size as usize;
    assert!(bs >= 512);
    let desc = reg.open("u0", true, |_| {}).unwrap();
    let ok = rt
        .handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            // Aligned fixed-buffer write + read.
            let mut w = IoBuf::alloc(65536).await;
            pattern(&mut w, 16, 1);
            let blocks = (65536 / bs) as u64;
            let (r, w) = ch.write(16, blocks, w).await;
            r.unwrap();
            let (r, rb) = ch.read(16, blocks, IoBuf::alloc(65536).await).await;
            r.unwrap();
            assert!(rb[..] == w[..], "fixed-buffer read back differs");
            // Vectored with segment lengths that break O_DIRECT alignment: the
            // layer must bounce (and count the copy).
            let mut a = IoBuf::heap(100);
            let mut b = IoBuf::heap(bs - 100);
            a.fill(0xA5);
            b.fill(0x5A);
            let (r, _) = ch.writev(0, 1, vec![a, b]).await;
            r.unwrap();
            let (r, back) = ch.read(0, 1, IoBuf::alloc(bs).await).await;
            r.unwrap();
            assert!(
                back[..100].iter().all(|x| *x == 0xA5) && back[100..].iter().all(|x| *x == 0x5A)
            );
            let (r, segs) = ch
                .readv(0, 1, vec![IoBuf::heap(100), IoBuf::heap(bs - 100)])
                .await;
            r.unwrap();
            assert!(segs[0].iter().all(|x| *x == 0xA5) && segs[1].iter().all(|x| *x == 0x5A));
            ch.flush(0, ch.num_blocks()).await.unwrap();
            ch.reset().await.unwrap();
            // Unmap reads back as zeroes on a file.
            ch.unmap(16, blocks).await.unwrap();
            let (r, z) = ch.read(16, blocks, IoBuf::alloc(65536).await).await;
            r.unwrap();
            assert!(z.iter().all(|x| *x == 0), "unmapped range not zero");
            true
        })
        .unwrap();
    assert!(ok);
    let st = reg.iostat("u0").unwrap();
    assert_eq!(st.bounce_ops, 2, "two misaligned I/Os bounced");
    assert!(st.get(IoType::Read).ops >= 3 && st.get(IoType::Write).ops >= 2);
    assert!(st.get(IoType::Read).lat_min_ticks > 0);
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

#[test]
fn splits_on_max_transfer_and_boundary() {
    let rt = runtime(1);
    let reg = registry(&rt);
    let mut o = ram("m2", 1024, 512);
    o.max_transfer_blocks = 3;
    o.optimal_io_boundary = 8;
    malloc::create(&reg, o).unwrap();
    let desc = reg.open("m2", true, |_| {}).unwrap();
    rt.handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            let mut w = IoBuf::alloc(64 * 512).await;
            pattern(&mut w, 5, 3);
            let (r, w) = ch.write(5, 64, w).await;
            r.unwrap();
            let (r, b) = ch.read(5, 64, IoBuf::alloc(64 * 512).await).await;
            r.unwrap();
            assert!(b[..] == w[..]);
        })
        .unwrap();
    assert_eq!(reg.iostat("m2").unwrap().split_ops, 2);
}

#[test]
fn write_zeroes_native_and_emulated() {
    // tmpfs has no FALLOC_FL_ZERO_RANGE: the uring driver answers EOPNOTSUPP
    // and the layer falls back to writing zeroes. malloc does it natively.
    let shm = std::path::Path::new("/dev/shm");
    let path = if shm.is_dir() {
        shm.join(format!("ustor-wz-{}", std::process::id()))
    } else {
        temp_file("wz", 1 << 20)
    };
    std::fs::File::create(&path)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let rt = runtime(1);
    let reg = registry(&rt);
    malloc::create(&reg, ram("m3", 2048, 512)).unwrap();
    uring::create(
        &reg,
        uring::UringOpts {
            name: "u3".into(),
            filename: path.to_string_lossy().into(),
            block_size: 512,
            uuid: None,
            direct: false,
            sqpoll: false,
            iopoll: false,
        },
    )
    .unwrap();
    for name in ["m3", "u3"] {
        let desc = reg.open(name, true, |_| {}).unwrap();
        let ok = rt
            .handle()
            .block_on(0, move || async move {
                let ch = desc.channel().unwrap();
                let mut w = IoBuf::alloc(65536).await;
                w.fill(0xEE);
                let (r, _) = ch.write(0, 128, w).await;
                r.unwrap();
                ch.write_zeroes(8, 100).await.unwrap();
                let (r, b) = ch.read(0, 128, IoBuf::alloc(65536).await).await;
                r.unwrap();
                b[..4096].iter().all(|x| *x == 0xEE)
                    && b[4096..4096 + 51200].iter().all(|x| *x == 0)
                    && b[55296..].iter().all(|x| *x == 0xEE)
            })
            .unwrap();
        assert!(ok, "{name}: write_zeroes result wrong");
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn claims_block_delete_and_hot_remove_fails_io() {
    let rt = runtime(1);
    let reg = registry(&rt);
    null::create(&reg, ram("n0", 1 << 20, 512)).unwrap();
    let events = Arc::new(AtomicUsize::new(0));
    let ev = events.clone();
    let desc = reg
        .open("n0", true, move |e| {
            assert_eq!(e, BdevEvent::Remove);
            ev.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    desc.claim("nbd").unwrap();
    assert!(matches!(
        reg.delete("n0"),
        Err(ControlError::Claimed { .. })
    ));
    // Targets share a bdev; an exclusive claim (a virtual bdev) is refused.
    let d3 = reg.open("n0", true, |_| {}).unwrap();
    d3.claim("nvmf").unwrap();
    assert_eq!(reg.get("n0").unwrap().claimed_by().unwrap(), "nbd, nvmf");
    assert!(matches!(
        d3.claim_exclusive("vbdev"),
        Err(ControlError::Claimed { .. })
    ));
    drop(d3);
    assert_eq!(reg.get("n0").unwrap().claimed_by().unwrap(), "nbd");
    // Aliases and UUID open the same bdev.
    reg.add_alias("n0", "fast").unwrap();
    let uuid = reg.get("n0").unwrap().info().uuid.to_string();
    assert!(reg.open("fast", false, |_| {}).is_ok());
    assert!(reg.open(&uuid, false, |_| {}).is_ok());
    assert!(matches!(
        reg.add_alias("n0", "fast"),
        Err(ControlError::Exists(_))
    ));
    let d2 = reg.open("n0", true, |_| {}).unwrap();
    reg.hot_remove("n0").unwrap();
    assert_eq!(events.load(Ordering::SeqCst), 1);
    assert!(reg.get("n0").is_none() && reg.get("fast").is_none());
    let r = rt
        .handle()
        .block_on(0, move || async move {
            match d2.channel() {
                Err(e) => Err(e),
                Ok(ch) => ch.read(0, 1, IoBuf::alloc(512).await).await.0,
            }
        })
        .unwrap();
    assert_eq!(r, Err(BdevError::Removed));
    assert!(matches!(
        malloc::create(&reg, ram("bad", 8, 1000)),
        Err(ControlError::Invalid {
            param: "block_size",
            ..
        })
    ));
}

#[test]
fn hot_remove_fails_outstanding_io() {
    // A uring read is in flight when the bdev is hot-removed: it completes
    // with Removed instead of success.
    let path = temp_file("hr", 1 << 20);
    let rt = runtime(1);
    let reg = registry(&rt);
    uring::create(
        &reg,
        uring::UringOpts {
            name: "u9".into(),
            filename: path.to_string_lossy().into(),
            block_size: 0,
            uuid: None,
            direct: true,
            sqpoll: false,
            iopoll: false,
        },
    )
    .unwrap();
    let desc = reg.open("u9", false, |_| {}).unwrap();
    let reg3 = reg.clone();
    let status = rt
        .handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            let bs = ch.block_size() as usize;
            let buf = IoBuf::alloc(bs).await;
            let io = ustor_runtime::spawn(async move { ch.read(0, 1, buf).await.0 });
            // Runs before the read's SQE is submitted by the reactor loop.
            reg3.hot_remove("u9").unwrap();
            io.await
        })
        .unwrap();
    assert_eq!(status, Err(BdevError::Removed));
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

#[test]
fn iopoll_is_detected_and_falls_back_clearly() {
    let path = temp_file("iopoll", 1 << 20);
    let rt = runtime(1);
    let reg = registry(&rt);
    let e = uring::create(
        &reg,
        uring::UringOpts {
            name: "up".into(),
            filename: path.to_string_lossy().into(),
            block_size: 0,
            uuid: None,
            direct: true,
            sqpoll: false,
            iopoll: true,
        },
    )
    .unwrap();
    let info = e.bdev().driver_info();
    let on = info["uring"]["iopoll"].as_bool().unwrap();
    if !on {
        let note = info["uring"]["iopoll_note"].as_str().unwrap();
        assert!(note.contains("no poll queues"), "{note}");
    }
    // Either way I/O works and is verified.
    let desc = reg.open("up", true, |_| {}).unwrap();
    let ok = rt
        .handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            let mut w = IoBuf::alloc(4096).await;
            pattern(&mut w, 3, 9);
            let n = 4096 / ch.block_size() as u64;
            let (r, w) = ch.write(8, n, w).await;
            r.unwrap();
            let (r, b) = ch.read(8, n, IoBuf::alloc(4096).await).await;
            r.unwrap();
            b[..] == w[..]
        })
        .unwrap();
    assert!(ok);
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

#[test]
fn sqpoll_ring_verified() {
    let path = temp_file("sqpoll", 1 << 20);
    let rt = runtime(1);
    let reg = registry(&rt);
    uring::create(
        &reg,
        uring::UringOpts {
            name: "us".into(),
            filename: path.to_string_lossy().into(),
            block_size: 0,
            uuid: None,
            direct: true,
            sqpoll: true,
            iopoll: false,
        },
    )
    .unwrap();
    let desc = reg.open("us", true, |_| {}).unwrap();
    let ok = rt
        .handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            let n = 4096 / ch.block_size() as u64;
            let mut all = true;
            for lba in (0..64).map(|i| i * n) {
                let mut w = IoBuf::alloc(4096).await;
                pattern(&mut w, lba, 2);
                let (r, w) = ch.write(lba, n, w).await;
                r.unwrap();
                let (r, b) = ch.read(lba, n, IoBuf::alloc(4096).await).await;
                r.unwrap();
                all &= b[..] == w[..];
            }
            all
        })
        .unwrap();
    assert!(ok);
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// `block_status` on a uring file bdev: holes and data as the file system
/// reports them, after writes through the bdev and after an unmap.
#[test]
fn uring_file_block_status_follows_writes_and_unmap() {
    let path = temp_file("bstatus", 8 << 20);
    let rt = runtime(1);
    let reg = registry(&rt);
    let e = uring::create(
        &reg,
        uring::UringOpts {
            name: "ub".into(),
            filename: path.to_string_lossy().into(),
            block_size: 0,
            uuid: None,
            direct: true,
            sqpoll: false,
            iopoll: false,
        },
    )
    .unwrap();
    let bs = u64::from(e.info().block_size);
    let total = (8u64 << 20) / bs;
    // (start byte, length, hole) runs of the whole device.
    let runs = |off: u64, n: u64| -> Vec<(u64, u64, bool)> {
        let mut v = Vec::new();
        let mut at = off;
        while at < off + n {
            let ext = e
                .bdev()
                .block_status(at, off + n - at)
                .expect("file can say");
            assert!(!ext.is_empty());
            for x in ext {
                assert!(x.num_blocks > 0);
                assert_eq!(x.hole, x.zero, "a file hole reads zeroes");
                v.push((at * bs, x.num_blocks * bs, x.hole));
                at += x.num_blocks;
            }
        }
        assert_eq!(at, off + n, "extents overran the range");
        v
    };
    assert_eq!(
        runs(0, total),
        vec![(0, 8 << 20, true)],
        "fresh sparse file"
    );

    let d2 = reg.open("ub", true, |_| {}).unwrap();
    rt.handle()
        .block_on(0, move || async move {
            let ch = d2.channel().unwrap();
            let mut w = IoBuf::alloc(65536).await;
            pattern(&mut w, 1, 3);
            let (r, w) = ch.write((1 << 20) / bs, 65536 / bs, w).await;
            r.unwrap();
            let mut w4 = w;
            w4.set_len(4096);
            let (r, _) = ch.write((5 << 20) / bs, 4096 / bs, w4).await;
            r.unwrap();
            ch.flush(0, 0).await.unwrap();
        })
        .unwrap();
    assert_eq!(
        runs(0, total),
        vec![
            (0, 1 << 20, true),
            (1 << 20, 65536, false),
            ((1 << 20) + 65536, (4 << 20) - 65536, true),
            (5 << 20, 4096, false),
            ((5 << 20) + 4096, (3 << 20) - 4096, true),
        ]
    );
    // A window inside the data and the hole after it.
    assert_eq!(
        runs(((1 << 20) + 32768) / bs, 65536 / bs),
        vec![
            ((1 << 20) + 32768, 32768, false),
            ((1 << 20) + 65536, 32768, true)
        ]
    );
    // Unmap punches the data at 5 MiB back into a hole (when the file
    // system can punch; the driver says EOPNOTSUPP otherwise).
    let d3 = reg.open("ub", true, |_| {}).unwrap();
    let unmapped = rt
        .handle()
        .block_on(0, move || async move {
            let ch = d3.channel().unwrap();
            ch.unmap((5 << 20) / bs, 4096 / bs).await.is_ok()
        })
        .unwrap();
    if unmapped {
        assert_eq!(
            runs((4 << 20) / bs, (4 << 20) / bs),
            vec![(4 << 20, 4 << 20, true)]
        );
    }
    let _ = std::fs::remove_file(&path);
}

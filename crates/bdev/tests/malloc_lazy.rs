//! The malloc bdev's memory is populated 2 MiB at a time on first write, off
//! the reactors: a fresh disk holds nothing, reads of extents never written
//! are zeros, a write to a fresh extent lands (data verified) and populates
//! just that extent, reads and write-zeroes across populated and fresh
//! extents are right, and first writes from two reactors to one fresh
//! extent both land.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use ustor_bdev::modules::{malloc, RamOpts};
use ustor_runtime::IoBuf;

const MIB: u64 = 1 << 20;
const BS: u64 = 512;

fn resident(reg: &ustor_bdev::Registry) -> u64 {
    let e = reg.get("lazy").unwrap();
    e.bdev().driver_info()["malloc"]["resident_bytes"]
        .as_u64()
        .unwrap()
}

#[test]
fn malloc_populates_extents_on_first_write() {
    let rt = runtime(2);
    let reg = registry(&rt);
    malloc::create(
        &reg,
        RamOpts {
            name: "lazy".into(),
            num_blocks: 16 * MIB / BS,
            block_size: BS as u32,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .unwrap();
    assert_eq!(resident(&reg), 0, "a fresh disk holds no memory");
    let h = rt.handle();

    // Fresh: a read is zeros (into a buffer that held 0xff) and populates
    // nothing.
    let desc = Arc::new(reg.open("lazy", true, |_| {}).unwrap());
    let d = desc.clone();
    let fresh = h
        .block_on(0, move || async move {
            let ch = d.channel().unwrap();
            let mut b = IoBuf::alloc(1 << 20).await;
            b.fill(0xff);
            let (r, b) = ch.read(0, MIB / BS, b).await;
            r.unwrap();
            b.iter().all(|x| *x == 0)
        })
        .unwrap();
    assert!(fresh, "a never-written range reads as zeros");
    assert_eq!(resident(&reg), 0);

    // A 4 KiB write inside extent 1 populates extent 1 only; one spanning
    // extents 3 and 4 populates both. Both read back.
    let writes = [
        ((4 * MIB - 4096) / BS, 8u64, 1u64),
        ((8 * MIB - 2048) / BS, 8, 2),
    ];
    for (i, (lba, n, seed)) in writes.into_iter().enumerate() {
        let d = desc.clone();
        h.block_on(i % 2, move || async move {
            let ch = d.channel().unwrap();
            let mut b = IoBuf::alloc(4096).await;
            pattern(&mut b, lba, seed);
            ch.write(lba, n, b).await.0.unwrap();
        })
        .unwrap();
    }
    assert_eq!(resident(&reg), 6 * MIB, "extents 1, 3 and 4");
    for (lba, n, seed) in writes {
        let d = desc.clone();
        let ok = h
            .block_on(1, move || async move {
                let ch = d.channel().unwrap();
                let (r, b) = ch.read(lba, n, IoBuf::alloc(4096).await).await;
                r.unwrap();
                let mut want = vec![0u8; 4096];
                pattern(&mut want, lba, seed);
                b[..] == want[..]
            })
            .unwrap();
        assert!(ok, "write at lba {lba} read back");
    }

    // A read across populated extent 1 and fresh extent 2: data, then zeros.
    let d = desc.clone();
    let (head, tail) = h
        .block_on(0, move || async move {
            let ch = d.channel().unwrap();
            let lba = (4 * MIB - 4096) / BS;
            let mut b = IoBuf::alloc(1 << 20).await;
            b.fill(0xff);
            let (r, b) = ch.read(lba, MIB / BS, b).await;
            r.unwrap();
            let mut want = vec![0u8; 4096];
            pattern(&mut want, lba, 1);
            (b[..4096] == want[..], b[4096..].iter().all(|x| *x == 0))
        })
        .unwrap();
    assert!(head && tail, "mixed read: data {head}, zeros {tail}");

    // Write zeroes over extents 0..=4 (fresh and populated) zeroes the data
    // and populates nothing more.
    let d = desc.clone();
    let zeroed = h
        .block_on(1, move || async move {
            let ch = d.channel().unwrap();
            ch.write_zeroes(0, 10 * MIB / BS).await.unwrap();
            let mut all = true;
            for m in 0..10 {
                let (r, b) = ch
                    .read(m * MIB / BS, MIB / BS, IoBuf::alloc(1 << 20).await)
                    .await;
                r.unwrap();
                all &= b.iter().all(|x| *x == 0);
            }
            all
        })
        .unwrap();
    assert!(zeroed);
    assert_eq!(resident(&reg), 6 * MIB);

    // First writes from both reactors into fresh extent 6, different blocks.
    let base = 12 * MIB / BS;
    let done = Arc::new(AtomicUsize::new(0));
    for r in 0..2u64 {
        let (d, done) = (desc.clone(), done.clone());
        h.send(r as usize, move || {
            drop(ustor_runtime::spawn(async move {
                let ch = d.channel().unwrap();
                for k in 0..16u64 {
                    let lba = base + (2 * k + r) * 8;
                    let mut b = IoBuf::alloc(4096).await;
                    pattern(&mut b, lba, 9);
                    ch.write(lba, 8, b).await.0.unwrap();
                }
                done.fetch_add(1, Ordering::SeqCst);
            }));
        })
        .unwrap();
    }
    testkit::wait_until(
        "both reactors' first writes",
        Duration::from_secs(30),
        || done.load(Ordering::SeqCst) == 2,
    );
    assert_eq!(resident(&reg), 8 * MIB, "extent 6 added");
    let d = desc.clone();
    let bad = h
        .block_on(0, move || async move {
            let ch = d.channel().unwrap();
            let mut bad = 0;
            for k in 0..32u64 {
                let lba = base + k * 8;
                let (r, b) = ch.read(lba, 8, IoBuf::alloc(4096).await).await;
                r.unwrap();
                let mut want = vec![0u8; 4096];
                pattern(&mut want, lba, 9);
                bad += (b[..] != want[..]) as u32;
            }
            bad
        })
        .unwrap();
    assert_eq!(bad, 0, "blocks lost in concurrent first writes");
}

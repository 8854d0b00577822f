//! Child I/O on borrowed iovecs: a 2-way stripe (tests/stripe) sends each
//! piece of an I/O to a base bdev over the parent's own buffers. Data is
//! checked through the stripe and on the bases (the strip layout), with
//! vectored buffers cut mid-strip, splits above (the stripe's max transfer)
//! and below (a base's), inline (malloc) and ring (uring) completions, and
//! the first error completing the parent.

mod common;
mod stripe;

use common::*;
use ustor_bdev::modules::{malloc, uring, RamOpts};
use ustor_bdev::{BdevError, IoFlags, IoType};
use ustor_runtime::IoBuf;

const STRIP: u64 = 8;

fn ram(name: &str, blocks: u64, max_transfer_blocks: u32) -> RamOpts {
    RamOpts {
        name: name.into(),
        num_blocks: blocks,
        block_size: 512,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks,
    }
}

/// Where stripe block `lba` lives: (base, base lba).
fn place(lba: u64) -> (usize, u64) {
    let k = lba / STRIP;
    ((k % 2) as usize, k / 2 * STRIP + lba % STRIP)
}

/// Writes patterns over `ranges` of `name` (vectored, segments cut at odd
/// block counts), reads them back through it, and checks every block on
/// its base. Returns the number of bad blocks.
fn round_trip(
    rt: &ustor_runtime::Runtime,
    reg: &ustor_bdev::Registry,
    name: &str,
    bases: [&str; 2],
) -> usize {
    let ranges: Vec<(u64, u64)> = vec![(0, 1), (3, 8), (7, 2), (30, 21), (100, 64), (250, 6)];
    let desc = reg.open(name, true, |_| {}).unwrap();
    let (d0, d1) = (
        reg.open(bases[0], false, |_| {}).unwrap(),
        reg.open(bases[1], false, |_| {}).unwrap(),
    );
    rt.handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            let base = [d0.channel().unwrap(), d1.channel().unwrap()];
            let mut bad = 0;
            for (i, &(off, n)) in ranges.iter().enumerate() {
                // Segments of 3 blocks and the rest: they cut strips.
                let first = n.min(3);
                let mut v = vec![IoBuf::alloc(first as usize * 512).await];
                if n > first {
                    v.push(IoBuf::alloc((n - first) as usize * 512).await);
                }
                let mut lba = off;
                for b in v.iter_mut() {
                    for blk in b.chunks_mut(512) {
                        pattern(blk, lba, i as u64);
                        lba += 1;
                    }
                }
                let flags = IoFlags::fua_if(i % 2 == 1);
                let (r, _) = ch.writev_flagged(off, n, v, flags).await;
                r.unwrap();
                let (r, got) = ch.read(off, n, IoBuf::alloc(n as usize * 512).await).await;
                r.unwrap();
                let mut want = vec![0u8; 512];
                for (j, blk) in got.chunks(512).enumerate() {
                    let lba = off + j as u64;
                    pattern(&mut want, lba, i as u64);
                    bad += (blk != &want[..]) as usize;
                    let (b, blba) = place(lba);
                    let (r, on_base) = base[b].read(blba, 1, IoBuf::alloc(512).await).await;
                    r.unwrap();
                    bad += (on_base[..] != want[..]) as usize;
                }
            }
            bad
        })
        .unwrap()
}

#[test]
fn stripe_over_malloc_round_trips_with_splits_above_and_below() {
    let rt = runtime(1);
    let reg = registry(&rt);
    malloc::create(&reg, ram("a", 256, 0)).unwrap();
    // A base that splits children further (max transfer 4 blocks).
    malloc::create(&reg, ram("b", 256, 4)).unwrap();
    stripe::create(&reg, "s", "a", "b", STRIP, 0).unwrap();
    assert_eq!(round_trip(&rt, &reg, "s", ["a", "b"]), 0);
    // The stripe itself split by the layer above (max transfer 5): the
    // children of split children complete the root.
    malloc::create(&reg, ram("c", 256, 0)).unwrap();
    malloc::create(&reg, ram("d", 256, 0)).unwrap();
    stripe::create(&reg, "s2", "c", "d", STRIP, 5).unwrap();
    assert_eq!(round_trip(&rt, &reg, "s2", ["c", "d"]), 0);
    // The bases are claimed by the stripe.
    assert!(reg.delete("a").is_err());
}

#[test]
fn stripe_over_uring_and_malloc_completes_from_the_ring() {
    let path = temp_file("stripe", 1 << 20);
    let rt = runtime(1);
    let reg = registry(&rt);
    uring::create(
        &reg,
        uring::UringOpts {
            name: "u".into(),
            filename: path.to_string_lossy().into(),
            block_size: 512,
            uuid: None,
            direct: false,
            sqpoll: false,
            iopoll: false,
        },
    )
    .unwrap();
    malloc::create(&reg, ram("m", 2048, 0)).unwrap();
    stripe::create(&reg, "s", "u", "m", STRIP, 0).unwrap();
    assert_eq!(round_trip(&rt, &reg, "s", ["u", "m"]), 0);
    // Flush and write-zeroes go to the bases too.
    let desc = reg.open("s", true, |_| {}).unwrap();
    let zero = rt
        .handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            ch.flush(0, ch.num_blocks()).await.unwrap();
            ch.write_zeroes(30, 21).await.unwrap();
            let (r, got) = ch.read(30, 21, IoBuf::alloc(21 * 512).await).await;
            r.unwrap();
            got.iter().all(|b| *b == 0)
        })
        .unwrap();
    assert!(zero, "write-zeroes through the stripe");
    assert_eq!(
        reg.iostat("u").unwrap().get(IoType::Flush).ops,
        0,
        "children bypass base iostat"
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_failed_child_fails_the_parent_and_the_rest_still_complete() {
    let rt = runtime(1);
    let reg = registry(&rt);
    malloc::create(&reg, ram("a", 256, 0)).unwrap();
    malloc::create(&reg, ram("b", 256, 0)).unwrap();
    stripe::create(&reg, "s", "a", "b", STRIP, 0).unwrap();
    let desc = reg.open("s", true, |_| {}).unwrap();
    let d = reg.open("s", true, |_| {}).unwrap();
    rt.handle()
        .block_on(0, move || async move {
            // Channels exist before the base goes away.
            d.channel().unwrap();
        })
        .unwrap();
    reg.hot_remove("b").unwrap();
    let (whole, only_a) = rt
        .handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            // Strips 0 (base a) and 1 (base b): b's child fails.
            let (r, _) = ch.write(4, 8, IoBuf::alloc(4096).await).await;
            // Strip 0 only: base a still works.
            let (r2, _) = ch.write(0, 8, IoBuf::alloc(4096).await).await;
            (r, r2)
        })
        .unwrap();
    assert!(matches!(whole, Err(BdevError::Removed)), "{whole:?}");
    only_a.unwrap();
}

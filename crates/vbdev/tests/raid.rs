//! raid0 and concat: data written through the array (vectored, I/Os
//! straddling strips and members) reads back through it and lies on the
//! members where the strip map says, for strip sizes 4 KiB to 1 MiB and
//! members of different sizes (truncated as SPDK does); unmap and write
//! zeroes across strips; the config call recreates the same array; a
//! concat grows with its last member, a raid0 with all of its members.

mod common;

use common::*;
use ustor_bdev::IoType;

/// I/Os around strip boundaries: one block each side, a strip and a bit
/// (three strips), and the array's last blocks.
fn straddling(strip: u64, total: u64) -> Vec<(u64, u64)> {
    let mut r = vec![(0, 1), (total - 5, 5)];
    for k in [1u64, 2, 3, 5, 7] {
        let b = k * strip;
        if b + strip + 2 > total {
            break;
        }
        r.push((b - 1, 2));
        let n = (strip + 2).min(CHUNK / BS);
        r.push((b - 1, n));
    }
    r
}

#[test]
fn raid0_straddling_strips_4k_to_1m_on_members_of_different_sizes() {
    let rt = runtime(1);
    let reg = registry(&rt);
    for (i, strip_kb) in [4u32, 8, 64, 1024].into_iter().enumerate() {
        let m: Vec<String> = (0..3).map(|j| format!("m{i}_{j}")).collect();
        // 4 MiB, 4 MiB + 3 KiB, 5 MiB: raid0 uses 4 MiB of each.
        for (j, extra) in [0u64, 3 << 10, 1 << 20].into_iter().enumerate() {
            ram(&reg, &m[j], (4 << 20) + extra);
        }
        let name = format!("r{i}");
        let mr: Vec<&str> = m.iter().map(|s| s.as_str()).collect();
        raid(&reg, &name, "raid0", &mr, strip_kb);
        let total = reg.get(&name).unwrap().info().num_blocks;
        assert_eq!(total, 3 * (4 << 20) / BS, "strip {strip_kb} KiB");
        let strip = strip_kb as u64 * 1024 / BS;
        let mut model = vec![0u8; (total * BS) as usize];
        write_ranges(
            &rt,
            &reg,
            &name,
            &straddling(strip, total),
            i as u64,
            &mut model,
        );
        check_layout(&rt, &reg, &name, &model, &mr, |lba| {
            let k = lba / strip;
            ((k % 3) as usize, k / 3 * strip + lba % strip)
        });
    }
}

#[test]
fn concat_is_linear_over_members_cut_to_whole_strips() {
    let rt = runtime(1);
    let reg = registry(&rt);
    // 1 MiB + 1 KiB, 2 MiB, 512 KiB: with 64 KiB strips concat uses
    // 1 MiB, 2 MiB and 512 KiB.
    for (n, bytes) in [("a", (1 << 20) + 1024), ("b", 2 << 20), ("c", 512 << 10)] {
        ram(&reg, n, bytes);
    }
    raid(&reg, "cc", "concat", &["a", "b", "c"], 64);
    let (la, lb) = ((1u64 << 20) / BS, (2u64 << 20) / BS);
    let total = reg.get("cc").unwrap().info().num_blocks;
    assert_eq!(total, la + lb + (512 << 10) / BS);
    let ranges = [
        (0, 3),
        (la - 2, 4),
        (la + lb - 1, 2),
        (la - 1, lb + 2),
        (total - 7, 7),
    ];
    let mut model = vec![0u8; (total * BS) as usize];
    write_ranges(&rt, &reg, "cc", &ranges, 9, &mut model);
    check_layout(&rt, &reg, "cc", &model, &["a", "b", "c"], |lba| {
        if lba < la {
            (0, lba)
        } else if lba < la + lb {
            (1, lba - la)
        } else {
            (2, lba - la - lb)
        }
    });
}

#[test]
fn unmap_and_write_zeroes_cover_exactly_their_range() {
    let rt = runtime(1);
    let reg = registry(&rt);
    ram(&reg, "z0", 1 << 20);
    ram(&reg, "z1", 1 << 20);
    raid(&reg, "rz", "raid0", &["z0", "z1"], 4);
    let total = reg.get("rz").unwrap().info().num_blocks;
    let mut model = vec![0u8; (total * BS) as usize];
    write_ranges(&rt, &reg, "rz", &[(0, 2048), (2048, 2048)], 1, &mut model);
    let zero = [
        (IoType::Unmap, 5u64, 30u64),
        (IoType::WriteZeroes, 100, 1000),
    ];
    for (kind, lba, n) in zero {
        model[(lba * BS) as usize..((lba + n) * BS) as usize].fill(0);
        let d = reg.open("rz", true, |_| {}).unwrap();
        rt.handle()
            .block_on(0, move || async move {
                let ch = d.channel().unwrap();
                match kind {
                    IoType::Unmap => ch.unmap(lba, n).await,
                    _ => ch.write_zeroes(lba, n).await,
                }
            })
            .unwrap()
            .unwrap();
    }
    check_layout(&rt, &reg, "rz", &model, &["z0", "z1"], |lba| {
        let k = lba / 8;
        ((k % 2) as usize, k / 2 * 8 + lba % 8)
    });
}

#[test]
fn config_call_recreates_the_same_array_and_get_bdevs_describes_it() {
    let rt = runtime(1);
    let reg = registry(&rt);
    ram(&reg, "x", 1 << 20);
    ram(&reg, "y", 1 << 20);
    raid(&reg, "r", "raid0", &["x", "y"], 16);
    let total = reg.get("r").unwrap().info().num_blocks;
    let mut model = vec![0u8; (total * BS) as usize];
    write_ranges(&rt, &reg, "r", &[(30, 40), (1000, 900)], 3, &mut model);
    let cfg = reg.get("r").unwrap().bdev().config_json();
    assert_eq!(cfg["method"], "bdev_raid_create");
    let listed = ustor_vbdev::raid::get_bdevs(&reg, "all").unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["name"], "r");
    assert_eq!(listed[0]["raid_level"], "raid0");
    assert_eq!(listed[0]["strip_size_kb"], 16);
    assert_eq!(listed[0]["num_base_bdevs_operational"], 2);
    assert_eq!(listed[0]["base_bdevs_list"][1]["name"], "y");
    assert!(ustor_vbdev::raid::get_bdevs(&reg, "bogus").is_err());
    // Deleting releases the members; the config call rebuilds the array
    // with the same layout, so the data is there again.
    assert!(reg.delete("x").is_err(), "member deleted under its array");
    reg.delete("r").unwrap();
    assert!(reg.get("x").unwrap().claimed_by().is_none());
    create(&reg, "raid", cfg["params"].clone()).unwrap();
    assert_eq!(
        reg.get("r").unwrap().info().uuid.to_string(),
        cfg["params"]["uuid"].as_str().unwrap()
    );
    check_layout(&rt, &reg, "r", &model, &["x", "y"], |lba| {
        let k = lba / 32;
        ((k % 2) as usize, k / 2 * 32 + lba % 32)
    });
}

/// A concat array takes its last member's growth (whole strips of it; an
/// rbd image resized sets its bdev's size so): its openers hear one
/// Resize per growth, data written past the old end lies on the member
/// where the layout says, and the config call rebuilds the grown array.
/// A shrink of the last member, or any resize of another, keeps the size.
#[test]
fn concat_grows_with_its_last_member() {
    let rt = runtime(1);
    let reg = registry(&rt);
    ram(&reg, "a", 1 << 20);
    ram(&reg, "b", 2 << 20);
    ram(&reg, "c", 2 << 20);
    // c starts smaller than its memory, so it can grow back into it.
    let mib = (1u64 << 20) / BS;
    assert!(reg.get("c").unwrap().resize(mib + 8));
    raid(&reg, "cc", "concat", &["a", "b", "c"], 64);
    let size = || reg.get("cc").unwrap().num_blocks();
    assert_eq!(size(), 4 * mib);
    let heard = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let h = heard.clone();
    let _top = reg
        .open("cc", false, move |ev| {
            if ev == ustor_bdev::BdevEvent::Resize {
                h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        })
        .unwrap();
    let heard = || heard.load(std::sync::atomic::Ordering::SeqCst);
    // Not the last member: nothing changes.
    assert!(reg.get("b").unwrap().resize(mib));
    assert!(reg.get("b").unwrap().resize(2 * mib));
    assert_eq!((size(), heard()), (4 * mib, 0));
    // c to 2 MiB less 4 KiB: the array takes 1 MiB + 960 KiB of it.
    let strip = (64 << 10) / BS;
    assert!(reg.get("c").unwrap().resize(2 * mib - 8));
    assert_eq!((size(), heard()), (5 * mib - strip, 1));
    // A shrink keeps the array's size; a grow within the used part too.
    assert!(reg.get("c").unwrap().resize(mib + 8));
    assert!(reg.get("c").unwrap().resize(2 * mib - 8));
    assert_eq!((size(), heard()), (5 * mib - strip, 1));
    assert!(reg.get("c").unwrap().resize(2 * mib));
    assert_eq!((size(), heard()), (5 * mib, 2));
    let listed = ustor_vbdev::raid::get_bdevs(&reg, "all").unwrap();
    assert_eq!(listed[0]["base_bdevs_list"][2]["data_size"], 2 * mib);
    // Across the first old end (4 MiB), across the second and up to the
    // new end.
    let (old, old2) = (4 * mib, 5 * mib - strip);
    let ranges = [(old - 3, 9), (old2 - 5, 10), (5 * mib - 7, 7)];
    let mut model = vec![0u8; (5 * mib * BS) as usize];
    write_ranges(&rt, &reg, "cc", &ranges, 11, &mut model);
    let place = |lba: u64| match lba {
        l if l < mib => (0, l),
        l if l < 3 * mib => (1, l - mib),
        l => (2, l - 3 * mib),
    };
    check_layout(&rt, &reg, "cc", &model, &["a", "b", "c"], place);
    // The config call has no sizes: it rebuilds the array at its new size.
    let cfg = reg.get("cc").unwrap().bdev().config_json();
    drop(_top);
    reg.delete("cc").unwrap();
    create(&reg, "raid", cfg["params"].clone()).unwrap();
    assert_eq!(size(), 5 * mib);
    check_layout(&rt, &reg, "cc", &model, &["a", "b", "c"], place);
}

/// Counts the Resize events an opener of `name` hears.
fn resize_counter(
    reg: &ustor_bdev::Registry,
    name: &str,
) -> (ustor_bdev::Desc, impl Fn() -> usize) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let heard = std::sync::Arc::new(AtomicUsize::new(0));
    let h = heard.clone();
    let d = reg
        .open(name, false, move |ev| {
            if ev == ustor_bdev::BdevEvent::Resize {
                h.fetch_add(1, Ordering::SeqCst);
            }
        })
        .unwrap();
    (d, move || heard.load(Ordering::SeqCst))
}

#[test]
fn raid0_grows_when_every_member_has_grown() {
    let rt = runtime(1);
    let reg = registry(&rt);
    let mib = (1u64 << 20) / BS;
    // Members start smaller than their memory, so they can grow into it.
    for m in ["a", "b"] {
        ram(&reg, m, 2 << 20);
        assert!(reg.get(m).unwrap().resize(mib + 8));
    }
    raid(&reg, "r0", "raid0", &["a", "b"], 64);
    let size = || reg.get("r0").unwrap().num_blocks();
    assert_eq!(size(), 2 * mib);
    let mut model = vec![0u8; (4 * mib * BS) as usize];
    write_ranges(&rt, &reg, "r0", &[(5, 3), (2 * mib - 3, 3)], 20, &mut model);
    let (_top, heard) = resize_counter(&reg, "r0");
    let strip = (64 << 10) / BS;
    // One member alone: raid0 uses the smallest member's size on each.
    assert!(reg.get("a").unwrap().resize(2 * mib));
    assert_eq!((size(), heard()), (2 * mib, 0));
    // b to 2 MiB less 4 KiB: each member gives 2 MiB less a strip.
    assert!(reg.get("b").unwrap().resize(2 * mib - 8));
    assert_eq!((size(), heard()), (2 * (2 * mib - strip), 1));
    // A shrink keeps the size; so does growing back within the used part.
    assert!(reg.get("a").unwrap().resize(mib));
    assert!(reg.get("a").unwrap().resize(2 * mib));
    assert_eq!((size(), heard()), (2 * (2 * mib - strip), 1));
    assert!(reg.get("b").unwrap().resize(2 * mib));
    assert_eq!((size(), heard()), (4 * mib, 2));
    let listed = ustor_vbdev::raid::get_bdevs(&reg, "all").unwrap();
    assert_eq!(listed[0]["base_bdevs_list"][1]["data_size"], 2 * mib);
    // Across the first old end (2 MiB), the second, and up to the new end:
    // the strip map is the same, so the old data stays where it was.
    let (old, old2) = (2 * mib, 2 * (2 * mib - strip));
    let ranges = [(old - 1, 9), (old2 - 5, 10), (4 * mib - 7, 7)];
    write_ranges(&rt, &reg, "r0", &ranges, 21, &mut model);
    let place = |lba: u64| {
        let k = lba / strip;
        ((k % 2) as usize, k / 2 * strip + lba % strip)
    };
    check_layout(&rt, &reg, "r0", &model, &["a", "b"], place);
    // The config call has no sizes: it rebuilds the array at its new size.
    let cfg = reg.get("r0").unwrap().bdev().config_json();
    drop(_top);
    reg.delete("r0").unwrap();
    create(&reg, "raid", cfg["params"].clone()).unwrap();
    assert_eq!(size(), 4 * mib);
    check_layout(&rt, &reg, "r0", &model, &["a", "b"], place);
}

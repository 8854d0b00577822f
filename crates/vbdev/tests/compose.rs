//! Composition and control: passthru and split alone and stacked (a
//! passthru over a raid0 of splits of one base, a raid1 of two raid0s of
//! splits), bad parameters refused
//! with nothing created (a raid1 member that would close a cycle too),
//! claims that stop deleting a member under its parent, hot-remove of a member that removes every bdev above it,
//! a base resize followed by passthru (and its openers), kept by split and raid.

mod common;

use common::*;
use serde_json::json;
use ustor_bdev::ControlError;

#[test]
fn passthru_over_raid0_over_splits_lands_on_the_base_where_the_stack_says() {
    let rt = runtime(1);
    let reg = registry(&rt);
    ram(&reg, "base", 4 << 20);
    let parts = ustor_vbdev::split::create(
        &reg,
        &std::sync::Arc::downgrade(&reg),
        serde_json::from_value(json!({"base_bdev": "base", "split_count": 4})).unwrap(),
    )
    .unwrap();
    assert_eq!(parts, ["basep0", "basep1", "basep2", "basep3"]);
    let part = (1u64 << 20) / BS;
    // raid0 over parts 3 and 1 (that order), strips of 8 KiB.
    raid(&reg, "r", "raid0", &["basep3", "basep1"], 8);
    create(
        &reg,
        "passthru",
        json!({"base_bdev_name": "r", "name": "pt"}),
    )
    .unwrap();
    let total = reg.get("pt").unwrap().info().num_blocks;
    assert_eq!(total, 2 * part);
    let mut model = vec![0u8; (total * BS) as usize];
    let ranges = [(0, 1), (15, 2), (10, 40), (part - 3, 6), (total - 16, 16)];
    write_ranges(&rt, &reg, "pt", &ranges, 4, &mut model);
    // Through the stack and on the base: strip k on member k % 2, member
    // 0 is part 3, member 1 is part 1.
    check_layout(&rt, &reg, "pt", &model, &["base"], |lba| {
        let k = lba / 16;
        let on = k / 2 * 16 + lba % 16;
        (0, on + if k % 2 == 0 { 3 * part } else { part })
    });
    // Parts 0 and 2 were never written.
    let raw = read_all(&rt, &reg, "base");
    assert!(raw[..(part * BS) as usize].iter().all(|b| *b == 0));
    // Claims hold bottom-up; deleting top-down releases them.
    assert!(matches!(reg.delete("r"), Err(ControlError::Claimed { .. })));
    assert!(matches!(
        ustor_vbdev::split::delete(&reg, "base"),
        Err(ControlError::Claimed { .. })
    ));
    assert!(
        reg.get("basep0").is_some(),
        "a part went on a refused delete"
    );
    reg.delete("pt").unwrap();
    reg.delete("r").unwrap();
    ustor_vbdev::split::delete(&reg, "base").unwrap();
    assert!(reg.get("basep3").is_none());
    reg.delete("base").unwrap();
}

#[test]
fn bad_parameters_are_refused_and_nothing_is_created_or_claimed() {
    let rt = runtime(1);
    let reg = registry(&rt);
    ram(&reg, "a", 1 << 20);
    ram(&reg, "b", 1 << 20);
    ram(&reg, "in_use", 1 << 20);
    create(
        &reg,
        "passthru",
        json!({"base_bdev_name": "in_use", "name": "holder"}),
    )
    .unwrap();
    ustor_bdev::modules::malloc::create(
        &reg,
        ustor_bdev::modules::RamOpts {
            name: "big_blocks".into(),
            num_blocks: 256,
            block_size: 4096,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .unwrap();
    let cases = [
        (
            json!({"name": "r", "raid_level": "raid0", "base_bdevs": ["a", "nope"], "strip_size_kb": 64}),
            "nope",
        ),
        (
            json!({"name": "r", "raid_level": "raid0", "base_bdevs": ["a", "b"], "strip_size_kb": 48}),
            "power of two",
        ),
        (
            json!({"name": "r", "raid_level": "raid0", "base_bdevs": ["a", "a"], "strip_size_kb": 64}),
            "twice",
        ),
        (
            json!({"name": "r", "raid_level": "raid0", "base_bdevs": ["a", "in_use"], "strip_size_kb": 64}),
            "claimed",
        ),
        (
            json!({"name": "r", "raid_level": "raid0", "base_bdevs": ["a", "big_blocks"], "strip_size_kb": 64}),
            "block size",
        ),
        (
            json!({"name": "r", "raid_level": "raid5f", "base_bdevs": ["a", "b"], "strip_size_kb": 64}),
            "raid5f",
        ),
        (
            json!({"name": "r", "raid_level": "raid0", "base_bdevs": ["a", "b"], "strip_size_kb": 2048}),
            "smaller than one strip",
        ),
        (
            json!({"name": "a", "raid_level": "raid0", "base_bdevs": ["b"], "strip_size_kb": 64}),
            "exists",
        ),
        (
            json!({"name": "r", "raid_level": "raid0", "base_bdevs": ["a"], "strip_kb": 64}),
            "strip_kb",
        ),
    ];
    for (params, why) in cases {
        let e = create(&reg, "raid", params.clone()).expect_err(&params.to_string());
        assert!(e.to_string().contains(why), "{params}: `{e}` lacks `{why}`");
        assert!(reg.get("r").is_none(), "{params}: created");
        for m in ["a", "b", "big_blocks"] {
            assert!(
                reg.get(m).unwrap().claimed_by().is_none(),
                "{params}: {m} left claimed"
            );
        }
    }
    // A cycle cannot be named: the parent must be new, its bases must exist.
    let e = create(
        &reg,
        "passthru",
        json!({"base_bdev_name": "c", "name": "c"}),
    )
    .unwrap_err();
    assert!(matches!(e, ControlError::NotFound(_)), "{e}");
    let e = create(
        &reg,
        "split",
        json!({"base_bdev": "a", "split_count": 3, "split_size_mb": 1}),
    )
    .unwrap_err();
    assert!(e.to_string().contains("exceed"), "{e}");
    assert!(reg.get("ap0").is_none());
    assert!(reg.get("a").unwrap().claimed_by().is_none());
}

#[test]
fn adding_a_raid1_member_built_on_the_raid_is_refused() {
    use ustor_vbdev::raid::mirror;
    let rt = runtime(1);
    let reg = registry(&rt);
    for n in ["a", "b"] {
        ram(&reg, n, 1 << 20);
    }
    raid(&reg, "m", "raid1", &["a", "b"], 0);
    mirror::remove_base(&reg, "b").unwrap();
    // The array itself (by name and by UUID), then a passthru over it and
    // a passthru over that: each would send the array's I/O back to it.
    let uuid = reg.get("m").unwrap().info().uuid.to_string();
    create(
        &reg,
        "passthru",
        json!({"base_bdev_name": "m", "name": "p1"}),
    )
    .unwrap();
    create(
        &reg,
        "passthru",
        json!({"base_bdev_name": "p1", "name": "p2"}),
    )
    .unwrap();
    for cyc in ["m", uuid.as_str(), "p1", "p2"] {
        let e = mirror::add_base(&reg, "m", cyc).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("cycle"), "{cyc}: {e}");
    }
    // Nothing changed: the slot is still free, p2 unclaimed, one member.
    assert!(reg.get("p2").unwrap().claimed_by().is_none());
    let raids = ustor_vbdev::raid::get_bdevs(&reg, "all").unwrap();
    assert_eq!(raids[0]["num_base_bdevs_discovered"], 1, "{raids:?}");
    let j = mirror::add_base(&reg, "m", "b").unwrap();
    rt.handle()
        .block_on(0, move || async move { mirror::rebuild(j).await })
        .unwrap()
        .unwrap();
}

#[test]
fn hot_remove_of_a_member_removes_every_bdev_above_it() {
    let rt = runtime(1);
    let reg = registry(&rt);
    ram(&reg, "a", 1 << 20);
    ram(&reg, "b", 1 << 20);
    raid(&reg, "cat", "concat", &["a", "b"], 4);
    create(
        &reg,
        "passthru",
        json!({"base_bdev_name": "cat", "name": "top"}),
    )
    .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let _watch = reg
        .open("top", false, move |ev| {
            let _ = tx.lock().unwrap().send(ev);
        })
        .unwrap();
    reg.hot_remove("b").unwrap();
    assert_eq!(rx.try_recv(), Ok(ustor_bdev::BdevEvent::Remove));
    assert!(reg.get("cat").is_none() && reg.get("top").is_none());
    // The surviving member is free again once the stack's descriptors go.
    drop(_watch);
    assert!(reg.get("a").unwrap().claimed_by().is_none());
}

#[test]
fn raid1_of_two_raid0s_of_splits_keeps_both_copies_on_the_base() {
    let rt = runtime(1);
    let reg = registry(&rt);
    ram(&reg, "base", 8 << 20);
    create(
        &reg,
        "split",
        json!({"base_bdev": "base", "split_count": 4}),
    )
    .unwrap();
    raid(&reg, "s0", "raid0", &["basep0", "basep1"], 4);
    raid(&reg, "s1", "raid0", &["basep2", "basep3"], 4);
    create(
        &reg,
        "raid",
        json!({"name": "mir", "raid_level": "raid1", "base_bdevs": ["s0", "s1"]}),
    )
    .unwrap();
    let part = (2u64 << 20) / BS;
    let total = reg.get("mir").unwrap().info().num_blocks;
    assert_eq!(total, 2 * part);
    let mut model = vec![0u8; (total * BS) as usize];
    let ranges = [(0, 9), (7, 2), (100, 333), (part - 4, 8), (total - 20, 20)];
    write_ranges(&rt, &reg, "mir", &ranges, 6, &mut model);
    for copy in 0..2u64 {
        check_layout(&rt, &reg, "mir", &model, &["base"], |lba| {
            let k = lba / 8;
            (0, (2 * copy + k % 2) * part + k / 2 * 8 + lba % 8)
        });
    }
    assert!(matches!(
        reg.delete("s0"),
        Err(ControlError::Claimed { .. })
    ));
}

/// A base's resize (here its size in the bdev layer, shrunk as a driver
/// such as rbd would set it) reaches the 1:1 vbdevs above it, and through
/// them their own openers; split parts and raid keep their sizes.
#[test]
fn base_resize_is_followed_by_passthru_and_kept_by_split_and_raid() {
    let rt = runtime(1);
    let reg = registry(&rt);
    ram(&reg, "b1", 4 << 20);
    ram(&reg, "b2", 4 << 20);
    ram(&reg, "b3", 4 << 20);
    create(
        &reg,
        "passthru",
        json!({"base_bdev_name": "b1", "name": "pt"}),
    )
    .unwrap();
    create(
        &reg,
        "passthru",
        json!({"base_bdev_name": "pt", "name": "pt2"}),
    )
    .unwrap();
    let heard = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let h = heard.clone();
    let top = reg
        .open("pt2", false, move |ev| {
            if ev == ustor_bdev::BdevEvent::Resize {
                h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        })
        .unwrap();
    ustor_vbdev::split::create(
        &reg,
        &std::sync::Arc::downgrade(&reg),
        serde_json::from_value(json!({"base_bdev": "b2", "split_count": 2})).unwrap(),
    )
    .unwrap();
    raid(&reg, "r", "raid0", &["b3"], 8);
    let full = (4u64 << 20) / BS;
    let (part, raid_blocks) = (
        reg.get("b2p0").unwrap().num_blocks(),
        reg.get("r").unwrap().num_blocks(),
    );
    for b in ["b1", "b2", "b3"] {
        assert!(reg.get(b).unwrap().resize(full / 2));
    }
    assert_eq!(reg.get("pt").unwrap().num_blocks(), full / 2);
    assert_eq!(reg.get("pt2").unwrap().num_blocks(), full / 2);
    assert_eq!(top.num_blocks(), full / 2);
    assert_eq!(heard.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(reg.get("b2p0").unwrap().num_blocks(), part);
    assert_eq!(reg.get("r").unwrap().num_blocks(), raid_blocks);
    // A read past the new end of the passthru is refused by the bdev layer.
    let desc = top;
    let r = rt
        .handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            let b = ustor_runtime::IoBuf::alloc(BS as usize).await;
            ch.read(full / 2, 1, b).await.0
        })
        .unwrap();
    assert!(r.is_err(), "{r:?}");
}

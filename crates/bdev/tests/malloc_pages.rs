//! A lazy malloc disk grows by 4 KiB pages as it is written, on the reactor
//! that writes: the mapping has no huge pages (allocating one may compact
//! memory for milliseconds) and a 4 KiB write holds about 4 KiB of RAM, not
//! a 2 MiB extent. Data written across fresh pages reads back.

mod common;

use std::sync::Arc;

use common::*;
use ustor_bdev::modules::{malloc, RamOpts};
use ustor_bdev::BdevModule;
use ustor_runtime::IoBuf;

const MIB: u64 = 1 << 20;
const BS: u64 = 512;
/// An odd size, so the test finds the disk's mapping by its length.
const LEN: u64 = 37 * MIB;

/// (Rss KiB, AnonHugePages KiB, VmFlags) of this process's mapping of
/// exactly `len` bytes.
fn mapping(len: u64) -> (u64, u64, String) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut found = None;
    let mut cur = None;
    for l in smaps.lines() {
        let head = l.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = head.split_once('-') {
            if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                cur = (b - a == len).then_some((0, 0, String::new()));
                continue;
            }
        }
        let Some(c) = cur.as_mut() else { continue };
        let kib = || l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap();
        if l.starts_with("Rss:") {
            c.0 = kib();
        } else if l.starts_with("AnonHugePages:") {
            c.1 = kib();
        } else if let Some(f) = l.strip_prefix("VmFlags:") {
            c.2 = f.trim().to_string();
            found = cur.take();
        }
    }
    found.expect("the disk's mapping")
}

#[test]
fn lazy_disk_grows_by_pages_without_huge_pages() {
    let rt = runtime(1);
    let reg = registry(&rt);
    malloc::create(
        &reg,
        RamOpts {
            name: "lazy".into(),
            num_blocks: LEN / BS,
            block_size: BS as u32,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .unwrap();
    let (rss, huge, flags) = mapping(LEN);
    assert_eq!((rss, huge), (0, 0), "a fresh disk holds no memory");
    assert!(
        flags.split(' ').any(|f| f == "nh"),
        "no THP advised: {flags}"
    );

    // One 4 KiB write into each of 16 fresh 2 MiB extents, then read back.
    let desc = Arc::new(reg.open("lazy", true, |_| {}).unwrap());
    let d = desc.clone();
    let bad = rt
        .handle()
        .block_on(0, move || async move {
            let ch = d.channel().unwrap();
            for e in 0..16u64 {
                let lba = (e * 2 * MIB + 8192) / BS;
                let mut b = IoBuf::alloc(4096).await;
                pattern(&mut b, lba, 5);
                ch.write(lba, 8, b).await.0.unwrap();
            }
            let mut bad = 0;
            for e in 0..16u64 {
                let lba = (e * 2 * MIB + 8192) / BS;
                let (r, b) = ch.read(lba, 8, IoBuf::alloc(4096).await).await;
                r.unwrap();
                let mut want = vec![0u8; 4096];
                pattern(&mut want, lba, 5);
                bad += (b[..] != want[..]) as u32;
            }
            bad
        })
        .unwrap();
    assert_eq!(bad, 0, "writes into fresh pages read back");
    let (rss, huge, _) = mapping(LEN);
    assert_eq!(huge, 0, "no huge page was faulted in");
    // 16 written pages (reads of the written pages map nothing new); a
    // 2 MiB-extent population would have made this 32 MiB.
    assert!((64..=256).contains(&rss), "RSS of the disk {rss} KiB");
}

/// `prefault: true` (a ustor extension of `bdev_malloc_create`) faults the
/// whole disk in at creation, and save_config keeps it.
#[test]
fn prefaulted_disk_is_resident_at_creation() {
    const PRE: u64 = 41 * MIB;
    let rt = runtime(1);
    let reg = registry(&rt);
    let m = malloc::module();
    let params = serde_json::json!({
        "name": "pre", "num_blocks": PRE / BS, "block_size": BS, "prefault": true
    });
    let e = m.create(&reg, params).unwrap();
    let (rss, _, flags) = mapping(PRE);
    assert_eq!(rss, PRE >> 10, "every page resident");
    assert!(flags.split(' ').any(|f| f == "hg"), "THP advised: {flags}");
    let c = e.bdev().config_json();
    assert_eq!(c["params"]["prefault"], true, "{c}");
    let lazy = serde_json::json!({"name": "lazy2", "num_blocks": 8, "block_size": 512});
    let c = m.create(&reg, lazy).unwrap().bdev().config_json();
    assert!(c["params"].get("prefault").is_none(), "{c}");
}

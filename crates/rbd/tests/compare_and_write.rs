//! Compare-and-write through librbd (`rbd_aio_compare_and_write`) against
//! a real one-node Ceph cluster (one mon, one memstore OSD) that this test
//! starts with `scripts/ceph-cluster.sh` and stops at exit: a miscompare
//! reports the first differing byte and writes nothing, a match writes
//! (read back through the bdev and with `rbd export`), eight concurrent
//! compare-and-writes of the same old data let exactly one through (the
//! OSD compares and writes atomically), and what librbd cannot do (more
//! than one 512-byte sector; a 4 KiB-block bdev) is refused up front.

mod common;

use std::sync::Arc;

use serde_json::json;
use ustor_bdev::{BdevError, IoFlags, IoType, Registry};
use ustor_rbd::{ClusterOpts, RbdOpts};
use ustor_runtime::{IoBuf, PollMode, Runtime, RuntimeConfig};

use common::{rbd, start_cluster};

fn block(lba: u64, seed: u8) -> Vec<u8> {
    (0..512u64)
        .map(|i| (i.wrapping_mul(31) ^ lba ^ seed as u64) as u8)
        .collect()
}

async fn buf(data: &[u8]) -> IoBuf {
    let mut b = IoBuf::alloc(data.len()).await;
    b.copy_from_slice(data);
    b
}

/// Past the first 4 MiB object and not at its start, so an offset counted
/// from the image, the object or the request would each show.
const LBA: u64 = (4 << 20) / 512 + 9;

#[test]
fn compare_and_write_miscompares_without_writing_and_writes_on_match() {
    let Some((dir, conf)) = start_cluster("caw") else {
        return;
    };
    rbd(&conf, &["create", "--size", "8M", "rbd/caw"]);
    rbd(&conf, &["create", "--size", "1M", "rbd/caw4k"]);

    let rt = Runtime::start(RuntimeConfig {
        cores: vec![0],
        pin: false,
        poll_mode: PollMode::Adaptive,
        bufs: ustor_runtime::BufPoolConfig {
            mem_bytes: 8 << 20,
            classes: vec![4096, 65536],
        },
        ..Default::default()
    })
    .unwrap();
    let reg: Arc<Registry> = Registry::new(Some(rt.handle()));
    let m = ustor_rbd::register(&reg, Some(rt.handle())).unwrap();
    m.clusters
        .register(ClusterOpts {
            name: "c1".into(),
            config_file: Some(conf.clone()),
            ..Default::default()
        })
        .unwrap();
    let opts = |name: &str, image: &str, bs: u32| -> RbdOpts {
        serde_json::from_value(json!({"name": name, "pool_name": "rbd", "rbd_name": image,
            "block_size": bs, "cluster_name": "c1"}))
        .unwrap()
    };
    m.create_bdev(&reg, opts("r512", "caw", 512)).unwrap();
    m.create_bdev(&reg, opts("r4k", "caw4k", 4096)).unwrap();
    // librbd compares within one 512-byte sector: a 4 KiB-block bdev does
    // not offer it.
    let d4k = reg.open("r4k", true, |_| {}).unwrap();
    assert!(!d4k.io_type_supported(IoType::CompareAndWrite));
    drop(d4k);

    let (old, new, racers) = (block(LBA, 1), block(LBA, 2), 8u8);
    let desc = reg.open("r512", true, |_| {}).unwrap();
    let (o, n) = (old.clone(), new.clone());
    let wins = rt
        .handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            assert_eq!(ch.max_compare_and_write_blocks(), 1);
            // A block of an object never written reads as zeros, so data
            // that is not all zeros miscompares there, and nothing is
            // written (libiscsi's CompareAndWrite.Unwritten).
            let (r, _, _) = ch
                .compare_and_write(1, 1, buf(&o).await, buf(&n).await, IoFlags::NONE)
                .await;
            assert!(
                matches!(r, Err(BdevError::Miscompare { .. })),
                "compare-and-write on an unwritten block: {r:?}"
            );
            let (r, b) = ch.read(1, 1, IoBuf::alloc(512).await).await;
            r.unwrap();
            assert!(
                b[..512].iter().all(|&x| x == 0),
                "an unwritten block changed"
            );
            let (r, _) = ch.write(LBA, 1, buf(&o).await).await;
            r.unwrap();

            // Differs at bytes 100 and 300: a miscompare at 100, nothing
            // written.
            let mut cmp = o.clone();
            cmp[100] ^= 0x5a;
            cmp[300] ^= 0x5a;
            let (r, _, _) = ch
                .compare_and_write(LBA, 1, buf(&cmp).await, buf(&n).await, IoFlags::NONE)
                .await;
            assert_eq!(r, Err(BdevError::Miscompare { offset: Some(100) }));
            let (r, back) = ch.read(LBA, 1, IoBuf::alloc(512).await).await;
            r.unwrap();
            assert_eq!(&back[..], &o[..], "a miscompare wrote");

            // More than librbd's one sector: refused before librbd.
            let two = [o.clone(), o.clone()].concat();
            let (r, _, _) = ch
                .compare_and_write(LBA, 2, buf(&two).await, buf(&two).await, IoFlags::NONE)
                .await;
            assert_eq!(r, Err(BdevError::Io(libc::EINVAL)));

            // A match writes.
            let (r, _, _) = ch
                .compare_and_write(LBA, 1, buf(&o).await, buf(&n).await, IoFlags::FUA)
                .await;
            r.unwrap();
            let (r, back) = ch.read(LBA, 1, back).await;
            r.unwrap();
            assert_eq!(&back[..], &n[..]);

            // Racers all expect `new` and each write their own block: the
            // OSD lets exactly one through, the rest miscompare at byte 0
            // (every racer's data differs from `new` there).
            let mut tasks = Vec::new();
            for i in 0..racers {
                let (ch, n) = (ch.clone(), n.clone());
                tasks.push(ustor_runtime::spawn(async move {
                    let mut mine = block(LBA, 10 + i);
                    mine[0] = n[0] ^ (i + 1);
                    let r = ch
                        .compare_and_write(LBA, 1, buf(&n).await, buf(&mine).await, IoFlags::NONE)
                        .await
                        .0;
                    (r, mine)
                }));
            }
            let mut wins = Vec::new();
            for t in tasks {
                let (r, mine) = t.await;
                match r {
                    Ok(()) => wins.push(mine),
                    Err(e) => assert_eq!(e, BdevError::Miscompare { offset: Some(0) }),
                }
            }
            assert_eq!(wins.len(), 1, "exactly one racer wins");
            let (r, back) = ch.read(LBA, 1, back).await;
            r.unwrap();
            assert_eq!(&back[..], &wins[0][..]);
            wins.pop().unwrap()
        })
        .unwrap();
    // Another client (the rbd CLI) reads the winner's block.
    let export = dir.join("caw.img");
    reg.delete("r512").unwrap();
    rbd(&conf, &["export", "rbd/caw", export.to_str().unwrap()]);
    let img = std::fs::read(&export).unwrap();
    let at = LBA as usize * 512;
    assert_eq!(&img[at..at + 512], &wins[..]);
    assert_ne!(&wins[..], &old[..]);
    reg.delete("r4k").unwrap();
}

//! SCSI bdev channels on reactors other than the host's: I/O forwarded to
//! the host's reactor and back, with verified data, concurrently from both
//! reactors, and hot removal seen from the remote reactor.

mod common;

use std::sync::Arc;

use common::*;
use ustor_bdev::{BdevError, Registry};
use ustor_runtime::{IoBuf, PollMode, Runtime, RuntimeConfig};
use ustor_scsi::lld::HostLimits;
use ustor_scsi::mid::HostConfig;
use ustor_scsi::ScsiStack;
use ustor_scsi_emul::EmulHandle;

const BS: u64 = 512;

/// Two reactors; the emulated host lives on reactor 0.
fn rig2() -> Rig {
    let rt = Runtime::start(RuntimeConfig {
        cores: vec![0, 1],
        pin: false,
        poll_mode: PollMode::Adaptive,
        bufs: ustor_runtime::BufPoolConfig {
            mem_bytes: 16 << 20,
            classes: vec![4096, 65536, 1 << 20],
        },
        ..Default::default()
    })
    .expect("runtime");
    let reg = Registry::new(Some(rt.handle()));
    let stack = ScsiStack::new(rt.handle(), reg.clone());
    let emul = EmulHandle::new(1, vec![disk(0)], HostLimits::default());
    let e = emul.clone();
    let host = stack
        .add_host(0, HostConfig::default(), move || Ok(e.lld()))
        .expect("add host");
    Rig {
        rt,
        reg,
        stack,
        emul,
        host,
    }
}

/// On `reactor`: `n` concurrent writes of `blocks` each (pattern `seed`)
/// starting at `lba0`, then `n` concurrent reads, each checked.
fn io_burst(
    r: &Rig,
    reactor: usize,
    name: &str,
    lba0: u64,
    n: u64,
    blocks: u64,
    seed: u64,
) -> Result<(), BdevError> {
    let desc = Arc::new(r.reg.open(name, true, |_| {}).expect("open"));
    r.rt.handle()
        .block_on(reactor, move || async move {
            let ch = desc.channel()?;
            let mut jobs = Vec::new();
            for i in 0..n {
                let ch = ch.clone();
                let lba = lba0 + i * blocks;
                jobs.push(ustor_runtime::spawn(async move {
                    let mut b = IoBuf::alloc((blocks * BS) as usize).await;
                    pattern(&mut b, lba, seed);
                    ch.write(lba, blocks, b).await.0
                }));
            }
            for j in jobs.drain(..) {
                j.await?;
            }
            let mut reads = Vec::new();
            for i in 0..n {
                let ch = ch.clone();
                let lba = lba0 + i * blocks;
                reads.push(ustor_runtime::spawn(async move {
                    let b = IoBuf::alloc((blocks * BS) as usize).await;
                    let (res, b) = ch.read(lba, blocks, b).await;
                    res.map(|_| (lba, b.to_vec()))
                }));
            }
            for j in reads {
                let (lba, data) = j.await?;
                expect_pattern(&data, lba, seed);
            }
            Ok(())
        })
        .expect("reactor")
}

#[test]
fn channel_on_another_reactor_forwards_io_with_verified_data() {
    let r = rig2();
    create(&r, "fwd", "sda", 0, Some(2 << 20)).unwrap();
    // 64 concurrent 4 KiB writes then reads from reactor 1 (host is on 0).
    io_burst(&r, 1, "fwd", 0, 64, 8, 7).unwrap();
    // The data is on the emulated disk, not only in some cache on the way.
    let disk = r.emul.read(0, 0, 0, 64 * 8 * BS as usize).unwrap();
    expect_pattern(&disk[..8 * BS as usize], 0, 7);
    expect_pattern(&disk[63 * 8 * BS as usize..], 63 * 8, 7);
    // Both reactors at once, on disjoint ranges; large I/O split by the
    // bdev layer (128 KiB max transfer) and forwarded piecewise.
    let r = Arc::new(r);
    let (a, b) = (r.clone(), r.clone());
    let t0 = std::thread::spawn(move || io_burst(&a, 0, "fwd", 1024, 16, 16, 11));
    let t1 = std::thread::spawn(move || io_burst(&b, 1, "fwd", 2048, 4, 512, 13));
    t0.join().unwrap().unwrap();
    t1.join().unwrap().unwrap();
    let disk = r
        .emul
        .read(0, 0, 2048 * BS as usize, 512 * BS as usize)
        .unwrap();
    expect_pattern(&disk, 2048, 13);
    // Flush and write-zeroes forwarded too.
    let desc = r.reg.open("fwd", true, |_| {}).unwrap();
    let res =
        r.rt.handle()
            .block_on(1, move || async move {
                let ch = desc.channel()?;
                ch.flush(0, 4096).await?;
                ch.write_zeroes(0, 8).await
            })
            .unwrap();
    res.unwrap();
    assert!(r
        .emul
        .read(0, 0, 0, 8 * BS as usize)
        .unwrap()
        .iter()
        .all(|b| *b == 0));
}

#[test]
fn remote_channel_sees_hot_removal() {
    let r = rig2();
    create(&r, "gone", "sda", 0, None).unwrap();
    io_burst(&r, 1, "gone", 0, 4, 8, 3).unwrap();
    let desc = Arc::new(r.reg.open("gone", true, |_| {}).unwrap());
    let d2 = desc.clone();
    // Keep a channel on reactor 1 open across the removal.
    r.rt.handle()
        .block_on(1, move || async move { d2.channel().map(|_| ()) })
        .unwrap()
        .unwrap();
    r.emul.remove_lun(0, 0);
    r.stack.scan_host(r.host).unwrap();
    let res =
        r.rt.handle()
            .block_on(1, move || async move {
                let ch = desc.channel()?;
                let b = IoBuf::alloc(4096).await;
                ch.read(0, 8, b).await.0
            })
            .unwrap();
    assert_eq!(res, Err(BdevError::Removed));
}

//! SCSI bdev channels on reactors other than the host's: I/O forwarded to
//! the host's reactor and back, with verified data, concurrently from both
//! reactors, hot removal seen from the remote reactor, and a submission
//! doorbell lost to the host's full inbox (the I/O still completes, and no
//! timer then wakes the idle reactors).

mod common;

use std::cell::RefCell;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::task::Poll;
use std::time::Duration;

use common::*;
use ustor_bdev::{BdevError, IoChannel, Registry};
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

thread_local! {
    /// The lost-doorbell test's channel, on reactor 1.
    static CH: RefCell<Option<IoChannel>> = const { RefCell::new(None) };
}

#[test]
fn a_submission_doorbell_lost_to_a_full_inbox_still_completes_and_idle_reactors_sleep() {
    let r = rig2();
    create(&r, "lost", "sda", 0, Some(1 << 20)).unwrap();
    let h = r.rt.handle();
    // A channel on reactor 1, registered with the host (reactor 0): one
    // write through it has come back.
    let desc = Arc::new(r.reg.open("lost", true, |_| {}).unwrap());
    h.block_on(1, move || async move {
        let ch = desc.channel()?;
        let mut b = IoBuf::alloc(8 * BS as usize).await;
        pattern(&mut b, 0, 21);
        ch.write(0, 8, b).await.0?;
        CH.with(|c| *c.borrow_mut() = Some(ch));
        Ok::<_, BdevError>(())
    })
    .unwrap()
    .unwrap();

    // Hold the host's reactor inside a message, then fill its inbox.
    let (gate_tx, gate_rx) = mpsc::channel::<()>();
    let held = Arc::new(AtomicBool::new(false));
    let held2 = held.clone();
    h.send(0, move || {
        held2.store(true, Ordering::Release);
        gate_rx.recv().unwrap();
    })
    .unwrap();
    testkit::wait_until(
        "the host's reactor to be held",
        Duration::from_secs(10),
        || held.load(Ordering::Acquire),
    );
    let mut filler = 0;
    while h.send(0, || {}).is_ok() {
        filler += 1;
    }
    assert!(filler > 0, "the inbox took no message");

    // A write on reactor 1: its submission doorbell finds the inbox full.
    let (sub_tx, sub_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    h.spawn_on(1, move || async move {
        let ch = CH.with(|c| c.borrow().clone()).unwrap();
        let mut b = IoBuf::alloc(8 * BS as usize).await;
        pattern(&mut b, 8, 22);
        let mut io = std::pin::pin!(ch.write(8, 8, b));
        // The first poll submits (and rings).
        let first = std::future::poll_fn(|cx| Poll::Ready(io.as_mut().poll(cx))).await;
        sub_tx.send(()).unwrap();
        let res = match first {
            Poll::Ready((res, _)) => res,
            Poll::Pending => io.await.0,
        };
        done_tx.send(res).unwrap();
    })
    .unwrap();
    sub_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the write was never submitted");
    assert!(
        done_rx.try_recv().is_err(),
        "completed while the host's reactor was held"
    );
    gate_tx.send(()).unwrap();
    let res = done_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the write whose doorbell was lost never completed");
    assert_eq!(res, Ok(()));
    let disk = r.emul.read(0, 0, 0, 16 * BS as usize).unwrap();
    expect_pattern(&disk[..8 * BS as usize], 0, 21);
    expect_pattern(&disk[8 * BS as usize..], 8, 22);

    // Idle now, with the channel (and the host's lost-doorbell poller)
    // still there: both reactors sleep until woken. A 1 ms retry timer
    // woke them ~195 times in this window; the bound (a tenth of that)
    // leaves room for the adaptive mode's short naps as the write's work
    // winds down, and for the spurious wake the notify left behind.
    let before = [h.sleeps(0).unwrap(), h.sleeps(1).unwrap()];
    std::thread::sleep(Duration::from_millis(200));
    let woke = [
        h.sleeps(0).unwrap() - before[0],
        h.sleeps(1).unwrap() - before[1],
    ];
    assert!(
        woke.iter().all(|w| *w <= 20),
        "idle reactors 0 and 1 slept {woke:?} times in 200 ms"
    );
    h.block_on(1, || async { CH.with(|c| drop(c.borrow_mut().take())) })
        .unwrap();
}

//! The NVMe/TCP initiator bdev against the ustor target, in one process:
//! two reactors, a malloc namespace. Data is verified byte for byte.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use ustor_bdev::{BdevError, Registry};
use ustor_nvme::initiator::{
    attach_controller, detach_controller, get_controllers, io_queue_stats, AttachParams,
    DetachParams, GetControllersParams,
};
use ustor_nvme::nvmf::{ListenAddress, ListenerParams};
use ustor_runtime::IoBuf;

fn params(e: &Env, name: &str) -> AttachParams {
    let mut p = AttachParams::tcp(name, "127.0.0.1", &e.port.to_string(), NQN);
    p.hostnqn = Some(HOSTNQN.into());
    p
}

fn fill(seed: u64, buf: &mut [u8]) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for c in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
}

/// On reactor 1: `qd` concurrent writes of `len` bytes (distinct ranges,
/// seeded patterns), then `qd` concurrent reads, compared.
fn verified_round(e: &Env, bdev: &str, qd: usize, len: usize, seed: u64) -> Result<(), BdevError> {
    let reg = e.registry.clone();
    let name = bdev.to_string();
    e.rt.handle()
        .block_on(1, move || async move {
            let d = reg.open(&name, true, |_| {}).expect("open");
            let ch = d.channel()?;
            let bs = ch.block_size() as usize;
            let nb = (len / bs) as u64;
            let mut hs = Vec::new();
            for i in 0..qd {
                let ch = ch.clone();
                hs.push(ustor_runtime::spawn(async move {
                    let mut b = IoBuf::alloc(len).await;
                    fill(seed + i as u64, &mut b);
                    ch.write(i as u64 * nb, nb, b).await.0
                }));
            }
            for h in hs {
                h.await?;
            }
            let mut hs = Vec::new();
            for i in 0..qd {
                let ch = ch.clone();
                hs.push(ustor_runtime::spawn(async move {
                    let mut b = IoBuf::alloc(len).await;
                    b.fill(0xee);
                    let (r, b) = ch.read(i as u64 * nb, nb, b).await;
                    r?;
                    let mut want = vec![0u8; len];
                    fill(seed + i as u64, &mut want);
                    assert!(b[..] == want[..], "data mismatch at I/O {i} (len {len})");
                    Ok::<(), BdevError>(())
                }));
            }
            for h in hs {
                h.await?;
            }
            Ok(())
        })
        .expect("reactor 1")
}

fn attach_and_verify(hdgst: bool, ddgst: bool, name: &str) {
    let e = env_with(65536, Default::default());
    let mut p = params(&e, name);
    p.hdgst = hdgst;
    p.ddgst = ddgst;
    let names = attach_controller(&e.rt.handle(), &e.registry, &p).expect("attach");
    assert_eq!(names, vec![format!("{name}n1")]);
    let info = e.registry.get(&names[0]).unwrap().info().clone();
    assert_eq!((info.block_size, info.num_blocks), (512, 65536));
    // 4 KiB: in-capsule. 16-32 KiB: R2T data the target copies out of its
    // greedy receives (up to its 32 KiB limit), whole or partly staged.
    // 36 and 128 KiB: R2T data received straight into the buffer.
    let sizes = [
        (1, 4096),
        (8, 4096),
        (32, 4096),
        (32, 16384),
        (16, 24576),
        (16, 32768),
        (8, 36864),
    ];
    for (qd, len) in sizes {
        verified_round(&e, &names[0], qd, len, qd as u64 * 1000 + len as u64)
            .expect("verified I/O");
    }
    let copied = |e: &Env| -> u64 {
        let st = e.target.nvmf_get_stats().expect("stats");
        st.poll_groups.iter().map(|g| g.payload_copied_bytes).sum()
    };
    let before = copied(&e);
    for (qd, len) in [(1, 131072), (8, 131072)] {
        verified_round(&e, &names[0], qd, len, qd as u64 * 1000 + len as u64)
            .expect("verified I/O");
    }
    // While an R2T for more than 32 KiB is due, the target reads at most
    // a capsule header's length (72 bytes) at a time into staging: of an
    // H2CData (24-byte header) only the first 48 bytes of data are copied.
    let big = copied(&e) - before;
    assert!(
        big <= 9 * 48,
        "target copied {big} bytes of 9 128 KiB writes"
    );
    let c = get_controllers(&GetControllersParams {
        name: Some(name.into()),
    })
    .unwrap();
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].ctrlrs[0].state, "enabled");
    assert_eq!(c[0].ctrlrs[0].trid.subnqn, NQN);
    let json = serde_json::to_value(&c).unwrap();
    assert!(json[0]["ctrlrs"][0]["trid"]["traddr"].is_string());
    let st = io_queue_stats(name).unwrap();
    assert!(st.iter().map(|s| s.ios).sum::<u64>() >= 100);
    // Reads land straight in the I/O buffers.
    assert_eq!(
        st.iter().map(|s| s.payload_copy_bytes).sum::<u64>(),
        0,
        "{st:?}"
    );
    detach_controller(&DetachParams { name: name.into() }).unwrap();
    assert!(get_controllers(&GetControllersParams {
        name: Some(name.into())
    })
    .is_err());
    assert!(e.registry.get(&names[0]).is_none());
}

#[test]
fn verified_io_without_digests() {
    attach_and_verify(false, false, "NvmePlain");
}

#[test]
fn verified_io_with_digests() {
    attach_and_verify(true, true, "NvmeDigest");
}

fn listener(e: &Env) -> ListenerParams {
    ListenerParams {
        nqn: NQN.into(),
        listen_address: ListenAddress {
            trtype: "TCP".into(),
            adrfam: "IPv4".into(),
            traddr: "127.0.0.1".into(),
            trsvcid: e.port.to_string(),
        },
    }
}

#[test]
fn io_during_an_outage_completes_after_reconnect() {
    let e = env_with(65536, Default::default());
    let mut p = params(&e, "NvmeRecon");
    p.ctrlr_loss_timeout_sec = 20;
    p.reconnect_delay_sec = 1;
    let names = attach_controller(&e.rt.handle(), &e.registry, &p).unwrap();
    verified_round(&e, &names[0], 4, 4096, 1).unwrap();
    // The target drops the controller and stops listening.
    e.target
        .nvmf_subsystem_remove_listener(&listener(&e))
        .unwrap();
    testkit::wait_until(
        "the initiator to see its controller dropped",
        Duration::from_secs(10),
        || {
            let c = get_controllers(&GetControllersParams {
                name: Some("NvmeRecon".into()),
            })
            .unwrap();
            c[0].ctrlrs[0].state != "enabled"
        },
    );
    // I/O issued during the outage: it must wait, then complete.
    let t0 = Instant::now();
    let (reg, name) = (e.registry.clone(), names[0].clone());
    let h = e.rt.handle();
    let io = std::thread::spawn(move || {
        let e2 = EnvRef {
            rt: h,
            registry: reg,
        };
        e2.round(&name, 8, 8192, 77)
    });
    // The workload: a 1.5 s outage in which the I/O must not complete.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!io.is_finished(), "I/O completed while the target was away");
    e.target.nvmf_subsystem_add_listener(&listener(&e)).unwrap();
    io.join().unwrap().expect("I/O after reconnect");
    assert!(t0.elapsed() < Duration::from_secs(15));
    let c = get_controllers(&GetControllersParams {
        name: Some("NvmeRecon".into()),
    })
    .unwrap();
    assert_eq!(c[0].ctrlrs[0].state, "enabled");
    assert!(c[0].ctrlrs[0].resets >= 1);
    verified_round(&e, &names[0], 16, 4096, 5).unwrap();
    detach_controller(&DetachParams {
        name: "NvmeRecon".into(),
    })
    .unwrap();
}

#[test]
fn io_fails_after_ctrlr_loss_timeout() {
    let e = env_with(65536, Default::default());
    let mut p = params(&e, "NvmeLost");
    p.ctrlr_loss_timeout_sec = 2;
    p.reconnect_delay_sec = 1;
    let names = attach_controller(&e.rt.handle(), &e.registry, &p).unwrap();
    verified_round(&e, &names[0], 2, 4096, 9).unwrap();
    e.target
        .nvmf_subsystem_remove_listener(&listener(&e))
        .unwrap();
    let t0 = Instant::now();
    let r = verified_round(&e, &names[0], 4, 4096, 10);
    let took = t0.elapsed();
    assert!(r.is_err(), "I/O must fail once the controller is lost");
    assert!(
        took >= Duration::from_millis(900),
        "failed too early: {took:?}"
    );
    assert!(took < Duration::from_secs(10), "failed too late: {took:?}");
    let c = get_controllers(&GetControllersParams {
        name: Some("NvmeLost".into()),
    })
    .unwrap();
    assert_eq!(c[0].ctrlrs[0].state, "failed");
    detach_controller(&DetachParams {
        name: "NvmeLost".into(),
    })
    .unwrap();
}

/// What a helper thread needs to drive I/O.
struct EnvRef {
    rt: ustor_runtime::RuntimeHandle,
    registry: Arc<Registry>,
}

impl EnvRef {
    fn round(&self, bdev: &str, qd: usize, len: usize, seed: u64) -> Result<(), BdevError> {
        let reg = self.registry.clone();
        let name = bdev.to_string();
        self.rt
            .block_on(1, move || async move {
                let d = reg.open(&name, true, |_| {}).expect("open");
                let ch = d.channel()?;
                let nb = (len / ch.block_size() as usize) as u64;
                for i in 0..qd {
                    let mut b = IoBuf::alloc(len).await;
                    fill(seed + i as u64, &mut b);
                    ch.write(i as u64 * nb, nb, b).await.0?;
                }
                for i in 0..qd {
                    let b = IoBuf::alloc(len).await;
                    let (r, b) = ch.read(i as u64 * nb, nb, b).await;
                    r?;
                    let mut want = vec![0u8; len];
                    fill(seed + i as u64, &mut want);
                    assert!(b[..] == want[..], "data mismatch after reconnect");
                }
                Ok(())
            })
            .expect("reactor 1")
    }
}

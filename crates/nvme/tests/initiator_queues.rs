//! The initiator against a controller that grants fewer I/O queues than it
//! asked for (found by `ustor bench --cores 0,1` against a target with
//! `max_io_qpairs_per_ctrlr` 1): a reactor beyond the grant must get a
//! channel error, not a queue whose refused Connect resets the controller
//! (which dropped the working queue too, in a loop, and hung the I/O).

use std::sync::Arc;
use std::time::Duration;

use ustor_bdev::{BdevError, Registry};
use ustor_nvme::initiator::{
    attach_controller, detach_controller, get_controllers, AttachParams, DetachParams,
    GetControllersParams,
};
use ustor_nvme::nvmf::TransportOpts;
use ustor_runtime::IoBuf;

mod common;

use common::{Env, NQN};

/// Two reactors, a malloc namespace, a target granting `max_io_queues`.
fn env(max_io_queues: u16) -> Env {
    common::env_opts(
        8192,
        TransportOpts {
            max_io_qpairs_per_ctrlr: max_io_queues,
            ..TransportOpts::default()
        },
    )
}

/// On `reactor`: writes `qd` 4 KiB blocks and reads them back. A channel
/// that cannot be had is the error.
fn round(e: &Env, reactor: usize, bdev: &str, seed: u8) -> Result<(), BdevError> {
    round_on(e.rt.handle(), e.registry.clone(), reactor, bdev, seed)
}

fn round_on(
    rt: ustor_runtime::RuntimeHandle,
    reg: Arc<Registry>,
    reactor: usize,
    bdev: &str,
    seed: u8,
) -> Result<(), BdevError> {
    let name = bdev.to_string();
    rt.block_on(reactor, move || async move {
        let d = reg.open(&name, true, |_| {}).expect("open");
        let ch = d.channel()?;
        for i in 0..8u64 {
            let mut b = IoBuf::alloc(4096).await;
            b.fill(seed.wrapping_add(i as u8));
            ch.write(i * 8, 8, b).await.0?;
        }
        for i in 0..8u64 {
            let (r, b) = ch.read(i * 8, 8, IoBuf::alloc(4096).await).await;
            r?;
            assert!(b.iter().all(|x| *x == seed.wrapping_add(i as u8)));
        }
        Ok(())
    })
    .expect("reactor")
}

fn resets(name: &str) -> (String, u64) {
    let c = get_controllers(&GetControllersParams {
        name: Some(name.into()),
    })
    .unwrap();
    (c[0].ctrlrs[0].state.clone(), c[0].ctrlrs[0].resets)
}

#[test]
fn reactor_beyond_granted_queues_gets_an_error_not_a_reset_loop() {
    let e = env(1);
    // Asks for the default 64 queues; the controller grants one.
    let mut p = AttachParams::tcp("NvmeFewQ", "127.0.0.1", &e.port.to_string(), NQN);
    p.ctrlr_loss_timeout_sec = 5;
    let names = attach_controller(&e.rt.handle(), &e.registry, &p).unwrap();
    round(&e, 0, &names[0], 1).expect("reactor 0 has the granted queue");
    let (rt, reg, name) = (e.rt.handle(), e.registry.clone(), names[0].clone());
    let h = std::thread::spawn(move || round_on(rt, reg, 1, &name, 2));
    // Before the fix: the refused queue reset the controller, in a loop.
    let finished = testkit::try_wait_for(Duration::from_secs(10), || h.is_finished().then_some(()));
    assert!(
        finished.is_some(),
        "I/O on the second reactor hangs; controller {:?}",
        resets("NvmeFewQ")
    );
    let r = h.join().unwrap();
    assert!(
        r.is_err(),
        "second reactor got a queue the controller lacks"
    );
    // A window in which a (wrong) reset would show, not a wait.
    std::thread::sleep(Duration::from_millis(300));
    // The controller was not reset and its queue still works.
    assert_eq!(resets("NvmeFewQ"), ("enabled".into(), 0));
    round(&e, 0, &names[0], 3).expect("reactor 0 after the refusal");
    assert_eq!(resets("NvmeFewQ"), ("enabled".into(), 0));
    detach_controller(&DetachParams {
        name: "NvmeFewQ".into(),
    })
    .unwrap();
}

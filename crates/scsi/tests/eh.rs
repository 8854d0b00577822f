//! Every error-handling and retry path, driven deterministically by the
//! emulated HBA's fault script: timeout → abort → LUN reset → host reset →
//! offline, BUSY / TASK SET FULL back-off, NOT READY becoming ready,
//! UNIT ATTENTION, and medium / hardware errors reaching the bdev with the
//! sense kept.

mod common;

use common::*;
use ustor_bdev::BdevError;
use ustor_scsi::api::*;
use ustor_scsi::cdb::op;
use ustor_scsi::mid::DeviceState;
use ustor_scsi::sense::{asc, Sense, SenseKey};
use ustor_scsi_emul::{Fault, FaultRule, TmfFaults};

fn setup() -> Rig {
    let r = rig(vec![disk(0), disk(1)]);
    create(&r, "d", "sda", 0, None).unwrap();
    create(&r, "e", "sdb", 0, None).unwrap();
    r
}

#[test]
fn timeout_is_aborted_and_retried() {
    let r = setup();
    r.emul
        .push_fault(FaultRule::on(op::WRITE_10, 1, Fault::Timeout));
    write(&r, "d", 0, 8, 1).unwrap();
    expect_pattern(&read(&r, "d", 0, 8).unwrap(), 0, 1);
    let s = stats(&r);
    assert_eq!(
        (s.timeouts, s.aborts, s.aborts_failed, s.device_resets),
        (1, 1, 0, 0)
    );
    assert_eq!(r.emul.tmf_counts(), (1, 0, 0));
    assert_eq!(r.emul.count(op::WRITE_10), 2, "the write was issued again");
}

#[test]
fn dropped_completion_with_failing_abort_resets_the_lun() {
    let r = setup();
    r.emul.set_tmf_faults(TmfFaults {
        abort_fails: true,
        ..Default::default()
    });
    r.emul
        .push_fault(FaultRule::on(op::WRITE_10, 1, Fault::DropCompletion));
    write(&r, "d", 16, 8, 2).unwrap();
    expect_pattern(&read(&r, "d", 16, 8).unwrap(), 16, 2);
    let s = stats(&r);
    assert_eq!(
        (s.timeouts, s.aborts_failed, s.device_resets, s.host_resets),
        (1, 1, 1, 0)
    );
    // The LUN reset's unit attention was retried away.
    assert!(s.unit_attentions >= 3);
    assert_eq!(r.emul.tmf_counts(), (1, 1, 0));
}

#[test]
fn failing_lun_reset_escalates_to_host_reset() {
    let r = setup();
    r.emul.set_tmf_faults(TmfFaults {
        abort_fails: true,
        device_reset_fails: true,
        ..Default::default()
    });
    r.emul
        .push_fault(FaultRule::on(op::READ_10, 1, Fault::Timeout));
    write(&r, "d", 0, 8, 3).unwrap();
    expect_pattern(&read(&r, "d", 0, 8).unwrap(), 0, 3);
    let s = stats(&r);
    assert_eq!(
        (
            s.aborts_failed,
            s.device_resets_failed,
            s.host_resets,
            s.host_resets_failed,
            s.offlined
        ),
        (1, 1, 1, 0, 0)
    );
    // The other device kept working.
    write(&r, "e", 0, 8, 4).unwrap();
    expect_pattern(&read(&r, "e", 0, 8).unwrap(), 0, 4);
}

#[test]
fn failing_host_reset_takes_the_device_offline() {
    let r = setup();
    r.emul.set_tmf_faults(TmfFaults {
        abort_fails: true,
        device_reset_fails: true,
        host_reset_fails: true,
    });
    r.emul
        .push_fault(FaultRule::on(op::WRITE_10, 1, Fault::Timeout));
    assert_eq!(write(&r, "d", 0, 8, 5), Err(BdevError::Io(libc::ENXIO)));
    let s = stats(&r);
    assert_eq!((s.host_resets_failed, s.offlined), (1, 1));
    assert_eq!(
        r.stack.find_device("sda").unwrap().state,
        DeviceState::Offline
    );
    // Offline fails fast; the healthy LUN is untouched.
    assert_eq!(read(&r, "d", 0, 8), Err(BdevError::Io(libc::ENXIO)));
    write(&r, "e", 0, 8, 6).unwrap();
    expect_pattern(&read(&r, "e", 0, 8).unwrap(), 0, 6);
}

#[test]
fn timeouts_beyond_the_retry_budget_fail_with_etimedout() {
    let r = setup();
    r.emul
        .push_fault(FaultRule::on(op::WRITE_10, 0, Fault::Timeout));
    assert_eq!(write(&r, "d", 0, 8, 1), Err(BdevError::Io(libc::ETIMEDOUT)));
    let s = stats(&r);
    assert_eq!((s.timeouts, s.aborts), (4, 4), "first try + 3 retries");
    r.emul.clear_faults();
    write(&r, "d", 0, 8, 1).unwrap();
}

#[test]
fn busy_and_task_set_full_back_off_and_retry() {
    let r = setup();
    r.emul
        .push_fault(FaultRule::on(op::WRITE_10, 2, Fault::Busy));
    r.emul
        .push_fault(FaultRule::on(op::READ_10, 2, Fault::TaskSetFull));
    write(&r, "d", 0, 8, 7).unwrap();
    expect_pattern(&read(&r, "d", 0, 8).unwrap(), 0, 7);
    let s = stats(&r);
    assert_eq!((s.busy, s.task_set_full, s.timeouts), (2, 2, 0));
    assert_eq!(r.emul.count(op::WRITE_10), 3);
}

#[test]
fn not_ready_becoming_ready_is_waited_for() {
    let r = setup();
    let nr = Sense::new(SenseKey::NotReady, asc::BECOMING_READY);
    r.emul
        .push_fault(FaultRule::on(op::WRITE_10, 2, Fault::Check(nr)));
    write(&r, "d", 0, 8, 8).unwrap();
    assert_eq!(stats(&r).not_ready_retries, 2);
    // Medium not present is not retried.
    let np = Sense::new(SenseKey::NotReady, asc::MEDIUM_NOT_PRESENT);
    r.emul
        .push_fault(FaultRule::on(op::WRITE_10, 1, Fault::Check(np)));
    assert_eq!(write(&r, "d", 0, 8, 8), Err(BdevError::Io(libc::EAGAIN)));
}

#[test]
fn unit_attention_is_retried() {
    let r = setup();
    r.emul.set_ua(
        0,
        0,
        Sense::new(SenseKey::UnitAttention, asc::POWER_ON_RESET),
    );
    let before = stats(&r).unit_attentions;
    write(&r, "d", 0, 8, 9).unwrap();
    assert_eq!(stats(&r).unit_attentions, before + 1);
    expect_pattern(&r.emul.read(0, 0, 0, 4096).unwrap(), 0, 9);
}

#[test]
fn medium_and_hardware_errors_reach_the_bdev_with_sense_kept() {
    let r = setup();
    let retries0 = stats(&r).retries;
    let me = Sense {
        info: Some(42),
        ..Sense::new(SenseKey::MediumError, asc::UNRECOVERED_READ)
    };
    r.emul
        .push_fault(FaultRule::on(op::READ_10, 1, Fault::Check(me)));
    assert_eq!(read(&r, "d", 40, 8), Err(BdevError::Io(libc::EIO)));
    let dev = scsi_get_devices(
        &r.stack,
        GetDevicesParams {
            device: Some("sda".into()),
        },
    )
    .unwrap();
    assert_eq!(dev[0].last_sense, Some(me), "sense kept on the device");
    let hw = Sense::new(SenseKey::HardwareError, asc::INTERNAL_TARGET_FAILURE);
    r.emul
        .push_fault(FaultRule::on(op::WRITE_10, 1, Fault::Check(hw)));
    assert_eq!(write(&r, "d", 0, 8, 1), Err(BdevError::Io(libc::EIO)));
    let dp = Sense::new(SenseKey::DataProtect, asc::WRITE_PROTECTED);
    r.emul
        .push_fault(FaultRule::on(op::WRITE_10, 1, Fault::Check(dp)));
    assert_eq!(write(&r, "d", 0, 8, 1), Err(BdevError::ReadOnly));
    let s = stats(&r);
    assert_eq!(
        (s.medium_errors, s.hardware_errors, s.retries - retries0),
        (1, 1, 0),
        "no retries"
    );
    // One I/O error does not take the device down.
    write(&r, "d", 0, 8, 1).unwrap();
}

#[test]
fn manual_resets_through_the_control_api() {
    let r = setup();
    scsi_device_reset(
        &r.stack,
        DeviceParams {
            device: "sdb".into(),
        },
    )
    .unwrap();
    scsi_host_reset(&r.stack, HostParams { host: r.host }).unwrap();
    assert_eq!(r.emul.tmf_counts(), (0, 1, 1));
    // The resets' unit attentions are absorbed by the retry rules.
    write(&r, "e", 0, 8, 2).unwrap();
    expect_pattern(&read(&r, "e", 0, 8).unwrap(), 0, 2);
    r.emul.set_tmf_faults(TmfFaults {
        host_reset_fails: true,
        ..Default::default()
    });
    assert!(scsi_host_reset(&r.stack, HostParams { host: r.host }).is_err());
    let s = scsi_get_stats(&r.stack).unwrap();
    assert_eq!(
        (
            s[0].device_resets,
            s[0].host_resets,
            s[0].host_resets_failed
        ),
        (1, 2, 1)
    );
}

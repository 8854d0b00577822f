//! The mid-layer and SCSI bdevs over the emulated HBA: scan and identity,
//! driver binding, bdev mapping rules, data verified through every I/O
//! kind, splitting, hot add/remove.

mod common;

use common::*;
use ustor_bdev::{BdevError, IoType};
use ustor_scsi::api::*;
use ustor_scsi::cdb::op;
use ustor_scsi::inquiry::DeviceType;
use ustor_scsi::mid::DeviceState;
use ustor_scsi_emul::EmulLun;

#[test]
fn scan_finds_and_identifies_devices() {
    let mut tape = EmulLun::disk(0, 2, 16, 512);
    tape.device_type = DeviceType::Tape;
    let r = rig(vec![disk(0), EmulLun::disk(0, 1, 4096, 4096), tape]);
    let devs = scsi_get_devices(&r.stack, GetDevicesParams::default()).unwrap();
    assert_eq!(devs.len(), 3, "{devs:#?}");
    let sda = &devs[0];
    assert_eq!((sda.name.as_str(), sda.hctl.as_str()), ("sda", "0:0:0:0"));
    assert_eq!((sda.block_size, sda.num_blocks), (512, 8192));
    assert_eq!(sda.driver, Some("sd"));
    assert_eq!(sda.serial.as_deref(), Some("EMUL0-0"));
    assert_eq!(sda.ids, vec!["naa.6001405e00000000".to_string()]);
    assert_eq!(sda.block_limits.unwrap().max_xfer_blocks, 256);
    assert_eq!(sda.characteristics.unwrap().rotation_rate, 1);
    assert_eq!(
        (sda.vendor.as_str(), sda.product.as_str()),
        ("USTOR", "EMUL DISK")
    );
    assert!(sda.thin_provisioned);
    assert!(sda.unmap_reads_zero, "the emulated thin disk reports LBPRZ");
    assert_eq!(sda.state, DeviceState::Running);
    assert_eq!(devs[1].block_size, 4096);
    // The tape is listed but has no driver bound.
    assert_eq!(
        (devs[2].device_type, devs[2].driver),
        (DeviceType::Tape, None)
    );
    // Lookup by name, H:C:T:L, serial and id all find the same device.
    for key in ["sda", "0:0:0:0", "EMUL0-0", "naa.6001405e00000000"] {
        assert_eq!(r.stack.find_device(key).unwrap().hctl, "0:0:0:0");
    }
    let hosts = scsi_get_hosts(&r.stack);
    assert_eq!((hosts.len(), hosts[0].driver.as_str()), (1, "emul"));
    // The power-on unit attention was retried away during bring-up.
    assert!(stats(&r).unit_attentions >= 1);
}

#[test]
fn bdevs_map_ranges_and_refuse_overlaps() {
    let r = rig(vec![disk(0)]);
    create(&r, "a", "sda", 0, Some(1 << 20)).unwrap();
    create(&r, "b", "0:0:0:0", 1 << 20, Some(1 << 20)).unwrap();
    let e = create(&r, "c", "sda", (1 << 20) + 512, Some(4096)).unwrap_err();
    assert!(e.to_string().contains("overlaps"), "{e}");
    assert!(
        create(&r, "d", "sda", 100, Some(4096)).is_err(),
        "unaligned offset"
    );
    assert!(
        create(&r, "d", "sda", 0, Some(8 << 20)).is_err(),
        "past the end"
    );
    assert!(create(&r, "d", "sdz", 0, None).is_err(), "no such device");
    // The rest of the device by default.
    create(&r, "rest", "sda", 2 << 20, None).unwrap();
    assert_eq!(r.reg.get("rest").unwrap().info().num_blocks, 8192 - 4096);
    // Same pattern written to both: each lands at its own device offset.
    write(&r, "a", 0, 8, 1).unwrap();
    write(&r, "b", 0, 8, 2).unwrap();
    expect_pattern(&read(&r, "a", 0, 8).unwrap(), 0, 1);
    expect_pattern(&read(&r, "b", 0, 8).unwrap(), 0, 2);
    expect_pattern(&r.emul.read(0, 0, 1 << 20, 4096).unwrap(), 0, 2);
    assert!(matches!(
        read(&r, "a", 2048, 1),
        Err(BdevError::OutOfRange { .. })
    ));
    assert_eq!(bdev_scsi_get_mappings(&r.stack).len(), 3);
    bdev_scsi_delete(&r.stack, ScsiBdevDelete { name: "a".into() }).unwrap();
    assert!(r.reg.get("a").is_none());
    create(&r, "a2", "sda", 0, Some(1 << 20)).unwrap();
}

#[test]
fn io_kinds_become_the_right_commands() {
    let r = rig(vec![disk(0)]);
    create(&r, "d", "sda", 0, None).unwrap();
    let e = r.reg.get("d").unwrap();
    assert!(e.bdev().io_type_supported(IoType::Unmap));
    assert!(e.bdev().io_type_supported(IoType::WriteZeroes));
    // The disk reports LBPRZ: the bdev promises zeroes after an unmap.
    assert!(e.bdev().info().unmap_reads_zero);
    // 1000 blocks: split to the 256-block transfer limit by the bdev layer.
    let w0 = r.emul.count(op::WRITE_10);
    write(&r, "d", 100, 1000, 9).unwrap();
    assert_eq!(r.emul.count(op::WRITE_10) - w0, 4);
    expect_pattern(&read(&r, "d", 100, 1000).unwrap(), 100, 9);
    expect_pattern(&r.emul.read(0, 0, 100 * 512, 1000 * 512).unwrap(), 100, 9);
    let desc = r.reg.open("d", true, |_| {}).unwrap();
    let (unmap, zero, flush) =
        r.rt.handle()
            .block_on(0, move || async move {
                let ch = desc.channel().unwrap();
                // 3000 blocks: three UNMAPs of at most 1024 blocks.
                let u = ch.unmap(100, 3000).await;
                let z = ch.write_zeroes(5000, 2100).await;
                let f = ch.flush(0, 8192).await;
                (u, z, f)
            })
            .unwrap();
    assert_eq!((unmap, zero, flush), (Ok(()), Ok(()), Ok(())));
    assert_eq!(r.emul.count(op::UNMAP), 3);
    assert_eq!(r.emul.count(op::WRITE_SAME_16), 3);
    assert_eq!(r.emul.count(op::SYNCHRONIZE_CACHE_10), 1);
    assert!(read(&r, "d", 100, 1000).unwrap().iter().all(|b| *b == 0));
}

#[test]
fn luns_come_and_go_with_unit_attentions() {
    let r = rig(vec![disk(0)]);
    create(&r, "d0", "sda", 0, Some(1 << 20)).unwrap();
    write(&r, "d0", 0, 8, 3).unwrap();
    // A new LUN appears: the next command to LUN 0 gets REPORTED LUNS DATA
    // HAS CHANGED, which is retried and triggers a rescan.
    r.emul.add_lun(disk(5));
    write(&r, "d0", 8, 8, 3).unwrap();
    let found = testkit::try_wait_for(std::time::Duration::from_secs(10), || {
        r.stack.find_device("0:0:0:5").ok()
    })
    .is_some();
    assert!(found, "LUN 5 was not discovered: {:#?}", r.stack.devices());
    assert_eq!(r.stack.find_device("0:0:0:5").unwrap().name, "sdb");
    assert!(stats(&r).luns_changed >= 1);
    create(&r, "d5", "sdb", 0, Some(1 << 20)).unwrap();
    write(&r, "d5", 0, 8, 4).unwrap();
    expect_pattern(&r.emul.read(0, 5, 0, 4096).unwrap(), 0, 4);
    // It goes away again; an explicit rescan removes it and its bdev.
    r.emul.remove_lun(0, 5);
    let rep = scsi_scan_host(&r.stack, HostParams { host: r.host }).unwrap();
    assert_eq!(rep.removed, vec!["sdb".to_string()]);
    assert!(
        r.reg.get("d5").is_none(),
        "bdev on a removed LUN is hot-removed"
    );
    assert!(r.stack.find_device("sdb").is_err());
    expect_pattern(&read(&r, "d0", 0, 8).unwrap(), 0, 3);
    expect_pattern(&read(&r, "d0", 8, 8).unwrap(), 8, 3);
}

//! The virtio-scsi PCI LLD over VFIO, end to end in a QEMU/TCG guest (q35
//! with an emulated Intel IOMMU, one boot): the guest runs
//! `tests/guest/scsi-vfio.sh` with the `ustor` binary against a
//! virtio-scsi-pci HBA (iommu_platform=on) holding three disks backed by
//! host files — target 0 LUNs 0 and 1, target 2 LUN 0 —, an LSI 53C895A
//! for the wrong-driver checks, and an LSI SAS1068 (`mptsas1068`, the MPT
//! Fusion driver) with two disks on targets 1 and 3, and a two-function
//! virtio-scsi slot (one IOMMU group). Checks, for both drivers: clear
//! errors for an unbound device, a wrong driver and (virtio-scsi) a device
//! whose IOMMU group holds a device still on its kernel driver, the
//! scan finds all the disks, LUN and host reset, a host reset that fails
//! cleanly once the HBA stops answering (its memory decoding turned off
//! behind ustor's back: registers read as zeroes), detach and re-attach, and
//! `ustor bench --verify` through SCSI bdevs on two disks, whose blocks the
//! host then finds in the image files at the bdevs' offset; save_config
//! lists the attach. Flush and unmap through both drivers: `ustor bench
//! -w flush --verify` reads every flushed unit back intact, `-w unmap`
//! deallocates a 1 MiB range that the host then reads as zeroes (the
//! drives pass discards to the image files). The SAS1068's target 1 runs
//! its passes in 1 MiB commands. Hot-unplug: the guest asks the host to
//! `device_del` a disk of each HBA (QMP) under a running `ustor bench`;
//! the mid-layer sees the disk gone and the bench ends with I/O errors.
//! Error handling for real: target 4 of the virtio-scsi HBA and target 5
//! of the SAS1068 are NBD drives that a `ustor serve` on the host exports
//! through delay bdevs; once the read phase of a QD1 `ustor bench -w read
//! --verify` pass runs, the guest asks the host (`on_host`) to make their
//! reads take 5 s, so one read sits in QEMU's block layer, which cannot
//! cancel it. The command times out, ABORT TASK times out, and the
//! mid-layer escalates: virtio-scsi's LUN reset makes QEMU drain the read
//! and answer (or, should its TMF time out first, a host reset follows);
//! the SAS1068's IOC still holds the
//! timed-out TMF's frame, so its LUN reset fails and a host reset (IOC
//! reset) follows. The retried read and every other block of the pass
//! verify, and the host finds the blocks the pass's verify prefill wrote
//! (a read pass with `--verify` writes its region first) in the images.
//!
//! Skips (`SKIPPED: reason`) only when no guest can run here.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;

use testvm::host::{md5_bytes, md5_range};
use testvm::{guest_script, require_guest, GuestBuilder};

const OFFSET_MIB: u64 = 1;
const SIZE_MIB: u64 = 4;
const SEED: u64 = 0xf10;
/// Where the flush and unmap passes run, 1 MiB long.
const UNMAP_OFF_MIB: u64 = 8;
const HBA: &str = "0000:00:05.0";
const WRONG: &str = "0000:00:06.0";
const MPT: &str = "0000:00:07.0";
/// Function 0 of a two-function slot: one IOMMU group with function 1.
const SHARED: &str = "0000:00:08.0";
/// Hot-unplug of target 0 LUN 1 (virtio-scsi) and target 1 (SAS1068).
const DEL_VDEV1: &str = r#"{"execute": "device_del", "arguments": {"id": "vdev1"}}"#;
const DEL_MDEV0: &str = r#"{"execute": "device_del", "arguments": {"id": "mdev0"}}"#;

/// How long a read takes on the host's delay bdevs while the guest makes
/// one get stuck: longer than the guest's command timeout (1 s) and TMF
/// timeout (1 s) together, with room for a loaded machine.
const STUCK_US: u64 = 5_000_000;
/// The size of the escalation passes' bdevs (at `OFFSET_MIB`).
const ESC_MIB: u64 = 1;

/// A `ustor serve` on the host exporting `nv` and `nm` by NBD on
/// 127.0.0.1 through delay bdevs `dnv` and `dnm` (no delay yet) over the
/// image files.
fn nbd_server(dir: &Path, nv: &Path, nm: &Path) -> common::Server {
    let mut bdevs = Vec::new();
    let mut exports = Vec::new();
    for (name, img) in [("nv", nv), ("nm", nm)] {
        bdevs.push(json!({"method": "bdev_uring_create",
            "params": {"name": name, "filename": img.to_str().unwrap(), "block_size": 512}}));
        bdevs.push(json!({"method": "bdev_delay_create", "params": {
            "base_bdev_name": name, "name": format!("d{name}"),
            "avg_read_latency": 0, "p99_read_latency": 0,
            "avg_write_latency": 0, "p99_write_latency": 0}}));
        exports.push(json!({"method": "nbd_export_create",
            "params": {"name": format!("d{name}"), "bdev_name": format!("d{name}")}}));
    }
    exports.insert(
        0,
        json!({"method": "nbd_server_start",
            "params": {"listen_address": {"traddr": "127.0.0.1", "trsvcid": "0"}}}),
    );
    let cfg = json!({"subsystems": [
        {"subsystem": "bdev", "config": bdevs},
        {"subsystem": "nbd", "config": exports},
    ]});
    common::Server::start(dir, &cfg, &[])
}

/// A host action: sets the read latency of delay bdev `bdev`.
fn set_read_latency(
    sock: PathBuf,
    bdev: &'static str,
    us: u64,
) -> impl Fn() -> String + Send + Sync + 'static {
    move || {
        let mut out = Vec::new();
        for t in ["avg_read", "p99_read"] {
            let p = json!({"delay_bdev_name": bdev, "latency_type": t, "latency_us": us});
            let r = ustor_rpc::RpcClient::connect(&sock)
                .map_err(|e| format!("{e:?}"))
                .and_then(|mut c| {
                    c.call("bdev_delay_update_latency", p)
                        .map_err(|e| format!("{e:?}"))
                });
            out.push(match r {
                Ok(v) => format!("{bdev} {t}={us}: {v}"),
                Err(e) => format!("{bdev} {t}={us}: error {e}"),
            });
        }
        out.join("; ")
    }
}

/// What `bench --verify -w read` leaves in a bdev of `mib` MiB of 512-byte
/// blocks (its verify prefill).
fn expected_md5(seed: u64, mib: u64) -> String {
    let mut buf = vec![0u8; (mib << 20) as usize];
    ustor_bench::verify::fill(&mut buf, 512, 0, seed, 1);
    md5_bytes(&buf).unwrap()
}

fn disk(dir: &Path, name: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    p
}

/// Checks the verify blocks of `tag`'s write and read passes in `img`.
fn check_image(out: &testvm::GuestOutcome, tag: &str, img: &Path, want: &str) {
    for pass in ["write", "read"] {
        let ios: u64 = out
            .value(&format!("{tag}_{pass}_ios"))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert!(ios > 0, "{tag} {pass}: no I/O");
    }
    // The blocks ustor wrote by DMA reached the right disk's file.
    let host = md5_range(img, OFFSET_MIB << 20, (SIZE_MIB << 20) as usize).unwrap();
    assert_eq!(host, want, "{tag}: image differs from the verify blocks");
}

#[test]
fn virtio_scsi_and_mptsas_over_vfio_in_guest() {
    require_guest!();
    let dir = common::tmpdir("scsi-vfio");
    let disks = [
        disk(&dir, "t0l0.img"),
        disk(&dir, "t0l1.img"),
        disk(&dir, "t2l0.img"),
    ];
    let mpt_disks = [disk(&dir, "m1.img"), disk(&dir, "m3.img")];
    // Targets 4 (virtio-scsi) and 5 (SAS1068), by NBD from the host.
    let (nv, nm) = (disk(&dir, "nv.img"), disk(&dir, "nm.img"));
    let srv = nbd_server(&dir, &nv, &nm);
    let port = srv.nbd_port();
    let mut g = GuestBuilder::new()
        .script_file(guest_script("scsi-vfio.sh"))
        .binary(env!("CARGO_BIN_EXE_ustor"))
        .iommu()
        .kernel_arg("intel_iommu=on")
        .qemu_arg("-device")
        .qemu_arg(
            "virtio-scsi-pci,id=vscsi,bus=pcie.0,addr=0x5,iommu_platform=on,disable-legacy=on",
        )
        .qemu_arg("-device")
        .qemu_arg("lsi53c895a,bus=pcie.0,addr=0x6")
        .qemu_arg("-device")
        .qemu_arg("mptsas1068,id=mpt,bus=pcie.0,addr=0x7")
        .qemu_arg("-device")
        .qemu_arg(
            "virtio-scsi-pci,bus=pcie.0,addr=0x8.0,multifunction=on,iommu_platform=on,disable-legacy=on",
        )
        .qemu_arg("-device")
        .qemu_arg("virtio-scsi-pci,bus=pcie.0,addr=0x8.1,iommu_platform=on,disable-legacy=on")
        .cpus(2)
        .memory_mib(1024)
        .env("VFIO_BDF", HBA)
        .env("WRONG_BDF", WRONG)
        .env("MPT_BDF", MPT)
        .env("SHARED_BDF", SHARED)
        .env("SEED", SEED.to_string())
        .env("OFF_MIB", OFFSET_MIB.to_string())
        .env("SIZE_MIB", SIZE_MIB.to_string())
        .env("BENCH_S", "1")
        .env("UNMAP_OFF_MIB", UNMAP_OFF_MIB.to_string())
        .on_qmp("unplug-t0l1", &[DEL_VDEV1])
        .on_qmp("unplug-m1", &[DEL_MDEV0])
        .on_host("slow-t4", set_read_latency(srv.sock.clone(), "dnv", STUCK_US))
        .on_host("fast-t4", set_read_latency(srv.sock.clone(), "dnv", 0))
        .on_host("slow-m5", set_read_latency(srv.sock.clone(), "dnm", STUCK_US))
        .on_host("fast-m5", set_read_latency(srv.sock.clone(), "dnm", 0))
        .timeout(Duration::from_secs(420));
    for (i, (d, (t, l))) in disks.iter().zip([(0, 0), (0, 1), (2, 0)]).enumerate() {
        g = g
            .qemu_arg("-drive")
            .qemu_arg(format!(
                "file={},if=none,format=raw,id=vd{i},cache=writeback,discard=unmap",
                d.display()
            ))
            .qemu_arg("-device")
            .qemu_arg(format!(
                "scsi-hd,drive=vd{i},id=vdev{i},bus=vscsi.0,channel=0,scsi-id={t},lun={l},discard_granularity=4096"
            ));
    }
    for (i, (d, t)) in mpt_disks.iter().zip([1, 3]).enumerate() {
        g = g
            .qemu_arg("-drive")
            .qemu_arg(format!(
                "file={},if=none,format=raw,id=md{i},cache=writeback,discard=unmap",
                d.display()
            ))
            .qemu_arg("-device")
            .qemu_arg(format!(
                "scsi-hd,drive=md{i},id=mdev{i},bus=mpt.0,scsi-id={t},lun=0,discard_granularity=4096"
            ));
    }
    for (i, (bus, t, bdev)) in [("vscsi.0", 4, "dnv"), ("mpt.0", 5, "dnm")]
        .into_iter()
        .enumerate()
    {
        g = g
            .qemu_arg("-drive")
            .qemu_arg(format!(
                "file=nbd://127.0.0.1:{port}/{bdev},if=none,format=raw,id=nd{i}"
            ))
            .qemu_arg("-device")
            .qemu_arg(format!(
                "scsi-hd,drive=nd{i},id=ndev{i},bus={bus},scsi-id={t},lun=0"
            ));
    }
    let out = g.run().and_then(|o| o.success()).unwrap();
    assert_eq!(out.value("unbound_error"), Some("1"), "{}", out.log);
    assert_eq!(out.value("wrong_driver_error"), Some("1"));
    assert_eq!(
        out.value("group_shared_error"),
        Some("1"),
        "shared IOMMU group accepted"
    );
    assert_eq!(out.value("disks"), Some("4"));
    // The reactor sleeps between commands (adaptive mode): the device's
    // interrupt, routed to an eventfd, woke it.
    for (p, kind) in [("", "msix"), ("mpt_", "msi")] {
        assert_eq!(out.value(&format!("{p}irq")), Some(kind), "{p}irq");
        let wakes: u64 = out
            .value(&format!("{p}irq_wakes"))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert!(wakes > 0, "{p}: no interrupt woke the reactor");
    }
    assert_eq!(out.value("reset_ok"), Some("1"));
    // A controller that stops answering fails its host reset, and says why.
    for p in ["", "mpt_"] {
        assert_eq!(
            out.value(&format!("{p}dead_reset_error")),
            Some("1"),
            "{p}: the reset of a dead controller did not fail cleanly"
        );
    }
    assert_eq!(out.value("saved_attach"), Some("1"));
    assert_eq!(out.value("reattach_disks"), Some("4"));
    let want = expected_md5(SEED, SIZE_MIB);
    check_image(&out, "t0", &disks[0], &want);
    check_image(&out, "t2", &disks[2], &want);
    // Every reactor's buffer pool is mapped: reactor 1's reads were
    // zero-copy too.
    for tag in ["t0", "m1"] {
        let n: u64 = out
            .value(&format!("{tag}_zero_copy_other"))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert!(n > 0, "{tag}: no zero-copy I/O from reactor 1's pool");
    }
    // The MPT Fusion SAS driver on the SAS1068.
    assert_eq!(out.value("mpt_wrong_driver_error"), Some("1"));
    assert_eq!(out.value("mpt_disks"), Some("3"));
    assert_eq!(out.value("mpt_reset_ok"), Some("1"));
    assert_eq!(out.value("mpt_events_on"), Some("true"), "MPT events off");
    assert_eq!(out.value("mpt_reattach_disks"), Some("3"));
    check_image(&out, "m1", &mpt_disks[0], &want);
    check_image(&out, "m3", &mpt_disks[1], &want);
    // Flush and unmap reached both drivers' disks: the unmapped MiB reads
    // as zeroes in the image (it held verify blocks of the flush pass).
    let zero_mib = md5_bytes(&vec![0u8; 1 << 20]).unwrap();
    for (tag, img) in [("t2", &disks[2]), ("m3", &mpt_disks[1])] {
        for pass in ["flush", "unmap"] {
            let ios: u64 = out
                .value(&format!("{tag}_{pass}_ios"))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            assert!(ios > 0, "{tag} {pass}: no I/O\n{}", out.log);
        }
        let got = md5_range(img, UNMAP_OFF_MIB << 20, 1 << 20).unwrap();
        assert_eq!(got, zero_mib, "{tag}: unmapped range is not zeroes");
    }
    // Hot-unplug: QEMU took the device_del, the mid-layer saw the disk
    // gone, and the bench on it ended with errors after some I/O.
    assert_eq!(out.qmp_replies.len(), 2, "{:?}", out.qmp_replies);
    for r in &out.qmp_replies {
        assert!(r.contains("\"return\""), "device_del refused: {r}");
    }
    for tag in ["t0l1", "m1"] {
        assert_eq!(
            out.value(&format!("{tag}_gone")),
            Some("1"),
            "{tag} not seen gone"
        );
        for what in ["ios", "errors"] {
            let n: u64 = out
                .value(&format!("{tag}_unplug_{what}"))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            assert!(n > 0, "{tag}: no {what} around the unplug");
        }
    }
    // LUN 1 of target 0 was never written.
    let zero = md5_bytes(&vec![0u8; (SIZE_MIB << 20) as usize]).unwrap();
    let l1 = md5_range(&disks[1], OFFSET_MIB << 20, (SIZE_MIB << 20) as usize).unwrap();
    assert_eq!(l1, zero, "LUN 1 was written");
    check_escalation(&out, &nv, &nm);
    drop(srv);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The EH steps each HBA's stuck read went through, and its data.
fn check_escalation(out: &testvm::GuestOutcome, nv: &Path, nm: &Path) {
    assert_eq!(out.host_replies.len(), 4, "{:?}", out.host_replies);
    for r in &out.host_replies {
        assert!(!r.contains("error"), "latency change failed: {r}");
    }
    let n = |k: &str| -> u64 {
        out.value(k)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {k}\n{}", out.log))
    };
    // The EH lines of the guest log, for the messages below.
    let eh: String = out
        .log
        .lines()
        .filter(|l| l.contains("EH:") || l.contains("TMF") || l.contains("_eh_"))
        .map(|l| format!("{l}\n"))
        .collect();
    // Shown on success too (with --nocapture): how long each TMF took.
    eprintln!("{eh}");
    for tag in ["t4", "m5"] {
        // The stuck read timed out, its abort timed out, then a LUN reset.
        for step in ["timeouts", "aborts", "aborts_failed", "device_resets"] {
            assert!(n(&format!("{tag}_eh_{step}")) > 0, "{tag}: no {step}\n{eh}");
        }
        assert_eq!(n(&format!("{tag}_eh_host_resets_failed")), 0, "{tag}\n{eh}");
    }
    // virtio-scsi: QEMU answers a LUN reset only once it has drained the
    // LUN's requests (here: until the stuck read ends). The LLD's TMF
    // timeout runs meanwhile; it passes unnoticed when the reactor's clock
    // reads wait on QEMU's lock during the drain (usually), but not always,
    // so a LUN reset may still time out: a host reset must then follow.
    if n("t4_eh_device_resets_failed") > 0 {
        assert!(n("t4_eh_host_resets") > 0, "t4: no host reset\n{eh}");
    }
    // SAS1068: the IOC held the abort's frame: LUN reset failed, IOC reset.
    assert!(
        n("m5_eh_device_resets_failed") > 0,
        "m5: LUN reset did not fail\n{eh}"
    );
    assert!(n("m5_eh_host_resets") > 0, "m5: no host reset\n{eh}");
    // The read pass's verify prefill reached the images.
    let want = expected_md5(SEED, ESC_MIB);
    for (tag, img) in [("t4", nv), ("m5", nm)] {
        assert!(n(&format!("{tag}_read_ios")) > 0, "{tag}: no reads");
        let host = md5_range(img, OFFSET_MIB << 20, (ESC_MIB << 20) as usize).unwrap();
        assert_eq!(host, want, "{tag}: image differs from the verify blocks");
    }
}

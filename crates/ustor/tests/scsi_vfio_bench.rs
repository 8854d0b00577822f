//! Boots the QEMU/TCG guest for `bench/scsi-vfio.sh`: one virtio-scsi-pci
//! HBA (iommu_platform=on, q35 + intel-iommu) with one disk backed by a
//! host file, measured through the kernel's virtio_scsi + sd and through
//! ustor's virtio-scsi LLD over VFIO by `tests/guest/scsi-vfio-bench.sh`
//! (the kernel path also through fio, shipped from the host, at QD1);
//! with SCSI_VFIO_MPT_DISK, also an LSI SAS1068 (mptsas1068) with that disk,
//! measured through ustor's MPT Fusion LLD.
//!
//! Ignored: a benchmark, not a test. Run it through the script, or with
//! `SCSI_VFIO_DISK=<64 MiB file> cargo test --release -p ustor --test
//! scsi_vfio_bench -- --ignored --nocapture`. Environment: SCSI_VFIO_DISK
//! (required); SCSI_VFIO_MPT_DISK; USTOR_BIN; SCSI_VFIO_LOG (copy of the serial log);
//! GUEST_TIMEOUT_S (900); ROUNDS, RUNTIME, POLL, WORKLOADS go to the guest.

use std::path::PathBuf;
use std::time::Duration;

use testvm::{guest_script, require_guest, GuestBuilder};

#[test]
#[ignore = "benchmark: run bench/scsi-vfio.sh"]
fn scsi_vfio_bench() {
    require_guest!();
    let disk = std::env::var("SCSI_VFIO_DISK").expect("SCSI_VFIO_DISK: run bench/scsi-vfio.sh");
    let bin = std::env::var_os("USTOR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ustor")));
    let timeout: u64 = std::env::var("GUEST_TIMEOUT_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(900);
    let mut b = GuestBuilder::new()
        .script_file(guest_script("scsi-vfio-bench.sh"))
        .binary(bin)
        .binary("/usr/bin/fio")
        .iommu()
        .kernel_arg("intel_iommu=on")
        .qemu_arg("-device")
        .qemu_arg(
            "virtio-scsi-pci,id=vscsi,bus=pcie.0,addr=0x5,iommu_platform=on,disable-legacy=on",
        )
        .qemu_arg("-drive")
        .qemu_arg(format!(
            "file={disk},if=none,format=raw,id=vd0,cache=writeback"
        ))
        .qemu_arg("-device")
        .qemu_arg("scsi-hd,drive=vd0,bus=vscsi.0,channel=0,scsi-id=0,lun=0")
        .cpus(2)
        .memory_mib(1024)
        .env("VFIO_BDF", "0000:00:05.0")
        .timeout(Duration::from_secs(timeout));
    if let Ok(mpt) = std::env::var("SCSI_VFIO_MPT_DISK") {
        b = b
            .qemu_arg("-device")
            .qemu_arg("mptsas1068,id=mpt,bus=pcie.0,addr=0x7")
            .qemu_arg("-drive")
            .qemu_arg(format!(
                "file={mpt},if=none,format=raw,id=md0,cache=writeback"
            ))
            .qemu_arg("-device")
            .qemu_arg("scsi-hd,drive=md0,bus=mpt.0,scsi-id=0,lun=0")
            .env("MPT_BDF", "0000:00:07.0");
    }
    for k in ["ROUNDS", "RUNTIME", "POLL", "WORKLOADS"] {
        if let Ok(v) = std::env::var(k) {
            b = b.env(k, v);
        }
    }
    if let Some(log) = std::env::var_os("SCSI_VFIO_LOG") {
        b = b.log_file(PathBuf::from(log));
    }
    let out = b.run().and_then(|o| o.success()).unwrap();
    println!("{}", out.log);
}

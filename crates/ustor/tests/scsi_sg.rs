//! The SG_IO passthrough LLD on real kernel SCSI disks: a QEMU/TCG guest
//! (`ustor-testvm`) gets the `ustor` binary and runs `tests/guest/scsi-sg.sh`
//! against a scsi_debug disk and a virtio-scsi disk backed by a host file:
//! `ustor serve` attaches every /dev/sg* by RPC config (devices, LUN and
//! host reset, save_config), then `ustor bench --verify` writes and reads a
//! SCSI bdev on each disk (the read pass on two reactors). The host checks
//! what the kernel's sd driver read back from each disk, and the virtio
//! disk's backing file, against the verify blocks the bench must have left.
//!
//! Skips (`SKIPPED: reason`) only when no guest can run here.

mod common;

use std::time::Duration;

use testvm::host::{md5_bytes, md5_range};
use testvm::{guest_script, require_guest, GuestBuilder};

const OFFSET_MIB: u64 = 1;
const SIZE_MIB: u64 = 4;
const SEED: u64 = 0x5c51;

/// What `bench --verify -w read` leaves in a bdev of 512-byte blocks: every
/// block in generation 1 for `seed`.
fn expected_md5(seed: u64) -> String {
    let mut buf = vec![0u8; (SIZE_MIB << 20) as usize];
    ustor_bench::verify::fill(&mut buf, 512, 0, seed, 1);
    md5_bytes(&buf).unwrap()
}

#[test]
fn sg_lld_in_guest_on_scsi_debug_and_virtio_scsi() {
    require_guest!();
    let dir = common::tmpdir("scsi-sg");
    let disk = dir.join("virtio.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let out = GuestBuilder::new()
        .script_file(guest_script("scsi-sg.sh"))
        .binary(env!("CARGO_BIN_EXE_ustor"))
        .virtio_scsi_disk(&disk)
        .cpus(2)
        .memory_mib(1024)
        .env("SG_SEED", SEED.to_string())
        .env("SG_OFFSET_MIB", OFFSET_MIB.to_string())
        .env("SG_SIZE_MIB", SIZE_MIB.to_string())
        .env("SG_BENCH_S", "2")
        .timeout(Duration::from_secs(420))
        .run()
        .and_then(|o| o.success())
        .unwrap();
    for k in [
        "debug_write_ios",
        "debug_read_ios",
        "virtio_write_ios",
        "virtio_read_ios",
    ] {
        eprintln!("{k} = {:?}", out.value(k));
    }
    // Both disks attached through "all", reset and saved.
    assert_eq!(out.value("serve_disks"), Some("2"), "{}", out.log);
    assert_eq!(out.value("reset_ok"), Some("1"));
    assert_eq!(out.value("saved_attach"), Some("1"));
    let want = expected_md5(SEED);
    for tag in ["debug", "virtio"] {
        for pass in ["write", "read"] {
            let ios: u64 = out
                .value(&format!("{tag}_{pass}_ios"))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            assert!(ios > 0, "{tag} {pass}: no I/O");
        }
        // The kernel's sd driver reads back exactly the blocks ustor wrote
        // through sg, at the bdev's offset on the disk.
        assert_eq!(
            out.value(&format!("{tag}_md5")),
            Some(want.as_str()),
            "{tag}: /dev/sdX region differs from the verify blocks"
        );
    }
    // And they reached the virtio disk's backing file on the host.
    let host = md5_range(&disk, OFFSET_MIB << 20, (SIZE_MIB << 20) as usize).unwrap();
    assert_eq!(host, want, "virtio backing file differs");
    let _ = std::fs::remove_dir_all(&dir);
}

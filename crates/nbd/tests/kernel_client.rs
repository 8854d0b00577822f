//! The Linux kernel's NBD client against ustor: a QEMU/TCG guest
//! (`ustor-testvm`) runs `tests/guest/nbd.sh` (nbd-client -N, mkfs.ext4,
//! files written, umount, e2fsck, remount, checksums compared) against an
//! in-process server exporting a malloc bdev. The host then reads the whole
//! bdev back through the same server (qemu-img convert) and checks it is a
//! clean ext4 holding the data the guest reported.
//!
//! Skips (`SKIPPED: reason`) only when no guest can run here.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use testvm::host::{ext4_file_md5, fsck_image};
use testvm::{guest_script, require_guest, GuestBuilder};

const EXPORT_BYTES: u64 = 64 << 20;

#[test]
fn kernel_nbd_client_makes_a_clean_ext4() {
    require_guest!();
    assert!(
        common::have("qemu-img"),
        "qemu-img is needed to read the export back (qemu-utils, .ci/apt/nbd.txt)"
    );
    let f = common::start_bdev(EXPORT_BYTES, 512, 2);
    let started = Instant::now();
    let result = GuestBuilder::new()
        .script_file(guest_script("nbd.sh"))
        .env("NBD_PORT", f.port.to_string())
        .env("NBD_EXPORT", "malloc")
        .timeout(Duration::from_secs(300))
        .run()
        .and_then(|o| o.success());
    let stats = f.server.get_stats().expect("stats");
    let out = result.unwrap_or_else(|e| panic!("guest failed: {e}\nserver stats: {stats:?}"));
    eprintln!(
        "kernel nbd client vs ustor: guest run {:?}, {stats:?}",
        started.elapsed()
    );
    assert_eq!(
        out.value("nbd_size"),
        Some(EXPORT_BYTES.to_string().as_str())
    );
    assert_eq!(out.value("files"), Some("21"), "file count");
    assert_eq!(stats.io_errors, 0, "{stats:?}");
    assert_eq!(stats.protocol_errors, 0, "{stats:?}");
    assert!(stats.writes > 0 && stats.reads > 0, "{stats:?}");
    // A malloc bdev has no volatile cache, so SEND_FLUSH is not advertised
    // and the kernel sends no FLUSH.
    assert_eq!(stats.flushes, 0, "{stats:?}");

    // Host side: the bdev's contents, read back through the server.
    let dir = tempfile::tempdir().expect("tempdir");
    let img = dir.path().join("export.img");
    let uri = format!("nbd://127.0.0.1:{}/malloc", f.port);
    let status = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", &uri])
        .arg(&img)
        .status()
        .expect("spawn qemu-img");
    assert!(status.success(), "qemu-img convert {uri}: {status}");
    assert_eq!(std::fs::metadata(&img).expect("image").len(), EXPORT_BYTES);
    fsck_image(&img).expect("host e2fsck -fn of the exported bdev");
    let guest_md5 = out.value("data_md5").expect("guest reported data_md5");
    let host_md5 = ext4_file_md5(&img, "/data.bin").expect("data.bin via debugfs");
    assert_eq!(
        guest_md5, host_md5,
        "data.bin differs between guest and bdev"
    );
}

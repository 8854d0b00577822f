//! The Linux kernel's iSCSI initiator (open-iscsi in a QEMU/TCG guest)
//! against `ustor serve`, across a restart of the target: SendTargets
//! discovery, login with mutual CHAP and CRC32C header and data digests,
//! ext4 with files, then fio with crc32c verify on a file of that ext4.
//! While fio writes, the target gets SIGTERM (it asks the initiator to log
//! out and drains) and is started again on the same port with the same
//! config and backing file. The guest's session must recover, fio's verify
//! pass, no I/O error reach the file system, and the files read back from
//! the restarted target match; the host then checks the backing file.
//! One boot (`tests/guest/iscsi-restart.sh`).
//!
//! Skips (`SKIPPED: reason`) only when no guest can run here.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use testvm::host::{ext4_file_md5, fsck_image};
use testvm::{guest_script, require_guest, GuestBuilder};

const MIB: u64 = 1 << 20;
const IQN: &str = "iqn.2016-06.io.spdk:restart";
/// Where the guest writes the marker that asks for the restart: past the
/// 48 MiB file system, in 512-byte blocks.
const MARKER_LBA: u64 = 60 * MIB / 512;
const MARKER: &str = "USTOR-RESTART-NOW";

fn config(img: &std::path::Path, port: u16) -> Value {
    json!({"subsystems": [
        {"subsystem": "bdev", "config": [
            {"method": "bdev_uring_create", "params": {"name": "Disk0", "filename": img.to_str().unwrap(), "block_size": 512}}
        ]},
        {"subsystem": "iscsi", "config": [
            {"method": "iscsi_create_portal_group", "params": {"tag": 1, "portals": [{"host": "127.0.0.1", "port": port.to_string()}]}},
            {"method": "iscsi_create_initiator_group", "params": {"tag": 1, "initiators": ["ANY"], "netmasks": ["ANY"]}},
            {"method": "iscsi_create_auth_group", "params": {"tag": 1, "secrets": [
                {"user": "guest", "secret": "guest-secret-01", "muser": "ustor", "msecret": "ustor-secret-02"}]}},
            {"method": "iscsi_create_target_node", "params": {"name": "restart",
                "pg_ig_maps": [{"pg_tag": 1, "ig_tag": 1}], "luns": [{"bdev_name": "Disk0", "lun_id": 0}],
                "queue_depth": 32, "require_chap": true, "mutual_chap": true, "chap_group": 1,
                "header_digest": true, "data_digest": true}}
        ]}
    ]})
}

fn marker_written(img: &std::path::Path) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(img).unwrap();
    let mut b = [0u8; 512];
    f.seek(SeekFrom::Start(MARKER_LBA * 512)).unwrap();
    f.read_exact(&mut b).unwrap();
    b.starts_with(MARKER.as_bytes())
}

fn iostat(s: &Server) -> (u64, u64) {
    let st = s.ok("bdev_get_iostat", json!({"name": "Disk0"}));
    let b = &st["bdevs"][0];
    (
        b["bytes_read"].as_u64().unwrap_or(0),
        b["bytes_written"].as_u64().unwrap_or(0),
    )
}

#[test]
fn open_iscsi_survives_a_target_restart() {
    require_guest!();
    if !testkit::need("fio") {
        return;
    }
    let dir = tmpdir("iscsi-guest");
    let img = dir.join("lun.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    let port = free_port();
    let cfg = config(&img, port);
    let s = Server::start(&dir, &cfg, &[]);

    let started = Instant::now();
    let guest = GuestBuilder::new()
        .script_file(guest_script("iscsi-restart.sh"))
        .binary("/usr/bin/fio")
        .env("ISCSI_PORT", port.to_string())
        .env("ISCSI_TARGET", IQN)
        .env("CHAP_USER", "guest")
        .env("CHAP_SECRET", "guest-secret-01")
        .env("CHAP_MUSER", "ustor")
        .env("CHAP_MSECRET", "ustor-secret-02")
        .env("RESTART_LBA", MARKER_LBA.to_string())
        .env("RESTART_MARKER", MARKER)
        .timeout(Duration::from_secs(300));
    let run = std::thread::spawn(move || guest.run());
    let asked = testkit::try_wait_for(Duration::from_secs(240), || {
        (marker_written(&img) || run.is_finished()).then_some(())
    });
    assert!(
        asked.is_some() && !run.is_finished(),
        "the guest never asked for the restart: {:?}",
        run.join().map(|r| r.map(|o| o.log))
    );
    let stopping = Instant::now();
    let (code, log1) = s.stop();
    assert_eq!(code, 0, "first ustor serve exit: {log1}");
    let s = Server::start(&dir, &cfg, &[]);
    eprintln!(
        "iscsi restart: SIGTERM to listening again {:?}",
        stopping.elapsed()
    );
    let result = run.join().expect("guest thread");
    let elapsed = started.elapsed();
    let (read, written) = iostat(&s);
    let (code, log2) = s.stop();
    let out = result
        .and_then(|o| o.success())
        .unwrap_or_else(|e| panic!("guest failed: {e}\nfirst target:\n{log1}\nrestarted:\n{log2}"));
    assert_eq!(code, 0, "restarted ustor serve exit: {log2}");
    eprintln!("open-iscsi across a ustor restart: guest run {elapsed:?}");

    assert_eq!(out.value("iscsi_target"), Some(IQN));
    assert_eq!(
        out.value("disk_size"),
        Some((64 * MIB).to_string().as_str())
    );
    // The stopping target asked for a logout while fio was writing, and
    // the session came back on the restarted one.
    assert_eq!(out.value("logout_requested"), Some("1"));
    assert_eq!(out.value("fio_running_at_restart"), Some("1"));
    assert_eq!(out.value("recovered"), Some("1"));
    assert_eq!(out.value("fio_status"), Some("0"));
    assert_eq!(out.value("fio_verify_errors"), Some("0"));
    assert_eq!(
        out.value("fio_phases"),
        Some("2"),
        "writes and verify reads"
    );
    assert_eq!(out.value("io_errors"), Some("0"), "I/O errors in dmesg");
    assert_eq!(out.value("fs_errors"), Some("0"), "ext4 errors in dmesg");
    assert_eq!(out.value("files"), Some("21"));
    // The restarted target took writes (fio's rest) and reads (its verify
    // and the remount).
    assert!(written > 0 && read > 0, "read {read} written {written}");
    fsck_image(&img).expect("host e2fsck of the LUN's backing file");
    let data = ext4_file_md5(&img, "/data.bin").expect("data.bin from the backing file");
    assert_eq!(out.value("data_md5"), Some(data.as_str()));
    let _ = std::fs::remove_dir_all(&dir);
}

//! vhost-user-scsi served by `ustor serve` to a QEMU/TCG guest's
//! virtio-scsi driver (one boot): a controller with targets 0 and 1
//! (uring bdevs over host files). The guest sees both disks, round-trips
//! data on each (the host compares with its files) and runs fio with
//! crc32c verify on target 0; a LUN reset (`sg_reset -d`, a TMF on the
//! control queue) completes and the data is still there. Then hot-plug:
//! on the guest's marker the host adds target 2 over RPC and the guest's
//! driver finds it from the event queue's TRANSPORT_RESET event (no manual
//! rescan) and round-trips data on it; on its next marker the host
//! removes target 1 and the guest sees the disk go.
//!
//! Twice: on split virtqueues, and on packed ones (`packed=on` in QEMU,
//! a controller created with `packed_ring: true`; while the guest runs
//! the session must report every running ring packed).
//!
//! Skips (`SKIPPED: reason`) only when no guest can run here.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use testvm::host::md5_range;
use testvm::{guest_script, require_guest, GuestBuilder};

const MIB: u64 = 1 << 20;
/// Where the guest writes its markers (MiB).
const MARK_MIB: u64 = 48;

fn image(dir: &Path, name: &str, mib: u64) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p)
        .unwrap()
        .set_len(mib * MIB)
        .unwrap();
    p
}

/// Whether `file` holds `text` at the marker offset.
fn marked(file: &Path, text: &str) -> bool {
    use std::os::unix::fs::FileExt;
    let mut b = vec![0u8; text.len()];
    let f = std::fs::File::open(file).unwrap();
    f.read_exact_at(&mut b, MARK_MIB * MIB).is_ok() && b == text.as_bytes()
}

#[test]
fn guest_virtio_scsi_on_ustor_vhost() {
    guest_virtio_scsi(false);
}

#[test]
fn guest_virtio_scsi_on_packed_rings() {
    guest_virtio_scsi(true);
}

fn guest_virtio_scsi(packed: bool) {
    require_guest!();
    if !testkit::need("fio") || !testkit::need("sg_reset") {
        return;
    }
    let dir = tmpdir(if packed {
        "vhost-scsi-packed"
    } else {
        "vhost-scsi-guest"
    });
    let sockets = dir.join("vhost");
    std::fs::create_dir_all(&sockets).unwrap();
    let files: Vec<PathBuf> = ["t0.img", "t1.img", "t2.img"]
        .iter()
        .map(|n| image(&dir, n, 64))
        .collect();
    let bdev = |f: &Path, n: &str| json!({"method": "bdev_uring_create", "params": {"filename": f.to_str().unwrap(), "name": n, "block_size": 512}});
    let add = |t: u32, b: &str| json!({"method": "vhost_scsi_controller_add_target", "params": {"ctrlr": "vs", "scsi_target_num": t, "bdev_name": b}});
    let config = json!({"subsystems": [
        {"subsystem": "bdev", "config": [bdev(&files[0], "T0"), bdev(&files[1], "T1"), bdev(&files[2], "T2")]},
        {"subsystem": "vhost_scsi", "config": [
            {"method": "vhost_create_scsi_controller", "params": {"ctrlr": "vs", "packed_ring": packed}},
            add(0, "T0"), add(1, "T1"),
        ]},
    ]});
    let args = ["-S", sockets.to_str().unwrap(), "--cores", "0,1"];
    let s = Server::start(&dir, &config, &args);

    let started = Instant::now();
    let mut guest = GuestBuilder::new();
    if packed {
        guest = guest.vhost_user_packed();
    }
    let guest = guest
        .script_file(guest_script("vhost-user-scsi.sh"))
        .binary("/usr/bin/fio")
        .binary("/usr/bin/sg_reset")
        .vhost_user_scsi(sockets.join("vs"))
        .env("VUS_MIB", "8:4")
        .env("VUS_FIO_MIB", "16:8")
        .env("VUS_MARK_MIB", MARK_MIB.to_string())
        .timeout(Duration::from_secs(300));
    let run = std::thread::spawn(move || guest.run());
    // Each step waits for the guest's marker (or the guest's end, which
    // then fails with its own message below).
    let wait_mark = |file: &Path, text: &str| {
        testkit::try_wait_for(Duration::from_secs(240), || {
            (marked(file, text) || run.is_finished()).then_some(())
        });
        marked(file, text)
    };
    // The rings as the session reports them while the guest runs.
    let mut live = None;
    if wait_mark(&files[1], "USTOR-ADD-TARGET") {
        live = Some(s.ok("vhost_get_controllers", json!({"name": "vs"})));
        s.ok(
            "vhost_scsi_controller_add_target",
            json!({"ctrlr": "vs", "scsi_target_num": 2, "bdev_name": "T2"}),
        );
        if wait_mark(&files[2], "USTOR-DEL-TARGET") {
            s.ok(
                "vhost_scsi_controller_remove_target",
                json!({"ctrlr": "vs", "scsi_target_num": 1}),
            );
        }
    }
    let result = run.join().expect("guest thread");
    let elapsed = started.elapsed();
    let ctrls = s.ok("vhost_get_controllers", json!({"name": "vs"}));
    let t1_claimed = s.ok("bdev_get_bdevs", json!({"name": "T1"}))[0]["claimed"].clone();
    let (code, log) = s.stop();
    let out = result
        .and_then(|o| o.success())
        .unwrap_or_else(|e| panic!("guest failed: {e}\nustor log:\n{log}"));
    assert_eq!(code, 0, "ustor serve exit: {log}");
    eprintln!("vhost-user-scsi on ustor: guest run {elapsed:?}; {ctrls}");

    let size = (64 * MIB).to_string();
    assert_eq!(out.value("t0_size"), Some(size.as_str()));
    assert_eq!(out.value("t1_size"), Some(size.as_str()));
    for (key, file) in [
        ("t0_md5", &files[0]),
        ("t1_md5", &files[1]),
        ("t2_md5", &files[2]),
    ] {
        let host = md5_range(file, 8 * MIB, 4 * MIB as usize).expect("md5");
        assert_eq!(
            out.value(key),
            Some(host.as_str()),
            "{key}: guest write in the file"
        );
    }
    assert_eq!(out.value("fio_ok"), Some("1"), "fio verify");
    assert_eq!(out.value("reset_ok"), Some("1"), "LUN reset");
    assert_eq!(out.value("t1_removed"), Some("1"), "hot-remove");
    let targets = &ctrls[0]["backend_specific"]["scsi"];
    let nums: Vec<u64> = targets
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["scsi_dev_num"].as_u64().unwrap())
        .collect();
    assert_eq!(nums, [0, 2], "targets after hot-plug and removal: {ctrls}");
    assert_eq!(t1_claimed, json!(false), "removed target's bdev released");
    let live = live.expect("the guest's first marker");
    let ses = &live[0]["sessions"][0];
    let running = ses["max_queues"].as_u64().unwrap_or(0);
    // virtio-scsi: control, event and at least one request queue.
    assert!(running >= 3, "rings running: {live}");
    let want = if packed { running } else { 0 };
    assert_eq!(
        ses["packed_rings"].as_u64(),
        Some(want),
        "packed rings: {live}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

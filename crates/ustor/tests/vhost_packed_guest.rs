//! Packed virtqueues end to end: a QEMU/TCG guest's Linux virtio-blk
//! driver on `vhost-user-blk-pci,...,packed=on`, served by
//! `ustor serve` from a controller created with `packed_ring: true` over a
//! uring bdev on a host file (one boot). The guest reads a region the host
//! wrote (md5), writes a region the host reads back from the file (md5),
//! and runs fio with crc32c verify (two jobs at queue depth 8, thousands of
//! requests: the rings wrap many times, completions out of order). The
//! controller must report the queue ran packed, with no errors and
//! nothing left in flight.
//!
//! Skips (`SKIPPED: reason`) only when no guest can run here.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;
use testvm::host::{md5_range, write_pattern};
use testvm::{guest_script, require_guest, GuestBuilder};

const MIB: u64 = 1 << 20;

#[test]
fn guest_virtio_blk_on_packed_rings() {
    require_guest!();
    if !testkit::need("fio") {
        return;
    }
    let dir = tmpdir("vhost-packed");
    let sockets = dir.join("vhost");
    std::fs::create_dir_all(&sockets).unwrap();
    let img = dir.join("disk.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(48 * MIB)
        .unwrap();
    write_pattern(&img, 4 * MIB, 4 * MIB as usize, 0x9ac4).expect("pattern");
    let host_md5 = md5_range(&img, 4 * MIB, 4 * MIB as usize).expect("md5");
    let config = json!({"subsystems": [
        {"subsystem": "bdev", "config": [{"method": "bdev_uring_create", "params": {
            "filename": img.to_str().unwrap(), "name": "Disk", "block_size": 512}}]},
        {"subsystem": "vhost_blk", "config": [{"method": "vhost_create_blk_controller",
            "params": {"ctrlr": "vpacked", "dev_name": "Disk", "packed_ring": true}}]},
    ]});
    let args = ["-S", sockets.to_str().unwrap(), "--cores", "0,1"];
    let s = Server::start(&dir, &config, &args);
    let guest = GuestBuilder::new()
        .script_file(guest_script("vhost-user-blk.sh"))
        .binary("/usr/bin/fio")
        .vhost_user_blk(sockets.join("vpacked"))
        .vhost_user_packed()
        .env("VUB_DEV", "/dev/vda")
        .env("VUB_READ_MIB", "4:4")
        .env("VUB_WRITE_MIB", "12:4")
        .env("VUB_FIO_MIB", "24:16")
        .timeout(Duration::from_secs(240));
    let result = guest.run();
    let ctrls = s.ok("vhost_get_controllers", json!({"name": "vpacked"}));
    let (code, log) = s.stop();
    let out = result
        .and_then(|o| o.success())
        .unwrap_or_else(|e| panic!("guest failed: {e}\nustor log:\n{log}"));
    assert_eq!(code, 0, "ustor serve exit: {log}");
    let queues = ctrls[0]["queues"].as_array().expect("queues");
    assert_eq!(queues.len(), 1, "one queue ran: {ctrls}");
    for q in queues {
        assert_eq!(q["ring"], "packed", "{ctrls}");
        assert!(q["requests"].as_u64().unwrap_or(0) > 0, "{ctrls}");
        assert_eq!(q["errors"], 0, "{ctrls}");
        assert_eq!(q["in_flight"], 0, "{ctrls}");
    }
    let total: u64 = queues.iter().filter_map(|q| q["requests"].as_u64()).sum();
    assert!(total > 4096, "fio's requests went through: {ctrls}");
    assert_eq!(out.value("vub_size"), Some((48 * MIB).to_string().as_str()));
    assert_eq!(
        out.value("read_md5"),
        Some(host_md5.as_str()),
        "guest read the host's pattern"
    );
    let written = md5_range(&img, 12 * MIB, 4 * MIB as usize).expect("md5");
    assert_eq!(
        out.value("write_md5"),
        Some(written.as_str()),
        "host reads the guest's write"
    );
    assert_eq!(out.value("fio_ok"), Some("1"), "fio verify");
    let _ = std::fs::remove_dir_all(&dir);
}

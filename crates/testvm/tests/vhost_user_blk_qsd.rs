//! Validates tests/guest/vhost-user-blk.sh against a peer vhost-user-blk
//! backend, qemu-storage-daemon: the guest reads a region the host wrote,
//! writes a region the host then reads from the backing file, and makes
//! and checks an ext4 on a second export.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use testvm::host::{md5_range, wait_for_path, write_pattern, Server};
use testvm::{guest_script, require_guest, GuestBuilder};

const MIB: u64 = 1 << 20;

#[test]
fn vhost_user_blk_script_against_qemu_storage_daemon() {
    require_guest!();
    let qsd = common::tool("qemu-storage-daemon", "qemu-system-common");
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = common::image(dir.path(), "raw.img", 64);
    let fs = common::image(dir.path(), "fs.img", 64);
    write_pattern(&raw, 8 * MIB, 4 * MIB as usize, 0x5eed).expect("pattern");
    let host_read_md5 = md5_range(&raw, 8 * MIB, 4 * MIB as usize).expect("md5");
    let sock_raw = dir.path().join("raw.sock");
    let sock_fs = dir.path().join("fs.sock");

    let mut cmd = Command::new(qsd);
    for (i, (img, sock)) in [(&raw, &sock_raw), (&fs, &sock_fs)].iter().enumerate() {
        cmd.arg("--blockdev")
            .arg(format!("driver=file,node-name=file{i},filename={}", img.display()))
            .arg("--blockdev")
            .arg(format!("driver=raw,node-name=disk{i},file=file{i}"))
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=exp{i},node-name=disk{i},writable=on,addr.type=unix,addr.path={}",
                sock.display()
            ));
    }
    let mut server =
        Server::spawn("qemu-storage-daemon", cmd, &dir.path().join("qsd.log")).expect("spawn");
    for sock in [&sock_raw, &sock_fs] {
        if let Err(e) = wait_for_path(sock, Duration::from_secs(10)) {
            panic!("qsd socket: {e}\n{}", server.stop(Duration::from_secs(1)));
        }
    }

    let started = Instant::now();
    let result = GuestBuilder::new()
        .script_file(guest_script("vhost-user-blk.sh"))
        .vhost_user_blk(&sock_raw)
        .vhost_user_blk(&sock_fs)
        .env("VUB_READ_MIB", "8:4")
        .env("VUB_WRITE_MIB", "16:4")
        .env("VUB_FS_DEV", "/dev/vdb")
        .timeout(Duration::from_secs(180))
        .run();
    let elapsed = started.elapsed();
    server
        .check_running()
        .expect("qsd still running after the guest");
    let server_log = server.stop(Duration::from_secs(5));
    let out = result
        .and_then(|o| o.success())
        .unwrap_or_else(|e| panic!("guest failed: {e}\nqsd log:\n{server_log}"));
    eprintln!("vhost-user-blk vs qemu-storage-daemon: guest run {elapsed:?}");

    assert_eq!(out.value("vub_size"), Some((64 * MIB).to_string().as_str()));
    assert_eq!(
        out.value("read_md5"),
        Some(host_read_md5.as_str()),
        "guest read the host's pattern"
    );
    let written = md5_range(&raw, 16 * MIB, 4 * MIB as usize).expect("md5");
    assert_eq!(
        out.value("write_md5"),
        Some(written.as_str()),
        "host reads the guest's write"
    );
    common::check_fs_image(&fs, &out);
}

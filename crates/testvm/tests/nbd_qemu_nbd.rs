//! Validates tests/guest/nbd.sh against a peer NBD server, qemu-nbd: the
//! kernel's nbd client makes and checks an ext4 through it, and the host
//! then finds the same file system and data in the backing image.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use testvm::host::{free_port, wait_for_port, Server};
use testvm::{guest_script, require_guest, GuestBuilder};

#[test]
fn nbd_script_against_qemu_nbd() {
    require_guest!();
    let qemu_nbd = common::tool("qemu-nbd", "qemu-utils");
    let dir = tempfile::tempdir().expect("tempdir");
    let img = common::image(dir.path(), "nbd.img", 64);
    let port = free_port().expect("port");
    let mut cmd = Command::new(qemu_nbd);
    cmd.args([
        "--format=raw",
        "--bind=127.0.0.1",
        "--persistent",
        "--export-name=ustor",
    ])
    .arg(format!("--port={port}"))
    .arg(&img);
    let mut server =
        Server::spawn("qemu-nbd", cmd, &dir.path().join("qemu-nbd.log")).expect("spawn");
    wait_for_port(port, Duration::from_secs(10)).expect("qemu-nbd listening");

    let started = Instant::now();
    let result = GuestBuilder::new()
        .script_file(guest_script("nbd.sh"))
        .env("NBD_PORT", port.to_string())
        .env("NBD_EXPORT", "ustor")
        .timeout(Duration::from_secs(180))
        .run();
    let elapsed = started.elapsed();
    server.check_running().expect("qemu-nbd still running");
    let server_log = server.stop(Duration::from_secs(5));
    let out = result
        .and_then(|o| o.success())
        .unwrap_or_else(|e| panic!("guest failed: {e}\nqemu-nbd log:\n{server_log}"));
    eprintln!("nbd vs qemu-nbd: guest run {elapsed:?}");

    assert_eq!(
        out.value("nbd_size"),
        Some((64u64 << 20).to_string().as_str())
    );
    common::check_fs_image(&img, &out);
}

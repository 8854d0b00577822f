//! Validates tests/guest/iscsi.sh against a peer iSCSI target, tgtd: the
//! guest's open-iscsi discovers, logs in, makes and checks an ext4, logs
//! out; the host then finds the same data in the LUN's backing file.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use testvm::host::{free_port, wait_for_port, Server};
use testvm::{guest_script, require_guest, GuestBuilder};

const IQN: &str = "iqn.2024-01.io.ustor:rig-tgtd";

fn tgtadm(control_port: u16, args: &[&str]) -> String {
    let mut cmd = Command::new("tgtadm");
    cmd.arg("-C").arg(control_port.to_string()).args(args);
    common::must(&mut cmd)
}

/// Shuts tgtd down through its control socket (it ignores SIGTERM).
fn stop_tgtd(control_port: u16, server: &mut Server) {
    let _ = Command::new("tgtadm")
        .arg("-C")
        .arg(control_port.to_string())
        .args([
            "--lld", "iscsi", "--op", "delete", "--mode", "target", "--tid", "1", "--force",
        ])
        .output();
    let _ = Command::new("tgtadm")
        .arg("-C")
        .arg(control_port.to_string())
        .args(["--op", "delete", "--mode", "system"])
        .output();
    // Server::wait_exit kills it by PID if it does not go by itself.
    server.wait_exit(Duration::from_secs(10));
}

fn configure(control_port: u16, img: &Path) {
    let cp = control_port;
    tgtadm(
        cp,
        &[
            "--lld", "iscsi", "--op", "new", "--mode", "target", "--tid", "1", "-T", IQN,
        ],
    );
    let backing = img.to_string_lossy();
    tgtadm(
        cp,
        &[
            "--lld",
            "iscsi",
            "--op",
            "new",
            "--mode",
            "logicalunit",
            "--tid",
            "1",
            "--lun",
            "1",
            "-b",
            &backing,
        ],
    );
    tgtadm(
        cp,
        &[
            "--lld", "iscsi", "--op", "bind", "--mode", "target", "--tid", "1", "-I", "ALL",
        ],
    );
}

#[test]
fn iscsi_script_against_tgtd() {
    require_guest!();
    let tgtd = common::tool("tgtd", "tgt");
    common::tool("tgtadm", "tgt");
    let dir = tempfile::tempdir().expect("tempdir");
    let img = common::image(dir.path(), "lun1.img", 64);
    let port = free_port().expect("port");
    // A control port of our own, so a system tgtd (socket.0) is untouched.
    let control_port = 20000 + port % 10000;
    let mut cmd = Command::new(tgtd);
    cmd.arg("-f")
        .arg("--iscsi")
        .arg(format!("portal=127.0.0.1:{port}"))
        .arg("-C")
        .arg(control_port.to_string());
    let mut server = Server::spawn("tgtd", cmd, &dir.path().join("tgtd.log")).expect("spawn tgtd");
    if let Err(e) = wait_for_port(port, Duration::from_secs(10)) {
        panic!(
            "tgtd not listening: {e}\n{}",
            server.stop(Duration::from_secs(1))
        );
    }
    configure(control_port, &img);

    let started = Instant::now();
    let result = GuestBuilder::new()
        .script_file(guest_script("iscsi.sh"))
        .env("ISCSI_PORT", port.to_string())
        .timeout(Duration::from_secs(240))
        .run();
    let elapsed = started.elapsed();
    let alive = server.check_running();
    stop_tgtd(control_port, &mut server);
    alive.expect("tgtd still running after the guest");
    let out = result
        .and_then(|o| o.success())
        .unwrap_or_else(|e| panic!("guest failed: {e}\ntgtd log:\n{}", server.log()));
    eprintln!("iscsi vs tgtd: guest run {elapsed:?}");

    assert_eq!(
        out.value("iscsi_target"),
        Some(IQN),
        "target found by discovery"
    );
    assert_eq!(
        out.value("disk_size"),
        Some((64u64 << 20).to_string().as_str())
    );
    common::check_fs_image(&img, &out);
}

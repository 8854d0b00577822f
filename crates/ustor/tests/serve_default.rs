//! `ustor serve` with no config, as README's first command runs it: the
//! embedded default exports one malloc bdev by NBD, NVMe/TCP and iSCSI, the
//! banner names how to reach each, real clients reach them (qemu-io writes
//! and verifies a pattern over NBD; libiscsi's tools log in over iSCSI and
//! see the same disk), and SIGTERM stops it cleanly. Ports are 0 so the
//! kernel picks free ones; the banner reports the bound ports.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_ustor");

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The value after `prefix` on the first banner line that has it.
fn after<'a>(banner: &'a [String], prefix: &str) -> &'a str {
    banner
        .iter()
        .find_map(|l| l.trim().strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no `{prefix}` in the banner: {banner:#?}"))
        .split_whitespace()
        .next()
        .unwrap()
}

#[test]
fn embedded_default_serves_nbd_nvmf_and_iscsi() {
    for p in ["qemu-io", "iscsi-ls", "iscsi-readcapacity16"] {
        if !testkit::need(p) {
            return;
        }
    }
    let dir = std::env::temp_dir().join(format!("ustor-serve-default-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("rpc.sock");
    let mut child = Command::new(BIN)
        .args(["serve", "--no-pin", "-r", sock.to_str().unwrap()])
        .args(["--nbd-port", "0", "--nvmf-port", "0", "--iscsi-port", "0"])
        .args(["--default-size-mib", "64"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut banner = Vec::new();
    testkit::wait_until("the serve banner", Duration::from_secs(30), || {
        banner.extend(rx.try_iter());
        banner.iter().any(|l| l.starts_with("Stop with"))
    });

    // NBD: write a pattern, read it back verified (qemu-io -P checks).
    let nbd = after(&banner, "nbdinfo ");
    run(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x5a 1M 256k", nbd],
    );
    run(
        "qemu-io",
        &["-f", "raw", "-r", "-c", "read -P 0x5a 1M 256k", nbd],
    );
    // NVMe/TCP: the banner names the subsystem on a bound port.
    assert!(
        after(&banner, "nvme connect -t tcp -a 127.0.0.1 -s ")
            .parse::<u16>()
            .unwrap()
            > 0,
        "{banner:#?}"
    );
    // iSCSI: discovery lists the default node with its LUN, and the LUN is
    // the same 64 MiB disk.
    let portal = after(&banner, "iscsi-ls -s ");
    let ls = run("iscsi-ls", &["-s", portal]);
    assert!(ls.contains("iqn.2026-11.io.ustor:malloc0"), "{ls}");
    let lun = after(&banner, "iscsi-inq ");
    let cap = run("iscsi-readcapacity16", &[lun]);
    assert!(cap.contains("LOGICAL BLOCK LENGTH IN BYTES:512"), "{cap}");
    assert!(cap.contains("Total size:67108864"), "{cap}");

    // SIGTERM: every target drains and stops, the process exits 0.
    // SAFETY: kill(2) on the child we started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    banner.extend(rx.iter());
    assert!(status.success(), "{status:?} {banner:#?}");
    for t in ["nbd", "nvmf", "iscsi"] {
        assert!(
            banner
                .iter()
                .any(|l| l.starts_with(&format!("ustor: target {t} stopped"))),
            "{t}: {banner:#?}"
        );
    }
    assert!(
        banner.iter().any(|l| l == "ustor: stopped cleanly"),
        "{banner:#?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

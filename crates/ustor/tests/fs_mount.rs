//! `ustor fs mount` against `ustor serve`'s file service, end to end
//! through the kernel's FUSE: a wrong secret is refused without leaving a
//! mount; data written and fsync'ed through the mount (tar of a tree, a
//! file of odd size) survives a SIGKILL of the server; while the server is
//! down calls fail with EIO in bounded time (no hang); after the restart
//! the same mount carries on; `umount` ends the mount process cleanly and
//! `ustor fs check` finds the region consistent.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{free_port, pseudo_random, sha256, tmpdir, Server, BIN};
use serde_json::json;

fn fuse_usable() -> Result<(), String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map(drop)
        .map_err(|e| format!("/dev/fuse: {e}"))
}

fn mounted(mp: &Path) -> bool {
    let m = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let mp = mp.to_str().unwrap();
    m.lines().any(|l| l.split(' ').nth(1) == Some(mp))
}

fn config(region: &Path, port: u16, secret: &Path) -> serde_json::Value {
    json!({"subsystems": [{"subsystem": "fs", "config": [
        {"method": "fs_create", "params": {"name": "vol", "path": region, "size": 64u64 << 20}},
        {"method": "fs_export", "params": {"name": "vol", "listen": format!("127.0.0.1:{port}"),
            "secret_file": secret}}
    ]}]})
}

fn mount(port: u16, mp: &Path, secret: &Path) -> Child {
    Command::new(BIN)
        .args(["fs", "mount", &format!("127.0.0.1:{port}/vol")])
        .arg(mp)
        .arg("--secret-file")
        .arg(secret)
        .args(["--reconnect", "2", "--timeout", "10"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn sums(root: &Path) -> String {
    let o = Command::new("sh")
        .arg("-c")
        .arg("find . -type f | sort | xargs sha256sum")
        .current_dir(root)
        .output()
        .unwrap();
    assert!(o.status.success());
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn mount_survives_server_sigkill_and_unmounts_cleanly() {
    testkit::require!(fuse_usable(), "a kernel with FUSE (/dev/fuse), as root");
    let d = tmpdir("fs-mount");
    let (region, mp, src) = (d.join("region"), d.join("mnt"), d.join("src"));
    std::fs::create_dir_all(&mp).unwrap();
    std::fs::create_dir_all(src.join("a/b")).unwrap();
    for (i, n) in [0usize, 1, 4096, 70_001, 1 << 20].iter().enumerate() {
        std::fs::write(src.join(format!("a/b/f{i}")), pseudo_random(*n, i as u64)).unwrap();
    }
    let secret = d.join("secret");
    std::fs::write(&secret, "s3cret\n").unwrap();
    let port = free_port();
    let cfg = config(&region, port, &secret);
    let server = Server::start(&d, &cfg, &[]);

    // A wrong secret: refused, exit 1, nothing mounted.
    let bad = d.join("bad");
    std::fs::write(&bad, "nope").unwrap();
    let out = mount(port, &mp, &bad).wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("authentication"));
    assert!(!mounted(&mp));

    let mut m = mount(port, &mp, &secret);
    testkit::wait_until("the export is mounted", Duration::from_secs(20), || {
        assert!(m.try_wait().unwrap().is_none(), "ustor fs mount exited");
        mounted(&mp)
    });
    let st = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "tar -C {} -cf - . | tar -C {} -xf - && sync -f {}/a/b/f4",
            src.display(),
            mp.display(),
            mp.display()
        ))
        .status()
        .unwrap();
    assert!(st.success());
    let file = mp.join("odd");
    let data = pseudo_random(300_007, 99);
    std::fs::write(&file, &data).unwrap();
    std::fs::File::open(&file).unwrap().sync_all().unwrap();
    assert_eq!(sums(&mp.join("a")), sums(&src.join("a")));

    // SIGKILL the server: while it is down a call fails with EIO (the
    // client gave up reconnecting after 2 s), it does not hang.
    drop(server);
    let e = std::fs::metadata(mp.join("never-seen")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");

    // Restarted on the same region and port: the same mount carries on.
    let server = Server::start(&d, &cfg, &[]);
    assert_eq!(sums(&mp.join("a")), sums(&src.join("a")));
    // Past the page cache: drop it, then read through the server.
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    assert_eq!(sha256(&std::fs::read(&file).unwrap()), sha256(&data));
    std::fs::write(mp.join("after"), b"restart").unwrap();
    assert_eq!(std::fs::read(mp.join("after")).unwrap(), b"restart");

    // umount ends the mount process with 0.
    let st = Command::new("umount").arg(&mp).status().unwrap();
    assert!(st.success());
    let code = testkit::wait_for("ustor fs mount to exit", Duration::from_secs(20), || {
        m.try_wait().unwrap()
    });
    assert!(code.success(), "{code:?}");
    assert!(!mounted(&mp));
    let (rc, out) = server.stop();
    assert_eq!(rc, 0, "{out}");
    let ck = Command::new(BIN)
        .args(["fs", "check"])
        .arg(&region)
        .output()
        .unwrap();
    assert!(ck.status.success(), "{ck:?}");
    let _ = std::fs::remove_dir_all(&d);
}

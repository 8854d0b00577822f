//! The file service over raw Ethernet (AF_XDP, copy mode: a veth has no
//! zero-copy driver) between two network namespaces this test makes over
//! a veth pair: `ustor serve` runs in one (`ip netns exec`), exporting a
//! region on /dev/shm with `fs_export` transport "xdp"; the Rust client
//! library runs in the other. Writes and reads of 4 KiB, 1 KiB and 1 MiB
//! files are checked by SHA-256 both ways (written by the client, read
//! back through the server, and read after a restart of the server from
//! the region); a wrong secret is refused; a malformed frame is counted
//! and the session goes on; `fs_get_stats` shows the 4 KiB and 1 MiB
//! payloads placed by the kernel in the region, the 1 KiB one copied.
//! A client that takes a placement grant and vanishes does not hold the
//! export: another client is served once the grant's deadline passed, the
//! vanished write's blocks are back, and placement works again; an
//! overwrite of existing blocks is granted in fragments, never placed.
//! `ustor fs mount xdp://IFNAME/EXPORT` (run under `nsenter --net`, so the
//! mount is in this test's mount namespace) serves files written and read
//! back by SHA-256, a rename, a symbolic and a hard link, chmod, truncate,
//! mkdir and rmdir. At MTU 3500 (an export's `mtu`), 4 KiB and 1 MiB
//! files go placed in 3504-byte frames (fewer than half the frames), and
//! a client on a 1500-byte MTU is served at 1514-byte frames with its
//! write copied.

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use testkit::netns::{self, VethNs};
use ustor_fs::ROOT_INO;
use ustor_fs_client::xdp::{XdpClient, XdpConfig};
use ustor_fs_client::ClientError;

const SECRET: &str = "xdp shared secret";

/// The region on /dev/shm (AF_XDP pins the UMEM's pages: tmpfs allows a
/// long-term pin of a shared file mapping, a disk file system does not),
/// removed on drop.
struct Region(PathBuf);

impl Drop for Region {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The test's temporary directory (RPC sockets), removed on drop, also
/// when the test fails.
struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `ustor serve` inside namespace `ns` (`ip netns exec` execs it: the
/// child's PID is the server's).
fn serve_in(ns: &str, dir: &std::path::Path) -> Server {
    let sock = dir.join(format!("rpc-{}.sock", rand_tag()));
    let child = Command::new("ip")
        .args(["netns", "exec", ns, BIN, "serve", "-r"])
        .arg(&sock)
        .args(["--no-pin", "--log-level", "warn"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn ustor serve");
    let s = Server { child, sock };
    testkit::wait_until("ustor serve answers RPC", Duration::from_secs(20), || {
        s.call("spdk_get_version", Value::Null).is_ok()
    });
    s
}

fn export(s: &Server, region: &std::path::Path, ifname: &str, create: bool) {
    export_mtu(s, region, ifname, create, None)
}

fn export_mtu(s: &Server, region: &std::path::Path, ifname: &str, create: bool, mtu: Option<u32>) {
    let mut p = json!({"name": "x", "path": region.to_str().unwrap()});
    if create {
        p["size"] = json!(64u64 << 20);
    }
    s.ok("fs_create", p);
    let mut p = json!({"name": "x", "listen": ifname, "transport": "xdp", "secret": SECRET});
    if let Some(m) = mtu {
        p["mtu"] = json!(m);
    }
    let r = s.ok("fs_export", p);
    assert_eq!(r["listen"], ifname);
}

fn stats(s: &Server) -> Value {
    s.ok("fs_get_stats", json!({"name": "x"}))[0].clone()
}

const FILES: [(&str, usize, u64); 3] = [("f4k", 4096, 1), ("f1k", 1024, 2), ("f1m", 1 << 20, 3)];

/// In namespace `ns`: connects, checks a wrong secret is refused, writes
/// the three files and reads them back; returns their digests.
fn client_writes(ns: &str, ifname: String) -> Vec<(String, String)> {
    VethNs::within(ns, move || {
        let bad = XdpClient::connect(XdpConfig::new(&ifname, "x", b"wrong"));
        assert_eq!(
            bad.err(),
            Some(ClientError::Auth),
            "a wrong secret is refused"
        );
        let c =
            XdpClient::connect(XdpConfig::new(&ifname, "x", SECRET.as_bytes())).expect("connect");
        let mut out = Vec::new();
        for (name, len, seed) in FILES {
            let data = pseudo_random(len, seed);
            let a = c
                .create(ROOT_INO, name.as_bytes(), 0o644, 0, 0)
                .expect("create");
            let after = c.write(a.ino, 0, &data).expect("write").expect("attr");
            assert_eq!(after.size, len as u64);
            let back = c.read(a.ino, 0, len).expect("read");
            assert_eq!(sha256(&back), sha256(&data), "{name} read back");
            out.push((name.to_string(), sha256(&data)));
        }
        // An overwrite of existing blocks is never placed (frames of other
        // senders could land in its slots): it goes in fragments, copied.
        let a = c.lookup(ROOT_INO, b"f4k").expect("lookup");
        c.write(a.ino, 0, &pseudo_random(4096, 1))
            .expect("overwrite");
        out
    })
}

/// In namespace `ns`: sends a malformed frame of our EtherType, then
/// checks the session still works.
fn client_malformed(ns: &str, ifname: String) {
    VethNs::within(ns, move || {
        let c =
            XdpClient::connect(XdpConfig::new(&ifname, "x", SECRET.as_bytes())).expect("connect");
        let (server, me) = c.macs();
        let mut f = vec![0u8; 60];
        f[..6].copy_from_slice(&server);
        f[6..12].copy_from_slice(&me);
        f[12..14].copy_from_slice(&0x88B5u16.to_be_bytes());
        f[14] = 0xEE; // no such frame kind
        c.send_raw(&f).expect("send malformed");
        let a = c
            .lookup(ROOT_INO, b"f4k")
            .expect("lookup after a malformed frame");
        assert_eq!(a.size, 4096);
        // An empty write is answered (nothing to place) and changes nothing.
        let after = c.write(a.ino, 0, &[]).expect("empty write").expect("attr");
        assert_eq!(after.size, 4096);
    })
}

/// In namespace `ns`: one client takes a grant for a 1 MiB write over
/// `f1m` and vanishes; a second one then reads `f1m` (unchanged), finds
/// the free space as before, and writes a placed 4 KiB file.
fn client_vanishes(ns: &str, ifname: String) {
    VethNs::within(ns, move || {
        let cfg = XdpConfig::new(&ifname, "x", SECRET.as_bytes());
        let c = XdpClient::connect(cfg.clone()).expect("connect");
        let a = c.lookup(ROOT_INO, b"f1m").expect("lookup");
        let h = c.create(ROOT_INO, b"held", 0o644, 0, 0).expect("create");
        let free = c.statfs().expect("statfs").bfree;
        assert!(c.take_grant(h.ino, 0, 1 << 20).expect("grant"), "placed");
        drop(c);
        let t = std::time::Instant::now();
        let c = XdpClient::connect(cfg).expect("connect while a grant is held");
        let back = c.read(a.ino, 0, 1 << 20).expect("read");
        let waited = t.elapsed();
        assert_eq!(sha256(&back), sha256(&pseudo_random(1 << 20, 3)));
        // The deadline is 1 s; the rest is the client's 200 ms resends.
        assert!(waited < Duration::from_secs(5), "served after {waited:?}");
        assert_eq!(c.statfs().expect("statfs").bfree, free, "blocks back");
        assert_eq!(c.getattr(h.ino).expect("getattr").size, 0, "write failed");
        let data = pseudo_random(4096, 4);
        let n = c.create(ROOT_INO, b"after", 0o644, 0, 0).expect("create");
        c.write(n.ino, 0, &data).expect("write after the rebuild");
        assert_eq!(
            sha256(&c.read(n.ino, 0, 4096).expect("read")),
            sha256(&data)
        );
    })
}

fn mounted(mp: &std::path::Path) -> bool {
    let m = std::fs::read_to_string("/proc/self/mounts").unwrap();
    m.lines().any(|l| l.split(' ').nth(1) == mp.to_str())
}

/// A mount process, unmounted (lazily, if still there) and reaped on drop.
struct Mount(std::process::Child, PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        if mounted(&self.1) {
            let _ = Command::new("umount").arg("-l").arg(&self.1).status();
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Files through `ustor fs mount xdp://...` in namespace `ns`.
fn through_mount(ns: &str, ifname: &str, dir: &std::path::Path) {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mp = dir.join("mnt");
    std::fs::create_dir_all(&mp).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    let child = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{ns}"))
        .arg(BIN)
        .args(["fs", "mount", &format!("xdp://{ifname}/x")])
        .arg(&mp)
        .arg("--secret-file")
        .arg(&secret)
        .args(["--fuse-mode", "classic"])
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn ustor fs mount");
    let mut m = Mount(child, mp.clone());
    testkit::wait_until("the xdp export is mounted", Duration::from_secs(20), || {
        assert!(m.0.try_wait().unwrap().is_none(), "ustor fs mount exited");
        mounted(&mp)
    });
    let data = pseudo_random(300_000, 7);
    std::fs::write(mp.join("m1"), &data).unwrap();
    assert_eq!(
        sha256(&std::fs::read(mp.join("m1")).unwrap()),
        sha256(&data)
    );
    std::fs::rename(mp.join("m1"), mp.join("m2")).unwrap();
    assert!(!mp.join("m1").exists());
    std::os::unix::fs::symlink("m2", mp.join("ln")).unwrap();
    assert_eq!(
        std::fs::read_link(mp.join("ln")).unwrap().to_str(),
        Some("m2")
    );
    assert_eq!(
        sha256(&std::fs::read(mp.join("ln")).unwrap()),
        sha256(&data)
    );
    std::fs::hard_link(mp.join("m2"), mp.join("hl")).unwrap();
    assert_eq!(std::fs::metadata(mp.join("m2")).unwrap().nlink(), 2);
    std::fs::set_permissions(mp.join("hl"), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(
        std::fs::metadata(mp.join("m2")).unwrap().mode() & 0o777,
        0o600
    );
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(mp.join("m2"))
        .unwrap();
    f.set_len(4096).unwrap();
    drop(f);
    assert_eq!(std::fs::read(mp.join("hl")).unwrap(), data[..4096]);
    std::fs::create_dir(mp.join("d")).unwrap();
    std::fs::remove_dir(mp.join("d")).unwrap();
    let mut names: Vec<String> = std::fs::read_dir(&mp)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    for n in ["hl", "ln", "m2"] {
        assert!(names.iter().any(|x| x == n), "{n} in {names:?}");
    }
    let st = Command::new("umount").arg(&mp).status().unwrap();
    assert!(st.success(), "umount");
    let code = m.0.wait().unwrap();
    assert!(code.success(), "ustor fs mount ends cleanly: {code}");
}

/// In namespace `ns`: reads the files and returns their digests.
fn client_reads(ns: &str, ifname: String) -> Vec<(String, String)> {
    VethNs::within(ns, move || {
        let c =
            XdpClient::connect(XdpConfig::new(&ifname, "x", SECRET.as_bytes())).expect("connect");
        FILES
            .iter()
            .map(|(name, len, _)| {
                let a = c.lookup(ROOT_INO, name.as_bytes()).expect("lookup");
                (
                    name.to_string(),
                    sha256(&c.read(a.ino, 0, *len).expect("read")),
                )
            })
            .collect()
    })
}

#[test]
fn files_cross_two_namespaces_over_af_xdp() {
    testkit::require!(netns::check(), "iproute2 (run as root)");
    testkit::require!(testkit::program("nsenter"), "nsenter (util-linux)");
    testkit::require!(
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/fuse")
            .map(drop)
            .map_err(|e| format!("/dev/fuse: {e}")),
        "/dev/fuse"
    );
    let ns = VethNs::create().expect("namespaces");
    let dir = Dir(tmpdir("fs-xdp"));
    let dir = &dir.0;
    let region = Region(PathBuf::from(format!(
        "/dev/shm/ustor-fs-xdp-{}.img",
        std::process::id()
    )));
    let _ = std::fs::remove_file(&region.0);

    let s = serve_in(&ns.a, dir);
    export(&s, &region.0, &ns.if_a, true);
    let wrote = client_writes(&ns.b, ns.if_b.clone());
    let before = stats(&s)["xdp"]["drops"].as_u64().unwrap();
    client_malformed(&ns.b, ns.if_b.clone());
    let st = stats(&s);
    let x = &st["xdp"];
    assert!(
        x["drops"].as_u64().unwrap() > before,
        "malformed frame counted: {st}"
    );
    assert_eq!(st["auth_failures"], 1, "{st}");
    assert!(
        x["placed_bytes"].as_u64().unwrap() >= 4096 + (1 << 20),
        "4 KiB and 1 MiB payloads placed in the region: {st}"
    );
    assert!(
        x["copied_bytes"].as_u64().unwrap() >= 1024 + 4096,
        "1 KiB payload and the 4 KiB overwrite copied: {st}"
    );
    assert!(x["frames_rx"].as_u64().unwrap() >= 700 && x["frames_tx"].as_u64().unwrap() >= 700);
    let placed = x["placed_bytes"].as_u64().unwrap();
    client_vanishes(&ns.b, ns.if_b.clone());
    let st = stats(&s);
    let x = &st["xdp"];
    assert_eq!(x["grants_expired"], 1, "{st}");
    assert!(x["placed_bytes"].as_u64().unwrap() >= placed + 4096, "{st}");
    through_mount(&ns.b, &ns.if_b, dir);
    let (code, _) = s.stop();
    assert_eq!(code, 0, "ustor serve stops cleanly");

    // The data is in the region: a new server reads it back.
    let s = serve_in(&ns.a, dir);
    export(&s, &region.0, &ns.if_a, false);
    let read = client_reads(&ns.b, ns.if_b.clone());
    assert_eq!(read, wrote);
    let _ = s.stop();
}

/// Sets the MTU of interface `ifname` in namespace `ns`.
fn set_mtu(ns: &str, ifname: &str, mtu: u32) {
    let st = Command::new("ip")
        .args(["-n", ns, "link", "set", ifname, "mtu", &mtu.to_string()])
        .status()
        .expect("ip link set mtu");
    assert!(st.success(), "{ifname} in {ns} takes MTU {mtu}");
}

/// In namespace `ns`: writes `name` (`len` bytes of `seed`) and reads it
/// back by SHA-256, and reads `other` (`olen` bytes of `oseed`) if given.
fn client_round_trip(
    ns: &str,
    ifname: String,
    (name, len, seed): (&'static str, usize, u64),
    other: Option<(&'static str, usize, u64)>,
) {
    VethNs::within(ns, move || {
        let c =
            XdpClient::connect(XdpConfig::new(&ifname, "x", SECRET.as_bytes())).expect("connect");
        let data = pseudo_random(len, seed);
        let a = c
            .create(ROOT_INO, name.as_bytes(), 0o644, 0, 0)
            .expect("create");
        c.write(a.ino, 0, &data).expect("write");
        let back = c.read(a.ino, 0, len).expect("read");
        assert_eq!(sha256(&back), sha256(&data), "{name} read back");
        if let Some((o, olen, oseed)) = other {
            let a = c.lookup(ROOT_INO, o.as_bytes()).expect("lookup");
            let back = c.read(a.ino, 0, olen).expect("read");
            assert_eq!(sha256(&back), sha256(&pseudo_random(olen, oseed)), "{o}");
        }
    })
}

/// An export at MTU 3500 (3504-byte frames: a 4 KiB block in 2 placed
/// frames, 1 MiB in 301) with a client at the same MTU, then a client on
/// a 1500-byte MTU (the veth's other end) served at 1514-byte frames: its
/// write is granted in fragments, not placed.
#[test]
fn large_frames_and_a_client_on_a_smaller_mtu() {
    testkit::require!(netns::check(), "iproute2 (run as root)");
    let ns = VethNs::create().expect("namespaces");
    set_mtu(&ns.a, &ns.if_a, 3500);
    set_mtu(&ns.b, &ns.if_b, 3500);
    let dir = Dir(tmpdir("fs-xdp-mtu"));
    let region = Region(PathBuf::from(format!(
        "/dev/shm/ustor-fs-xdp-mtu-{}.img",
        std::process::id()
    )));
    let _ = std::fs::remove_file(&region.0);
    let s = serve_in(&ns.a, &dir.0);
    export_mtu(&s, &region.0, &ns.if_a, true, Some(3500));
    client_round_trip(&ns.b, ns.if_b.clone(), ("b4k", 4096, 11), None);
    client_round_trip(&ns.b, ns.if_b.clone(), ("b1m", 1 << 20, 12), None);
    let st = stats(&s);
    let x = &st["xdp"];
    let placed = x["placed_bytes"].as_u64().unwrap();
    assert!(placed >= 4096 + (1 << 20), "placed: {st}");
    // At 1514-byte frames the 1 MiB write and read alone are 700 frames
    // each way.
    let (rx, tx) = (
        x["frames_rx"].as_u64().unwrap(),
        x["frames_tx"].as_u64().unwrap(),
    );
    assert!(rx < 450 && tx < 450, "3504-byte frames: {st}");

    set_mtu(&ns.b, &ns.if_b, 1500);
    client_round_trip(
        &ns.b,
        ns.if_b.clone(),
        ("s1m", 1 << 20, 13),
        Some(("b1m", 1 << 20, 12)),
    );
    let st = stats(&s);
    let x = &st["xdp"];
    assert_eq!(x["placed_bytes"].as_u64().unwrap(), placed, "{st}");
    assert!(x["copied_bytes"].as_u64().unwrap() >= 3 << 20, "{st}");
    let (code, _) = s.stop();
    assert_eq!(code, 0, "ustor serve stops cleanly");
}

//! `ustor fs mount` against `ustor serve` on the default port, one server
//! and two mounts of one export for every case: fio with 4 jobs verifies
//! its data while the server sees several requests of the connection in
//! flight at once (the mount answers the kernel from workers); a table of
//! POSIX calls gives the same results on the mount as on tmpfs (readdir's
//! "." and ".." included); a file written through a shared mmap reads back
//! through the server; a sqlite database passes integrity_check on both
//! mounts, and a file rewritten on one is read fresh on the other. The
//! second mount runs with the kernel's writeback cache (`--writeback`):
//! what it writes is on the server by its close, and buffered fio with 4
//! jobs verifies through it while the first mount reads the same bytes.
//! Both run classic /dev/fuse; a third mount runs on FUSE over io_uring
//! (`--fuse-mode uring`) and passes the table and fio verify, its exit
//! report showing the ring answered the requests.

mod common;
mod posix;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{pseudo_random, sha256, tmpdir, Server, BIN};
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

/// One server exporting on the default port and one mount of it; the
/// mount is unmounted and the server stopped when dropped.
struct Rig {
    server: Option<Server>,
    mounts: Vec<(Child, PathBuf)>,
    /// The first mount's directory.
    mp: PathBuf,
    dir: PathBuf,
}

fn mount(mp: &Path, secret: &Path, extra: &[&str]) -> Child {
    std::fs::create_dir_all(mp).unwrap();
    let mut m = Command::new(BIN)
        .args(["fs", "mount", "127.0.0.1/vol"])
        .arg(mp)
        .arg("--secret-file")
        .arg(secret)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    testkit::wait_until("the export is mounted", Duration::from_secs(20), || {
        assert!(m.try_wait().unwrap().is_none(), "ustor fs mount exited");
        mounted(mp)
    });
    m
}

impl Rig {
    fn start() -> Rig {
        let dir = tmpdir("fs-posix");
        let (region, mp, secret) = (dir.join("region"), dir.join("mnt"), dir.join("secret"));
        std::fs::write(&secret, "posix-secret\n").unwrap();
        // "listen" without a port: the default one, which the mount dials
        // when its target names none.
        let cfg = json!({"subsystems": [{"subsystem": "fs", "config": [
            {"method": "fs_create", "params": {"name": "vol", "path": region, "size": 128u64 << 20}},
            {"method": "fs_export", "params": {"name": "vol", "listen": "127.0.0.1",
                "secret_file": secret}}
        ]}]});
        let server = Server::start(&dir, &cfg, &[]);
        let ex = server.ok("fs_get_exports", json!(null));
        assert_eq!(ex[0]["listen"], "127.0.0.1:4800", "{ex}");
        let mp2 = dir.join("mnt2");
        let mounts = vec![
            (mount(&mp, &secret, &["--fuse-mode", "classic"]), mp.clone()),
            // The second mount with the kernel's writeback cache.
            (
                mount(&mp2, &secret, &["--writeback", "--fuse-mode", "classic"]),
                mp2,
            ),
        ];
        Rig {
            server: Some(server),
            mounts,
            mp,
            dir,
        }
    }

    fn stats(&self) -> serde_json::Value {
        let s = self.server.as_ref().unwrap();
        s.ok("fs_get_stats", json!({"name": "vol"}))[0].clone()
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        for (m, mp) in &mut self.mounts {
            if mounted(mp) {
                let _ = Command::new("umount").arg(&*mp).status();
            }
            let _ = testkit::try_wait_for(Duration::from_secs(20), || m.try_wait().ok().flatten());
            if let Ok(None) = m.try_wait() {
                let _ = m.kill();
                let _ = m.wait();
            }
        }
        drop(self.server.take());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn fio(dir: &Path, bs: &str, rw: &str, size: &str) -> String {
    fio_with(dir, bs, rw, size, "--direct=1")
}

fn fio_with(dir: &Path, bs: &str, rw: &str, size: &str, direct: &str) -> String {
    let o = Command::new("fio")
        .args([
            "--name=par",
            "--numjobs=4",
            "--ioengine=psync",
            direct,
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
            "--group_reporting",
        ])
        .arg(format!("--bs={bs}"))
        .arg(format!("--rw={rw}"))
        .arg(format!("--size={size}"))
        .arg(format!("--directory={}", dir.display()))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "fio {bs} {rw} failed:\n{out}");
    out
}

/// fio with 4 jobs: every block verified (crc32c), and the server saw more
/// than one request of the mount's connection in flight.
fn parallel_fio_overlaps_and_verifies(r: &Rig) {
    let dir = r.mp.join("fio");
    std::fs::create_dir(&dir).unwrap();
    let before = r.stats();
    assert_eq!(before["max_requests_in_flight"], 1, "{before}");
    fio(&dir, "4k", "randwrite", "512k");
    fio(&dir, "1m", "write", "2m");
    let st = r.stats();
    let peak = st["max_requests_in_flight"].as_u64().unwrap();
    assert!(peak > 1, "requests never overlapped: {st}");
    assert_eq!(st["copied_bytes"], 0, "{st}");
    assert!(
        st["bytes_written"].as_u64().unwrap() >= 4 * (5 << 19),
        "{st}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Rows whose outcome on the mount differs from tmpfs by design, with why.
const KNOWN: &[(&str, &str)] = &[];

fn posix_table_matches_tmpfs(mp: &Path) {
    let on_mount = mp.join("posix");
    std::fs::create_dir(&on_mount).unwrap();
    let reference = Path::new("/dev/shm").join(format!("ustor-posix-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&reference);
    std::fs::create_dir(&reference).unwrap();
    let want = posix::run(&reference);
    let got = posix::run(&on_mount);
    let _ = std::fs::remove_dir_all(&reference);
    assert_eq!(want.len(), got.len());
    let diff: Vec<String> = want
        .iter()
        .zip(&got)
        .filter(|(w, g)| w != g)
        .filter(|(w, _)| !KNOWN.iter().any(|k| w.starts_with(&format!("{}:", k.0))))
        .map(|(w, g)| format!("  tmpfs  {w}\n  mount  {g}"))
        .collect();
    assert!(
        diff.is_empty(),
        "{} calls differ from tmpfs:\n{}",
        diff.len(),
        diff.join("\n")
    );
    std::fs::remove_dir_all(&on_mount).unwrap();
}

/// A file changed through a shared mapping reads back through the server
/// (after the page cache is dropped), and a mapping reads what write(2)
/// put there.
fn mmap_round_trip(r: &Rig) {
    let p = r.mp.join("mapped");
    let base = pseudo_random(256 << 10, 5);
    std::fs::write(&p, &base).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    // SAFETY: a shared mapping of a file this test alone uses.
    let mut m = unsafe { memmap2::MmapMut::map_mut(&f).unwrap() };
    assert!(m[..] == base[..], "the mapping shows what write(2) wrote");
    let patch = pseudo_random(100_000, 6);
    m[70_000..170_000].copy_from_slice(&patch);
    m.flush().unwrap();
    drop(m);
    drop(f);
    let mut want = base.clone();
    want[70_000..170_000].copy_from_slice(&patch);
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    assert_eq!(sha256(&std::fs::read(&p).unwrap()), sha256(&want));
    assert_eq!(std::fs::metadata(&p).unwrap().size(), 256 << 10);
}

fn run(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{cmd:?} failed:\n{out}");
    out
}

/// sqlite on the first mount (journal files created, fsync'ed, unlinked,
/// concurrent reads and writes through the workers), checked on both; a
/// same-size rewrite on the first mount is read fresh on the second after
/// it opens the file (close-to-open).
fn sqlite_and_two_clients(r: &Rig) {
    let (a, b) = (&r.mounts[0].1, &r.mounts[1].1);
    let sql = "PRAGMA journal_mode=DELETE;\
        CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT, n INT);\
        CREATE INDEX tn ON t(n);\
        WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<1000)\
          INSERT INTO t SELECT x, hex(randomblob(40)), x%97 FROM c;\
        BEGIN; UPDATE t SET n=n+1 WHERE id%3=0; DELETE FROM t WHERE id%5=0; COMMIT;\
        VACUUM;";
    run(Command::new("sqlite3").arg(a.join("t.db")).arg(sql));
    let (mut cnt, mut sum) = (0u64, 0u64);
    for id in (1..=1000u64).filter(|id| id % 5 != 0) {
        cnt += 1;
        sum += id % 97 + (id % 3 == 0) as u64;
    }
    let want = format!("ok\n{cnt}|{sum}\n");
    let check = "PRAGMA integrity_check; SELECT count(*), sum(n) FROM t;";
    for m in [a, b] {
        let out = run(Command::new("sqlite3").arg(m.join("t.db")).arg(check));
        assert_eq!(out, want, "sqlite on {}", m.display());
    }
    std::fs::write(a.join("shared"), pseudo_random(8192, 1)).unwrap();
    assert!(std::fs::read(b.join("shared")).unwrap() == pseudo_random(8192, 1));
    std::fs::write(a.join("shared"), pseudo_random(8192, 2)).unwrap();
    assert!(
        std::fs::read(b.join("shared")).unwrap() == pseudo_random(8192, 2),
        "the second mount served a stale page cache"
    );
    // The other way: what the writeback mount wrote reaches the server by
    // its close.
    std::fs::write(b.join("shared"), pseudo_random(8192, 3)).unwrap();
    assert!(
        std::fs::read(a.join("shared")).unwrap() == pseudo_random(8192, 3),
        "a write the writeback mount closed was not on the server"
    );
}

/// The second mount caches writes (the kernel's writeback cache): buffered
/// fio with 4 jobs verifies its blocks, and once fio closed its files the
/// first mount (another client, nothing cached) reads the same bytes.
fn writeback_fio_then_other_client(r: &Rig) {
    let (a, b) = (&r.mounts[0].1, &r.mounts[1].1);
    std::fs::create_dir(b.join("wb")).unwrap();
    fio_with(&b.join("wb"), "4k", "randwrite", "512k", "--direct=0");
    for j in 0..4 {
        let name = format!("wb/par.{j}.0");
        let via_b = sha256(&std::fs::read(b.join(&name)).unwrap());
        assert_eq!(
            sha256(&std::fs::read(a.join(&name)).unwrap()),
            via_b,
            "{name}"
        );
    }
    std::fs::remove_dir_all(b.join("wb")).unwrap();
}

#[test]
fn mount_on_default_port_parallel_posix_table_and_mmap() {
    testkit::require!(fuse_usable(), "a kernel with FUSE (/dev/fuse), as root");
    if !testkit::need("fio") || !testkit::need("sqlite3") {
        return;
    }
    let t = std::time::Instant::now();
    let r = Rig::start();
    eprintln!("mounted after {:?}", t.elapsed());
    parallel_fio_overlaps_and_verifies(&r);
    eprintln!("fio done after {:?}", t.elapsed());
    posix_table_matches_tmpfs(&r.mp);
    eprintln!("table done after {:?}", t.elapsed());
    mmap_round_trip(&r);
    eprintln!("mmap done after {:?}", t.elapsed());
    sqlite_and_two_clients(&r);
    eprintln!("sqlite done after {:?}", t.elapsed());
    writeback_fio_then_other_client(&r);
    eprintln!("writeback done after {:?}", t.elapsed());
    let st = r.stats();
    assert_eq!(st["copied_bytes"], 0, "{st}");
    uring_mount_passes_the_table_and_fio(&r);
    eprintln!("uring done after {:?}", t.elapsed());
}

const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// Puts enable_uring back as it was, also when the test fails.
struct Restore(String);

impl Drop for Restore {
    fn drop(&mut self) {
        let _ = std::fs::write(ENABLE_URING, &self.0);
    }
}

/// Unmounts (lazily) when a failed assertion leaves the mount behind; the
/// mount process then ends by itself.
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        if mounted(&self.0) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

fn uring_usable() -> Result<(), String> {
    std::fs::read_to_string(ENABLE_URING)
        .map(drop)
        .map_err(|e| format!("{ENABLE_URING}: {e}"))
}

/// A third mount on FUSE over io_uring (`--fuse-mode uring`, with
/// enable_uring set to Y for the test): the POSIX table gives tmpfs's
/// results and fio verifies its blocks through it; when it is unmounted
/// the mount reports that it ran on the ring and that the ring, not
/// /dev/fuse, answered the requests.
fn uring_mount_passes_the_table_and_fio(r: &Rig) {
    testkit::require!(
        uring_usable(),
        "Linux 6.14+ with CONFIG_FUSE_IO_URING (FUSE over io_uring)"
    );
    let before = std::fs::read_to_string(ENABLE_URING).unwrap();
    std::fs::write(ENABLE_URING, "Y").unwrap();
    let _restore = Restore(before.trim().to_string());
    let mp = r.dir.join("mnt-uring");
    let g = Unmount(mp.clone());
    let mut m = mount(&mp, &r.dir.join("secret"), &["--fuse-mode", "uring"]);
    posix_table_matches_tmpfs(&mp);
    let dir = mp.join("fio");
    std::fs::create_dir(&dir).unwrap();
    fio(&dir, "4k", "randwrite", "256k");
    // 1 MiB reads come back straight into the ring's entries, their data
    // padded to align (FLAG_ALIGN); 1 MiB writes go out of the entries.
    fio(&dir, "1m", "write", "4m");
    std::fs::remove_dir_all(&dir).unwrap();
    let st = Command::new("umount").arg(&mp).status().unwrap();
    assert!(st.success());
    drop(g);
    let code = testkit::wait_for("the uring mount to exit", Duration::from_secs(20), || {
        m.try_wait().unwrap()
    });
    let out = m.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(code.success(), "{code:?}: {text}");
    assert!(text.contains("mounted, fuse mode uring"), "{text}");
    let ring: u64 = text
        .split("ended; fuse mode uring, ")
        .nth(1)
        .and_then(|t| t.split(" queues, ").nth(1))
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no ring count in: {text}"));
    // The table alone makes hundreds of requests: most went to the ring.
    assert!(ring > 100, "the ring answered only {ring}: {text}");
}

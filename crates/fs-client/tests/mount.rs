//! The FUSE file system through a real kernel mount (/dev/fuse) against a
//! server running the real request handler: files, directories, renames,
//! links, truncation and statfs through std::fs and tar (checksums compared
//! with the source tree), and two mounts of one export seeing each other's
//! closed files (close-to-open: the second client's page cache is dropped
//! when the file changed).

mod common;

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::{region, tempdir, TestServer};
use ustor_fs_client::fuse::FuseFs;
use ustor_fs_client::session::{self, Background, FuseMode};
use ustor_fs_client::{Client, Config};

fn fuse_usable() -> Result<(), String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map(drop)
        .map_err(|e| {
            format!("/dev/fuse: {e} (FUSE mounts need it and CAP_SYS_ADMIN or fusermount3)")
        })
}

fn mount(s: &TestServer, mp: &Path) -> Background {
    let c = Client::connect(Config::new(&s.addr.to_string(), "exp", b"k")).unwrap();
    let fs = FuseFs::new(Arc::new(c), Duration::from_secs(1));
    let opts = "default_permissions";
    session::spawn(fs, mp, "ustor-test", opts, FuseMode::Classic).unwrap()
}

fn sha(p: &Path) -> String {
    let o = Command::new("sha256sum").arg(p).output().unwrap();
    String::from_utf8(o.stdout).unwrap()[..64].to_string()
}

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A source tree of nested directories, files of odd sizes and a symlink.
fn make_tree(root: &Path) {
    for d in 0..3u64 {
        let dir = root.join(format!("d{d}/sub"));
        std::fs::create_dir_all(&dir).unwrap();
        for f in 0..5u64 {
            let n = [0, 1, 4095, 4097, 300_000][f as usize];
            std::fs::write(dir.join(format!("f{f}")), pattern(d * 10 + f, n)).unwrap();
        }
    }
    std::os::unix::fs::symlink("d0/sub/f4", root.join("link")).unwrap();
}

/// sha256sum of every file, by relative path, as `find | sort` lists them.
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
fn posix_calls_tar_and_two_clients_through_a_mount() {
    testkit::require!(fuse_usable(), "a kernel with FUSE, run as root");
    let (_d, fs) = region(64 << 20);
    let s = TestServer::start("127.0.0.1:0", fs, "exp", b"k");
    let t = tempdir::Dir::new();
    let (a, b, src) = (t.0.join("a"), t.0.join("b"), t.0.join("src"));
    for p in [&a, &b, &src] {
        std::fs::create_dir(p).unwrap();
    }
    let _ma = mount(&s, &a);
    let _mb = mount(&s, &b);

    // Data: a file written at offsets, read back, truncated.
    let f = a.join("file");
    let data = pattern(7, 2 << 20);
    std::fs::write(&f, &data).unwrap();
    assert!(std::fs::read(&f).unwrap() == data);
    let mut h = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
    h.seek(SeekFrom::Start(5000)).unwrap();
    h.write_all(b"hello").unwrap();
    h.sync_all().unwrap();
    drop(h);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(6000)
        .unwrap();
    let back = std::fs::read(&f).unwrap();
    assert_eq!(back.len(), 6000);
    assert_eq!(&back[5000..5005], b"hello");
    assert_eq!(&back[..5000], &data[..5000]);

    // Namespace: mkdir, rename (also over an existing name), link, chmod.
    std::fs::create_dir(a.join("dir")).unwrap();
    std::fs::write(a.join("dir/x"), b"x").unwrap();
    std::fs::write(a.join("y"), b"y").unwrap();
    std::fs::rename(a.join("y"), a.join("dir/x")).unwrap();
    assert_eq!(std::fs::read(a.join("dir/x")).unwrap(), b"y");
    std::fs::hard_link(a.join("dir/x"), a.join("hl")).unwrap();
    assert_eq!(std::fs::metadata(a.join("hl")).unwrap().nlink(), 2);
    std::fs::set_permissions(a.join("hl"), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(
        std::fs::metadata(a.join("dir/x")).unwrap().mode() & 0o7777,
        0o600
    );
    let e = std::fs::remove_dir(a.join("dir")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOTEMPTY));
    assert_eq!(
        std::fs::read(a.join("nope")).unwrap_err().kind(),
        std::io::ErrorKind::NotFound
    );
    std::fs::remove_file(a.join("dir/x")).unwrap();
    std::fs::remove_dir(a.join("dir")).unwrap();
    std::fs::remove_file(a.join("hl")).unwrap();
    let df = Command::new("df").arg("-B4096").arg(&a).output().unwrap();
    assert!(df.status.success(), "{df:?}");

    // tar a tree in and out; checksums equal the source's.
    make_tree(&src);
    let st = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "tar -C {} -cf - . | tar -C {} -xf -",
            src.display(),
            a.display()
        ))
        .status()
        .unwrap();
    assert!(st.success());
    let want: String = sums(&src);
    let got: String = sums(&a)
        .lines()
        .filter(|l| !l.ends_with("./file"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(got, want);
    assert_eq!(
        std::fs::read_link(a.join("link")).unwrap(),
        Path::new("d0/sub/f4")
    );

    // Two clients: b sees a's tree, then a's rewrite after close-to-open.
    assert_eq!(sha(&b.join("d1/sub/f4")), sha(&src.join("d1/sub/f4")));
    let p = b.join("shared");
    std::fs::write(a.join("shared"), pattern(1, 8192)).unwrap();
    let mut buf = Vec::new();
    std::fs::File::open(&p)
        .unwrap()
        .read_to_end(&mut buf)
        .unwrap();
    assert!(buf == pattern(1, 8192));
    // Same size, new bytes: only the mtime/close-to-open check catches it.
    std::fs::write(a.join("shared"), pattern(2, 8192)).unwrap();
    buf.clear();
    std::fs::File::open(&p)
        .unwrap()
        .read_to_end(&mut buf)
        .unwrap();
    assert!(
        buf == pattern(2, 8192),
        "client b served a stale page cache"
    );
}

fn run(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{cmd:?} failed:\n{out}");
    out
}

#[test]
fn fio_verify_and_sqlite_integrity_through_a_mount() {
    testkit::require!(fuse_usable(), "a kernel with FUSE, run as root");
    if !testkit::need("fio") || !testkit::need("sqlite3") {
        return;
    }
    let (_d, fs) = region(96 << 20);
    let s = TestServer::start("127.0.0.1:0", fs, "exp", b"k");
    let t = tempdir::Dir::new();
    let mp = t.0.join("m");
    std::fs::create_dir(&mp).unwrap();
    let _m = mount(&s, &mp);
    // fio writes with crc32c verify headers and reads every block back,
    // at 4 KiB random and 1 MiB sequential.
    for (bs, rw) in [("4k", "randwrite"), ("1m", "write")] {
        run(Command::new("fio")
            .args([
                "--name=v",
                "--ioengine=psync",
                "--size=2m",
                "--verify=crc32c",
            ])
            .arg(format!("--bs={bs}"))
            .arg(format!("--rw={rw}"))
            .args(["--do_verify=1", "--verify_fatal=1", "--verify_state_save=0"])
            .arg(format!(
                "--filename={}",
                mp.join(format!("fio-{bs}")).display()
            )));
    }
    // sqlite: tables, an index, updates and deletes in transactions (its
    // journal files are created, written, fsync'ed and unlinked), then
    // integrity_check and a sum computed both ways.
    let db = mp.join("t.db");
    let sql = "PRAGMA journal_mode=DELETE;\
        CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT, n INT);\
        CREATE INDEX tn ON t(n);\
        WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<3000)\
          INSERT INTO t SELECT x, hex(randomblob(40)), x%97 FROM c;\
        BEGIN; UPDATE t SET n=n+1 WHERE id%3=0; DELETE FROM t WHERE id%5=0; COMMIT;\
        VACUUM;\
        PRAGMA integrity_check; SELECT count(*), sum(n) FROM t;";
    let out = run(Command::new("sqlite3").arg(&db).arg(sql));
    let want = {
        let (mut cnt, mut sum) = (0u64, 0u64);
        for id in 1..=3000u64 {
            if id % 5 != 0 {
                cnt += 1;
                sum += id % 97 + (id % 3 == 0) as u64;
            }
        }
        format!("ok\n{cnt}|{sum}\n")
    };
    assert!(
        out.ends_with(&want),
        "sqlite said:\n{out}\nwanted the end:\n{want}"
    );
    let out = run(Command::new("sqlite3")
        .arg(&db)
        .arg("PRAGMA integrity_check;"));
    assert_eq!(out, "ok\n");
}

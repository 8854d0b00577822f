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
use fuser::{BackgroundSession, MountOption};
use ustor_fs_client::fuse::FuseFs;
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

fn mount(s: &TestServer, mp: &Path) -> BackgroundSession {
    let c = Client::connect(Config::new(&s.addr.to_string(), "exp", b"k")).unwrap();
    let fs = FuseFs::new(Arc::new(c), Duration::from_secs(1));
    let opts = [
        MountOption::FSName("ustor-test".into()),
        MountOption::DefaultPermissions,
    ];
    fuser::spawn_mount2(fs, mp, &opts).unwrap()
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

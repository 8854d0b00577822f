//! Shared setup for the peer-validation tests: temp images and the
//! host-side checks of what the guest wrote.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use testvm::host::{ext4_file_md5, fsck_image};
use testvm::GuestOutcome;

/// A sparse raw image of `mib` MiB.
pub fn image(dir: &Path, name: &str, mib: u64) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p)
        .and_then(|f| f.set_len(mib << 20))
        .unwrap_or_else(|e| panic!("create image {}: {e}", p.display()));
    p
}

/// The path of a host tool the test needs, or a failure that says which
/// package provides it (only a missing QEMU is a reason to skip).
pub fn tool(name: &str, package: &str) -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!("{name} not found: install Debian package {package} (.ci/apt/testvm.txt)")
    })
}

/// After a guest ran `fs_roundtrip` on a disk backed by `image`: the image
/// is a clean ext4 on the host too, and its data.bin has the md5 the guest
/// reported.
pub fn check_fs_image(image: &Path, out: &GuestOutcome) {
    fsck_image(image).expect("host e2fsck of the image the guest wrote");
    let guest_md5 = out.value("data_md5").expect("guest reported data_md5");
    let host_md5 = ext4_file_md5(image, "/data.bin").expect("read data.bin from image");
    assert_eq!(
        guest_md5, host_md5,
        "data.bin differs between guest and backing file"
    );
    assert_eq!(out.value("files"), Some("21"), "file count");
}

/// Runs a command, panicking with its stderr if it fails.
pub fn must(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

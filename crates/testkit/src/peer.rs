//! Peers a test needs (tgtd, QEMU, nbdkit, fio, SPDK's Python client, ...)
//! and what happens when one is not installed.
//!
//! One rule, decided in [`missing`]: on a developer's machine the test prints
//! `SKIPPED: <what> (install: <how>) [<test>]` and returns, so a partial
//! setup still runs everything else; under `CI=true` a missing peer panics
//! with the same text, because a CI run that skipped its interop tests and
//! passed would prove nothing. `scripts/test.sh` installs every peer listed
//! in `.ci/apt/*.txt` and `.ci/pip.txt`.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Whether this run is a CI run (`CI=true`, or `CI=1`), where a missing peer
/// fails the test instead of skipping it.
pub fn on_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// The full path of program `name` found on `PATH`, or why not.
pub fn program(name: &str) -> Result<PathBuf, String> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
        .ok_or_else(|| format!("`{name}` is not on PATH"))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// How to install a peer program the tests use, by program name (the
/// Debian package or PyPI project that provides it, and the `.ci` list
/// that names it so `scripts/test.sh` installs it).
pub fn install_hint(program: &str) -> String {
    let (how, list) = match program {
        "tgtd" | "tgtadm" => ("apt-get install tgt", ".ci/apt/iscsi.txt"),
        "iscsi-perf" | "iscsi-ls" | "iscsi-inq" | "iscsi-readcapacity16" => {
            ("apt-get install libiscsi-bin", ".ci/apt/iscsi.txt")
        }
        "qemu-io" | "qemu-img" | "qemu-nbd" => ("apt-get install qemu-utils", ".ci/apt/nbd.txt"),
        "qemu-storage-daemon" => ("apt-get install qemu-system-common", ".ci/apt/testvm.txt"),
        "qemu-system-x86_64" => ("apt-get install qemu-system-x86", ".ci/apt/testvm.txt"),
        "nbdinfo" | "nbdcopy" | "nbdsh" => ("apt-get install libnbd-bin", ".ci/apt/nbd.txt"),
        "nbdkit" => ("apt-get install nbdkit", ".ci/apt/nbd.txt"),
        "fio" => ("apt-get install fio", ".ci/apt/nbd.txt"),
        "sg_reset" | "sg_inq" => ("apt-get install sg3-utils", ".ci/apt/scsi.txt"),
        "spdk-rpc" => ("python3 -m pip install spdk", ".ci/pip.txt"),
        "python3" => ("apt-get install python3", ".ci/apt/iscsi.txt"),
        "tmux" => ("apt-get install tmux", ".ci/apt/operating.txt"),
        "prometheus" | "promtool" => ("apt-get install prometheus", ".ci/apt/operating.txt"),
        "ceph-mon" | "ceph-osd" | "ceph" | "rbd" | "rados" => (
            "apt-get install --no-install-recommends ceph-mon ceph-osd ceph-common",
            ".ci/apt/ceph.txt",
        ),
        other => return format!("install `{other}`, and list its package in .ci/apt/"),
    };
    format!("{how}; listed in {list}, which scripts/test.sh installs")
}

/// Whether program `name` is installed; when it is not, reports it through
/// [`missing`] (a skip message, or a panic under `CI=true`) with the
/// [`install_hint`] for it.
///
/// ```no_run
/// if !testkit::need("fio") {
///     return;
/// }
/// ```
#[track_caller]
pub fn need(name: &str) -> bool {
    match program(name) {
        Ok(_) => true,
        Err(why) => {
            missing(&why, &install_hint(name));
            false
        }
    }
}

/// A peer the calling test needs is missing: `what` says which and why,
/// `install` how to get it. Under `CI=true` this panics; otherwise it writes
/// `SKIPPED: ...` straight to the stderr file descriptor (libtest captures
/// `eprintln!` of passing tests, which would hide the skip) and returns, and
/// the caller returns from the test.
#[track_caller]
pub fn missing(what: &str, install: &str) {
    let test = std::thread::current()
        .name()
        .unwrap_or("<unnamed test>")
        .to_string();
    if on_ci() {
        panic!("{test}: CI=true and a peer is missing: {what} (install: {install})");
    }
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "SKIPPED: {what} (install: {install}) [{test}]");
}

/// What a skipped test returns: `()` for plain tests, `Ok(())` for tests
/// returning `Result`, so one macro serves both.
pub trait SkipReturn {
    fn skip_value() -> Self;
}

impl SkipReturn for () {
    fn skip_value() -> Self {}
}

impl<E> SkipReturn for Result<(), E> {
    fn skip_value() -> Self {
        Ok(())
    }
}

/// Returns from the calling test when `$check` (a `Result<_, String>` saying
/// why a peer is unusable) is `Err`, after [`missing`] reported it (and
/// panicked, under `CI=true`).
///
/// ```no_run
/// fn python_spdk() -> Result<(), String> { Ok(()) }
/// fn my_test() {
///     testkit::require!(python_spdk(), "pip install spdk (.ci/pip.txt)");
/// }
/// ```
#[macro_export]
macro_rules! require {
    ($check:expr, $install:expr) => {
        if let Err(why) = $check {
            $crate::missing(&why, $install);
            return $crate::SkipReturn::skip_value();
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_sh_and_not_a_made_up_name() {
        assert!(program("sh").is_ok());
        let err = program("ustor-no-such-program").unwrap_err();
        assert!(err.contains("ustor-no-such-program"), "{err}");
    }

    #[test]
    fn hints_name_the_package_and_the_ci_list() {
        let h = install_hint("tgtd");
        assert!(
            h.contains("apt-get install tgt") && h.contains(".ci/apt/iscsi.txt"),
            "{h}"
        );
        assert!(install_hint("made-up").contains(".ci/apt/"));
    }
}

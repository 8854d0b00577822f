//! ustor's interop rig: the Linux kernel's own initiators (nbd, nvme-tcp,
//! iscsi_tcp, virtio-blk over vhost-user, virtio-scsi) run in a small QEMU
//! guest under TCG, driven from Rust integration tests.
//!
//! The host kernel has none of those initiator modules, so every target's
//! interop tests boot this guest instead: a Debian kernel (booted as an ELF
//! by PVH) and an initramfs with busybox, nvme-cli, open-iscsi, nbd-client
//! and e2fsprogs. A test starts its server on 127.0.0.1, boots the guest
//! with a shell script (which reaches the host at 10.0.2.2), and asserts on
//! the script's exit status and on values it printed:
//!
//! ```no_run
//! use std::time::Duration;
//! testvm::require_guest!();
//! let out = testvm::GuestBuilder::new()
//!     .script_file(testvm::guest_script("nbd.sh"))
//!     .env("NBD_PORT", "10809")
//!     .timeout(Duration::from_secs(120))
//!     .run()?
//!     .success()?;
//! assert!(out.value("data_md5").is_some());
//! # Ok::<(), testvm::GuestError>(())
//! ```
//!
//! Modules: [`assets`] builds and caches the kernel and base initramfs,
//! [`guest`] boots one guest, [`host`] has server/port/checksum helpers for
//! the host side, [`cpio`] and [`modules`] are the initramfs plumbing,
//! [`lock`] serializes guest runs machine-wide, [`qmp`] runs QMP commands
//! a script asks for mid-run (hot-unplug).

pub mod assets;
pub mod cpio;
pub mod error;
pub mod guest;
pub mod host;
pub mod lock;
pub mod modules;
pub mod qmp;

use std::sync::OnceLock;

pub use error::GuestError;
pub use guest::{guest_script, GuestBuilder, GuestOutcome};

/// Set to `1` to turn "guest unavailable" into a test failure instead of a
/// skip (CI jobs that must exercise the guest).
pub const REQUIRE_ENV: &str = "USTOR_TESTVM_REQUIRE";

/// Whether a guest can run here; `Err` says why not (no QEMU, the kernel or
/// tools could not be downloaded or assembled). The first call may take a
/// minute to download and build the assets; the answer is cached for the
/// process.
pub fn available() -> Result<(), String> {
    static STATE: OnceLock<Result<(), String>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            let qemu = guest::qemu_binary().map_err(|e| e.to_string())?;
            assets::run_cmd(std::process::Command::new(&qemu).arg("--version"))
                .map_err(|e| format!("{} cannot run: {e}", qemu.display()))?;
            assets::ensure().map_err(|e| format!("guest kernel/initramfs unavailable: {e}"))?;
            Ok(())
        })
        .clone()
}

/// Reports a skipped test through the workspace's one missing-peer rule
/// ([`testkit::missing`]): `SKIPPED: <reason>` on a developer's machine, a
/// panic under `CI=true` or when [`REQUIRE_ENV`] is `1`.
#[track_caller]
pub fn report_skip(reason: &str) {
    if std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1") {
        let test = std::thread::current()
            .name()
            .unwrap_or("<unnamed test>")
            .to_string();
        panic!("{test}: guest required ({REQUIRE_ENV}=1) but unavailable: {reason}");
    }
    testkit::missing(
        &format!("no QEMU guest: {reason}"),
        "the Debian packages in .ci/apt/testvm.txt, which scripts/test.sh installs",
    );
}

/// Returns from the calling test (after printing `SKIPPED: <reason>`; a
/// failure instead under `CI=true`) when no guest can run here.
#[macro_export]
macro_rules! require_guest {
    () => {
        if let Err(reason) = $crate::available() {
            $crate::report_skip(&reason);
            return $crate::SkipReturn::skip_value();
        }
    };
}

/// What a skipped test returns: `()` for plain tests, `Ok(())` for tests
/// returning `Result`.
pub use testkit::SkipReturn;

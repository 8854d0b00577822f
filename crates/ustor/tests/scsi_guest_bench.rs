//! Boots the QEMU/TCG guest for `bench/scsi-guest.sh`: the kernel's iSCSI
//! initiator (open-iscsi, iscsi_tcp, sd) against ustor's iSCSI LLD, both
//! measured with `ustor bench` inside the guest against a tgtd LUN that the
//! script serves on the host. The guest script is `tests/guest/scsi-bench.sh`.
//!
//! Ignored: it is a benchmark, not a test, and needs the host side the
//! script sets up. Run it through the script, or by hand with
//! `SCSI_BENCH_PORT=<tgtd port> SCSI_BENCH_IQN=<iqn> cargo test --release -p
//! ustor --test scsi_guest_bench -- --ignored --nocapture`.
//!
//! Environment: SCSI_BENCH_PORT, SCSI_BENCH_IQN (required); USTOR_BIN (the
//! binary to ship, default this build's `ustor`); SCSI_BENCH_LOG (also copy
//! the serial log there); GUEST_CPUS (2), GUEST_MEM_MIB (1536),
//! GUEST_TIMEOUT_S (1200); ROUNDS, RUNTIME, POLL, VERIFY_S, WORKLOADS,
//! KERNEL_SCHED are passed to the guest script as they are.
//! The serial log goes to stdout.

use std::path::PathBuf;
use std::time::Duration;

use testvm::{guest_script, require_guest, GuestBuilder};

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
#[ignore = "benchmark: run bench/scsi-guest.sh"]
fn scsi_guest_bench() {
    require_guest!();
    let port = std::env::var("SCSI_BENCH_PORT")
        .expect("SCSI_BENCH_PORT (tgtd's port on 127.0.0.1) is required: run bench/scsi-guest.sh");
    let iqn = std::env::var("SCSI_BENCH_IQN").expect("SCSI_BENCH_IQN is required");
    let bin = std::env::var_os("USTOR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ustor")));
    let mut b = GuestBuilder::new()
        .script_file(guest_script("scsi-bench.sh"))
        .binary(&bin)
        .cpus(env_or("GUEST_CPUS", 2))
        .memory_mib(env_or("GUEST_MEM_MIB", 1536))
        .env("BENCH_PORT", port)
        .env("BENCH_IQN", iqn)
        .timeout(Duration::from_secs(env_or("GUEST_TIMEOUT_S", 1200)));
    for key in [
        "ROUNDS",
        "RUNTIME",
        "POLL",
        "VERIFY_S",
        "WORKLOADS",
        "KERNEL_SCHED",
    ] {
        if let Ok(v) = std::env::var(key) {
            b = b.env(key, v);
        }
    }
    if let Some(p) = std::env::var_os("SCSI_BENCH_LOG") {
        b = b.log_file(PathBuf::from(p));
    }
    let out = b.run().unwrap_or_else(|e| panic!("guest run failed: {e}"));
    print!("{}", out.log);
    eprintln!(
        "guest exit {} in {:?} (boot {:?} s)",
        out.exit_code,
        out.duration,
        out.boot_seconds()
    );
    assert_eq!(out.exit_code, 0, "guest script failed (log above)");
}

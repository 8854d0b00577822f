//! Boots the QEMU/TCG guest for `bench/dm-poll.sh`: two emulated NVMe disks
//! backed by host files, driven by the guest kernel's NVMe driver with poll
//! queues; `tests/guest/dm-poll-bench.sh` compares the kernel's polled
//! dm-linear / dm-stripe (fio io_uring with and without hipri, and `ustor
//! bench` on a uring bdev with IOPOLL over the DM device) against ustor's
//! polled concat / raid0 over two IOPOLL uring bdevs (issue 21, part 2).
//!
//! Ignored: a benchmark, not a test. Run it through the script, or with
//! `DM_POLL_DISKS=<file0>,<file1> cargo test --release -p ustor --test
//! dm_poll_bench -- --ignored --nocapture`. Environment: DM_POLL_DISKS
//! (required: two files of the same size); USTOR_BIN; DM_POLL_LOG (copy of
//! the serial log); GUEST_TIMEOUT_S (900); ROUNDS, RUNTIME, QDS, LAYOUTS go
//! to the guest.

use std::path::PathBuf;
use std::time::Duration;

use testvm::{guest_script, require_guest, GuestBuilder};

#[test]
#[ignore = "benchmark: run bench/dm-poll.sh"]
fn dm_poll_bench() {
    require_guest!();
    let disks = std::env::var("DM_POLL_DISKS").expect("DM_POLL_DISKS: run bench/dm-poll.sh");
    let disks: Vec<&str> = disks.split(',').collect();
    assert_eq!(disks.len(), 2, "DM_POLL_DISKS names two files");
    let bin = std::env::var_os("USTOR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ustor")));
    let timeout: u64 = std::env::var("GUEST_TIMEOUT_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(900);
    let mut b = GuestBuilder::new()
        .script_file(guest_script("dm-poll-bench.sh"))
        .binary(bin)
        .binary("/usr/bin/fio")
        .binary("/usr/sbin/dmsetup")
        .cpus(2)
        .memory_mib(1024)
        .timeout(Duration::from_secs(timeout));
    for (i, disk) in disks.iter().enumerate() {
        b = b
            .qemu_arg("-drive")
            .qemu_arg(format!(
                "file={disk},if=none,format=raw,id=nv{i},cache=writeback"
            ))
            .qemu_arg("-device")
            .qemu_arg(format!("nvme,serial=ustor-nv{i},drive=nv{i}"));
    }
    for k in ["ROUNDS", "RUNTIME", "QDS", "LAYOUTS"] {
        if let Ok(v) = std::env::var(k) {
            b = b.env(k, v);
        }
    }
    if let Some(log) = std::env::var_os("DM_POLL_LOG") {
        b = b.log_file(PathBuf::from(log));
    }
    let out = b.run().and_then(|o| o.success()).unwrap();
    println!("{}", out.log);
}

//! Boots the QEMU/TCG guest for `bench/fs-guest.sh`: inside it the kernel's
//! NFSv3 client mounts nfs-ganesha and ustor's FUSE client mounts ustor's
//! file server, both servers on the host (reached at 10.0.2.2), and fio
//! measures both mounts (`tests/guest/fs-bench.sh`). fio writes its JSON
//! reports into the shared directory, where the script reads them.
//!
//! Ignored: a benchmark, not a test. Run it through the script. Environment:
//! FS_GUEST_SHARE (required: the host directory shared at /mnt/share);
//! USTOR_BIN (the binary to ship); FS_GUEST_LOG (copy of the serial log);
//! GUEST_TIMEOUT_S (1200); NFS_PATH, NFS_PORT, MNT_PORT, FS_PORT,
//! FS_EXPORT, USTOR_FS_SECRET, ROUNDS, RUNTIME, SIZE_MIB, WORKS go to the
//! guest script as they are.

use std::path::PathBuf;

use testvm::{guest_script, require_guest, GuestBuilder};

fn read(path: &str) -> Vec<u8> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("{path}: {e} (apt-get install -y libtirpc-common netbase)"))
}

#[test]
#[ignore = "benchmark: run bench/fs-guest.sh"]
fn fs_guest_bench() {
    require_guest!();
    let share = std::env::var_os("FS_GUEST_SHARE").expect("FS_GUEST_SHARE: run bench/fs-guest.sh");
    let bin = std::env::var_os("USTOR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ustor")));
    let mut b = GuestBuilder::new()
        .script_file(guest_script("fs-bench.sh"))
        .binary(bin)
        .binary("/usr/bin/fio")
        .binary("/usr/sbin/mount.nfs")
        .share_dir(PathBuf::from(share))
        // libtirpc (mount.nfs) looks its transports up in these; the base
        // image has neither. The guest script puts them in /etc.
        .file("netconfig", read("/etc/netconfig"))
        .file("protocols", read("/etc/protocols"))
        .cpus(2)
        .memory_mib(1536)
        .timeout_from_env(1200)
        .env_from_host(&[
            "NFS_PATH",
            "NFS_PORT",
            "MNT_PORT",
            "FS_PORT",
            "FS_EXPORT",
            "USTOR_FS_SECRET",
            "ROUNDS",
            "RUNTIME",
            "SIZE_MIB",
            "WORKS",
        ]);
    if let Some(log) = std::env::var_os("FS_GUEST_LOG") {
        b = b.log_file(PathBuf::from(log));
    }
    let out = b.run().and_then(|o| o.success()).unwrap();
    println!("{}", out.log);
}

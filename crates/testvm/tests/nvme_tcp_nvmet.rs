//! Validates tests/guest/nvme-tcp.sh. The host has no nvmet module, so the
//! target is the guest kernel's own nvmet-tcp, configured through configfs
//! in the guest and reached over the guest's loopback (NVME_ADDR=127.0.0.1).
//! This exercises every step of the script (discover, connect, id-ctrl,
//! O_DIRECT raw check, ext4 round trip, disconnect); the ustor NVMe/TCP
//! target's tests run the same script against 10.0.2.2.

use std::time::{Duration, Instant};

use testvm::{guest_script, require_guest, GuestBuilder};

const NQN: &str = "nqn.2024-01.io.ustor:rig-nvmet";

/// Guest-side nvmet setup: a 64 MiB file namespace (buffered, since the
/// initramfs's tmpfs has no O_DIRECT) on a TCP port at 127.0.0.1:4420.
const SETUP: &str = r#". /ustor/lib.sh
set -u
run modprobe nvmet-tcp
grep -q " /sys/kernel/config " /proc/mounts || run mount -t configfs configfs /sys/kernel/config
run dd if=/dev/zero of=/tmp/nvmet.img bs=1M count=0 seek=64 2>/dev/null
cfg=/sys/kernel/config/nvmet
sub=$cfg/subsystems/$SETUP_NQN
mkdir "$sub" || die "mkdir $sub"
echo 1 > "$sub/attr_allow_any_host"
mkdir "$sub/namespaces/1"
echo -n /tmp/nvmet.img > "$sub/namespaces/1/device_path"
echo 1 > "$sub/namespaces/1/buffered_io"
echo 1 > "$sub/namespaces/1/enable" || die "enable namespace"
mkdir "$cfg/ports/1"
echo tcp > "$cfg/ports/1/addr_trtype"
echo ipv4 > "$cfg/ports/1/addr_adrfam"
echo 127.0.0.1 > "$cfg/ports/1/addr_traddr"
echo "$NVME_PORT" > "$cfg/ports/1/addr_trsvcid"
ln -s "$sub" "$cfg/ports/1/subsystems/$SETUP_NQN" || die "enable port"
/bin/sh /ustor/nvme-tcp.sh
"#;

#[test]
fn nvme_tcp_script_against_guest_nvmet() {
    require_guest!();
    let script = std::fs::read(guest_script("nvme-tcp.sh")).expect("read nvme-tcp.sh");
    let started = Instant::now();
    let out = GuestBuilder::new()
        .script(SETUP)
        .file("nvme-tcp.sh", script)
        .env("NVME_ADDR", "127.0.0.1")
        .env("NVME_PORT", "4420")
        // NVME_NQN is left unset on purpose: the script must find it in
        // the discovery log. It is only used by the setup above.
        .env("SETUP_NQN", NQN)
        .timeout(Duration::from_secs(180))
        .run()
        .and_then(|o| o.success())
        .unwrap_or_else(|e| panic!("guest failed: {e}"));
    eprintln!(
        "nvme-tcp vs in-guest nvmet: guest run {:?}",
        started.elapsed()
    );

    assert_eq!(out.value("nvme_nqn"), Some(NQN));
    assert_eq!(out.value("nvme_mn"), Some("Linux"));
    assert_eq!(
        out.value("ns_size"),
        Some((64u64 << 20).to_string().as_str())
    );
    let raw = out.value("raw_md5").expect("raw_md5");
    assert!(
        raw.len() == 32 && raw.chars().all(|c| c.is_ascii_hexdigit()),
        "{raw}"
    );
    assert_eq!(out.value("files"), Some("21"));
}

//! Tests of the rig itself: exit status and environment reach the host
//! intact, the guest's network reaches a host server at 10.0.2.2, and the
//! 9p share and virtio-scsi disk carry real data both ways.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener};
use std::time::{Duration, Instant};

use testvm::host::{md5_bytes, md5_range, write_pattern};
use testvm::{require_guest, GuestBuilder};

#[test]
fn exit_status_and_env_round_trip() {
    require_guest!();
    let tricky = "it's a \"value\" with $dollar and spaces";
    let out = GuestBuilder::new()
        .script(
            r#". /ustor/lib.sh
kv tricky "$TRICKY"
kv kernel "$(uname -r)"
exit 7
"#,
        )
        .env("TRICKY", tricky)
        .timeout(Duration::from_secs(120))
        .run()
        .expect("guest run");
    assert_eq!(out.exit_code, 7, "log:\n{}", out.log);
    assert_eq!(out.value("tricky"), Some(tricky));
    assert!(out.value("kernel").is_some_and(|k| k.ends_with("-amd64")));
    let boot = out.boot_seconds().expect("boot time in log");
    eprintln!(
        "guest boot {boot:.2}s (guest clock), run {:?}",
        out.duration
    );
}

#[test]
fn network_share_and_scsi_disk() {
    require_guest!();
    let dir = tempfile::tempdir().expect("tempdir");
    let share = dir.path().join("share");
    std::fs::create_dir(&share).expect("mkdir share");

    // 9p: a host file the guest checksums, and a file the guest writes back.
    let host_blob: Vec<u8> = (0..300_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(share.join("from-host.bin"), &host_blob).expect("write blob");

    // virtio-scsi: a pattern at 1 MiB the guest must read back exactly.
    let disk = dir.path().join("disk.img");
    std::fs::File::create(&disk)
        .and_then(|f| f.set_len(32 << 20))
        .expect("create disk");
    write_pattern(&disk, 1 << 20, 1 << 20, 42).expect("pattern");

    // TCP: the guest sends a payload to the host's loopback via 10.0.2.2.
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("read");
        got
    });

    let started = Instant::now();
    let out = GuestBuilder::new()
        .script(
            r#". /ustor/lib.sh
set -e
kv host_md5 "$(md5_of /mnt/share/from-host.bin)"
dd if=/dev/urandom of=/mnt/share/from-guest.bin bs=4k count=50 2>/dev/null
kv guest_md5 "$(md5_of /mnt/share/from-guest.bin)"
wait_for /dev/sda
dd if=/dev/sda bs=1M skip=1 count=1 2>/dev/null > /tmp/region
kv scsi_md5 "$(md5_of /tmp/region)"
printf 'hello-from-guest %s' "$(md5_of /tmp/region)" | nc 10.0.2.2 "$PORT"
"#,
        )
        .env("PORT", port.to_string())
        .share_dir(&share)
        .virtio_scsi_disk(&disk)
        .timeout(Duration::from_secs(120))
        .run()
        .expect("guest run")
        .success()
        .expect("script succeeded");
    eprintln!("share/scsi/net guest run {:?}", started.elapsed());

    assert_eq!(
        out.value("host_md5"),
        Some(md5_bytes(&host_blob).expect("md5").as_str())
    );
    let back = std::fs::read(share.join("from-guest.bin")).expect("guest file on host");
    assert_eq!(back.len(), 200 * 1024);
    assert_eq!(
        out.value("guest_md5"),
        Some(md5_bytes(&back).expect("md5").as_str())
    );
    let region = md5_range(&disk, 1 << 20, 1 << 20).expect("md5 region");
    assert_eq!(out.value("scsi_md5"), Some(region.as_str()));
    let got = server.join().expect("server thread");
    assert_eq!(
        String::from_utf8_lossy(&got),
        format!("hello-from-guest {region}")
    );
}

#[test]
fn timeout_kills_the_guest() {
    require_guest!();
    let started = Instant::now();
    let err = GuestBuilder::new()
        .script("echo sleeping-forever; sleep 1000")
        .timeout(Duration::from_secs(10))
        .run()
        .expect_err("must time out");
    assert!(matches!(err, testvm::GuestError::Timeout { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(60));
    let _ = std::io::stderr().flush();
}

//! Validates tests/guest/iscsi.sh against a peer iSCSI target, tgtd: the
//! guest's open-iscsi discovers, logs in, makes and checks an ext4, logs
//! out; the host then finds the same data in the LUN's backing file.

mod common;

use std::time::{Duration, Instant};

use testvm::host::Tgtd;
use testvm::{guest_script, require_guest, GuestBuilder};

const IQN: &str = "iqn.2024-01.io.ustor:rig-tgtd";

#[test]
fn iscsi_script_against_tgtd() {
    require_guest!();
    common::tool("tgtd", "tgt");
    common::tool("tgtadm", "tgt");
    let dir = tempfile::tempdir().expect("tempdir");
    let img = common::image(dir.path(), "lun1.img", 64);
    let mut tgtd = Tgtd::start(IQN, &img, &dir.path().join("tgtd.log")).expect("start tgtd");
    let port = tgtd.port();

    let started = Instant::now();
    let result = GuestBuilder::new()
        .script_file(guest_script("iscsi.sh"))
        .env("ISCSI_PORT", port.to_string())
        .timeout(Duration::from_secs(240))
        .run();
    let elapsed = started.elapsed();
    let alive = tgtd.check_running();
    let log = tgtd.log();
    tgtd.stop();
    alive.expect("tgtd still running after the guest");
    let out = result
        .and_then(|o| o.success())
        .unwrap_or_else(|e| panic!("guest failed: {e}\ntgtd log:\n{log}"));
    eprintln!("iscsi vs tgtd: guest run {elapsed:?}");

    assert_eq!(
        out.value("iscsi_target"),
        Some(IQN),
        "target found by discovery"
    );
    assert_eq!(
        out.value("disk_size"),
        Some((64u64 << 20).to_string().as_str())
    );
    common::check_fs_image(&img, &out);
}

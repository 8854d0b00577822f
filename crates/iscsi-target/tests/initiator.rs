//! ustor's own iSCSI initiator (the SCSI LLD) against ustor's target:
//! SCSI bdev -> iSCSI -> target -> malloc bdev, with the data checked
//! byte for byte through the initiator and in the target's bdev; without
//! and with CHAP (one-way, mutual, a wrong secret) and CRC32C digests,
//! immediate and unsolicited data and R2Ts.

mod common;

use common::*;
use ustor_iscsi::initiator::{IscsiConfig, IscsiLld};
use ustor_iscsi_target::{AuthGroupParams, Secret};
use ustor_runtime::IoBuf;
use ustor_scsi::api::*;
use ustor_scsi::mid::HostConfig;
use ustor_scsi::ScsiStack;

fn attach(f: &Fixture, stack: &ScsiStack, cfg: IscsiConfig) -> Result<u32, String> {
    let _ = f;
    stack
        .add_host(
            0,
            HostConfig {
                cmd_timeout_ms: 5000,
                max_retries: 1,
            },
            move || Ok(Box::new(IscsiLld::new(cfg))),
        )
        .map_err(|e| e.to_string())
}

fn disk_bdev(stack: &ScsiStack, name: &str) {
    let devs = scsi_get_devices(stack, GetDevicesParams::default()).unwrap();
    let d = devs
        .iter()
        .find(|d| d.driver == Some("sd"))
        .expect("a disk behind the target");
    assert_eq!(d.target_name, NODE);
    bdev_scsi_create(
        stack,
        ScsiBdevOpts {
            name: name.into(),
            device: d.name.clone(),
            offset: None,
            size: None,
            uuid: None,
        },
    )
    .unwrap();
}

/// Writes `len` bytes of pattern `seed` at `off` through the initiator,
/// reads them back, and checks both the read and the target's bdev.
fn write_read(f: &Fixture, bdev: &str, off: u64, len: usize, seed: u64) {
    let data = pattern(seed, len);
    let desc = f.registry.open(bdev, true, |_| {}).unwrap();
    let d = data.clone();
    let back =
        f.rt.handle()
            .block_on(0, move || async move {
                let ch = desc.channel().unwrap();
                let bs = ch.block_size() as u64;
                let mut b = IoBuf::alloc(d.len()).await;
                b[..d.len()].copy_from_slice(&d);
                let (r, _) = ch.write(off / bs, d.len() as u64 / bs, b).await;
                r.unwrap();
                let b = IoBuf::alloc(d.len()).await;
                let (r, b) = ch.read(off / bs, d.len() as u64 / bs, b).await;
                r.unwrap();
                b[..d.len()].to_vec()
            })
            .unwrap();
    assert!(
        back == data,
        "data read back through iSCSI differs ({len} at {off})"
    );
    assert!(
        f.read_bdev("Malloc0", off, len) == data,
        "target bdev differs ({len} at {off})"
    );
}

fn sizes(f: &Fixture, bdev: &str) {
    // Immediate only, immediate + unsolicited/R2T, several R2Ts and Data-In bursts.
    for (i, len) in [4096usize, 65536 + 4096, 256 << 10, 1 << 20]
        .iter()
        .enumerate()
    {
        write_read(f, bdev, (i as u64) << 21, *len, 10 + i as u64);
    }
}

#[test]
fn scsi_bdev_over_ustor_target() {
    let f = start(64 << 20, 512);
    let stack = ScsiStack::new(f.rt.handle(), f.registry.clone());
    // No target named: SendTargets discovery finds it.
    let mut cfg = IscsiConfig::new(f.portal(), None);
    cfg.queue_depth = 16;
    attach(&f, &stack, cfg).expect("iSCSI host");
    disk_bdev(&stack, "i0");
    sizes(&f, "i0");
}

#[test]
fn digests_and_unsolicited_data() {
    let f = start(64 << 20, 4096);
    let stack = ScsiStack::new(f.rt.handle(), f.registry.clone());
    let mut cfg = IscsiConfig::new(f.portal(), Some(NODE.into()));
    cfg.header_digest = true;
    cfg.data_digest = true;
    cfg.initial_r2t = false;
    let host = attach(&f, &stack, cfg).expect("iSCSI host with digests");
    let info = scsi_get_hosts(&stack)
        .into_iter()
        .find(|h| h.host == host)
        .unwrap()
        .info;
    let n = &info["negotiated"];
    assert_eq!(n["header_digest"], true, "{info}");
    assert_eq!(n["data_digest"], true, "{info}");
    assert_eq!(n["initial_r2t"], false, "{info}");
    disk_bdev(&stack, "d0");
    sizes(&f, "d0");
}

fn chap_fixture(mutual: bool) -> Fixture {
    let f = start_with(16 << 20, 512, |p| {
        p.require_chap = true;
        p.mutual_chap = mutual;
        p.chap_group = 1;
    });
    f.target
        .create_auth_group(&AuthGroupParams {
            tag: 1,
            secrets: vec![Secret {
                user: "user".into(),
                secret: "initiator-secret".into(),
                muser: "tgt".into(),
                msecret: "target-secret".into(),
            }],
        })
        .unwrap();
    f
}

#[test]
fn chap_one_way_mutual_and_wrong_secret() {
    let f = chap_fixture(false);
    let stack = ScsiStack::new(f.rt.handle(), f.registry.clone());
    let mut cfg = IscsiConfig::new(f.portal(), Some(NODE.into()));
    cfg.chap_user = Some("user".into());
    cfg.chap_secret = Some("wrong".into());
    assert!(
        attach(&f, &stack, cfg.clone()).is_err(),
        "a wrong secret logs in"
    );
    cfg.chap_secret = Some("initiator-secret".into());
    attach(&f, &stack, cfg).expect("one-way CHAP");
    disk_bdev(&stack, "c0");
    write_read(&f, "c0", 0, 64 << 10, 3);

    let f = chap_fixture(true);
    let stack = ScsiStack::new(f.rt.handle(), f.registry.clone());
    let mut cfg = IscsiConfig::new(f.portal(), Some(NODE.into()));
    cfg.chap_user = Some("user".into());
    cfg.chap_secret = Some("initiator-secret".into());
    assert!(
        attach(&f, &stack, cfg.clone()).is_err(),
        "mutual required, not asked"
    );
    cfg.mutual_chap_user = Some("tgt".into());
    cfg.mutual_chap_secret = Some("target-secret".into());
    attach(&f, &stack, cfg).expect("mutual CHAP");
    disk_bdev(&stack, "m0");
    write_read(&f, "m0", 4096, 128 << 10, 4);
}

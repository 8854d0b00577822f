//! The iSCSI initiator LLD against tgtd: discovery, login, scan, a SCSI
//! bdev over the LUN, data verified by checksum in the bdev and in the
//! LUN's backing file.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use testvm::host::Tgtd;

use ustor_bdev::Registry;
use ustor_iscsi::initiator::{IscsiConfig, IscsiLld};
use ustor_runtime::{IoBuf, Runtime, RuntimeConfig};
use ustor_scsi::api::*;
use ustor_scsi::mid::HostConfig;
use ustor_scsi::ScsiStack;

const IQN: &str = "iqn.2024-01.io.ustor:scsi-test";

/// A tgtd LUN on a backing file (in /dev/shm when it exists), through the
/// rig's shared tgtd helper (stopped via tgtadm, then by PID, on drop).
struct Lun {
    _tgtd: Tgtd,
    img: PathBuf,
    _dir: tempfile::TempDir,
}

fn start_tgtd(size: u64) -> Option<(Lun, u16)> {
    let have = Command::new("tgtd")
        .arg("--help")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !have {
        eprintln!(
            "SKIPPED: tgtd (Debian `tgt`) is not installed [scsi_bdev_over_iscsi_against_tgtd]"
        );
        return None;
    }
    let dir = tempfile::Builder::new()
        .prefix("ustor-scsi")
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("tempdir");
    let img = dir.path().join("lun1.img");
    std::fs::File::create(&img).unwrap().set_len(size).unwrap();
    let tgtd = Tgtd::start(IQN, &img, &dir.path().join("tgtd.log")).expect("start tgtd");
    let port = tgtd.port();
    Some((
        Lun {
            _tgtd: tgtd,
            img,
            _dir: dir,
        },
        port,
    ))
}

fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

#[test]
fn scsi_bdev_over_iscsi_against_tgtd() {
    let Some((tgt, port)) = start_tgtd(64 << 20) else {
        return;
    };
    let rt = Runtime::start(RuntimeConfig {
        cores: vec![0],
        pin: false,
        ..Default::default()
    })
    .unwrap();
    let reg = Registry::new(Some(rt.handle()));
    let stack = ScsiStack::new(rt.handle(), reg.clone());
    // No target named: SendTargets discovery finds it.
    let cfg = IscsiConfig {
        portal: format!("127.0.0.1:{port}"),
        target: None,
        initiator: "iqn.2024-01.io.ustor:test-init".into(),
        queue_depth: 32,
    };
    let host = stack
        .add_host(
            0,
            HostConfig {
                cmd_timeout_ms: 5000,
                max_retries: 3,
            },
            move || Ok(Box::new(IscsiLld::new(cfg))),
        )
        .expect("iSCSI host");
    let devs = scsi_get_devices(&stack, GetDevicesParams::default()).unwrap();
    let disk = devs
        .iter()
        .find(|d| d.driver == Some("sd"))
        .expect("a disk behind tgtd");
    assert_eq!(disk.num_blocks * disk.block_size as u64, 64 << 20);
    assert_eq!(disk.target_name, IQN);
    let dev = disk.name.clone();
    bdev_scsi_create(
        &stack,
        ScsiBdevOpts {
            name: "i0".into(),
            device: dev,
            offset: Some(Size::Text("1M".into())),
            size: Some(Size::Text("8M".into())),
            uuid: None,
        },
    )
    .unwrap();
    let desc = reg.open("i0", true, |_| {}).unwrap();
    let (sum_w, sum_r) = rt
        .handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            let mut sw = 0u64;
            let mut sr = 0u64;
            // 1 MiB writes (split to the transfer limit), then read back.
            for i in 0..4u64 {
                let mut b = IoBuf::alloc(1 << 20).await;
                for (k, c) in b.chunks_mut(8).enumerate() {
                    c.copy_from_slice(&((i << 32) | k as u64).to_le_bytes());
                }
                sw ^= fnv(&b).wrapping_add(i);
                let (r, _) = ch.write(i * 2048, 2048, b).await;
                r.unwrap();
            }
            for i in 0..4u64 {
                let b = IoBuf::alloc(1 << 20).await;
                let (r, b) = ch.read(i * 2048, 2048, b).await;
                r.unwrap();
                sr ^= fnv(&b).wrapping_add(i);
            }
            ch.flush(0, 16384).await.unwrap();
            (sw, sr)
        })
        .unwrap();
    assert_eq!(sum_w, sum_r, "data read back through iSCSI differs");
    // And the LUN's backing file holds it at the mapped offset.
    let file = std::fs::read(&tgt.img).unwrap();
    let mut sf = 0u64;
    for i in 0..4usize {
        let off = (1 << 20) + i * (1 << 20);
        sf ^= fnv(&file[off..off + (1 << 20)]).wrapping_add(i as u64);
    }
    assert_eq!(sf, sum_w, "backing file differs");
    // Host reset = session reinstatement; I/O works afterwards.
    scsi_host_reset(&stack, HostParams { host }).unwrap();
    let desc = reg.open("i0", false, |_| {}).unwrap();
    rt.handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            let b = IoBuf::alloc(4096).await;
            ch.read(0, 8, b).await.0.unwrap();
        })
        .unwrap();
    drop(stack);
}

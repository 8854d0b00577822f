//! The iSCSI initiator LLD against tgtd: discovery, login, scan, a SCSI
//! bdev over the LUN, data verified by checksum in the bdev and in the
//! LUN's backing file.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ustor_bdev::Registry;
use ustor_iscsi::initiator::{IscsiConfig, IscsiLld};
use ustor_runtime::{IoBuf, Runtime, RuntimeConfig};
use ustor_scsi::api::*;
use ustor_scsi::mid::HostConfig;
use ustor_scsi::ScsiStack;

const IQN: &str = "iqn.2024-01.io.ustor:scsi-test";

struct Tgtd {
    child: Child,
    control: u16,
    img: std::path::PathBuf,
}

fn tgtadm(control: u16, args: &[&str]) {
    let out = Command::new("tgtadm")
        .arg("-C")
        .arg(control.to_string())
        .args(args)
        .output()
        .expect("tgtadm");
    assert!(
        out.status.success(),
        "tgtadm {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Drop for Tgtd {
    fn drop(&mut self) {
        let _ = Command::new("tgtadm")
            .args([
                "-C",
                &self.control.to_string(),
                "--op",
                "delete",
                "--mode",
                "system",
            ])
            .output();
        for _ in 0..50 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.img);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_tgtd(size: u64) -> Option<(Tgtd, u16)> {
    if Command::new("tgtd")
        .arg("--help")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_err()
    {
        eprintln!("tgtd not installed; skipping");
        return None;
    }
    let port = free_port();
    let control = 20000 + port % 10000;
    let img = std::path::PathBuf::from(format!(
        "/dev/shm/ustor-scsi-{}-{port}.img",
        std::process::id()
    ));
    std::fs::File::create(&img).unwrap().set_len(size).unwrap();
    let child = Command::new("tgtd")
        .args([
            "-f",
            "--iscsi",
            &format!("portal=127.0.0.1:{port}"),
            "-C",
            &control.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let t = Tgtd {
        child,
        control,
        img,
    };
    let up = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    assert!(up, "tgtd did not listen");
    tgtadm(
        control,
        &[
            "--lld", "iscsi", "--op", "new", "--mode", "target", "--tid", "1", "-T", IQN,
        ],
    );
    let backing = t.img.to_string_lossy().to_string();
    tgtadm(
        control,
        &[
            "--lld",
            "iscsi",
            "--op",
            "new",
            "--mode",
            "logicalunit",
            "--tid",
            "1",
            "--lun",
            "1",
            "-b",
            &backing,
        ],
    );
    tgtadm(
        control,
        &[
            "--lld", "iscsi", "--op", "bind", "--mode", "target", "--tid", "1", "-I", "ALL",
        ],
    );
    Some((t, port))
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

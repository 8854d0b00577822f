//! A tgtd LUN and a one-reactor SCSI stack for the iSCSI LLD tests:
//! attach hosts, map SCSI bdevs, write patterns and read them back.
#![allow(dead_code)]

use std::path::PathBuf;

use testvm::host::Tgtd;
use ustor_bdev::Registry;
use ustor_iscsi::initiator::{IscsiConfig, IscsiLld};
use ustor_runtime::{IoBuf, Runtime, RuntimeConfig};
use ustor_scsi::api::*;
use ustor_scsi::mid::HostConfig;
use ustor_scsi::ScsiStack;

pub const IQN: &str = "iqn.2024-01.io.ustor:scsi-test";

pub struct Rig {
    pub stack: ScsiStack,
    pub reg: std::sync::Arc<Registry>,
    pub rt: Runtime,
    pub tgtd: Tgtd,
    pub img: PathBuf,
    _dir: tempfile::TempDir,
}

pub fn have_tgtd() -> bool {
    testkit::program("tgtd").is_ok()
}

/// The deterministic pattern of `seed` at byte `i`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            ((i as u64 / 8).wrapping_mul(0x9e37_79b9) ^ seed.wrapping_mul(131) ^ i as u64) as u8
        })
        .collect()
}

pub fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on the tgtd we started (found by its unique portal).
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
}

impl Rig {
    /// A tgtd with a LUN of `size` bytes (backing file in /dev/shm when it
    /// exists) and a one-reactor stack; `None` (and `SKIPPED:`) without
    /// tgtd, or a panic under `CI=true` (`testkit::missing`).
    pub fn start(test: &str, size: u64) -> Option<Rig> {
        if let Err(why) = testkit::program("tgtd") {
            let hint = testkit::install_hint("tgtd");
            testkit::missing(&format!("{why}, needed by {test}"), &hint);
            return None;
        }
        let dir = tempfile::Builder::new()
            .prefix("ustor-iscsi")
            .tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .expect("tempdir");
        let img = dir.path().join("lun1.img");
        std::fs::File::create(&img).unwrap().set_len(size).unwrap();
        let tgtd = Tgtd::start(IQN, &img, &dir.path().join("tgtd.log")).expect("start tgtd");
        let rt = Runtime::start(RuntimeConfig {
            cores: vec![0],
            pin: false,
            ..Default::default()
        })
        .unwrap();
        let reg = Registry::new(Some(rt.handle()));
        let stack = ScsiStack::new(rt.handle(), reg.clone());
        Some(Rig {
            stack,
            reg,
            rt,
            tgtd,
            img,
            _dir: dir,
        })
    }

    pub fn portal(&self) -> String {
        format!("127.0.0.1:{}", self.tgtd.port())
    }

    pub fn attach(&mut self, cfg: IscsiConfig) -> Result<u32, String> {
        self.attach_with(cfg, 5000, 3)
    }

    pub fn attach_with(
        &mut self,
        cfg: IscsiConfig,
        timeout_ms: u64,
        retries: u32,
    ) -> Result<u32, String> {
        self.stack
            .add_host(
                0,
                HostConfig {
                    cmd_timeout_ms: timeout_ms,
                    max_retries: retries,
                },
                move || Ok(Box::new(IscsiLld::new(cfg))),
            )
            .map_err(|e| e.to_string())
    }

    /// A tgtd CHAP account bound to the target: incoming (the target
    /// checks us) or outgoing (the target's own, for mutual CHAP).
    pub fn account(&mut self, user: &str, pw: &str, outgoing: bool) {
        self.tgtd
            .admin(&[
                "--lld",
                "iscsi",
                "--op",
                "new",
                "--mode",
                "account",
                "--user",
                user,
                "--password",
                pw,
            ])
            .expect("new account");
        let mut bind = vec![
            "--lld", "iscsi", "--op", "bind", "--mode", "account", "--tid", "1", "--user", user,
        ];
        if outgoing {
            bind.push("--outgoing");
        }
        self.tgtd.admin(&bind).expect("bind account");
    }

    /// The first disk behind tgtd.
    pub fn disk(&self) -> String {
        let devs = scsi_get_devices(&self.stack, GetDevicesParams::default()).unwrap();
        let d = devs
            .iter()
            .find(|d| d.driver == Some("sd"))
            .expect("a disk behind tgtd");
        assert_eq!(d.target_name, IQN);
        d.name.clone()
    }

    pub fn bdev(&self, name: &str, dev: &str, offset: u64, size: u64) {
        bdev_scsi_create(
            &self.stack,
            ScsiBdevOpts {
                name: name.into(),
                device: dev.into(),
                offset: Some(Size::Bytes(offset)),
                size: Some(Size::Bytes(size)),
                uuid: None,
            },
        )
        .unwrap();
    }

    /// The live facts of the newest iSCSI session (`scsi_get_hosts` has
    /// the host's info as it was when added).
    /// Sets tgtd's target 1 login parameters (tgtd offers no digests and
    /// wants InitialR2T unless told otherwise).
    pub fn target_params(&mut self, params: &[(&str, &str)]) {
        for (k, v) in params {
            self.tgtd
                .admin(&[
                    "--lld", "iscsi", "--op", "update", "--mode", "target", "--tid", "1", "--name",
                    k, "--value", v,
                ])
                .unwrap_or_else(|e| panic!("tgtd target parameter {k}={v}: {e}"));
        }
    }

    /// The host's live LLD facts, through `scsi_get_hosts` (the control
    /// path users see).
    pub fn info(&self, host: u32) -> serde_json::Value {
        scsi_get_hosts(&self.stack)
            .into_iter()
            .find(|h| h.host == host)
            .expect("the host is listed")
            .info
    }

    /// Writes `len` bytes of pattern `seed` at `off` (chunks of 1 MiB),
    /// reads them back and compares byte for byte; returns the data.
    pub fn write_read(&self, bdev: &str, off: u64, len: usize, seed: u64) -> Vec<u8> {
        let data = pattern(seed, len);
        let desc = self.reg.open(bdev, true, |_| {}).unwrap();
        let d = data.clone();
        let back = self
            .rt
            .handle()
            .block_on(0, move || async move {
                let ch = desc.channel().unwrap();
                let bs = 512u64;
                let mut back = Vec::with_capacity(d.len());
                for c in d.chunks(1 << 20).enumerate() {
                    let (i, c) = c;
                    let at = off / bs + (i as u64) * 2048;
                    let mut b = IoBuf::alloc(c.len()).await;
                    b[..c.len()].copy_from_slice(c);
                    let (r, _) = ch.write(at, c.len() as u64 / bs, b).await;
                    r.unwrap();
                }
                for (i, c) in d.chunks(1 << 20).enumerate() {
                    let at = off / bs + (i as u64) * 2048;
                    let b = IoBuf::alloc(c.len()).await;
                    let (r, b) = ch.read(at, c.len() as u64 / bs, b).await;
                    r.unwrap();
                    back.extend_from_slice(&b[..c.len()]);
                }
                ch.flush(0, 1).await.unwrap();
                back
            })
            .unwrap();
        assert!(back == data, "data read back through iSCSI differs");
        data
    }

    /// Reads `len` bytes at `off`; the data or the error.
    pub fn read_back(&self, bdev: &str, off: u64, len: usize) -> Result<Vec<u8>, String> {
        let desc = self
            .reg
            .open(bdev, false, |_| {})
            .map_err(|e| e.to_string())?;
        self.rt
            .handle()
            .block_on(0, move || async move {
                let ch = desc.channel().map_err(|e| e.to_string())?;
                let b = IoBuf::alloc(len).await;
                let (r, b) = ch.read(off / 512, len as u64 / 512, b).await;
                r.map_err(|e| e.to_string())?;
                Ok(b[..len].to_vec())
            })
            .map_err(|e| e.to_string())?
    }

    /// One read; its result.
    pub fn try_read(&self, bdev: &str, off: u64, len: usize) -> Result<(), String> {
        let desc = self
            .reg
            .open(bdev, false, |_| {})
            .map_err(|e| e.to_string())?;
        self.rt
            .handle()
            .block_on(0, move || async move {
                let ch = desc.channel().map_err(|e| e.to_string())?;
                let b = IoBuf::alloc(len).await;
                ch.read(off / 512, len as u64 / 512, b)
                    .await
                    .0
                    .map_err(|e| e.to_string())
            })
            .map_err(|e| e.to_string())?
    }

    /// The PID of the tgtd this rig started: our child with our portal.
    pub fn tgtd_pid(&self) -> i32 {
        let me = std::process::id().to_string();
        let portal = format!("portal={}", self.portal());
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            // ppid is the 2nd field after the ")" of the command name.
            let ppid = stat
                .rsplit(')')
                .next()
                .and_then(|s| s.split_whitespace().nth(1));
            if cmd.starts_with("tgtd ") && cmd.contains(&portal) && ppid == Some(me.as_str()) {
                return pid;
            }
        }
        panic!("tgtd with {portal} not found among our children");
    }
}

/// A TCP proxy between the initiator and tgtd that can flip one bit in the
/// target-to-initiator stream on demand (digest-mismatch tests). Threads
/// end when either side closes.
pub struct Proxy {
    pub port: u16,
    pub corrupt: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    pub fn start(target_port: u16) -> Proxy {
        use std::io::{Read, Write};
        use std::net::{Shutdown, TcpListener, TcpStream};
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let l = TcpListener::bind("127.0.0.1:0").expect("proxy listen");
        let port = l.local_addr().unwrap().port();
        let corrupt = Arc::new(AtomicBool::new(false));
        let flag = corrupt.clone();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(down) = c else { return };
                let Ok(up) = TcpStream::connect(("127.0.0.1", target_port)) else {
                    continue;
                };
                let _ = up.set_nodelay(true);
                let _ = down.set_nodelay(true);
                let pipe =
                    |mut from: TcpStream, mut to: TcpStream, flip: Option<Arc<AtomicBool>>| {
                        std::thread::spawn(move || {
                            let mut buf = vec![0u8; 65536];
                            loop {
                                let n = match from.read(&mut buf) {
                                    Ok(0) | Err(_) => break,
                                    Ok(n) => n,
                                };
                                if flip
                                    .as_ref()
                                    .is_some_and(|f| f.swap(false, Ordering::SeqCst))
                                {
                                    buf[n / 2] ^= 0x40;
                                }
                                if to.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                            let _ = to.shutdown(Shutdown::Both);
                            let _ = from.shutdown(Shutdown::Both);
                        });
                    };
                pipe(down.try_clone().unwrap(), up.try_clone().unwrap(), None);
                pipe(up, down, Some(flag.clone()));
            }
        });
        Proxy { port, corrupt }
    }
}

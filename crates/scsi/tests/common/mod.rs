//! Shared helpers for the SCSI integration tests: a one-reactor runtime, a
//! stack with an emulated HBA, and bdev I/O with verified data.
#![allow(dead_code)]

use std::sync::Arc;

use ustor_bdev::{BdevError, Registry};
use ustor_runtime::{IoBuf, PollMode, Runtime, RuntimeConfig};
use ustor_scsi::lld::HostLimits;
use ustor_scsi::mid::HostConfig;
use ustor_scsi::ScsiStack;
use ustor_scsi_emul::{EmulHandle, EmulLun};

pub fn runtime() -> Runtime {
    Runtime::start(RuntimeConfig {
        cores: vec![0],
        pin: false,
        poll_mode: PollMode::Adaptive,
        bufs: ustor_runtime::BufPoolConfig {
            mem_bytes: 16 << 20,
            classes: vec![4096, 65536, 1 << 20],
        },
        ..Default::default()
    })
    .expect("runtime")
}

pub struct Rig {
    pub rt: Runtime,
    pub reg: Arc<Registry>,
    pub stack: ScsiStack,
    pub emul: EmulHandle,
    pub host: u32,
}

/// A stack with one emulated host: target 0 with LUN 0 (and `extra` LUNs),
/// 500 ms command timeout (long enough that a loaded machine does not time
/// out a command the emulator answers; tests that script a timeout wait it
/// out), 3 retries.
pub fn rig(luns: Vec<EmulLun>) -> Rig {
    let rt = runtime();
    let reg = Registry::new(Some(rt.handle()));
    let stack = ScsiStack::new(rt.handle(), reg.clone());
    let emul = EmulHandle::new(1, luns, HostLimits::default());
    let e = emul.clone();
    let cfg = HostConfig {
        cmd_timeout_ms: 500,
        max_retries: 3,
    };
    let host = stack
        .add_host(0, cfg, move || Ok(e.lld()))
        .expect("add host");
    Rig {
        rt,
        reg,
        stack,
        emul,
        host,
    }
}

pub fn disk(lun: u64) -> EmulLun {
    EmulLun::disk(0, lun, 8192, 512)
}

/// A pattern that differs per block and per seed.
pub fn pattern(buf: &mut [u8], lba: u64, seed: u64) {
    for (i, c) in buf.chunks_mut(8).enumerate() {
        let v = (lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed ^ i as u64).to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
}

/// Writes `blocks` of pattern(seed) at `lba` through bdev `name`.
pub fn write(r: &Rig, name: &str, lba: u64, blocks: u64, seed: u64) -> Result<(), BdevError> {
    let desc = r.reg.open(name, true, |_| {}).expect("open");
    r.rt.handle()
        .block_on(0, move || async move {
            let ch = desc.channel()?;
            let bs = ch.block_size() as u64;
            let mut b = IoBuf::alloc((blocks * bs) as usize).await;
            pattern(&mut b, lba, seed);
            ch.write(lba, blocks, b).await.0
        })
        .expect("reactor")
}

/// Reads `blocks` at `lba` through bdev `name`.
pub fn read(r: &Rig, name: &str, lba: u64, blocks: u64) -> Result<Vec<u8>, BdevError> {
    let desc = r.reg.open(name, false, |_| {}).expect("open");
    r.rt.handle()
        .block_on(0, move || async move {
            let ch = desc.channel()?;
            let bs = ch.block_size() as u64;
            let b = IoBuf::alloc((blocks * bs) as usize).await;
            let (res, b) = ch.read(lba, blocks, b).await;
            res.map(|_| b.to_vec())
        })
        .expect("reactor")
}

pub fn expect_pattern(data: &[u8], lba: u64, seed: u64) {
    let mut want = vec![0u8; data.len()];
    pattern(&mut want, lba, seed);
    assert!(
        data == &want[..],
        "data at lba {lba} differs from pattern {seed}"
    );
}

pub fn create(
    r: &Rig,
    name: &str,
    device: &str,
    offset: u64,
    size: Option<u64>,
) -> Result<String, ustor_scsi::ScsiError> {
    use ustor_scsi::api::*;
    bdev_scsi_create(
        &r.stack,
        ScsiBdevOpts {
            name: name.into(),
            device: device.into(),
            offset: Some(Size::Bytes(offset)),
            size: size.map(Size::Bytes),
            uuid: None,
        },
    )
}

pub fn stats(r: &Rig) -> ustor_scsi::mid::HostStats {
    r.stack.stats().expect("stats").remove(0)
}

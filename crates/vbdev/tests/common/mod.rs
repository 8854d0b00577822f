//! Shared helpers for the vbdev tests: a runtime, a registry with every
//! module, RAM bases, and a byte model of a bdev checked through it and
//! on its bases.
#![allow(dead_code)]

use std::sync::Arc;

use serde_json::{json, Value};
use ustor_bdev::modules::{malloc, RamOpts};
use ustor_bdev::{ControlError, Registry};
use ustor_runtime::{IoBuf, PollMode, Runtime, RuntimeConfig};

pub const BS: u64 = 512;
/// Largest single I/O the tests issue (the buffer pool's largest class).
pub const CHUNK: u64 = 1 << 20;

pub fn runtime(cores: usize) -> Runtime {
    Runtime::start(RuntimeConfig {
        cores: (0..cores).collect(),
        pin: false,
        poll_mode: PollMode::Adaptive,
        bufs: ustor_runtime::BufPoolConfig {
            mem_bytes: 32 << 20,
            classes: vec![4096, 65536, 1 << 20],
        },
        ..Default::default()
    })
    .expect("runtime")
}

pub fn registry(rt: &Runtime) -> Arc<Registry> {
    let reg = Registry::new(Some(rt.handle()));
    ustor_bdev::modules::register_builtin(&reg).unwrap();
    ustor_vbdev::register(&reg).unwrap();
    reg
}

pub fn ram(reg: &Registry, name: &str, bytes: u64) {
    malloc::create(
        reg,
        RamOpts {
            name: name.into(),
            num_blocks: bytes / BS,
            block_size: BS as u32,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .unwrap();
}

/// Creates through the module table, as the RPC method does.
pub fn create(reg: &Registry, module: &str, params: Value) -> Result<String, ControlError> {
    let m = reg.module(module).unwrap();
    m.create(reg, params).map(|e| e.info().name.clone())
}

pub fn raid(reg: &Registry, name: &str, level: &str, members: &[&str], strip_kb: u32) {
    create(
        reg,
        "raid",
        json!({"name": name, "raid_level": level, "base_bdevs": members, "strip_size_kb": strip_kb}),
    )
    .unwrap();
}

/// A pattern that differs per block and per seed.
pub fn pattern(buf: &mut [u8], lba: u64, seed: u64) {
    for (i, c) in buf.chunks_mut(8).enumerate() {
        let v = (lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed ^ i as u64).to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
}

/// Reads all of bdev `name` (in chunks) on reactor 0.
pub fn read_all(rt: &Runtime, reg: &Registry, name: &str) -> Vec<u8> {
    let d = reg.open(name, false, |_| {}).unwrap();
    rt.handle()
        .block_on(0, move || async move {
            let ch = d.channel().unwrap();
            let total = ch.num_blocks() * BS;
            let mut out = Vec::with_capacity(total as usize);
            let mut at = 0;
            while at < total {
                let n = CHUNK.min(total - at);
                let (r, b) = ch
                    .read(at / BS, n / BS, IoBuf::alloc(n as usize).await)
                    .await;
                r.unwrap();
                out.extend_from_slice(&b[..]);
                at += n;
            }
            out
        })
        .unwrap()
}

/// Writes a pattern over each range `(lba, blocks)` of `name`, in two
/// segments cut at an odd block count (segments cross strips), and
/// applies it to `model` (the bdev's expected bytes).
pub fn write_ranges(
    rt: &Runtime,
    reg: &Registry,
    name: &str,
    ranges: &[(u64, u64)],
    seed: u64,
    model: &mut [u8],
) {
    for (i, &(lba, n)) in ranges.iter().enumerate() {
        let s = seed * 1000 + i as u64;
        for b in 0..n {
            let at = ((lba + b) * BS) as usize;
            pattern(&mut model[at..at + BS as usize], lba + b, s);
        }
    }
    let d = reg.open(name, true, |_| {}).unwrap();
    let ranges = ranges.to_vec();
    rt.handle()
        .block_on(0, move || async move {
            let ch = d.channel().unwrap();
            for (i, (lba, n)) in ranges.into_iter().enumerate() {
                let s = seed * 1000 + i as u64;
                let first = n.min(3);
                let mut v = vec![IoBuf::alloc((first * BS) as usize).await];
                if n > first {
                    v.push(IoBuf::alloc(((n - first) * BS) as usize).await);
                }
                let mut b_lba = lba;
                for b in v.iter_mut() {
                    for blk in b.chunks_mut(BS as usize) {
                        pattern(blk, b_lba, s);
                        b_lba += 1;
                    }
                }
                let (r, _) = ch.writev(lba, n, v).await;
                r.unwrap_or_else(|e| panic!("write {lba}+{n}: {e}"));
            }
        })
        .unwrap();
}

/// The bytes of `model` must be what `name` reads and, block by block,
/// what its bases hold where `place` says (base index, base lba).
pub fn check_layout(
    rt: &Runtime,
    reg: &Registry,
    name: &str,
    model: &[u8],
    bases: &[&str],
    place: impl Fn(u64) -> (usize, u64),
) {
    let got = read_all(rt, reg, name);
    assert_eq!(got.len(), model.len());
    let bad = (0..model.len() / BS as usize)
        .filter(|b| got[b * 512..(b + 1) * 512] != model[b * 512..(b + 1) * 512])
        .count();
    assert_eq!(bad, 0, "{bad} blocks of {name} read back wrong");
    let on: Vec<Vec<u8>> = bases.iter().map(|b| read_all(rt, reg, b)).collect();
    for lba in 0..model.len() as u64 / BS {
        let (m, at) = place(lba);
        let a = (at * BS) as usize;
        let want = &model[(lba * BS) as usize..((lba + 1) * BS) as usize];
        assert!(
            on[m][a..a + BS as usize] == *want,
            "{name} block {lba}: not at {}:{at}",
            bases[m]
        );
    }
}

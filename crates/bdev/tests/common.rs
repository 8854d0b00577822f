//! Shared helpers for the bdev integration tests.
#![allow(dead_code)]

use std::sync::Arc;

use ustor_bdev::Registry;
use ustor_runtime::{PollMode, Runtime, RuntimeConfig};

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
    Registry::new(Some(rt.handle()))
}

/// A pattern that differs per block and per seed.
pub fn pattern(buf: &mut [u8], lba: u64, seed: u64) {
    for (i, c) in buf.chunks_mut(8).enumerate() {
        let v = (lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed ^ i as u64).to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
}

pub fn temp_file(name: &str, len: u64) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ustor-bdev-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("disk.img");
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(len).unwrap();
    p
}

//! What the runtime's integration tests share: a one-reactor runtime.

use ustor_runtime::{PollMode, Runtime, RuntimeConfig};

/// One adaptive reactor on core 0 (not pinned) with a pool of `mem_bytes`
/// of 4 KiB buffers.
pub fn one_reactor(mem_bytes: usize) -> Runtime {
    let cfg = RuntimeConfig {
        cores: vec![0],
        pin: false,
        poll_mode: PollMode::Adaptive,
        bufs: ustor_runtime::BufPoolConfig {
            mem_bytes,
            classes: vec![4096],
        },
        ..Default::default()
    };
    Runtime::start(cfg).expect("runtime starts")
}

//! The malloc bdev's populator thread runs on the process's CPUs, not on the
//! pinned core of the reactor whose first write started it. Its own test
//! binary: the populator is one per process, started once, and another test
//! in the same process could start it from an unpinned thread first.

mod common;

use std::sync::Arc;

use common::*;
use ustor_bdev::modules::{malloc, RamOpts};
use ustor_runtime::{IoBuf, PollMode, Runtime, RuntimeConfig};

const MIB: u64 = 1 << 20;
const BS: u64 = 512;

fn resident(reg: &ustor_bdev::Registry) -> u64 {
    let e = reg.get("lazy").unwrap();
    e.bdev().driver_info()["malloc"]["resident_bytes"]
        .as_u64()
        .unwrap()
}

/// The CPUs a thread of this process may run on (`/proc` status line).
fn cpus_allowed(status: &str) -> String {
    let s = std::fs::read_to_string(status).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string()
}

fn populator_task() -> Option<String> {
    std::fs::read_dir("/proc/self/task").unwrap().find_map(|e| {
        let id = e.ok()?.file_name().into_string().ok()?;
        let comm = std::fs::read_to_string(format!("/proc/self/task/{id}/comm")).ok()?;
        (comm.trim() == "ustor-populate").then_some(id)
    })
}

/// A first write from a reactor pinned to one core starts the populator;
/// had it kept that pin it would compete with the reactor waiting for it
/// (an NVMe/TCP target did 250 randwrite IOPS on a fresh disk that way).
#[test]
fn populator_is_not_pinned_to_a_reactors_core() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let process = cpus_allowed("/proc/self/status");
    if cpus < 2 || process == "0" {
        // One CPU: nothing else to run on; the pin cannot be told apart.
        return;
    }
    let rt = Runtime::start(RuntimeConfig {
        cores: vec![1],
        pin: true,
        poll_mode: PollMode::Adaptive,
        bufs: ustor_runtime::BufPoolConfig {
            mem_bytes: 8 << 20,
            classes: vec![4096],
        },
        ..Default::default()
    })
    .expect("runtime");
    let reg = registry(&rt);
    malloc::create(
        &reg,
        RamOpts {
            name: "lazy".into(),
            num_blocks: 4 * MIB / BS,
            block_size: BS as u32,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .unwrap();
    let desc = Arc::new(reg.open("lazy", true, |_| {}).unwrap());
    let d = desc.clone();
    let pinned = rt
        .handle()
        .block_on(0, move || async move {
            let ch = d.channel().unwrap();
            let mut b = IoBuf::alloc(4096).await;
            pattern(&mut b, 0, 3);
            ch.write(0, 8, b).await.0.unwrap();
            cpus_allowed("/proc/thread-self/status")
        })
        .unwrap();
    assert_eq!(pinned, "1", "the reactor is pinned to core 1");
    assert_eq!(resident(&reg), 2 * MIB);
    let task = populator_task().expect("the populator thread runs");
    assert_eq!(
        cpus_allowed(&format!("/proc/self/task/{task}/status")),
        process,
        "the populator may run on every CPU of the process"
    );
}

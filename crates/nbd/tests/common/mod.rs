//! Shared fixtures for the peer tests: a runtime, a server with one RAM
//! export on a free port, and helpers to run the peer tools.

#![allow(dead_code)]

pub mod client;
pub mod fault;
pub mod mem;
pub mod raw;

use std::process::{Command, Output};
use std::sync::Arc;

use ustor_nbd::server::{ExportCreateParams, ListenAddress, NbdServer, ServerStartParams};
use ustor_runtime::{PollMode, Runtime, RuntimeConfig};

pub struct Fixture {
    pub server: Arc<NbdServer>,
    pub registry: Arc<ustor_bdev::Registry>,
    pub port: u16,
    // Dropped last: stops the reactors.
    pub rt: Runtime,
}

pub fn start(export_bytes: usize, reactors: usize) -> Fixture {
    let cfg = RuntimeConfig {
        cores: (0..reactors).collect(),
        pin: false,
        poll_mode: PollMode::Adaptive,
        ..RuntimeConfig::default()
    };
    let rt = Runtime::start(cfg).expect("runtime starts");
    let registry = ustor_bdev::Registry::new(Some(rt.handle()));
    mem::create(&registry, "Malloc0", export_bytes as u64, 512, None);
    let server = Arc::new(NbdServer::new(rt.handle()));
    let r = server
        .start(&ServerStartParams {
            listen_address: ListenAddress {
                traddr: "127.0.0.1".into(),
                trsvcid: "0".into(),
            },
            max_connections: 64,
        })
        .expect("server starts");
    let params = ExportCreateParams {
        name: "mem".into(),
        bdev_name: "Malloc0".into(),
        read_only: false,
        description: "RAM test export".into(),
    };
    server.export_create(&registry, &params).expect("export");
    Fixture {
        server,
        registry,
        port: r.trsvcid.parse().expect("port"),
        rt,
    }
}

impl Fixture {
    pub fn uri(&self, export: &str) -> String {
        format!("nbd://127.0.0.1:{}/{}", self.port, export)
    }
}

/// Whether `tool` is installed; tests that need it skip (loudly), or fail
/// under `CI=true`, otherwise (`testkit::need`).
pub fn have(tool: &str) -> bool {
    testkit::need(tool)
}

pub fn run(cmd: &str, args: &[&str]) -> Output {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    if !out.status.success() {
        panic!(
            "{cmd} {args:?} failed: {}\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A server exporting a malloc bdev named `Malloc0` as export `malloc`.
pub struct BdevFixture {
    pub server: Arc<NbdServer>,
    pub registry: Arc<ustor_bdev::Registry>,
    pub port: u16,
    pub rt: Runtime,
}

pub fn start_bdev(size_bytes: u64, block_size: u32, reactors: usize) -> BdevFixture {
    start_bdev_with(size_bytes, block_size, reactors, "malloc", |_| {
        "Malloc0".into()
    })
}

/// A malloc bdev `Malloc0` plus whatever `stack` registers over it (it
/// returns the name of the bdev to export), exported as `export`.
pub fn start_bdev_with(
    size_bytes: u64,
    block_size: u32,
    reactors: usize,
    export: &str,
    stack: impl FnOnce(&Arc<ustor_bdev::Registry>) -> String,
) -> BdevFixture {
    let cfg = RuntimeConfig {
        cores: (0..reactors).collect(),
        pin: false,
        ..RuntimeConfig::default()
    };
    let rt = Runtime::start(cfg).expect("runtime starts");
    let registry = ustor_bdev::Registry::new(Some(rt.handle()));
    let opts = ustor_bdev::modules::RamOpts {
        name: "Malloc0".into(),
        num_blocks: size_bytes / u64::from(block_size),
        block_size,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    };
    ustor_bdev::modules::malloc::create(&registry, opts).expect("malloc bdev");
    let bdev_name = stack(&registry);
    let server = Arc::new(NbdServer::new(rt.handle()));
    let r = server
        .start(&ServerStartParams {
            listen_address: ListenAddress {
                traddr: "127.0.0.1".into(),
                trsvcid: "0".into(),
            },
            max_connections: 64,
        })
        .expect("server starts");
    let params = ExportCreateParams {
        name: export.into(),
        bdev_name,
        read_only: false,
        description: "bdev export".into(),
    };
    server.export_create(&registry, &params).expect("export");
    BdevFixture {
        server,
        registry,
        port: r.trsvcid.parse().expect("port"),
        rt,
    }
}

/// A fault-injecting passthru (`common::fault`) over a malloc bdev,
/// exported as `fault`; the probe counts what reached the device.
/// A 1 MiB fault bdev (512-byte blocks, one reactor, native write-zeroes)
/// whose reads of blocks 0..8 take `delay`: a slow request for others to
/// overtake.
pub fn start_slow_reads(delay: std::time::Duration) -> (BdevFixture, Arc<fault::Probe>) {
    let opts = fault::FaultOpts {
        slow_reads: Some((0..8, delay)),
        native_write_zeroes: true,
        ..fault::FaultOpts::default()
    };
    start_fault(1 << 20, 512, 1, opts)
}

pub fn start_fault(
    size_bytes: u64,
    block_size: u32,
    reactors: usize,
    opts: fault::FaultOpts,
) -> (BdevFixture, Arc<fault::Probe>) {
    let mut probe = None;
    let f = start_bdev_with(size_bytes, block_size, reactors, "fault", |reg| {
        probe = Some(fault::create(reg, "Malloc0", "Fault0", opts));
        "Fault0".into()
    });
    (f, probe.expect("probe"))
}

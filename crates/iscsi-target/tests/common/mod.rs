//! Fixtures for the iSCSI target tests: a runtime, a malloc bdev, a target
//! with one portal on 127.0.0.1 (ephemeral port), an initiator group that
//! admits anyone and a node with the bdev as LUN 0; helpers to run peers.
#![allow(dead_code)]

use std::process::{Command, Output};
use std::sync::Arc;

use ustor_bdev::modules::{malloc, RamOpts};
use ustor_bdev::Registry;
use ustor_iscsi_target::*;
use ustor_runtime::{IoBuf, Runtime, RuntimeConfig};

pub const NODE: &str = "iqn.2016-06.io.spdk:disk1";

pub struct Fixture {
    pub target: IscsiTarget,
    pub registry: Arc<Registry>,
    pub port: u16,
    pub rt: Runtime,
}

pub fn node_params(name: &str, bdev: &str) -> TargetNodeParams {
    TargetNodeParams {
        name: name.into(),
        alias_name: "ustor disk".into(),
        pg_ig_maps: vec![PgIgMap {
            pg_tag: 1,
            ig_tag: 1,
        }],
        luns: vec![NodeLun {
            bdev_name: bdev.into(),
            lun_id: 0,
        }],
        queue_depth: 64,
        disable_chap: false,
        require_chap: false,
        mutual_chap: false,
        chap_group: 0,
        header_digest: false,
        data_digest: false,
    }
}

/// A target with `Malloc0` (`size` bytes of `block` byte blocks) as LUN 0
/// of node `disk1`; `node` may change the node before it is created.
pub fn start_with(size: u64, block: u32, node: impl FnOnce(&mut TargetNodeParams)) -> Fixture {
    start_full(size, block, node, |_| {})
}

/// [`start_with`], `setup` running on the target before its portal opens.
pub fn start_full(
    size: u64,
    block: u32,
    node: impl FnOnce(&mut TargetNodeParams),
    setup: impl FnOnce(&IscsiTarget),
) -> Fixture {
    let rt = Runtime::start(RuntimeConfig {
        cores: vec![0, 1],
        pin: false,
        ..RuntimeConfig::default()
    })
    .expect("runtime");
    let registry = Registry::new(Some(rt.handle()));
    malloc::create(
        &registry,
        RamOpts {
            name: "Malloc0".into(),
            num_blocks: size / block as u64,
            block_size: block,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .expect("malloc");
    let target = IscsiTarget::new(rt.handle(), registry.clone());
    setup(&target);
    target
        .create_portal_group(&PortalGroupParams {
            tag: 1,
            portals: vec![Portal {
                host: "127.0.0.1".into(),
                port: "0".into(),
            }],
            private: false,
            wait: false,
        })
        .expect("portal group");
    target
        .create_initiator_group(&InitiatorGroupParams {
            tag: 1,
            initiators: vec!["ANY".into()],
            netmasks: vec!["ANY".into()],
        })
        .expect("initiator group");
    let mut p = node_params("disk1", "Malloc0");
    node(&mut p);
    target.create_target_node(&p).expect("node");
    let port = target.get_portal_groups()[0].portals[0]
        .port
        .parse()
        .unwrap();
    Fixture {
        target,
        registry,
        port,
        rt,
    }
}

pub fn start(size: u64, block: u32) -> Fixture {
    start_with(size, block, |_| {})
}

impl Fixture {
    pub fn portal(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn url(&self, lun: u32) -> String {
        format!("iscsi://127.0.0.1:{}/{NODE}/{lun}", self.port)
    }

    /// `len` bytes of `bdev` at `off`, read on reactor 0.
    pub fn read_bdev(&self, bdev: &str, off: u64, len: usize) -> Vec<u8> {
        let desc = self.registry.open(bdev, false, |_| {}).unwrap();
        self.rt
            .handle()
            .block_on(0, move || async move {
                let ch = desc.channel().unwrap();
                let bs = ch.block_size() as u64;
                let b = IoBuf::alloc(len).await;
                let (r, b) = ch.read(off / bs, len as u64 / bs, b).await;
                r.unwrap();
                b[..len].to_vec()
            })
            .unwrap()
    }
}

/// Whether `tool` is installed (a skip, or a failure under `CI=true`).
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

/// The deterministic pattern of `seed` at byte `i`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            ((i as u64 / 8).wrapping_mul(0x9e37_79b9) ^ seed.wrapping_mul(131) ^ i as u64) as u8
        })
        .collect()
}

//! A standalone target for manual runs and conformance suites:
//! `cargo run -p ustor-iscsi-target --example serve -- [PORT] [BLOCK] [MiB]
//! [PHYSICAL]` serves node `iqn.2016-06.io.spdk:disk1` (LUN 0: a malloc
//! bdev) on 127.0.0.1:PORT until killed; PHYSICAL is the physical block
//! size the LUN reports (the `physical_block_size` option, default 4096;
//! 0 = the block size). The target runs REACTORS reactors (environment,
//! default 2) in POLL_MODE (environment: adaptive, the default, poll or
//! interrupt). PREFAULT=1 (environment) faults the disk in at creation,
//! with huge pages, as SPDK's malloc disk is (the default is lazy: pages
//! fault in on their first write).

use std::sync::Arc;

use ustor_bdev::modules::{malloc, RamOpts};
use ustor_bdev::Registry;
use ustor_iscsi_target::*;
use ustor_runtime::{Runtime, RuntimeConfig};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let port = args.get(1).cloned().unwrap_or_else(|| "3260".into());
    let block: u32 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(512);
    let mib: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(128);
    let physical: Option<u32> = args.get(4).and_then(|s| s.parse().ok());
    let reactors: usize = std::env::var("REACTORS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let rt = Runtime::start(RuntimeConfig {
        cores: (0..reactors.max(1)).collect(),
        pin: false,
        poll_mode: std::env::var("POLL_MODE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(ustor_runtime::PollMode::Adaptive),
        ..RuntimeConfig::default()
    })
    .expect("runtime");
    let registry: Arc<Registry> = Registry::new(Some(rt.handle()));
    if std::env::var("PREFAULT").is_ok_and(|v| v == "1") {
        // Faulted in at creation with huge pages, as SPDK's malloc disk is:
        // a benchmark then times the target, not first-touch page faults.
        use ustor_bdev::BdevModule;
        malloc::module()
            .create(
                &registry,
                serde_json::json!({"name": "Malloc0", "num_blocks": (mib << 20) / block as u64,
                    "block_size": block, "prefault": true}),
            )
            .expect("malloc");
    } else {
        malloc::create(
            &registry,
            RamOpts {
                name: "Malloc0".into(),
                num_blocks: (mib << 20) / block as u64,
                block_size: block,
                uuid: None,
                optimal_io_boundary: 0,
                max_transfer_blocks: 0,
            },
        )
        .expect("malloc");
    }
    let t = IscsiTarget::new(rt.handle(), registry);
    if let Some(p) = physical {
        t.set_options(IscsiOptions {
            physical_block_size: p,
            ..t.get_options()
        })
        .expect("physical block size");
    }
    t.create_portal_group(&PortalGroupParams {
        tag: 1,
        portals: vec![Portal {
            host: "127.0.0.1".into(),
            port,
        }],
        private: false,
        wait: false,
    })
    .expect("portal group");
    t.create_initiator_group(&InitiatorGroupParams {
        tag: 1,
        initiators: vec!["ANY".into()],
        netmasks: vec!["ANY".into()],
    })
    .expect("initiator group");
    t.create_target_node(&TargetNodeParams {
        name: "disk1".into(),
        alias_name: "ustor disk".into(),
        pg_ig_maps: vec![PgIgMap {
            pg_tag: 1,
            ig_tag: 1,
        }],
        luns: vec![NodeLun {
            bdev_name: "Malloc0".into(),
            lun_id: 0,
        }],
        queue_depth: 64,
        disable_chap: false,
        require_chap: false,
        mutual_chap: false,
        chap_group: 0,
        header_digest: false,
        data_digest: false,
    })
    .expect("node");
    println!("listening on {:?}", t.get_portal_groups()[0].portals);
    loop {
        std::thread::park();
    }
}

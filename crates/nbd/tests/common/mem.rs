//! The in-memory bdev the protocol tests export: a malloc bdev behind a
//! passthru that adds what the protocol paths need to see and malloc does
//! not claim: a volatile write cache (so FLUSH is advertised), an
//! allocation map (`base:allocation`; "all data" unless the test scripts
//! one), and memory residency (CACHE).

use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use ustor_bdev::{Bdev, BdevChannel, BdevError, BdevInfo, Extent, IoType, Registry};
use ustor_nbd::wire::{state, BlockDescriptor};

/// Extents (in bytes) every block-status query reports, when scripted.
pub type Script = Arc<Mutex<Vec<BlockDescriptor>>>;

struct MemBdev {
    info: BdevInfo,
    inner: Arc<dyn Bdev>,
    script: Option<Script>,
}

impl Bdev for MemBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, t: IoType) -> bool {
        self.inner.io_type_supported(t)
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        self.inner.create_channel()
    }
    fn config_json(&self) -> Value {
        json!({"method": "test_mem_create", "params": {"name": self.info.name}})
    }
    fn block_status(&self, _offset_blocks: u64, num_blocks: u64) -> Option<Vec<Extent>> {
        let Some(script) = &self.script else {
            return Some(vec![Extent {
                num_blocks,
                hole: false,
                zero: false,
            }]);
        };
        let bs = u64::from(self.info.block_size);
        let s = script.lock().unwrap();
        Some(
            s.iter()
                .map(|e| Extent {
                    num_blocks: u64::from(e.length) / bs,
                    hole: e.flags & state::HOLE != 0,
                    zero: e.flags & state::ZERO != 0,
                })
                .collect(),
        )
    }
}

/// Registers a malloc bdev `<name>_base` of `size_bytes` and the in-memory
/// test bdev `name` over it.
pub fn create(
    registry: &Arc<Registry>,
    name: &str,
    size_bytes: u64,
    block_size: u32,
    script: Option<Script>,
) {
    let base = format!("{name}_base");
    let opts = ustor_bdev::modules::RamOpts {
        name: base.clone(),
        num_blocks: size_bytes / u64::from(block_size),
        block_size,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    };
    ustor_bdev::modules::malloc::create(registry, opts).expect("malloc bdev");
    let inner = registry.get(&base).expect("base bdev").bdev().clone();
    let mut info = inner.info().clone();
    info.name = name.into();
    info.module = "mem_test";
    info.memory_resident = true;
    info.write_cache = true;
    info.product_name = "In-memory test bdev".into();
    info.uuid = serde_json::from_value(json!("6f1d2c3b-4a59-4e6d-8c7b-9a0b1c2d3e4f")).unwrap();
    registry
        .register(Arc::new(MemBdev {
            info,
            inner,
            script,
        }))
        .expect("register mem bdev");
}

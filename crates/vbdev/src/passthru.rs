//! The passthru bdev (`bdev_passthru_create` / `_delete`): a bdev with the
//! same blocks as its base, every I/O one child I/O at the same offset.
//! It is the template for a new virtual bdev: module, params, create,
//! channel, config.

use std::sync::{Arc, Weak};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use ustor_bdev::modules::parse_params;
use ustor_bdev::{
    Bdev, BdevChannel, BdevEntry, BdevError, BdevInfo, BdevModule, ControlError, Desc, IoChannel,
    IoHandle, IoType, Registry,
};

use crate::base;

/// `bdev_passthru_create`'s parameters, as SPDK's client sends them.
#[derive(Deserialize, Serialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct PassthruParams {
    pub base_bdev_name: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<uuid::Uuid>,
}

struct PassthruBdev {
    info: BdevInfo,
    base: [Desc; 1],
    params: PassthruParams,
}

struct PassthruChannel {
    base: IoChannel,
}

impl BdevChannel for PassthruChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        let kids = io.into_children();
        kids.submit(&self.base, d.kind, d.offset_blocks, d.num_blocks, 0);
    }
}

impl Bdev for PassthruBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, t: IoType) -> bool {
        base::all_support(&self.base, t)
    }
    fn fua_supported(&self, t: IoType) -> bool {
        base::all_fua(&self.base, t)
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        Ok(Box::new(PassthruChannel {
            base: self.base[0].channel()?,
        }))
    }
    fn config_json(&self) -> Value {
        json!({"method": "bdev_passthru_create", "params": self.params})
    }
    fn driver_info(&self) -> Value {
        json!({"passthru": {"name": self.info.name, "base_bdev_name": self.base[0].name()}})
    }
}

/// Creates passthru bdev `p.name` over `p.base_bdev_name`.
pub fn create(
    reg: &Registry,
    weak: &Weak<Registry>,
    p: PassthruParams,
) -> Result<Arc<BdevEntry>, ControlError> {
    base::check_free(reg, &p.name)?;
    let b = base::open(
        reg,
        weak,
        &p.base_bdev_name,
        &p.name,
        base::OnResize::Follow,
    )?;
    let base = [b];
    let n = base[0].num_blocks();
    let info = base::info(&p.name, p.uuid, "passthru", "passthru", &base, n)?;
    reg.register(Arc::new(PassthruBdev {
        info,
        base,
        params: p,
    }))
}

/// The passthru module.
pub struct PassthruModule(pub Weak<Registry>);

impl BdevModule for PassthruModule {
    fn name(&self) -> &'static str {
        "passthru"
    }
    fn create(&self, reg: &Registry, params: Value) -> Result<Arc<BdevEntry>, ControlError> {
        create(reg, &self.0, parse_params(params)?)
    }
}

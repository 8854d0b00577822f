//! The Ceph RBD methods that are not a plain module create or delete:
//! `bdev_rbd_register_cluster`, `bdev_rbd_unregister_cluster`,
//! `bdev_rbd_get_clusters_info`, `bdev_rbd_resize` (SPDK's names and
//! parameters). `bdev_rbd_create` / `bdev_rbd_delete` come from the module
//! table like every module's; this file adds the module to it.

use serde::Deserialize;
use serde_json::{json, Value};
use ustor_rbd::ClusterOpts;
use ustor_rpc::{parse_params, RPC_RUNTIME};

use super::{control_err, Ctx};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NameParam {
    name: String,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct InfoParam {
    name: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Resize {
    name: String,
    /// MiB (SPDK's unit).
    new_size: u64,
}

/// Adds the rbd module to the registry (before the bdev methods are made
/// from the module table) and registers the cluster methods.
pub fn register(ctx: &Ctx) -> Result<(), ustor_rpc::RegisterError> {
    let m = ustor_rbd::register(&ctx.registry, Some(ctx.rt.clone()))
        .map_err(|e| ustor_rpc::RegisterError::Duplicate(format!("bdev module rbd ({e})")))?;
    let m2 = m.clone();
    ctx.method("bdev_rbd_register_cluster", RPC_RUNTIME, move |_, p| {
        let o: ClusterOpts = parse_params(p)?;
        let name = o.name.clone();
        m2.clusters
            .register(o)
            .map_err(|e| control_err(e.into_control()))?;
        Ok(json!(name))
    })?;
    let m2 = m.clone();
    ctx.method("bdev_rbd_unregister_cluster", RPC_RUNTIME, move |_, p| {
        let p: NameParam = parse_params(p)?;
        m2.clusters
            .unregister(&p.name)
            .map_err(|e| control_err(e.into_control()))?;
        Ok(json!(true))
    })?;
    let m2 = m.clone();
    ctx.method("bdev_rbd_get_clusters_info", RPC_RUNTIME, move |_, p| {
        let p: InfoParam = if p.is_null() {
            InfoParam::default()
        } else {
            parse_params(p)?
        };
        m2.clusters
            .info(p.name.as_deref())
            .map_err(|e| control_err(e.into_control()))
    })?;
    ctx.method("bdev_rbd_resize", RPC_RUNTIME, move |_, p| {
        let p: Resize = parse_params(p)?;
        m.resize(&p.name, p.new_size)
            .map_err(|e| control_err(e.into_control()))?;
        Ok(Value::Bool(true))
    })?;
    Ok(())
}

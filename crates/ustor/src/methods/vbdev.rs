//! The virtual bdevs' RPC methods that are not a plain module create or
//! delete by name: `bdev_raid_get_bdevs`, `bdev_raid_remove_base_bdev`,
//! `bdev_raid_add_base_bdev` (starts the rebuild), `bdev_split_create` (returns
//! every part) / `bdev_split_delete` (by base), `bdev_error_inject_error`,
//! `bdev_delay_update_latency`, `bdev_wait_for_examine`.
//! The plain ones (`bdev_raid_create`, `bdev_passthru_delete`, ...) come
//! from the module table like every module's.

use serde::Deserialize;
use serde_json::{json, Value};
use ustor_rpc::{parse_params, RPC_RUNTIME};

use super::{control_err, Ctx};

/// Waits for every examine started so far, then starts each raid1 that
/// still misses members degraded (`ustor_vbdev::raid::sb::start_degraded`).
/// Run by `bdev_wait_for_examine` and by `ustor serve` once its
/// configuration is applied.
pub fn settle_examine(
    rt: &ustor_runtime::RuntimeHandle,
    reg: &std::sync::Arc<ustor_bdev::Registry>,
) -> Result<(), String> {
    rt.block_on(0, || async {
        while ustor_vbdev::raid::sb::examining() > 0 {
            ustor_runtime::yield_now().await;
        }
    })
    .map_err(|e| e.to_string())?;
    ustor_vbdev::raid::sb::start_degraded(reg, &std::sync::Arc::downgrade(reg));
    Ok(())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RaidGet {
    #[serde(default = "all")]
    category: String,
}

fn all() -> String {
    "all".into()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RaidAdd {
    raid_bdev: String,
    base_bdev: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NameParam {
    name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SplitDelete {
    base_bdev: String,
}

pub fn register(ctx: &Ctx) -> Result<(), ustor_rpc::RegisterError> {
    ctx.method("bdev_raid_get_bdevs", RPC_RUNTIME, |c, p| {
        let p: RaidGet = parse_params(p)?;
        ustor_vbdev::raid::get_bdevs(&c.registry, &p.category)
            .map(Value::Array)
            .map_err(control_err)
    })?;
    ctx.method("bdev_raid_remove_base_bdev", RPC_RUNTIME, |c, p| {
        let p: NameParam = parse_params(p)?;
        ustor_vbdev::raid::mirror::remove_base(&c.registry, &p.name).map_err(control_err)?;
        Ok(json!(true))
    })?;
    ctx.method("bdev_raid_add_base_bdev", RPC_RUNTIME, |c, p| {
        let p: RaidAdd = parse_params(p)?;
        let j = ustor_vbdev::raid::mirror::add_base(&c.registry, &p.raid_bdev, &p.base_bdev)
            .map_err(control_err)?;
        // The copy runs in the background on the first reactor; progress
        // shows in bdev_raid_get_bdevs.
        c.rt.send(0, move || {
            ustor_runtime::spawn(async move {
                let _ = ustor_vbdev::raid::mirror::rebuild(j).await;
            });
        })
        .map_err(ustor_rpc::RpcError::internal)?;
        Ok(json!(true))
    })?;
    // SPDK's: returns once every examine started so far is done (raid
    // arrays found from their superblocks are assembled); then, as the
    // point where the configured bdevs have all been seen, a raid1 still
    // missing members starts degraded.
    ctx.method("bdev_wait_for_examine", RPC_RUNTIME, |c, _p| {
        settle_examine(&c.rt, &c.registry).map_err(ustor_rpc::RpcError::internal)?;
        Ok(json!(true))
    })?;
    ctx.method("bdev_split_create", RPC_RUNTIME, |c, p| {
        let weak = std::sync::Arc::downgrade(&c.registry);
        ustor_vbdev::split::create(&c.registry, &weak, parse_params(p)?)
            .map(|names| json!(names))
            .map_err(control_err)
    })?;
    ctx.method("bdev_split_delete", RPC_RUNTIME, |c, p| {
        let p: SplitDelete = parse_params(p)?;
        ustor_vbdev::split::delete(&c.registry, &p.base_bdev).map_err(control_err)?;
        Ok(json!(true))
    })?;
    ctx.method("bdev_error_inject_error", RPC_RUNTIME, |c, p| {
        ustor_vbdev::error::inject(&c.registry, parse_params(p)?).map_err(control_err)?;
        Ok(json!(true))
    })?;
    ctx.method("bdev_delay_update_latency", RPC_RUNTIME, |c, p| {
        ustor_vbdev::delay::update_latency(&c.registry, parse_params(p)?).map_err(control_err)?;
        Ok(json!(true))
    })?;
    Ok(())
}

//! vhost-user-scsi methods (SPDK's names and parameters):
//! `vhost_create_scsi_controller`, `vhost_scsi_controller_add_target`,
//! `vhost_scsi_controller_remove_target`; the scsi controllers' part of
//! `vhost_get_controllers`, and the vhost_scsi subsystem's config dump.
//! Deleting and coalescing go through the shared vhost methods.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{json, Value};
use ustor_rpc::{parse_params, Replier, RPC_RUNTIME};
use ustor_vhost::scsi::target::ScsiControllerInfo;
use ustor_vhost::target::{DEFAULT_DELAY_BASE_US, DEFAULT_IOPS_THRESHOLD};
use ustor_vhost::VhostTarget;

use super::vhost::err;
use super::Ctx;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateParams {
    ctrlr: String,
    #[serde(default)]
    cpumask: Option<String>,
    /// Ours (SPDK's scsi method has none; its blk method does): offer
    /// packed virtqueues besides split ones.
    #[serde(default)]
    packed_ring: bool,
    /// SPDK's "start later" flag: accepted, the controller starts at once.
    #[serde(default)]
    #[allow(dead_code)]
    delay: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddTargetParams {
    ctrlr: String,
    scsi_target_num: u32,
    bdev_name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveTargetParams {
    ctrlr: String,
    scsi_target_num: u32,
}

/// One scsi controller as SPDK's `vhost_get_controllers` shows it.
pub fn info_json(c: &ScsiControllerInfo) -> Value {
    let targets: Vec<Value> = c
        .targets
        .iter()
        .map(|(n, bdev)| {
            json!({
                "scsi_dev_num": n, "id": n, "target_name": format!("Target {n}"),
                "luns": [{"id": 0, "bdev_name": bdev}],
            })
        })
        .collect();
    json!({
        "ctrlr": c.ctrlr,
        "cpumask": c.cpumask,
        "delay_base_us": c.delay_base_us,
        "iops_threshold": c.iops_threshold,
        "packed_ring": c.packed_ring,
        "socket": c.socket.display().to_string(),
        "sessions": session_json(c),
        "backend_specific": {"scsi": targets},
    })
}

/// SPDK's session list, as for blk: the connected frontend with what is
/// real about it (`started`: its rings run, `max_queues`: how many,
/// `inflight_task_cnt`: commands at the targets now) and ustor's
/// `frontend_pid`, `packed_rings` (how many of the running rings are
/// packed) and `resubmitted` (commands served again after a restart).
fn session_json(c: &ScsiControllerInfo) -> Vec<Value> {
    if !c.connected {
        return vec![];
    }
    let (running, packed) = c.rings_running;
    vec![json!({
        "vid": 0, "id": 0, "name": format!("{}s0", c.ctrlr),
        "started": running > 0, "max_queues": running,
        "inflight_task_cnt": c.in_flight,
        "frontend_pid": c.frontend_pid,
        "packed_rings": packed,
        "resubmitted": c.resubmitted,
    })]
}

/// The calls that recreate the scsi controllers (save_config).
pub fn config_calls(t: &VhostTarget) -> Vec<Value> {
    let mut calls = Vec::new();
    for c in t.scsi_controllers(None) {
        let mut params = json!({"ctrlr": c.ctrlr, "cpumask": c.cpumask});
        // Only when set: a config without it stays one SPDK takes.
        if c.packed_ring {
            params["packed_ring"] = json!(true);
        }
        calls.push(json!({"method": "vhost_create_scsi_controller", "params": params}));
        for (n, bdev) in &c.targets {
            calls.push(
                json!({"method": "vhost_scsi_controller_add_target", "params": {
                    "ctrlr": c.ctrlr, "scsi_target_num": n, "bdev_name": bdev,
                }}),
            );
        }
        if (c.delay_base_us, c.iops_threshold) != (DEFAULT_DELAY_BASE_US, DEFAULT_IOPS_THRESHOLD) {
            calls.push(json!({"method": "vhost_controller_set_coalescing", "params": {
                "ctrlr": c.ctrlr, "delay_base_us": c.delay_base_us, "iops_threshold": c.iops_threshold,
            }}));
        }
    }
    calls
}

pub fn register(ctx: &Ctx) -> Result<(), ustor_rpc::RegisterError> {
    ctx.method("vhost_create_scsi_controller", RPC_RUNTIME, |c, params| {
        let p: CreateParams = parse_params(params)?;
        c.vhost
            .create_scsi(&p.ctrlr, p.cpumask.as_deref(), p.packed_ring)
            .map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method(
        "vhost_scsi_controller_add_target",
        RPC_RUNTIME,
        |c, params| {
            let p: AddTargetParams = parse_params(params)?;
            c.vhost
                .scsi_add_target(&p.ctrlr, p.scsi_target_num, &p.bdev_name)
                .map_err(err)?;
            // SPDK answers with the target number.
            Ok(json!(p.scsi_target_num))
        },
    )?;
    ctx.method(
        "vhost_scsi_controller_remove_target",
        RPC_RUNTIME,
        |c, params| {
            let p: RemoveTargetParams = parse_params(params)?;
            c.vhost
                .scsi_remove_target(&p.ctrlr, p.scsi_target_num)
                .map_err(err)?;
            Ok(json!(true))
        },
    )?;
    let t: Arc<VhostTarget> = ctx.vhost.clone();
    ctx.table
        .add_subsystem("vhost_scsi", &["bdev"], move |reply: Replier| {
            reply.ok(Value::Array(config_calls(&t)));
        })?;
    Ok(())
}

//! vhost_* methods (SPDK's names and parameters) over the vhost target,
//! and the vhost_blk subsystem's config dump (the scsi controllers' own
//! methods are in `vhost_scsi`).

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{json, Value};
use ustor_rpc::{parse_params, Replier, RpcError, RPC_RUNTIME};
use ustor_vhost::target::{ControllerInfo, CreateBlk};
use ustor_vhost::{VhostError, VhostTarget};

use super::Ctx;

pub(crate) fn err(e: VhostError) -> RpcError {
    let errno = e.errno();
    RpcError::errno_msg(
        errno,
        format!("{}: {e}", ustor_rpc::errors::strerror(errno)),
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBlkParams {
    ctrlr: String,
    dev_name: String,
    #[serde(default)]
    cpumask: Option<String>,
    #[serde(default)]
    readonly: bool,
    #[serde(default)]
    packed_ring: bool,
    /// SPDK's virtio-blk transport name; only vhost-user is served.
    #[serde(default)]
    transport: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CtrlrParams {
    ctrlr: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GetParams {
    #[serde(default)]
    name: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CoalescingParams {
    ctrlr: String,
    delay_base_us: u32,
    iops_threshold: u32,
}

const TRANSPORT: &str = "vhost_user_blk";

/// One controller as SPDK's `vhost_get_controllers` shows it.
fn info_json(c: &ControllerInfo) -> Value {
    json!({
        "ctrlr": c.ctrlr,
        "cpumask": c.cpumask,
        "delay_base_us": c.delay_base_us,
        "iops_threshold": c.iops_threshold,
        "socket": c.socket.display().to_string(),
        "sessions": session_json(c),
        // ustor's: every queue the frontend has started, with counters
        // since the controller was created.
        "queues": c.queues.iter().enumerate()
            .filter(|(_, q)| q.running || q.requests > 0 || q.kicks > 0)
            .map(|(i, q)| json!({
                "index": i, "running": q.running, "requests": q.requests,
                "in_flight": q.in_flight(), "errors": q.errors, "kicks": q.kicks,
                "signals": q.signals, "resubmitted": q.resubmitted,
                "read_ahead": q.read_ahead,
                "ring": if q.packed { "packed" } else { "split" },
            }))
            .collect::<Vec<_>>(),
        "backend_specific": {"block": {
            // SPDK shows a hot-removed bdev as null.
            "readonly": c.readonly, "bdev": (!c.bdev_removed).then_some(&c.bdev),
            "transport": TRANSPORT, "packed_ring": c.packed_ring,
            "capacity_sectors": c.capacity_sectors,
        }},
    })
}

/// SPDK's session list: the connected frontend (one at a time here), with
/// what is real about it: whether its queues run, how many, the requests
/// in flight, and (ustor's) its process ID and backend channel.
fn session_json(c: &ControllerInfo) -> Vec<Value> {
    if !c.connected {
        return vec![];
    }
    let running = c.queues.iter().filter(|q| q.running).count();
    let in_flight: u64 = c.queues.iter().map(|q| q.in_flight()).sum();
    vec![json!({
        "vid": 0, "id": 0, "name": format!("{}s0", c.ctrlr),
        "started": running > 0, "max_queues": running,
        "inflight_task_cnt": in_flight,
        "frontend_pid": c.frontend_pid,
        "config_notify": c.notifier,
    })]
}

/// The calls that recreate the controllers (save_config).
pub fn config_calls(t: &VhostTarget) -> Vec<Value> {
    let mut calls = Vec::new();
    for c in t.controllers(None).unwrap_or_default() {
        calls.push(json!({"method": "vhost_create_blk_controller", "params": {
            "ctrlr": c.ctrlr, "dev_name": c.bdev, "cpumask": c.cpumask,
            "readonly": c.readonly, "packed_ring": c.packed_ring, "transport": TRANSPORT,
        }}));
        if (c.delay_base_us, c.iops_threshold)
            != (
                ustor_vhost::target::DEFAULT_DELAY_BASE_US,
                ustor_vhost::target::DEFAULT_IOPS_THRESHOLD,
            )
        {
            calls.push(json!({"method": "vhost_controller_set_coalescing", "params": {
                "ctrlr": c.ctrlr, "delay_base_us": c.delay_base_us, "iops_threshold": c.iops_threshold,
            }}));
        }
    }
    calls
}

pub fn register(ctx: &Ctx) -> Result<(), ustor_rpc::RegisterError> {
    ctx.method("vhost_create_blk_controller", RPC_RUNTIME, |c, params| {
        let p: CreateBlkParams = parse_params(params)?;
        if let Some(t) = p.transport.as_deref() {
            if t != TRANSPORT {
                return Err(err(VhostError::Invalid(format!(
                    "transport {t}: only {TRANSPORT} is served"
                ))));
            }
        }
        c.vhost
            .create_blk(&CreateBlk {
                ctrlr: p.ctrlr,
                dev_name: p.dev_name,
                cpumask: p.cpumask,
                readonly: p.readonly,
                packed_ring: p.packed_ring,
            })
            .map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("vhost_delete_controller", RPC_RUNTIME, |c, params| {
        let p: CtrlrParams = parse_params(params)?;
        c.vhost.delete(&p.ctrlr).map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("vhost_get_controllers", RPC_RUNTIME, |c, params| {
        let p: GetParams = parse_params(params)?;
        let list = c.vhost.controllers(p.name.as_deref()).map_err(err)?;
        let scsi = c.vhost.scsi_controllers(p.name.as_deref());
        let scsi = scsi.iter().map(super::vhost_scsi::info_json);
        Ok(Value::Array(
            list.iter().map(info_json).chain(scsi).collect(),
        ))
    })?;
    ctx.method(
        "vhost_controller_set_coalescing",
        RPC_RUNTIME,
        |c, params| {
            let p: CoalescingParams = parse_params(params)?;
            c.vhost
                .set_coalescing(&p.ctrlr, p.delay_base_us, p.iops_threshold)
                .map_err(err)?;
            Ok(json!(true))
        },
    )?;
    let t: Arc<VhostTarget> = ctx.vhost.clone();
    ctx.table
        .add_subsystem("vhost_blk", &["bdev"], move |reply: Replier| {
            reply.ok(Value::Array(config_calls(&t)));
        })?;
    Ok(())
}

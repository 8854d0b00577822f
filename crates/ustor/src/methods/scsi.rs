//! scsi_* and bdev_scsi_* methods over the userspace SCSI stack, plus
//! `scsi_iscsi_attach_host` (ustor's own: attaches an iSCSI initiator as a
//! SCSI host), `scsi_sg_attach_host` (the SG_IO passthrough LLD over
//! /dev/sgN), and the scsi subsystem's config dump (hosts, then bdevs).

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use ustor_iscsi::initiator::{IscsiConfig, IscsiLld};
use ustor_rpc::{no_params, parse_params, Replier, RpcError, RPC_RUNTIME};
use ustor_scsi::api;
use ustor_scsi::mid::HostConfig;
use ustor_scsi::sg::{SgConfig, SgLld};
use ustor_scsi::ScsiError;

use super::Ctx;

fn err(e: ScsiError) -> RpcError {
    let n = e.errno();
    RpcError::errno_msg(n, format!("{}: {e}", ustor_rpc::errors::strerror(n)))
}

fn out<T: Serialize>(v: T) -> Result<Value, RpcError> {
    serde_json::to_value(v).map_err(RpcError::internal)
}

/// `scsi_iscsi_attach_host`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct AttachIscsi {
    #[serde(flatten)]
    iscsi: IscsiConfig,
    /// Reactor that owns the host (its session and completions).
    #[serde(default)]
    reactor: usize,
    #[serde(default)]
    cmd_timeout_ms: Option<u64>,
    #[serde(default)]
    max_retries: Option<u32>,
}

/// `scsi_sg_attach_host`: `devices` is a list of sg nodes or `"all"`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct AttachSg {
    /// A label for the config dump and logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    devices: SgDevices,
    #[serde(default)]
    reactor: usize,
    /// Kernel-side timeout per command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    timeout_ms: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cmd_timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_retries: Option<u32>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(untagged)]
enum SgDevices {
    List(Vec<std::path::PathBuf>),
    All(String),
}

/// Attaches the SG_IO LLD as a SCSI host; returns the host number.
fn attach_sg(c: &Ctx, p: &AttachSg) -> Result<u32, RpcError> {
    if p.reactor >= c.rt.num_reactors() {
        return Err(RpcError::invalid_param(
            "reactor",
            format!("no reactor {}", p.reactor),
        ));
    }
    let mut cfg = match &p.devices {
        SgDevices::List(v) if !v.is_empty() => SgConfig {
            devices: v.clone(),
            ..SgConfig::all()
        },
        SgDevices::All(s) if s == "all" => SgConfig::all(),
        _ => {
            return Err(RpcError::invalid_param(
                "devices",
                "a non-empty list of sg nodes or \"all\"".to_string(),
            ))
        }
    };
    if cfg.devices.is_empty() {
        return Err(RpcError::invalid_param(
            "devices",
            "no /dev/sg* found".to_string(),
        ));
    }
    if let Some(t) = p.timeout_ms {
        cfg.timeout_ms = t;
    }
    let mut hc = HostConfig::default();
    if let Some(t) = p.cmd_timeout_ms {
        hc.cmd_timeout_ms = t;
    }
    if let Some(r) = p.max_retries {
        hc.max_retries = r;
    }
    c.scsi
        .add_host(p.reactor, hc, move || {
            Ok(Box::new(SgLld::new(cfg)?) as Box<dyn ustor_scsi::lld::Lld>)
        })
        .map_err(err)
}

pub fn register(ctx: &Ctx) -> Result<(), ustor_rpc::RegisterError> {
    let attached: Arc<Mutex<Vec<Value>>> = Arc::default();
    let at = attached.clone();
    ctx.method("scsi_iscsi_attach_host", RPC_RUNTIME, move |c, params| {
        let p: AttachIscsi = parse_params(params.clone())?;
        if p.reactor >= c.rt.num_reactors() {
            return Err(RpcError::invalid_param(
                "reactor",
                format!("no reactor {}", p.reactor),
            ));
        }
        let mut hc = HostConfig::default();
        if let Some(t) = p.cmd_timeout_ms {
            hc.cmd_timeout_ms = t;
        }
        if let Some(r) = p.max_retries {
            hc.max_retries = r;
        }
        let cfg = p.iscsi.clone();
        let host = c
            .scsi
            .add_host(p.reactor, hc, move || {
                Ok(Box::new(IscsiLld::new(cfg)) as Box<dyn ustor_scsi::lld::Lld>)
            })
            .map_err(err)?;
        at.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(json!({"method": "scsi_iscsi_attach_host", "params": params}));
        Ok(json!(host))
    })?;
    let at = attached.clone();
    ctx.method("scsi_sg_attach_host", RPC_RUNTIME, move |c, params| {
        let p: AttachSg = parse_params(params.clone())?;
        let host = attach_sg(c, &p)?;
        at.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(json!({"method": "scsi_sg_attach_host", "params": params}));
        Ok(json!(host))
    })?;
    ctx.method("scsi_get_hosts", RPC_RUNTIME, |c, p| {
        no_params("scsi_get_hosts", &p)?;
        out(api::scsi_get_hosts(&c.scsi))
    })?;
    ctx.method("scsi_get_devices", RPC_RUNTIME, |c, p| {
        let p: api::GetDevicesParams = if p.is_null() {
            serde_json::from_value(json!({})).map_err(RpcError::internal)?
        } else {
            parse_params(p)?
        };
        api::scsi_get_devices(&c.scsi, p).map_err(err).and_then(out)
    })?;
    ctx.method("scsi_scan_host", RPC_RUNTIME, |c, p| {
        let p: api::HostParams = parse_params(p)?;
        api::scsi_scan_host(&c.scsi, p).map_err(err).and_then(out)
    })?;
    ctx.method("scsi_device_reset", RPC_RUNTIME, |c, p| {
        let p: api::DeviceParams = parse_params(p)?;
        api::scsi_device_reset(&c.scsi, p)
            .map_err(err)
            .map(|_| json!(true))
    })?;
    ctx.method("scsi_host_reset", RPC_RUNTIME, |c, p| {
        let p: api::HostParams = parse_params(p)?;
        api::scsi_host_reset(&c.scsi, p)
            .map_err(err)
            .map(|_| json!(true))
    })?;
    ctx.method("scsi_get_stats", RPC_RUNTIME, |c, p| {
        no_params("scsi_get_stats", &p)?;
        api::scsi_get_stats(&c.scsi).map_err(err).and_then(out)
    })?;
    ctx.method("bdev_scsi_create", RPC_RUNTIME, |c, p| {
        let p: ustor_scsi::bdev::ScsiBdevOpts = parse_params(p)?;
        api::bdev_scsi_create(&c.scsi, p)
            .map_err(err)
            .map(|n| json!(n))
    })?;
    ctx.method("bdev_scsi_delete", RPC_RUNTIME, |c, p| {
        let p: ustor_scsi::bdev::ScsiBdevDelete = parse_params(p)?;
        api::bdev_scsi_delete(&c.scsi, p)
            .map_err(err)
            .map(|_| json!(true))
    })?;
    ctx.method("bdev_scsi_get_mappings", RPC_RUNTIME, |c, p| {
        no_params("bdev_scsi_get_mappings", &p)?;
        out(api::bdev_scsi_get_mappings(&c.scsi))
    })?;
    super::scsi_vfio::register(ctx, attached.clone())?;
    let reg = ctx.registry.clone();
    ctx.table
        .add_subsystem("scsi", &["bdev"], move |reply: Replier| {
            let mut calls = attached.lock().unwrap_or_else(|e| e.into_inner()).clone();
            calls.extend(
                reg.list()
                    .iter()
                    .filter(|e| e.info().module == "scsi")
                    .map(|e| e.bdev().config_json()),
            );
            reply.ok(Value::Array(calls));
        })?;
    Ok(())
}

//! nbd_* methods (ustor's own names: SPDK has no NBD server) and the nbd
//! subsystem's config dump.

use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use ustor_bdev::ControlError;
use ustor_nbd::server::{
    ExportCreateParams, ExportDeleteParams, NbdServerError, ServerStartParams,
};
use ustor_rpc::{no_params, parse_params, Replier, RpcError, RPC_RUNTIME};

use super::Ctx;

fn err(e: NbdServerError) -> RpcError {
    let errno = match &e {
        NbdServerError::AlreadyStarted | NbdServerError::ExportExists(_) => libc::EEXIST,
        NbdServerError::NotStarted | NbdServerError::NoSuchExport(_) => libc::ENODEV,
        NbdServerError::BadAddress(_) | NbdServerError::InvalidExport(_) => libc::EINVAL,
        NbdServerError::Listen(io) => io.raw_os_error().unwrap_or(libc::EIO),
        NbdServerError::Bdev(ControlError::Claimed { .. }) => libc::EBUSY,
        NbdServerError::Bdev(_) | NbdServerError::BdevIo(_) => libc::ENODEV,
        NbdServerError::Runtime(_) => libc::EIO,
    };
    RpcError::errno_msg(
        errno,
        format!("{}: {e}", ustor_rpc::errors::strerror(errno)),
    )
}

pub fn register(ctx: &Ctx) -> Result<(), ustor_rpc::RegisterError> {
    // The start parameters, for the config dump (max_connections).
    let started: Arc<Mutex<Option<ServerStartParams>>> = Arc::default();
    let st = started.clone();
    ctx.method("nbd_server_start", RPC_RUNTIME, move |c, params| {
        let mut p: ServerStartParams = parse_params(params)?;
        let r = c.nbd.start(&p).map_err(err)?;
        // The server allows at least one connection; save what it enforces.
        p.max_connections = p.max_connections.max(1);
        *st.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
        Ok(serde_json::to_value(r).unwrap_or(Value::Null))
    })?;
    ctx.method("nbd_server_stop", RPC_RUNTIME, |c, p| {
        no_params("nbd_server_stop", &p)?;
        if c.nbd.local_addr().is_none() {
            return Err(err(NbdServerError::NotStarted));
        }
        c.nbd.stop();
        Ok(json!(true))
    })?;
    ctx.method("nbd_export_create", RPC_RUNTIME, |c, params| {
        let p: ExportCreateParams = parse_params(params)?;
        c.nbd.export_create(&c.registry, &p).map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("nbd_export_delete", RPC_RUNTIME, |c, params| {
        let p: ExportDeleteParams = parse_params(params)?;
        c.nbd.export_delete(&p).map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("nbd_get_exports", RPC_RUNTIME, |c, p| {
        no_params("nbd_get_exports", &p)?;
        Ok(serde_json::to_value(c.nbd.get_exports()).unwrap_or(Value::Null))
    })?;
    ctx.method("nbd_get_stats", RPC_RUNTIME, |c, p| {
        no_params("nbd_get_stats", &p)?;
        let s = c.nbd.get_stats().map_err(err)?;
        Ok(serde_json::to_value(s).unwrap_or(Value::Null))
    })?;
    // ustor's own (SPDK has no NBD server): the live connections with
    // their request and byte counters, for `ustor top` and the metrics.
    ctx.method("nbd_get_connections", RPC_RUNTIME, |c, p| {
        no_params("nbd_get_connections", &p)?;
        let s = c.nbd.get_connections().map_err(err)?;
        Ok(serde_json::to_value(s).unwrap_or(Value::Null))
    })?;
    let nbd = ctx.nbd.clone();
    ctx.table.add_subsystem("nbd", &["bdev"], move |reply: Replier| {
        let mut calls = Vec::new();
        if let Some(a) = nbd.local_addr() {
            calls.push(json!({"method": "nbd_server_start", "params": {
                "listen_address": {"traddr": a.ip().to_string(), "trsvcid": a.port().to_string()},
                "max_connections": started.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|p| p.max_connections).unwrap_or(256),
            }}));
        }
        for e in nbd.get_exports() {
            calls.push(json!({"method": "nbd_export_create", "params": {
                "name": e.name, "bdev_name": e.bdev_name, "read_only": e.read_only, "description": e.description,
            }}));
        }
        reply.ok(Value::Array(calls));
    })?;
    Ok(())
}

//! fs_* methods (ustor's own: SPDK has no file service): volumes on
//! persistent-memory regions and their TCP exports, and the fs
//! subsystem's config dump.

use serde_json::{json, Value};
use ustor_fs::server::{CreateParams, ExportParams, FsServerError, NameParams};
use ustor_rpc::{no_params, parse_params, Replier, RpcError, RPC_RUNTIME};

use super::Ctx;

fn err(e: FsServerError) -> RpcError {
    let errno = e.errno();
    RpcError::errno_msg(
        errno,
        format!("{}: {e}", ustor_rpc::errors::strerror(errno)),
    )
}

pub fn register(ctx: &Ctx) -> Result<(), ustor_rpc::RegisterError> {
    ctx.method("fs_create", RPC_RUNTIME, |c, params| {
        let p: CreateParams = parse_params(params)?;
        c.fs.create(&p).map_err(err)?;
        Ok(json!(p.name))
    })?;
    ctx.method("fs_export", RPC_RUNTIME, |c, params| {
        let p: ExportParams = parse_params(params)?;
        let a = c.fs.export(&p).map_err(err)?;
        Ok(json!({"listen": a.to_string()}))
    })?;
    ctx.method("fs_delete", RPC_RUNTIME, |c, params| {
        let p: NameParams = parse_params(params)?;
        let name = p
            .name
            .ok_or_else(|| RpcError::invalid_param("name", "missing"))?;
        c.fs.delete(&name).map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("fs_get_exports", RPC_RUNTIME, |c, p| {
        no_params("fs_get_exports", &p)?;
        Ok(serde_json::to_value(c.fs.exports()).unwrap_or(Value::Null))
    })?;
    ctx.method("fs_get_stats", RPC_RUNTIME, |c, params| {
        let p: NameParams = parse_params(params)?;
        let s = c.fs.stats(p.name.as_deref()).map_err(err)?;
        Ok(serde_json::to_value(s).unwrap_or(Value::Null))
    })?;
    let fs = ctx.fs.clone();
    ctx.table.add_subsystem("fs", &[], move |reply: Replier| {
        let calls = fs
            .config_calls()
            .into_iter()
            .map(|(m, p)| json!({"method": m, "params": p}))
            .collect();
        reply.ok(Value::Array(calls));
    })?;
    Ok(())
}

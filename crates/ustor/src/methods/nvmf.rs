//! nvmf_* methods (SPDK's names and parameters) over the NVMe-oF/TCP
//! target, and the nvmf subsystem's config dump.

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use ustor_nvme::nvmf::rpc::*;
use ustor_nvme::nvmf::{NvmfError, Target};
use ustor_rpc::{no_params, parse_params, Replier, RpcError, RPC_RUNTIME};

use super::Ctx;

fn err(e: NvmfError) -> RpcError {
    RpcError::errno_msg(
        -e.code(),
        format!("{}: {e}", ustor_rpc::errors::strerror(-e.code())),
    )
}

fn out<T: Serialize>(v: T) -> Result<Value, RpcError> {
    serde_json::to_value(v).map_err(RpcError::internal)
}

/// Registers `name` taking params `P` and calling `f` on the target.
fn with_params<P, R>(
    ctx: &Ctx,
    t: &Target,
    name: &'static str,
    f: impl Fn(&Target, &P) -> Result<R, NvmfError> + Send + Sync + 'static,
) -> Result<(), ustor_rpc::RegisterError>
where
    P: DeserializeOwned,
    R: Serialize,
{
    let t = t.clone();
    ctx.method(name, RPC_RUNTIME, move |_, params| {
        let p: P = parse_params(params)?;
        f(&t, &p).map_err(err).and_then(out)
    })
}

pub fn register(ctx: &Ctx) -> Result<(), ustor_rpc::RegisterError> {
    let t = ctx.nvmf.clone();
    with_params(
        ctx,
        &t,
        "nvmf_create_transport",
        |t, p: &CreateTransportParams| t.nvmf_create_transport(p),
    )?;
    with_params(
        ctx,
        &t,
        "nvmf_create_subsystem",
        |t, p: &CreateSubsystemParams| t.nvmf_create_subsystem(p),
    )?;
    with_params(ctx, &t, "nvmf_delete_subsystem", |t, p: &NqnParams| {
        t.nvmf_delete_subsystem(p)
    })?;
    with_params(ctx, &t, "nvmf_subsystem_add_ns", |t, p: &AddNsParams| {
        t.nvmf_subsystem_add_ns(p)
    })?;
    with_params(
        ctx,
        &t,
        "nvmf_subsystem_remove_ns",
        |t, p: &RemoveNsParams| t.nvmf_subsystem_remove_ns(p),
    )?;
    with_params(
        ctx,
        &t,
        "nvmf_subsystem_add_listener",
        |t, p: &ListenerParams| t.nvmf_subsystem_add_listener(p),
    )?;
    with_params(
        ctx,
        &t,
        "nvmf_subsystem_remove_listener",
        |t, p: &ListenerParams| t.nvmf_subsystem_remove_listener(p),
    )?;
    with_params(ctx, &t, "nvmf_subsystem_add_host", |t, p: &HostParams| {
        t.nvmf_subsystem_add_host(p)
    })?;
    with_params(
        ctx,
        &t,
        "nvmf_subsystem_remove_host",
        |t, p: &HostParams| t.nvmf_subsystem_remove_host(p),
    )?;
    with_params(
        ctx,
        &t,
        "nvmf_subsystem_allow_any_host",
        |t, p: &AllowAnyHostParams| t.nvmf_subsystem_allow_any_host(p),
    )?;
    let t2 = t.clone();
    ctx.method("nvmf_get_transports", RPC_RUNTIME, move |_, p| {
        if !p.is_null() && p.get("trtype").is_none() {
            no_params("nvmf_get_transports", &p)?;
        }
        out(t2.nvmf_get_transports())
    })?;
    let t3 = t.clone();
    ctx.method("nvmf_get_subsystems", RPC_RUNTIME, move |_, p| {
        if !p.is_null() && p.get("nqn").is_none() {
            no_params("nvmf_get_subsystems", &p)?;
        }
        let all = t3.nvmf_get_subsystems();
        match p.get("nqn").and_then(|n| n.as_str()) {
            Some(nqn) => {
                let one: Vec<_> = all.into_iter().filter(|s| s.nqn == nqn).collect();
                if one.is_empty() {
                    return Err(RpcError::errno(libc::ENODEV));
                }
                out(one)
            }
            None => out(all),
        }
    })?;
    let t4 = t.clone();
    ctx.method("nvmf_get_stats", RPC_RUNTIME, move |_, p| {
        no_params("nvmf_get_stats", &p)?;
        t4.nvmf_get_stats().map_err(err).and_then(out)
    })?;
    ctx.table
        .add_subsystem("nvmf", &["bdev"], move |reply: Replier| {
            reply.ok(Value::Array(t.config_json()))
        })?;
    Ok(())
}

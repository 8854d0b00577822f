//! framework_* and spdk_get_version.

use serde_json::{json, Value};
use ustor_rpc::{no_params, RpcError, RPC_ANY_STATE, RPC_RUNTIME, RPC_STARTUP};

use super::Ctx;

pub fn register(ctx: &Ctx) -> Result<(), ustor_rpc::RegisterError> {
    ctx.method("spdk_get_version", RPC_ANY_STATE, |_, p| {
        no_params("spdk_get_version", &p)?;
        let v = env!("CARGO_PKG_VERSION");
        let mut it = v.split('.').map(|x| x.parse::<u64>().unwrap_or(0));
        Ok(json!({
            "version": format!("ustor v{v}"),
            "fields": {"major": it.next().unwrap_or(0), "minor": it.next().unwrap_or(0), "patch": it.next().unwrap_or(0), "suffix": ""}
        }))
    })?;
    ctx.method("framework_start_init", RPC_STARTUP, |c, p| {
        no_params("framework_start_init", &p)?;
        c.table.set_state(RPC_RUNTIME);
        Ok(json!(true))
    })?;
    // SPDK's semantics: the answer comes once initialization, the startup
    // config included, is complete (at once when it is), so a client never
    // sees a half-built configuration.
    let table = ctx.table.clone();
    ctx.table.register(
        "framework_wait_init",
        RPC_ANY_STATE,
        move |p, reply| match no_params("framework_wait_init", &p) {
            Ok(()) => table.wait_init(reply),
            Err(e) => reply.err(e),
        },
    )?;
    ctx.method("framework_get_reactors", RPC_RUNTIME, |c, p| {
        no_params("framework_get_reactors", &p)?;
        let stats = c.rt.stats().map_err(RpcError::internal)?;
        let tick_rate = ustor_runtime::ticks::hz();
        let to_ticks = |ns: u64| (ns as u128 * tick_rate as u128 / 1_000_000_000) as u64;
        let reactors: Vec<Value> = stats
            .iter()
            .map(|s| {
                json!({
                    "lcore": s.core,
                    "busy": to_ticks(s.busy_ns),
                    "idle": to_ticks(s.idle_ns),
                    "in_interrupt": s.poll_mode == "interrupt",
                    "poll_mode": s.poll_mode,
                    "loops": s.loops,
                    "messages": s.messages,
                    "sleeps": s.sleeps,
                    "wakeups": s.wakeups,
                    "sleeps_contended": s.sleeps_contended,
                    "sleeps_batched": s.sleeps_batched,
                    "naps": s.naps,
                    "naps_early": s.naps_early,
                    "tasks": s.tasks,
                    "io_uring_submits": s.submits,
                    "io_uring_completions": s.completions,
                    "lw_threads": [{"name": format!("reactor_{}", s.reactor), "id": s.reactor, "cpumask": format!("{:#x}", 1u128 << s.core), "elapsed": to_ticks(s.busy_ns + s.idle_ns)}],
                    "pollers": s.pollers.iter().map(|(n, timed)| json!({"name": n, "timed": timed})).collect::<Vec<_>>(),
                })
            })
            .collect();
        Ok(json!({"tick_rate": tick_rate, "pid": std::process::id(), "reactors": reactors}))
    })?;
    Ok(())
}

//! Methods every table has, answered inside the crate: `rpc_get_methods`
//! (and its deprecated alias `get_rpc_methods`), `framework_get_subsystems`
//! and `framework_get_config`. They hold a weak reference to the table so
//! the table does not keep itself alive.

use super::{read, Inner, MethodTable, Replier, RPC_ANY_STATE};
use crate::errors::RpcError;
use crate::params::{no_params, parse_params};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::{Arc, Weak};

pub(super) fn register(t: &MethodTable) {
    // The table is new, so these names cannot collide.
    let me = Arc::downgrade(&t.inner);
    let r = t.register_sync("rpc_get_methods", RPC_ANY_STATE, move |p| {
        rpc_get_methods(&me, p)
    });
    debug_assert!(r.is_ok());
    let me = Arc::downgrade(&t.inner);
    let r = t.register_sync("framework_get_subsystems", RPC_ANY_STATE, move |p| {
        framework_get_subsystems(&me, p)
    });
    debug_assert!(r.is_ok());
    let me = Arc::downgrade(&t.inner);
    let r = t.register("framework_get_config", RPC_ANY_STATE, move |p, reply| {
        framework_get_config(&me, p, reply)
    });
    debug_assert!(r.is_ok());
    let r = t.register_alias("get_rpc_methods", "rpc_get_methods", true);
    debug_assert!(r.is_ok());
}

fn upgrade(me: &Weak<Inner>) -> Result<MethodTable, RpcError> {
    let inner = me
        .upgrade()
        .ok_or_else(|| RpcError::internal("shutting down"))?;
    Ok(MethodTable { inner })
}

fn rpc_get_methods(me: &Weak<Inner>, params: Value) -> Result<Value, RpcError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct P {
        #[serde(default)]
        current: bool,
        #[serde(default)]
        include_aliases: bool,
    }
    let p: P = parse_params(params)?;
    let t = upgrade(me)?;
    Ok(json!(t.method_names(p.current, p.include_aliases)))
}

fn framework_get_subsystems(me: &Weak<Inner>, params: Value) -> Result<Value, RpcError> {
    no_params("framework_get_subsystems", &params)?;
    let t = upgrade(me)?;
    let subs = read(&t.inner.subsystems);
    let list = subs
        .iter()
        .map(|s| json!({"subsystem": s.name, "depends_on": s.depends_on}))
        .collect();
    Ok(Value::Array(list))
}

fn framework_get_config(me: &Weak<Inner>, params: Value, reply: Replier) {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct P {
        name: String,
        // Accepted for SPDK compatibility; ustor's dumps have no batches.
        #[serde(default)]
        #[allow(dead_code)]
        with_batches: bool,
    }
    let p: P = match parse_params(params) {
        Ok(p) => p,
        Err(e) => return reply.err(e),
    };
    let t = match upgrade(me) {
        Ok(t) => t,
        Err(e) => return reply.err(e),
    };
    // Clone the dump function out so the lock is not held while it runs.
    let dump = read(&t.inner.subsystems)
        .iter()
        .find(|s| s.name == p.name)
        .map(|s| s.dump.clone());
    match dump {
        Some(d) => d(reply),
        None => reply.err(RpcError::invalid_param(
            "name",
            format!("subsystem `{}` not found", p.name),
        )),
    }
}

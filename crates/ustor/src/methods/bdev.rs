//! bdev_* methods: create/delete for every module in the registry's table
//! (malloc, null, uring); bdev_null_resize; bdev_get_bdevs;
//! bdev_get_iostat; bdev_set_qos_limit; and the bdev subsystem's config
//! dump.

use serde::Deserialize;
use serde_json::{json, Value};
use ustor_bdev::{BdevEntry, BdevModule, IoType, QosUpdate};
use ustor_rpc::{parse_params, Replier, RpcError, RPC_RUNTIME};

use super::{control_err, Ctx};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NameParam {
    name: String,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct IostatParams {
    name: Option<String>,
    /// SPDK 24+: a list of names.
    names: Option<Vec<String>>,
    #[serde(default)]
    per_channel: bool,
    reset_mode: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct GetParams {
    name: Option<String>,
    #[serde(default)]
    timeout: u64,
}

fn delete(c: &Ctx, params: Value, m: &dyn BdevModule) -> Result<Value, RpcError> {
    let p: NameParam = parse_params(params)?;
    let module = m.name();
    match c.registry.get(&p.name) {
        Some(e) if e.info().module == module => {}
        Some(_) => {
            return Err(RpcError::errno_msg(
                libc::ENODEV,
                format!("bdev {} is not a {module} bdev", p.name),
            ))
        }
        None => return Err(RpcError::errno(libc::ENODEV)),
    }
    m.delete(&c.registry, &p.name).map_err(control_err)?;
    Ok(json!(true))
}

/// SPDK's `bdev_get_bdevs` entry.
pub fn bdev_json(e: &BdevEntry) -> Value {
    let i = e.info();
    let b = e.bdev();
    let claim = e.claimed_by();
    let sup = |t| b.io_type_supported(t);
    json!({
        "name": i.name,
        "aliases": e.aliases(),
        "product_name": i.product_name,
        "block_size": i.block_size,
        "num_blocks": e.num_blocks(),
        "uuid": i.uuid.to_string(),
        "assigned_rate_limits": e.qos_limits(),
        "claimed": claim.is_some(),
        // SPDK's names: a virtual bdev's claim is exclusive; targets share.
        "claim_type": match (&claim, e.claimed_exclusive()) {
            (None, _) => "none",
            (Some(_), true) => "exclusive_write",
            (Some(_), false) => "read_many_write_many",
        },
        "claimed_by": claim,
        "zoned": false,
        "optimal_io_boundary": i.optimal_boundary_blocks,
        "md_size": 0,
        "write_cache": i.write_cache,
        "required_alignment": i.required_alignment.trailing_zeros(),
        "supported_io_types": {
            "read": sup(IoType::Read), "write": sup(IoType::Write), "unmap": sup(IoType::Unmap),
            "flush": sup(IoType::Flush), "reset": sup(IoType::Reset),
            // Emulated with writes where the driver lacks it.
            "write_zeroes": true,
            "compare_and_write": sup(IoType::CompareAndWrite),
            "compare": false, "abort": false, "copy": false,
            "seek_hole": false, "seek_data": false, "nvme_admin": false, "nvme_io": false, "nvme_io_md": false, "zcopy": false,
        },
        "driver_specific": b.driver_info(),
        "module": i.module,
    })
}

/// The `bdev_set_qos_limit` call that restores a bdev's limits, if any.
fn qos_config(e: &BdevEntry) -> Option<Value> {
    let l = e.qos_limits();
    if l.is_unlimited() {
        return None;
    }
    let mut p = serde_json::to_value(l).ok()?;
    p["name"] = json!(e.info().name);
    Some(json!({"method": "bdev_set_qos_limit", "params": p}))
}

/// SPDK's `bdev_null_resize`: grows a null bdev to `mib` MiB (SPDK
/// refuses to shrink one); its openers hear the resize.
fn null_resize(c: &Ctx, name: &str, mib: u64) -> Result<(), RpcError> {
    let e = c
        .registry
        .get(name)
        .ok_or_else(|| RpcError::errno(libc::ENODEV))?;
    if e.info().module != "null" {
        return Err(RpcError::errno_msg(
            libc::EINVAL,
            format!("{name} is not a null bdev"),
        ));
    }
    let bs = e.info().block_size as u64;
    let now = e.num_blocks() * bs;
    let bytes = mib
        .checked_mul(1 << 20)
        .filter(|b| *b >= now)
        .ok_or_else(|| {
            RpcError::errno_msg(
                libc::EINVAL,
                "the new size must not be smaller than the current size",
            )
        })?;
    e.resize(bytes / bs);
    Ok(())
}

pub fn register(ctx: &Ctx) -> Result<(), ustor_rpc::RegisterError> {
    module_methods(ctx)?;
    ctx.method("bdev_get_bdevs", RPC_RUNTIME, |c, params| {
        let p: GetParams = if params.is_null() {
            GetParams::default()
        } else {
            parse_params(params)?
        };
        let _ = p.timeout;
        match p.name {
            Some(n) => match c.registry.get(&n) {
                Some(e) => Ok(json!([bdev_json(&e)])),
                None => Err(RpcError::errno(libc::ENODEV)),
            },
            None => Ok(Value::Array(
                c.registry.list().iter().map(|e| bdev_json(e)).collect(),
            )),
        }
    })?;
    ctx.method("bdev_get_iostat", RPC_RUNTIME, |c, params| {
        let p: IostatParams = if params.is_null() { IostatParams::default() } else { parse_params(params)? };
        if p.per_channel {
            return Err(RpcError::errno_msg(libc::EOPNOTSUPP, "per_channel iostat is not supported yet"));
        }
        if p.reset_mode.as_deref().is_some_and(|m| m != "none") {
            return Err(RpcError::errno_msg(libc::EOPNOTSUPP, "reset_mode is not supported yet"));
        }
        let wanted: Vec<String> = p.name.into_iter().chain(p.names.unwrap_or_default()).collect();
        let entries = if wanted.is_empty() {
            c.registry.list()
        } else {
            wanted.iter().map(|n| c.registry.get(n).ok_or_else(|| RpcError::errno(libc::ENODEV))).collect::<Result<_, _>>()?
        };
        let mut out = Vec::new();
        for e in entries {
            let name = e.info().name.clone();
            let st = c.registry.iostat(&name).map_err(control_err)?;
            out.push(st.to_spdk_json(&name));
        }
        Ok(json!({"tick_rate": ustor_runtime::ticks::hz(), "ticks": ustor_runtime::ticks::now(), "bdevs": out}))
    })?;
    ctx.method("bdev_enable_histogram", RPC_RUNTIME, |c, params| {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct P {
            name: String,
            enable: bool,
            /// SPDK 24+: per-opcode histograms; only all opcodes here.
            opc: Option<String>,
        }
        let p: P = parse_params(params)?;
        if p.opc.is_some() {
            return Err(RpcError::invalid_param(
                "opc",
                "per-opcode histograms are not supported",
            ));
        }
        let e = c
            .registry
            .get(&p.name)
            .ok_or_else(|| RpcError::errno(libc::ENODEV))?;
        e.set_histograms(p.enable);
        Ok(json!(true))
    })?;
    ctx.method("bdev_null_resize", RPC_RUNTIME, |c, params| {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct P {
            name: String,
            /// MiB, as SPDK's.
            new_size: u64,
        }
        let p: P = parse_params(params)?;
        null_resize(c, &p.name, p.new_size)?;
        Ok(json!(true))
    })?;
    ctx.method("bdev_set_qos_limit", RPC_RUNTIME, |c, params| {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct P {
            name: String,
            rw_ios_per_sec: Option<u64>,
            rw_mbytes_per_sec: Option<u64>,
            r_mbytes_per_sec: Option<u64>,
            w_mbytes_per_sec: Option<u64>,
        }
        let p: P = parse_params(params)?;
        let u = QosUpdate {
            rw_ios_per_sec: p.rw_ios_per_sec,
            rw_mbytes_per_sec: p.rw_mbytes_per_sec,
            r_mbytes_per_sec: p.r_mbytes_per_sec,
            w_mbytes_per_sec: p.w_mbytes_per_sec,
        };
        c.registry
            .set_qos_limits(&p.name, &u)
            .map_err(control_err)?;
        Ok(json!(true))
    })?;
    nvme_initiator(ctx)?;
    let reg = ctx.registry.clone();
    ctx.table
        .add_subsystem("bdev", &[], move |reply: Replier| {
            // The table's modules: their options, then their bdevs in
            // creation order. Bdevs of other kinds come back another way:
            // NVMe namespaces by attaching their controller once, SCSI
            // bdevs by the scsi subsystem after its hosts.
            let modules = reg.modules();
            let mut calls: Vec<Value> = modules.iter().flat_map(|m| m.config_json()).collect();
            calls.extend(
                reg.list()
                    .iter()
                    .filter(|e| modules.iter().any(|m| m.name() == e.info().module))
                    .map(|e| {
                        let mut c = e.bdev().config_json();
                        // A resized null bdev comes back at its size now.
                        if e.info().module == "null" && c["params"].is_object() {
                            c["params"]["num_blocks"] = json!(e.num_blocks());
                        }
                        c
                    })
                    .filter(|c| !c.is_null()),
            );
            // Arrays with superblocks are not in the list: the members bring
            // them back through examine. As SPDK's save_config does, wait
            // for it before the subsystems that use them.
            if reg
                .list()
                .iter()
                .any(|e| e.info().module == "raid" && e.bdev().config_json().is_null())
            {
                calls.push(json!({"method": "bdev_wait_for_examine"}));
            }
            // Limits after the bdevs they apply to.
            calls.extend(reg.list().iter().filter_map(|e| qos_config(e)));
            calls.extend(ustor_nvme::initiator::config_json());
            reply.ok(Value::Array(calls));
        })?;
    Ok(())
}

/// Each table module's create and delete methods (`bdev_malloc_create`,
/// `bdev_malloc_delete`, ...).
fn module_methods(ctx: &Ctx) -> Result<(), ustor_rpc::RegisterError> {
    for m in ctx.registry.modules() {
        if let Some(method) = m.create_method() {
            let m = m.clone();
            ctx.method(&method, RPC_RUNTIME, move |c, params| {
                m.create(&c.registry, params)
                    .map(|e| json!(e.info().name))
                    .map_err(control_err)
            })?;
        }
        if let Some(method) = m.delete_method() {
            let m = m.clone();
            ctx.method(&method, RPC_RUNTIME, move |c, p| delete(c, p, m.as_ref()))?;
        }
    }
    Ok(())
}

/// bdev_nvme_* (the NVMe/TCP initiator), SPDK's names and parameters.
fn nvme_initiator(ctx: &Ctx) -> Result<(), ustor_rpc::RegisterError> {
    use ustor_nvme::initiator::{
        self as ini, AttachParams, DetachParams, GetControllersParams, InitiatorError,
    };
    fn err(e: InitiatorError) -> RpcError {
        RpcError::errno_msg(
            -e.code(),
            format!("{}: {e}", ustor_rpc::errors::strerror(-e.code())),
        )
    }
    ctx.method("bdev_nvme_attach_controller", RPC_RUNTIME, |c, params| {
        let p: AttachParams = parse_params(params)?;
        let names = ini::attach_controller(&c.rt, &c.registry, &p).map_err(err)?;
        Ok(json!(names))
    })?;
    ctx.method("bdev_nvme_detach_controller", RPC_RUNTIME, |_, params| {
        let p: DetachParams = parse_params(params)?;
        ini::detach_controller(&p).map(|b| json!(b)).map_err(err)
    })?;
    ctx.method("bdev_nvme_get_controllers", RPC_RUNTIME, |_, params| {
        let p: GetControllersParams = if params.is_null() {
            GetControllersParams::default()
        } else {
            parse_params(params)?
        };
        let v = ini::get_controllers(&p).map_err(err)?;
        serde_json::to_value(v).map_err(RpcError::internal)
    })?;
    Ok(())
}

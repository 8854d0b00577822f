//! iscsi_* methods with SPDK's names and parameters, and the iscsi
//! subsystem's config dump (auth groups, portal groups, initiator groups,
//! target nodes, in the order they depend on each other).

use serde::Deserialize;
use serde_json::{json, Value};
use ustor_bdev::ControlError;
use ustor_iscsi_target::{
    AddLunParams, AuthGroupParams, InitiatorGroupParams, IscsiError, IscsiOptions, NodeNameParams,
    PortalGroupParams, Secret, TagParams, TargetNodeParams,
};
use ustor_rpc::{no_params, parse_params, Replier, RpcError, RPC_ANY_STATE, RPC_RUNTIME};

use super::Ctx;

fn err(e: IscsiError) -> RpcError {
    let errno = match &e {
        IscsiError::Exists(..) => libc::EEXIST,
        IscsiError::NotFound(..) => libc::ENODEV,
        IscsiError::Invalid(..) => libc::EINVAL,
        IscsiError::InUse(..) => libc::EBUSY,
        IscsiError::Listen(_, io) => io.raw_os_error().unwrap_or(libc::EIO),
        IscsiError::Bdev(ControlError::Claimed { .. }) => libc::EBUSY,
        IscsiError::Bdev(_) => libc::ENODEV,
    };
    RpcError::errno_msg(
        errno,
        format!("{}: {e}", ustor_rpc::errors::strerror(errno)),
    )
}

/// `iscsi_auth_group_add_secret`.
#[derive(Deserialize)]
struct AddSecret {
    tag: u32,
    #[serde(flatten)]
    secret: Secret,
}

pub fn register(ctx: &Ctx) -> Result<(), ustor_rpc::RegisterError> {
    ctx.method("iscsi_create_portal_group", RPC_RUNTIME, |c, p| {
        let p: PortalGroupParams = parse_params(p)?;
        c.iscsi.create_portal_group(&p).map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("iscsi_delete_portal_group", RPC_RUNTIME, |c, p| {
        let p: TagParams = parse_params(p)?;
        c.iscsi.delete_portal_group(p.tag).map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("iscsi_get_portal_groups", RPC_RUNTIME, |c, p| {
        no_params("iscsi_get_portal_groups", &p)?;
        Ok(serde_json::to_value(c.iscsi.get_portal_groups()).unwrap_or(Value::Null))
    })?;
    ctx.method("iscsi_create_initiator_group", RPC_RUNTIME, |c, p| {
        let p: InitiatorGroupParams = parse_params(p)?;
        c.iscsi.create_initiator_group(&p).map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("iscsi_delete_initiator_group", RPC_RUNTIME, |c, p| {
        let p: TagParams = parse_params(p)?;
        c.iscsi.delete_initiator_group(p.tag).map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("iscsi_get_initiator_groups", RPC_RUNTIME, |c, p| {
        no_params("iscsi_get_initiator_groups", &p)?;
        Ok(serde_json::to_value(c.iscsi.get_initiator_groups()).unwrap_or(Value::Null))
    })?;
    ctx.method("iscsi_create_auth_group", RPC_RUNTIME, |c, p| {
        let p: AuthGroupParams = parse_params(p)?;
        c.iscsi.create_auth_group(&p).map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("iscsi_auth_group_add_secret", RPC_RUNTIME, |c, p| {
        let p: AddSecret = parse_params(p)?;
        c.iscsi
            .auth_group_add_secret(p.tag, p.secret)
            .map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("iscsi_delete_auth_group", RPC_RUNTIME, |c, p| {
        let p: TagParams = parse_params(p)?;
        c.iscsi.delete_auth_group(p.tag).map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("iscsi_get_auth_groups", RPC_RUNTIME, |c, p| {
        no_params("iscsi_get_auth_groups", &p)?;
        Ok(serde_json::to_value(c.iscsi.get_auth_groups()).unwrap_or(Value::Null))
    })?;
    ctx.method("iscsi_create_target_node", RPC_RUNTIME, |c, p| {
        let p: TargetNodeParams = parse_params(p)?;
        c.iscsi.create_target_node(&p).map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("iscsi_target_node_add_lun", RPC_RUNTIME, |c, p| {
        let p: AddLunParams = parse_params(p)?;
        c.iscsi.target_node_add_lun(&p).map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("iscsi_delete_target_node", RPC_RUNTIME, |c, p| {
        let p: NodeNameParams = parse_params(p)?;
        c.iscsi
            .delete_target_node(&p.target_node_name)
            .map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("iscsi_get_target_nodes", RPC_RUNTIME, |c, p| {
        no_params("iscsi_get_target_nodes", &p)?;
        Ok(serde_json::to_value(c.iscsi.get_target_nodes()).unwrap_or(Value::Null))
    })?;
    // SPDK takes options only before init; here they hold for logins
    // from the call on, so a config file's call works too.
    ctx.method("iscsi_set_options", RPC_ANY_STATE, |c, p| {
        let p: IscsiOptions = parse_params(p)?;
        c.iscsi.set_options(p).map_err(err)?;
        Ok(json!(true))
    })?;
    ctx.method("iscsi_get_options", RPC_ANY_STATE, |c, p| {
        no_params("iscsi_get_options", &p)?;
        Ok(serde_json::to_value(c.iscsi.get_options()).unwrap_or(Value::Null))
    })?;
    ctx.method("iscsi_get_stats", RPC_RUNTIME, |c, p| {
        no_params("iscsi_get_stats", &p)?;
        Ok(serde_json::to_value(c.iscsi.get_stats()).unwrap_or(Value::Null))
    })?;
    ctx.method("iscsi_get_connections", RPC_RUNTIME, |c, p| {
        no_params("iscsi_get_connections", &p)?;
        Ok(serde_json::to_value(c.iscsi.get_connections()).unwrap_or(Value::Null))
    })?;
    let iscsi = ctx.iscsi.clone();
    ctx.table
        .add_subsystem("iscsi", &["bdev"], move |reply: Replier| {
            reply.ok(Value::Array(iscsi.config_json()));
        })?;
    Ok(())
}

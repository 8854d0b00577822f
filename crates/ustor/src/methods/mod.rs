//! The JSON-RPC methods, by subsystem, with SPDK's names and parameters.
//! Each subsystem also dumps the config calls that recreate its objects
//! (`framework_get_config`, used by `save_config`).

pub mod bdev;
pub mod framework;
pub mod fs;
pub mod iscsi;
pub mod nbd;
pub mod nvmf;
pub mod rbd;
pub mod scsi;
pub mod scsi_vfio;
pub mod vbdev;
pub mod vhost;
pub mod vhost_scsi;

use std::sync::Arc;

use serde_json::Value;
use ustor_bdev::{ControlError, Registry};
use ustor_nbd::server::NbdServer;
use ustor_rpc::{MethodTable, RegisterError, RpcError};
use ustor_runtime::RuntimeHandle;

use crate::control::ControlSender;

/// What methods need.
#[derive(Clone)]
pub struct Ctx {
    pub rt: RuntimeHandle,
    pub registry: Arc<Registry>,
    pub nbd: Arc<NbdServer>,
    pub fs: Arc<ustor_fs::server::FsServer>,
    pub iscsi: Arc<ustor_iscsi_target::IscsiTarget>,
    pub nvmf: ustor_nvme::nvmf::Target,
    pub scsi: ustor_scsi::ScsiStack,
    pub vhost: Arc<ustor_vhost::VhostTarget>,
    pub table: MethodTable,
    pub ctl: ControlSender,
}

impl Ctx {
    /// Registers a method that runs on the control thread.
    pub fn method(
        &self,
        name: &str,
        mask: u32,
        f: impl Fn(&Ctx, Value) -> Result<Value, RpcError> + Send + Sync + 'static,
    ) -> Result<(), RegisterError> {
        let me = self.clone();
        self.ctl.method(&self.table, name, mask, move |p| f(&me, p))
    }
}

pub fn register_all(ctx: &Ctx) -> Result<(), RegisterError> {
    framework::register(ctx)?;
    // Before bdev: it adds the rbd module, whose create/delete methods
    // bdev::register makes from the module table.
    rbd::register(ctx)?;
    bdev::register(ctx)?;
    nbd::register(ctx)?;
    fs::register(ctx)?;
    iscsi::register(ctx)?;
    nvmf::register(ctx)?;
    scsi::register(ctx)?;
    vbdev::register(ctx)?;
    vhost::register(ctx)?;
    vhost_scsi::register(ctx)?;
    Ok(())
}

/// SPDK-style domain error from a bdev control error.
pub fn control_err(e: ControlError) -> RpcError {
    match &e {
        ControlError::Invalid { param, why } => RpcError::invalid_param(param, why),
        ControlError::Params { path, msg } => ustor_rpc::params_error(path, msg),
        // SPDK's message is strerror(errno); the detail follows it.
        _ => RpcError::errno_msg(
            e.errno(),
            format!("{}: {e}", ustor_rpc::errors::strerror(e.errno())),
        ),
    }
}

/// The undo call for a config call that created something (config
/// rollback): a bdev module's create is undone by its delete (from the
/// registry's module table), the targets' by theirs.
pub fn undo_in(reg: &Registry, c: &ustor_rpc::ConfigCall) -> Option<ustor_rpc::ConfigCall> {
    let name = c.params.get("name").cloned();
    let module_delete = || {
        reg.modules()
            .iter()
            .find(|m| m.create_method().as_deref() == Some(c.method.as_str()))
            .and_then(|m| m.delete_method())
    };
    let method = match c.method.as_str() {
        "bdev_nvme_attach_controller" => "bdev_nvme_detach_controller".to_string(),
        "nbd_export_create" => "nbd_export_delete".to_string(),
        "fs_create" => "fs_delete".to_string(),
        "iscsi_create_target_node" => {
            return Some(ustor_rpc::ConfigCall::new(
                "iscsi_delete_target_node",
                serde_json::json!({ "target_node_name": name? }),
            ))
        }
        "bdev_scsi_create" => "bdev_scsi_delete".to_string(),
        "vhost_create_blk_controller" | "vhost_create_scsi_controller" => {
            return Some(ustor_rpc::ConfigCall::new(
                "vhost_delete_controller",
                serde_json::json!({ "ctrlr": c.params.get("ctrlr")? }),
            ))
        }
        "bdev_rbd_register_cluster" => "bdev_rbd_unregister_cluster".to_string(),
        "nbd_server_start" => {
            return Some(ustor_rpc::ConfigCall::new("nbd_server_stop", Value::Null))
        }
        _ => module_delete()?,
    };
    let name = name?;
    Some(ustor_rpc::ConfigCall::new(
        &method,
        serde_json::json!({ "name": name }),
    ))
}

/// [`undo_in`] with ustor's built-in module table, for a client that has no
/// registry of its own (`ustor rpc load`).
pub fn undo_call(c: &ustor_rpc::ConfigCall) -> Option<ustor_rpc::ConfigCall> {
    let reg = Registry::new(None);
    ustor_bdev::modules::register_builtin(&reg).ok()?;
    ustor_vbdev::register(&reg).ok()?;
    ustor_rbd::register(&reg, None).ok()?;
    undo_in(&reg, c)
}

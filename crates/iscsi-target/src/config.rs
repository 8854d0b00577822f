//! Control-plane objects with SPDK's RPC parameter names: portal groups,
//! initiator groups, auth groups, target nodes and their LUNs. Plain serde
//! types; [`crate::target`] owns the live objects built from them.

use serde::{Deserialize, Serialize};

use crate::login::Secret;

/// IQN prefix SPDK adds to node names that are not full iSCSI names.
pub const NODE_BASE: &str = "iqn.2016-06.io.spdk";

/// One listen address of a portal group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Portal {
    pub host: String,
    pub port: String,
}

/// `iscsi_create_portal_group`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortalGroupParams {
    pub tag: u32,
    pub portals: Vec<Portal>,
    #[serde(default)]
    pub private: bool,
    #[serde(default)]
    pub wait: bool,
}

/// `iscsi_create_initiator_group`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitiatorGroupParams {
    pub tag: u32,
    pub initiators: Vec<String>,
    #[serde(default)]
    pub netmasks: Vec<String>,
}

/// `iscsi_create_auth_group`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthGroupParams {
    pub tag: u32,
    #[serde(default)]
    pub secrets: Vec<Secret>,
}

/// One portal group to initiator group mapping of a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PgIgMap {
    pub pg_tag: u32,
    pub ig_tag: u32,
}

/// One LUN of a node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeLun {
    pub bdev_name: String,
    pub lun_id: u64,
}

fn default_queue_depth() -> u32 {
    64
}

/// `iscsi_create_target_node`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetNodeParams {
    pub name: String,
    #[serde(default)]
    pub alias_name: String,
    pub pg_ig_maps: Vec<PgIgMap>,
    pub luns: Vec<NodeLun>,
    #[serde(default = "default_queue_depth")]
    pub queue_depth: u32,
    #[serde(default)]
    pub disable_chap: bool,
    #[serde(default)]
    pub require_chap: bool,
    #[serde(default)]
    pub mutual_chap: bool,
    #[serde(default)]
    pub chap_group: u32,
    #[serde(default)]
    pub header_digest: bool,
    #[serde(default)]
    pub data_digest: bool,
}

impl TargetNodeParams {
    /// The node's full iSCSI name (SPDK's rule: a bare name gets the base).
    pub fn full_name(&self) -> String {
        full_name(&self.name)
    }
}

/// `name` as a full iSCSI name.
pub fn full_name(name: &str) -> String {
    if name.starts_with("iqn.") || name.starts_with("eui.") || name.starts_with("naa.") {
        name.to_string()
    } else {
        format!("{NODE_BASE}:{name}")
    }
}

/// `iscsi_target_node_add_lun`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddLunParams {
    pub name: String,
    pub bdev_name: String,
    #[serde(default)]
    pub lun_id: Option<u64>,
}

/// Parameters naming an object by tag (`iscsi_delete_portal_group` etc.).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TagParams {
    pub tag: u32,
}

/// `iscsi_delete_target_node`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeNameParams {
    pub target_node_name: String,
}

/// A node as `iscsi_get_target_nodes` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub name: String,
    pub alias_name: String,
    pub pg_ig_maps: Vec<PgIgMap>,
    pub luns: Vec<NodeLun>,
    pub queue_depth: u32,
    pub disable_chap: bool,
    pub require_chap: bool,
    pub mutual_chap: bool,
    pub chap_group: u32,
    pub header_digest: bool,
    pub data_digest: bool,
}

//! The initiator's configuration: what to connect to and how, with the
//! defaults the JSON-RPC parameters fall back to.

use crate::chap::ChapSecret;

/// What to connect to and how.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct IscsiConfig {
    /// `host:port` of the portal.
    pub portal: String,
    /// Target IQN; `None` = the first one SendTargets lists.
    #[serde(default)]
    pub target: Option<String>,
    #[serde(default = "default_initiator")]
    pub initiator: String,
    #[serde(default = "default_queue")]
    pub queue_depth: u32,
    /// CHAP: our name and secret (the target checks us).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chap_user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chap_secret: Option<String>,
    /// Mutual CHAP: the target's name and secret (we check the target).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mutual_chap_user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mutual_chap_secret: Option<String>,
    /// Offer CRC32C header / data digests.
    #[serde(default)]
    pub header_digest: bool,
    #[serde(default)]
    pub data_digest: bool,
    /// Offer ImmediateData=Yes and InitialR2T=No (fewer round trips for
    /// writes); the target's answer decides.
    #[serde(default = "yes")]
    pub immediate_data: bool,
    #[serde(default)]
    pub initial_r2t: bool,
    #[serde(default = "default_first_burst")]
    pub first_burst_length: u32,
    #[serde(default = "default_max_burst")]
    pub max_burst_length: u32,
    /// Idle time before a NOP-Out ping, ms (0 = no pings).
    #[serde(default = "default_nop_ms")]
    pub nop_interval_ms: u64,
    /// Time a ping may go unanswered before the connection counts as
    /// failed, ms.
    #[serde(default = "default_nop_ms")]
    pub nop_timeout_ms: u64,
    /// Bound on one login (a target that accepts and then stalls).
    #[serde(default = "default_login_ms")]
    pub login_timeout_ms: u64,
}

fn default_initiator() -> String {
    "iqn.2024-01.io.ustor:initiator".into()
}
fn default_queue() -> u32 {
    64
}
fn yes() -> bool {
    true
}
fn default_first_burst() -> u32 {
    65536
}
fn default_max_burst() -> u32 {
    262_144
}
fn default_nop_ms() -> u64 {
    5000
}
fn default_login_ms() -> u64 {
    5000
}

impl IscsiConfig {
    /// A config with every option at its default.
    pub fn new(portal: impl Into<String>, target: Option<String>) -> IscsiConfig {
        IscsiConfig {
            portal: portal.into(),
            target,
            initiator: default_initiator(),
            queue_depth: default_queue(),
            chap_user: None,
            chap_secret: None,
            mutual_chap_user: None,
            mutual_chap_secret: None,
            header_digest: false,
            data_digest: false,
            immediate_data: true,
            initial_r2t: false,
            first_burst_length: default_first_burst(),
            max_burst_length: default_max_burst(),
            nop_interval_ms: default_nop_ms(),
            nop_timeout_ms: default_nop_ms(),
            login_timeout_ms: default_login_ms(),
        }
    }

    pub(super) fn secret(user: &Option<String>, secret: &Option<String>) -> Option<ChapSecret> {
        Some(ChapSecret {
            user: user.clone()?,
            secret: secret.clone()?,
        })
    }
}

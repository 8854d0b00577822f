//! The target-wide options of `iscsi_set_options` / `iscsi_get_options`
//! with SPDK's names. First burst length, immediate data and the
//! connections per session feed the operational-key offer of every login
//! from then on, the NOP-In interval and timeout the pings of sessions
//! logging in from then on, allow_duplicated_isid turns session
//! reinstatement off, max_sessions caps each target node's normal
//! sessions (SPDK's caps every session of the target); the others
//! are kept and reported so that SPDK's tools see the fields they expect.

use serde::{Deserialize, Serialize};

use crate::config::NODE_BASE;

/// SPDK's iSCSI global options (fields not given take their defaults).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IscsiOptions {
    pub node_base: String,
    pub nop_timeout: u32,
    pub nop_in_interval: u32,
    pub disable_chap: bool,
    pub require_chap: bool,
    pub mutual_chap: bool,
    pub chap_group: u32,
    pub max_sessions: u32,
    pub max_connections_per_session: u32,
    pub max_queue_depth: u32,
    pub default_time2wait: u32,
    pub default_time2retain: u32,
    pub first_burst_length: u32,
    pub immediate_data: bool,
    pub allow_duplicated_isid: bool,
    pub error_recovery_level: u32,
    pub max_large_datain_per_connection: u32,
    pub max_r2t_per_connection: u32,
    pub pdu_pool_size: u32,
    pub immediate_data_pool_size: u32,
    pub data_out_pool_size: u32,
    /// ustor extension: the physical block size LUNs report (READ
    /// CAPACITY(16) LBPPBE) when their blocks are smaller; 0 = each
    /// LUN's own block size. 4 KiB by default: hosts then align to the
    /// page size the bdevs' buffers work in.
    pub physical_block_size: u32,
}

impl Default for IscsiOptions {
    fn default() -> IscsiOptions {
        IscsiOptions {
            node_base: NODE_BASE.to_string(),
            nop_timeout: 60,
            nop_in_interval: 30,
            disable_chap: false,
            require_chap: false,
            mutual_chap: false,
            chap_group: 0,
            max_sessions: 128,
            max_connections_per_session: 2,
            max_queue_depth: 64,
            default_time2wait: 2,
            default_time2retain: 20,
            // The target's own offer (SPDK's default is 8192).
            first_burst_length: 64 << 10,
            immediate_data: true,
            allow_duplicated_isid: false,
            error_recovery_level: 0,
            max_large_datain_per_connection: 64,
            max_r2t_per_connection: 4,
            pdu_pool_size: 36864,
            immediate_data_pool_size: 16384,
            data_out_pool_size: 2048,
            physical_block_size: 4096,
        }
    }
}

/// Longest NOP-In interval in seconds (SPDK's cap; 0 = no pings).
const MAX_NOP_IN_INTERVAL: u32 = 60;

/// Smallest and largest FirstBurstLength (RFC 7143 §13.14, SPDK's cap).
const FIRST_BURST: std::ops::RangeInclusive<u32> = 512..=(16 << 20);

impl IscsiOptions {
    /// SPDK's checks: why these options cannot be set, if they cannot.
    pub fn check(&self) -> Result<(), String> {
        if !FIRST_BURST.contains(&self.first_burst_length) {
            return Err(format!(
                "first_burst_length {} not in 512..=16MiB",
                self.first_burst_length
            ));
        }
        let pbs = self.physical_block_size;
        if pbs != 0 && (!pbs.is_power_of_two() || !(512..=65536).contains(&pbs)) {
            return Err(format!(
                "physical_block_size {pbs} is not 0 or a power of two in 512..=65536"
            ));
        }
        if self.nop_in_interval > MAX_NOP_IN_INTERVAL {
            return Err(format!(
                "nop_in_interval {} over {MAX_NOP_IN_INTERVAL}",
                self.nop_in_interval
            ));
        }
        if self.error_recovery_level > 2 {
            return Err(format!(
                "error_recovery_level {} over 2",
                self.error_recovery_level
            ));
        }
        if self.disable_chap && (self.require_chap || self.mutual_chap) {
            return Err("disable_chap with require_chap or mutual_chap".into());
        }
        if self.mutual_chap && !self.require_chap {
            return Err("mutual_chap without require_chap".into());
        }
        let zero = [
            ("max_sessions", self.max_sessions),
            (
                "max_connections_per_session",
                self.max_connections_per_session,
            ),
            ("max_queue_depth", self.max_queue_depth),
            ("max_r2t_per_connection", self.max_r2t_per_connection),
        ];
        match zero.iter().find(|(_, v)| *v == 0) {
            Some((name, _)) => Err(format!("{name} must be at least 1")),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_pass_and_bad_values_fail() {
        assert_eq!(IscsiOptions::default().check(), Ok(()));
        let o: IscsiOptions = serde_json::from_str(r#"{"first_burst_length": 100}"#).unwrap();
        assert!(o.check().is_err());
        let o: IscsiOptions = serde_json::from_str(r#"{"mutual_chap": true}"#).unwrap();
        assert!(o.check().is_err());
        assert!(serde_json::from_str::<IscsiOptions>(r#"{"nope": 1}"#).is_err());
        for bad in [100, 256, 3072, 1 << 17] {
            let o = IscsiOptions {
                physical_block_size: bad,
                ..IscsiOptions::default()
            };
            assert!(o.check().is_err(), "{bad}");
        }
        for good in [0, 512, 4096, 65536] {
            let o = IscsiOptions {
                physical_block_size: good,
                ..IscsiOptions::default()
            };
            assert_eq!(o.check(), Ok(()), "{good}");
        }
    }
}

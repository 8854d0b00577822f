//! Runtime configuration: which cores, how reactors wait, how big the rings
//! and buffer pools are.

use std::time::Duration;

use crate::buf::BufPoolConfig;

/// A `--poll-mode`, `--cores` or `--cpumask` value that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("unknown poll mode `{0}` (poll, interrupt, adaptive)")]
    PollMode(String),
    #[error("bad cpumask `{spec}`: {why}")]
    CpuMask { spec: String, why: String },
    #[error("bad core range `{0}`")]
    CoreRange(String),
    #[error("bad core `{0}`")]
    Core(String),
    #[error("no cores selected by `{0}`")]
    NoCores(String),
}

/// Command lines that report configuration errors as text keep doing so
/// with `?`.
impl From<ConfigError> for String {
    fn from(e: ConfigError) -> String {
        e.to_string()
    }
}

/// How a reactor waits when it has nothing to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollMode {
    /// Busy-poll forever (lowest latency, a core burnt at idle).
    Poll,
    /// Block in `io_uring_enter` as soon as a loop pass finds no work.
    Interrupt,
    /// Busy-poll while pollers report work; block after an idle spin that
    /// adapts between 50 µs and `idle_period` (see `spin.rs`).
    Adaptive,
}

impl std::str::FromStr for PollMode {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "poll" => Ok(PollMode::Poll),
            "interrupt" => Ok(PollMode::Interrupt),
            "adaptive" => Ok(PollMode::Adaptive),
            _ => Err(ConfigError::PollMode(s.to_string())),
        }
    }
}

impl std::fmt::Display for PollMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PollMode::Poll => "poll",
            PollMode::Interrupt => "interrupt",
            PollMode::Adaptive => "adaptive",
        })
    }
}

/// Everything a [`crate::Runtime`] needs to start.
#[derive(Clone, Debug)]
pub struct RuntimeConfig {
    /// CPU cores, one reactor each (reactor i runs on `cores[i]`).
    pub cores: Vec<usize>,
    /// Pin each reactor thread to its core.
    pub pin: bool,
    pub poll_mode: PollMode,
    /// Adaptive mode: the longest a reactor busy-polls without work before
    /// it sleeps (the spin shrinks when spinning does not pay).
    pub idle_period: Duration,
    /// Submission queue entries of each reactor's ring (completion queue is 2x).
    pub ring_entries: u32,
    /// In-flight io_uring operations per reactor that futures may hold.
    pub max_ops: u32,
    /// Capacity of each reactor's inbox.
    pub inbox_capacity: usize,
    /// Most tasks alive on one reactor.
    pub max_tasks: u32,
    pub bufs: BufPoolConfig,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            cores: vec![0],
            pin: true,
            poll_mode: PollMode::Adaptive,
            idle_period: Duration::from_millis(1),
            ring_entries: 1024,
            max_ops: 4096,
            inbox_capacity: 4096,
            max_tasks: 16384,
            bufs: BufPoolConfig::default(),
        }
    }
}

/// Parses `--cpumask 0x3` (hex mask) or `--cores 0,1,4-6` into core numbers.
pub fn parse_cores(spec: &str) -> Result<Vec<usize>, ConfigError> {
    let spec = spec.trim();
    let mut cores = Vec::new();
    if let Some(hex) = spec.strip_prefix("0x").or_else(|| spec.strip_prefix("0X")) {
        let mask = u128::from_str_radix(hex, 16).map_err(|e| ConfigError::CpuMask {
            spec: spec.to_string(),
            why: e.to_string(),
        })?;
        for bit in 0..128 {
            if mask & (1u128 << bit) != 0 {
                cores.push(bit);
            }
        }
    } else {
        for part in spec.split(',').filter(|p| !p.is_empty()) {
            if let Some((a, b)) = part.split_once('-') {
                let range = || ConfigError::CoreRange(part.to_string());
                let a: usize = a.trim().parse().map_err(|_| range())?;
                let b: usize = b.trim().parse().map_err(|_| range())?;
                if a > b {
                    return Err(range());
                }
                cores.extend(a..=b);
            } else {
                cores.push(
                    part.trim()
                        .parse()
                        .map_err(|_| ConfigError::Core(part.to_string()))?,
                );
            }
        }
    }
    cores.sort_unstable();
    cores.dedup();
    if cores.is_empty() {
        return Err(ConfigError::NoCores(spec.to_string()));
    }
    Ok(cores)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_and_lists() {
        assert_eq!(parse_cores("0x3").unwrap(), vec![0, 1]);
        assert_eq!(parse_cores("0x5").unwrap(), vec![0, 2]);
        assert_eq!(parse_cores("0,1").unwrap(), vec![0, 1]);
        assert_eq!(parse_cores("3-5,1").unwrap(), vec![1, 3, 4, 5]);
        assert!(parse_cores("0x0").is_err());
        assert!(parse_cores("zz").is_err());
        assert!(parse_cores("5-3").is_err());
        assert_eq!(
            parse_cores("5-3").unwrap_err(),
            ConfigError::CoreRange("5-3".into())
        );
        assert_eq!(
            "spin".parse::<PollMode>().unwrap_err().to_string(),
            "unknown poll mode `spin` (poll, interrupt, adaptive)"
        );
    }
}

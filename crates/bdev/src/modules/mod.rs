//! Bdev drivers: `null` (completes at once: the pure stack cost), `malloc`
//! (RAM), `uring` (files and block devices through io_uring), each with its
//! [`crate::BdevModule`] for the registry's module table.

mod lazy_mem;
pub mod malloc;
pub mod null;
pub mod uring;

use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use crate::error::ControlError;
use crate::registry::{BdevEntry, Registry};
use crate::BdevModule;

/// Registers ustor's own modules (malloc, null, uring) in `reg`'s table.
pub fn register_builtin(reg: &Registry) -> Result<(), ControlError> {
    reg.add_module(Arc::new(malloc::module()))?;
    reg.add_module(Arc::new(null::module()))?;
    reg.add_module(Arc::new(uring::UringModule))
}

/// A module whose bdevs are RAM-shaped (malloc, null): SPDK's
/// `bdev_<name>_create` params ([`RamParams`]) and a `<name>:SIZE` inline
/// spec; only the driver's create function differs.
pub struct RamModule {
    pub(crate) name: &'static str,
    /// Default name stem (`Malloc` -> `Malloc0`, `Malloc1`, ...).
    pub(crate) prefix: &'static str,
    pub(crate) spec: &'static str,
    pub(crate) make: fn(&Registry, RamOpts) -> Result<Arc<BdevEntry>, ControlError>,
    /// What the inline spec (`ustor bench`) and `prefault: true` create with.
    pub(crate) make_inline: fn(&Registry, RamOpts) -> Result<Arc<BdevEntry>, ControlError>,
}

impl BdevModule for RamModule {
    fn name(&self) -> &'static str {
        self.name
    }
    fn create(&self, reg: &Registry, params: Value) -> Result<Arc<BdevEntry>, ControlError> {
        let p: RamParams = parse_params(params)?;
        let make = if p.prefault {
            self.make_inline
        } else {
            self.make
        };
        make(reg, p.into_opts(reg, self.prefix)?)
    }
    fn inline_spec_syntax(&self) -> Option<&'static str> {
        Some(self.spec)
    }
    fn inline_spec(
        &self,
        reg: &Registry,
        arg: &str,
        block_size: u32,
    ) -> Result<Arc<BdevEntry>, ControlError> {
        let name = format!("{}0", self.prefix);
        ram_spec(&name, self.name, arg, block_size).and_then(|o| (self.make_inline)(reg, o))
    }
}

/// Decodes a module's create parameters (`null` is `{}`: SPDK's client
/// omits empty params); a failure names the field.
pub fn parse_params<T: DeserializeOwned>(params: Value) -> Result<T, ControlError> {
    let params = match params {
        Value::Null => Value::Object(Default::default()),
        p => p,
    };
    serde_path_to_error::deserialize::<_, T>(params).map_err(|e| ControlError::Params {
        path: e.path().to_string(),
        msg: e.into_inner().to_string(),
    })
}

/// `bdev_malloc_create` / `bdev_null_create` as SPDK's client sends them.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RamParams {
    name: Option<String>,
    num_blocks: u64,
    block_size: u32,
    uuid: Option<uuid::Uuid>,
    #[serde(default)]
    optimal_io_boundary: u32,
    /// Accepted when equal to block_size (no separate physical size here).
    physical_block_size: Option<u32>,
    /// Metadata is not supported: only absent or 0 is accepted.
    #[serde(default)]
    md_size: u32,
    #[serde(default)]
    md_interleave: bool,
    #[serde(default)]
    dif_type: u32,
    #[serde(default)]
    dif_is_head_of_md: bool,
    #[serde(default)]
    dif_pi_format: u32,
    /// NUMA placement is the kernel's business here (no hugepages).
    #[allow(dead_code)]
    numa_id: Option<i32>,
    #[serde(default)]
    max_transfer_blocks: u32,
    /// ustor extension: fault the whole disk in at creation, with huge
    /// pages, as SPDK's hugepage malloc disk is (what `ustor bench`'s
    /// `malloc:SIZE` does); by default memory is faulted in by first writes.
    #[serde(default)]
    prefault: bool,
}

impl RamParams {
    /// The options, checked; a missing name becomes the first free
    /// `{prefix}{i}` (SPDK's `Malloc0`, `Null0`).
    pub fn into_opts(self, reg: &Registry, prefix: &str) -> Result<RamOpts, ControlError> {
        if self.md_size != 0
            || self.dif_type != 0
            || self.dif_pi_format != 0
            || self.md_interleave
            || self.dif_is_head_of_md
        {
            return Err(ControlError::invalid(
                "md_size",
                "metadata and DIF are not supported",
            ));
        }
        if let Some(pbs) = self.physical_block_size {
            if pbs != self.block_size && pbs != 0 {
                return Err(ControlError::invalid(
                    "physical_block_size",
                    "must equal block_size",
                ));
            }
        }
        let name = match self.name {
            Some(n) => n,
            None => (0..)
                .map(|i| format!("{prefix}{i}"))
                .find(|n| reg.get(n).is_none())
                .unwrap_or_default(),
        };
        Ok(RamOpts {
            name,
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            uuid: self.uuid,
            optimal_io_boundary: self.optimal_io_boundary,
            max_transfer_blocks: self.max_transfer_blocks,
        })
    }
}

/// `malloc:256M` / `null:1G` for `ustor bench`: a RAM bdev `name` of that
/// many bytes in blocks of `block_size`.
pub(crate) fn ram_spec(
    name: &str,
    what: &str,
    arg: &str,
    block_size: u32,
) -> Result<RamOpts, ControlError> {
    let bytes = crate::parse_size(arg)
        .filter(|s| *s > 0)
        .ok_or_else(|| ControlError::invalid("bdev", format!("bad {what} size `{arg}`")))?;
    Ok(RamOpts {
        name: name.into(),
        num_blocks: bytes / block_size as u64,
        block_size,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    })
}

/// Common create parameters (SPDK's names).
#[derive(Clone, Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RamOpts {
    pub name: String,
    pub num_blocks: u64,
    pub block_size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<uuid::Uuid>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub optimal_io_boundary: u32,
    /// ustor extension: largest I/O in blocks the device takes (0 = any);
    /// lets tests and users exercise the generic layer's splitting.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_transfer_blocks: u32,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

pub(crate) fn check_block_size(bs: u32) -> Result<(), ControlError> {
    if bs < 512 || !bs.is_power_of_two() || bs > 65536 {
        return Err(ControlError::invalid(
            "block_size",
            format!("{bs} is not a power of two in 512..=65536"),
        ));
    }
    Ok(())
}

/// Copies between a byte range of `mem` and a list of iovecs.
///
/// # Safety
/// `mem` must be valid for `len` bytes at `off`, and the iovecs valid for
/// their lengths and not overlapping `mem`.
pub(crate) unsafe fn copy_iov(mem: *mut u8, off: usize, iov: &[libc::iovec], to_mem: bool) {
    let mut pos = off;
    for v in iov {
        let p = v.iov_base as *mut u8;
        if to_mem {
            std::ptr::copy_nonoverlapping(p, mem.add(pos), v.iov_len);
        } else {
            std::ptr::copy_nonoverlapping(mem.add(pos), p, v.iov_len);
        }
        pos += v.iov_len;
    }
}

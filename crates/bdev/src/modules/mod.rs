//! Bdev drivers: `null` (completes at once: the pure stack cost), `malloc`
//! (RAM), `uring` (files and block devices through io_uring).

pub mod malloc;
pub mod null;
pub mod uring;

use serde::Deserialize;

use crate::error::ControlError;

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

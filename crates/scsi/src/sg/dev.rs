//! One /dev/sgN node: opening it for the asynchronous v3 interface, its
//! limits (SG_GET_RESERVED_SIZE, SG_GET_SG_TABLESIZE, the request queue's
//! max_sectors_kb in sysfs), its kernel address (SG_GET_SCSI_ID), resets
//! (SG_SCSI_RESET) and the non-blocking `read()` of one reply. The
//! syscalls live here, each behind a small safe function.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::hdr::{self, SgIoHdr, SgScsiId, SG_IO_HDR_LEN};

/// What the kernel says about one sg node.
#[derive(Clone, Debug, Serialize)]
pub struct SgFacts {
    pub path: PathBuf,
    /// sg driver version (30536 = 3.5.36).
    pub version: i32,
    pub reserved_size: i32,
    /// Scatter-gather entries of the kernel host adapter.
    pub sg_tablesize: i32,
    /// The request queue's max_sectors_kb (0 = unknown: no block device).
    pub max_sectors_kb: u32,
    /// Kernel H:C:T:L.
    pub kernel_hctl: String,
    pub scsi_type: i32,
}

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// An `int` ioctl: `arg` in, `arg` out.
fn ioctl_int(fd: RawFd, req: libc::c_ulong, arg: &mut i32) -> Result<(), i32> {
    // SAFETY: every sg ioctl used here takes a pointer to one int, which
    // `arg` is for the duration of the call.
    let r = unsafe { libc::ioctl(fd, req as _, arg as *mut i32) };
    if r < 0 {
        Err(errno())
    } else {
        Ok(())
    }
}

/// Opens `path` read-write, non-blocking (a `read()` with nothing ready
/// returns EAGAIN), with command queuing on.
pub fn open(path: &Path) -> Result<(OwnedFd, SgFacts), i32> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| libc::EINVAL)?;
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    let raw = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    if raw < 0 {
        return Err(errno());
    }
    // SAFETY: `raw` is a file descriptor we just opened and own alone.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut version = 0;
    // Not an sg node (or a pre-v3 driver) when this fails.
    ioctl_int(fd.as_raw_fd(), hdr::SG_GET_VERSION_NUM, &mut version).map_err(|_| libc::ENOTTY)?;
    if version < 30000 {
        return Err(libc::ENOTTY);
    }
    let mut one = 1;
    ioctl_int(fd.as_raw_fd(), hdr::SG_SET_COMMAND_Q, &mut one)?;
    let mut reserved = 0;
    ioctl_int(fd.as_raw_fd(), hdr::SG_GET_RESERVED_SIZE, &mut reserved)?;
    let mut table = 0;
    ioctl_int(fd.as_raw_fd(), hdr::SG_GET_SG_TABLESIZE, &mut table)?;
    let mut id = SgScsiId::default();
    // SAFETY: SG_GET_SCSI_ID writes one `struct sg_scsi_id`, which `id` is.
    let r = unsafe {
        libc::ioctl(
            fd.as_raw_fd(),
            hdr::SG_GET_SCSI_ID as _,
            &mut id as *mut SgScsiId,
        )
    };
    if r < 0 {
        return Err(errno());
    }
    let facts = SgFacts {
        path: path.to_path_buf(),
        version,
        reserved_size: reserved,
        sg_tablesize: table,
        max_sectors_kb: max_sectors_kb(path),
        kernel_hctl: format!("{}:{}:{}:{}", id.host_no, id.channel, id.scsi_id, id.lun),
        scsi_type: id.scsi_type,
    };
    Ok((fd, facts))
}

/// `/sys/class/scsi_generic/sgN/device/block/*/queue/max_sectors_kb`.
fn max_sectors_kb(path: &Path) -> u32 {
    let Some(name) = path.file_name() else {
        return 0;
    };
    let dir = Path::new("/sys/class/scsi_generic")
        .join(name)
        .join("device/block");
    let Ok(mut entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .next()
        .and_then(|e| e.ok())
        .and_then(|e| std::fs::read_to_string(e.path().join("queue/max_sectors_kb")).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Every /dev/sgN, in numeric order.
pub fn scan_all() -> Vec<PathBuf> {
    let mut v: Vec<(u32, PathBuf)> = std::fs::read_dir("/dev")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_str()?.strip_prefix("sg")?.parse().ok()?;
            Some((n, e.path()))
        })
        .collect();
    v.sort();
    v.into_iter().map(|(_, p)| p).collect()
}

/// SG_SCSI_RESET with `what` (`SG_SCSI_RESET_DEVICE`, `_BUS`, `_HOST`).
/// Blocks until the kernel's error handler is done: call it off-reactor.
pub fn reset(fd: RawFd, what: i32) -> Result<(), i32> {
    let mut w = what;
    ioctl_int(fd, hdr::SG_SCSI_RESET, &mut w)
}

/// One finished command's reply header into `out`; `Ok(false)` when none
/// is ready. The kernel copies data-in and sense to the buffers named at
/// `write()` time during this call.
pub fn read_reply(fd: RawFd, out: &mut SgIoHdr) -> Result<bool, i32> {
    // SAFETY: `out` is a valid, exclusively borrowed sg_io_hdr of exactly
    // SG_IO_HDR_LEN bytes; the buffers its reply names (data, sense) were
    // given at write() time and are kept alive by the mid-layer until this
    // command is reported.
    let n = unsafe { libc::read(fd, (out as *mut SgIoHdr).cast(), SG_IO_HDR_LEN) };
    if n == SG_IO_HDR_LEN as isize {
        return Ok(true);
    }
    match errno() {
        _ if n >= 0 => Err(libc::EIO),
        libc::EAGAIN => Ok(false),
        e => Err(e),
    }
}

/// Sets the reserved buffer (best effort: the kernel may give less).
pub fn set_reserved(fd: RawFd, bytes: i32) {
    let mut b = bytes;
    let _ = ioctl_int(fd, hdr::SG_SET_RESERVED_SIZE, &mut b);
}

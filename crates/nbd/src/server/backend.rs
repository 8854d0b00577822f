//! The storage seam of the server: what a connection needs from the device
//! behind an export, on the connection's own reactor.
//!
//! [`ExportSource`] is the `Send + Sync` side the control plane holds (one
//! per export); each connection asks it for a [`Channel`] on its reactor and
//! keeps that channel for life, so nothing on the I/O path is shared between
//! reactors. The bdev layer implements both; [`MemSource`] is a plain
//! in-memory device for tests of the protocol path.

use std::cell::RefCell;
use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;

use ustor_runtime::IoBuf;

use crate::export::{BlockSizes, ExportFeatures};
use crate::wire::{BlockDescriptor, NbdErrno};

/// Result of a data operation that hands its buffer back.
pub type BufResult = (Result<(), NbdErrno>, IoBuf);

/// Per-reactor I/O channel to an export's device. Offsets and lengths are in
/// bytes, already validated against the export (in range, aligned to the
/// advertised minimum block size).
pub trait Channel: 'static {
    /// Fills `buf` (its `len()` bytes) from `offset`.
    fn read(&self, offset: u64, buf: IoBuf) -> impl Future<Output = BufResult>;
    /// Writes `buf` at `offset`; durable before completion when `fua`.
    fn write(&self, offset: u64, buf: IoBuf, fua: bool) -> impl Future<Output = BufResult>;
    fn flush(&self) -> impl Future<Output = Result<(), NbdErrno>>;
    fn trim(&self, offset: u64, len: u64) -> impl Future<Output = Result<(), NbdErrno>>;
    /// Zeroes the range; `no_hole` asks for it to stay allocated.
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        no_hole: bool,
    ) -> impl Future<Output = Result<(), NbdErrno>>;
    /// Allocation status from `offset` (`base:allocation` flags); fills `out`
    /// and returns how many extents it wrote (at least one). The default says
    /// "allocated, contents unknown" for the whole range, which is always
    /// correct.
    fn block_status(&self, _offset: u64, len: u32, out: &mut [BlockDescriptor]) -> usize {
        if let Some(first) = out.first_mut() {
            *first = BlockDescriptor {
                length: len,
                flags: 0,
            };
        }
        1
    }
}

/// What the server holds for one export, shared across reactors.
pub trait ExportSource: Send + Sync + 'static {
    type Channel: Channel;
    fn size_bytes(&self) -> u64;
    fn block_sizes(&self) -> BlockSizes;
    fn features(&self) -> ExportFeatures;
    /// Opens this reactor's channel (called on the connection's reactor).
    fn channel(&self) -> Result<Self::Channel, NbdErrno>;
}

/// A RAM-backed device: a test fixture for the protocol path, shared by all
/// reactors through one mutex (fine for tests, never for production I/O).
pub struct MemSource {
    data: Arc<std::sync::Mutex<Vec<u8>>>,
    block_size: u32,
}

impl MemSource {
    pub fn new(size_bytes: usize, block_size: u32) -> Self {
        Self {
            data: Arc::new(std::sync::Mutex::new(vec![0; size_bytes])),
            block_size,
        }
    }
}

/// Channel of [`MemSource`].
pub struct MemChannel {
    data: Arc<std::sync::Mutex<Vec<u8>>>,
    // Keeps the channel !Send like a real per-reactor channel.
    _reactor_local: Rc<RefCell<()>>,
}

impl MemChannel {
    fn with<R>(&self, f: impl FnOnce(&mut Vec<u8>) -> R) -> Result<R, NbdErrno> {
        let mut guard = self.data.lock().map_err(|_| NbdErrno::Io)?;
        Ok(f(&mut guard))
    }

    fn range(&self, offset: u64, len: u64) -> Result<std::ops::Range<usize>, NbdErrno> {
        let start = usize::try_from(offset).map_err(|_| NbdErrno::Inval)?;
        let end = usize::try_from(offset + len).map_err(|_| NbdErrno::Inval)?;
        Ok(start..end)
    }
}

impl Channel for MemChannel {
    async fn read(&self, offset: u64, mut buf: IoBuf) -> BufResult {
        let r = self.range(offset, buf.len() as u64).and_then(|r| {
            self.with(|d| {
                d.get(r)
                    .map(|src| buf.copy_from_slice(src))
                    .ok_or(NbdErrno::Inval)
            })?
        });
        (r, buf)
    }

    async fn write(&self, offset: u64, buf: IoBuf, _fua: bool) -> BufResult {
        let r = self.range(offset, buf.len() as u64).and_then(|r| {
            self.with(|d| {
                d.get_mut(r)
                    .map(|dst| dst.copy_from_slice(&buf))
                    .ok_or(NbdErrno::NoSpc)
            })?
        });
        (r, buf)
    }

    async fn flush(&self) -> Result<(), NbdErrno> {
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u64) -> Result<(), NbdErrno> {
        self.write_zeroes(offset, len, false).await
    }

    async fn write_zeroes(&self, offset: u64, len: u64, _no_hole: bool) -> Result<(), NbdErrno> {
        let r = self.range(offset, len)?;
        self.with(|d| d.get_mut(r).map(|dst| dst.fill(0)).ok_or(NbdErrno::NoSpc))?
    }
}

impl ExportSource for MemSource {
    type Channel = MemChannel;

    fn size_bytes(&self) -> u64 {
        self.data.lock().map(|d| d.len() as u64).unwrap_or(0)
    }

    fn block_sizes(&self) -> BlockSizes {
        BlockSizes {
            min: self.block_size,
            preferred: 4096.max(self.block_size),
            max_payload: 32 << 20,
        }
    }

    fn features(&self) -> ExportFeatures {
        ExportFeatures {
            can_flush: true,
            can_trim: true,
            can_write_zeroes: true,
            fast_zero: true,
            can_cache: true,
            multi_conn: true,
            has_allocation_map: true,
            ..Default::default()
        }
    }

    fn channel(&self) -> Result<MemChannel, NbdErrno> {
        Ok(MemChannel {
            data: self.data.clone(),
            _reactor_local: Rc::new(RefCell::new(())),
        })
    }
}

//! Plain descriptions of a bdev and of I/O kinds.

use serde::Serialize;

/// Kinds of bdev I/O (SPDK's `spdk_bdev_io_type` subset).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IoType {
    Read,
    Write,
    Flush,
    Unmap,
    WriteZeroes,
    Reset,
}

impl IoType {
    pub const ALL: [IoType; 6] = [
        IoType::Read,
        IoType::Write,
        IoType::Flush,
        IoType::Unmap,
        IoType::WriteZeroes,
        IoType::Reset,
    ];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            IoType::Read => "read",
            IoType::Write => "write",
            IoType::Flush => "flush",
            IoType::Unmap => "unmap",
            IoType::WriteZeroes => "write_zeroes",
            IoType::Reset => "reset",
        }
    }

    /// Whether the I/O carries a data payload.
    pub fn has_data(self) -> bool {
        matches!(self, IoType::Read | IoType::Write)
    }
}

/// What a driver says about a device; fixed for the device's life.
#[derive(Clone, Debug, Serialize)]
pub struct BdevInfo {
    pub name: String,
    pub uuid: uuid::Uuid,
    pub product_name: String,
    pub module: &'static str,
    pub block_size: u32,
    pub num_blocks: u64,
    /// Buffer address and length alignment the driver needs (1 = none).
    pub required_alignment: u32,
    /// Largest I/O the driver takes, in blocks (0 = no limit).
    pub max_transfer_blocks: u32,
    /// I/O must not cross multiples of this many blocks (0 = none).
    pub optimal_boundary_blocks: u32,
    pub write_cache: bool,
    /// Unmapped (deallocated) blocks read back as zeroes: what a target may
    /// promise its hosts (NVMe DLFEAT, SCSI LBPRZ).
    pub unmap_reads_zero: bool,
    /// All data is in memory: a read-ahead hint (NBD_CMD_CACHE) has
    /// nothing to do.
    pub memory_resident: bool,
}

impl BdevInfo {
    pub fn size_bytes(&self) -> u64 {
        self.num_blocks * self.block_size as u64
    }
}

/// Events sent to the openers of a bdev.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BdevEvent {
    /// The bdev is going away; outstanding I/O fails with `Removed`.
    Remove,
    /// The bdev's size changed (`Desc::num_blocks` has the new one).
    Resize,
}

/// Per-I/O flags a submitter sets (SPDK's `spdk_bdev_io` write flags).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct IoFlags(u8);

impl IoFlags {
    pub const NONE: IoFlags = IoFlags(0);
    /// Force Unit Access: the written data is durable (not only in a
    /// volatile cache) when the I/O completes.
    pub const FUA: IoFlags = IoFlags(1);

    /// [`IoFlags::FUA`] when `fua`, else none: what a target decodes from a
    /// command bit (NBD `NBD_CMD_FLAG_FUA`, NVMe CDW12 bit 30, SCSI FUA).
    #[inline]
    pub const fn fua_if(fua: bool) -> IoFlags {
        IoFlags(fua as u8)
    }

    #[inline]
    pub const fn fua(self) -> bool {
        self.0 & IoFlags::FUA.0 != 0
    }
}

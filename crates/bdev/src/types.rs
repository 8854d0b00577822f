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
    /// Compare the range with one buffer and, only if every byte matches,
    /// write another, atomically against every other write (SPDK's
    /// `SPDK_BDEV_IO_TYPE_COMPARE_AND_WRITE`, SCSI COMPARE AND WRITE, NVMe
    /// fused Compare + Write). The I/O's bytes are the data to compare
    /// followed by the data to write, each `num_blocks` long. Only native:
    /// the generic layer cannot make it atomic for a driver, so it neither
    /// emulates nor splits it.
    CompareAndWrite,
}

impl IoType {
    pub const ALL: [IoType; 7] = [
        IoType::Read,
        IoType::Write,
        IoType::Flush,
        IoType::Unmap,
        IoType::WriteZeroes,
        IoType::Reset,
        IoType::CompareAndWrite,
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
            IoType::CompareAndWrite => "compare_and_write",
        }
    }

    /// Whether the I/O carries a data payload.
    #[inline]
    pub fn has_data(self) -> bool {
        matches!(self, IoType::Read | IoType::Write | IoType::CompareAndWrite)
    }

    /// Bytes of payload an I/O of `num_blocks` blocks of `block_size`
    /// carries: the range once for a read or write, twice for a
    /// compare-and-write (compare data, then write data), none otherwise.
    #[inline]
    pub fn payload_bytes(self, num_blocks: u64, block_size: u64) -> u64 {
        let copies = match self {
            IoType::Read | IoType::Write => 1,
            IoType::CompareAndWrite => 2,
            _ => 0,
        };
        copies * num_blocks * block_size
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

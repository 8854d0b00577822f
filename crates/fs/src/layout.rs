//! The on-region layout, in 4 KiB blocks: block 0 holds the superblock, then
//! the redo log, the block bitmap (one bit per block, set = in use), the inode
//! table (128-byte inodes) and the data blocks. All integers are
//! little-endian so a region moves between machines.

use crate::FsError;

/// Size of every block of the region.
pub const BLOCK_SIZE: usize = 4096;
/// Superblock magic: "USTORFS2" (version 2 added the log and inode table).
pub const MAGIC: u64 = u64::from_le_bytes(*b"USTORFS2");
/// Blocks of the redo log (one transaction at a time; see `tx`).
pub const LOG_BLOCKS: u64 = 8;
/// Bytes of one on-region inode.
pub const INODE_SIZE: usize = 128;
/// The root directory's inode number (0 means "no inode").
pub const ROOT_INO: u64 = 1;

/// Where each part of the layout lives, in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub blocks: u64,
    pub log_start: u64,
    pub bitmap_start: u64,
    pub bitmap_blocks: u64,
    pub inode_start: u64,
    pub inode_blocks: u64,
}

impl Geometry {
    /// The geometry of a region of `len` bytes: one inode block per 64
    /// blocks (an inode per 8 KiB of data), at least one.
    pub fn for_len(len: usize) -> Result<Self, FsError> {
        let blocks = (len / BLOCK_SIZE) as u64;
        let bitmap_blocks = blocks.div_ceil(BLOCK_SIZE as u64 * 8).max(1);
        let inode_blocks = (blocks / 64).max(1);
        let g = Self {
            blocks,
            log_start: 1,
            bitmap_start: 1 + LOG_BLOCKS,
            bitmap_blocks,
            inode_start: 1 + LOG_BLOCKS + bitmap_blocks,
            inode_blocks,
        };
        if blocks < g.data_start() + 2 {
            return Err(FsError::TooSmall(len));
        }
        Ok(g)
    }

    /// The first data block.
    pub fn data_start(&self) -> u64 {
        self.inode_start + self.inode_blocks
    }

    /// Number of inodes (inode 0 is never used).
    pub fn inodes(&self) -> u64 {
        self.inode_blocks * (BLOCK_SIZE / INODE_SIZE) as u64
    }

    /// Byte offset of inode `ino` in the region.
    pub fn inode_off(&self, ino: u64) -> usize {
        self.inode_start as usize * BLOCK_SIZE + ino as usize * INODE_SIZE
    }

    /// Byte offset of the bitmap byte holding block `blk`'s bit.
    pub fn bit_off(&self, blk: u64) -> usize {
        self.bitmap_start as usize * BLOCK_SIZE + (blk / 8) as usize
    }
}

pub(crate) fn read_u64(region: &[u8], off: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&region[off..off + 8]);
    u64::from_le_bytes(b)
}

pub(crate) fn bit(region: &[u8], g: &Geometry, blk: u64) -> bool {
    region[g.bit_off(blk)] & (1 << (blk % 8)) != 0
}

pub(crate) fn set_bit(region: &mut [u8], g: &Geometry, blk: u64, on: bool) {
    let m = 1u8 << (blk % 8);
    let b = &mut region[g.bit_off(blk)];
    *b = if on { *b | m } else { *b & !m };
}

/// Formats `region`: superblock, an empty log, a bitmap with the metadata
/// blocks marked in use, a cleared inode table holding only the root
/// directory.
pub fn format(region: &mut [u8]) -> Result<Geometry, FsError> {
    let g = Geometry::for_len(region.len())?;
    let meta_end = g.data_start() as usize * BLOCK_SIZE;
    region[..meta_end].fill(0);
    for blk in 0..g.data_start() {
        set_bit(region, &g, blk, true);
    }
    let root = crate::inode::Inode::new(crate::inode::S_IFDIR | 0o755, 0, 0, ROOT_INO);
    root.encode(&mut region[g.inode_off(ROOT_INO)..][..INODE_SIZE]);
    let words = [
        g.blocks,
        g.log_start,
        g.bitmap_blocks,
        g.inode_blocks,
        LOG_BLOCKS,
    ];
    for (i, w) in words.iter().enumerate() {
        region[8 + i * 8..16 + i * 8].copy_from_slice(&w.to_le_bytes());
    }
    // The magic is written last so a torn format is never taken for a file
    // system.
    region[..8].copy_from_slice(&MAGIC.to_le_bytes());
    Ok(g)
}

/// Verifies the superblock and the metadata blocks' bits; the full check
/// (inodes, directories, block ownership) is `check::check`.
pub fn check_superblock(region: &[u8]) -> Result<Geometry, FsError> {
    let g = Geometry::for_len(region.len())?;
    if read_u64(region, 0) != MAGIC {
        return Err(FsError::BadMagic);
    }
    let sb_blocks = read_u64(region, 8);
    let want = [
        g.blocks,
        g.log_start,
        g.bitmap_blocks,
        g.inode_blocks,
        LOG_BLOCKS,
    ];
    if (0..5).any(|i| read_u64(region, 8 + i * 8) != want[i]) {
        return Err(FsError::SizeMismatch {
            sb: sb_blocks,
            region: g.blocks,
        });
    }
    if let Some(b) = (0..g.data_start()).find(|&b| !bit(region, &g, b)) {
        return Err(FsError::MetaNotAllocated(b));
    }
    let bits = g.bitmap_blocks * BLOCK_SIZE as u64 * 8;
    if let Some(b) = (g.blocks..bits).find(|&b| bit(region, &g, b)) {
        return Err(FsError::BitBeyondEnd(b));
    }
    Ok(g)
}

//! The on-region layout: block 0 holds the superblock, the next blocks hold
//! the block bitmap (one bit per block of the region, set = in use), the rest
//! are 4 KiB data blocks. All integers are little-endian so a region moves
//! between machines.

use thiserror::Error;

/// Size of every block of the region.
pub const BLOCK_SIZE: usize = 4096;
/// Superblock magic: "USTORFS1".
pub const MAGIC: u64 = u64::from_le_bytes(*b"USTORFS1");

/// Errors of the layout layer.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FsError {
    #[error("region of {0} bytes is too small (need at least 3 blocks)")]
    TooSmall(usize),
    #[error("bad superblock magic")]
    BadMagic,
    #[error("superblock says {sb} blocks but the region holds {region}")]
    SizeMismatch { sb: u64, region: u64 },
    #[error("metadata block {0} is not marked in use in the bitmap")]
    MetaNotAllocated(u64),
    #[error("bitmap marks block {0}, beyond the end of the region")]
    BitBeyondEnd(u64),
}

/// Where each part of the layout lives, in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub blocks: u64,
    pub bitmap_start: u64,
    pub bitmap_blocks: u64,
}

impl Geometry {
    /// The geometry of a region of `len` bytes.
    pub fn for_len(len: usize) -> Result<Self, FsError> {
        let blocks = (len / BLOCK_SIZE) as u64;
        let bitmap_blocks = blocks.div_ceil(BLOCK_SIZE as u64 * 8);
        if blocks < 2 + bitmap_blocks {
            return Err(FsError::TooSmall(len));
        }
        Ok(Self {
            blocks,
            bitmap_start: 1,
            bitmap_blocks,
        })
    }

    /// The first data block.
    pub fn data_start(&self) -> u64 {
        self.bitmap_start + self.bitmap_blocks
    }
}

fn bit(region: &[u8], g: &Geometry, blk: u64) -> bool {
    let off = g.bitmap_start as usize * BLOCK_SIZE + (blk / 8) as usize;
    region[off] & (1 << (blk % 8)) != 0
}

/// Formats `region`: superblock, a cleared bitmap with the metadata blocks
/// marked in use.
pub fn format(region: &mut [u8]) -> Result<Geometry, FsError> {
    let g = Geometry::for_len(region.len())?;
    let meta_end = g.data_start() as usize * BLOCK_SIZE;
    region[..meta_end].fill(0);
    for blk in 0..g.data_start() {
        let off = g.bitmap_start as usize * BLOCK_SIZE + (blk / 8) as usize;
        region[off] |= 1 << (blk % 8);
    }
    // The magic is written last so a torn format is never taken for a file
    // system.
    region[8..16].copy_from_slice(&g.blocks.to_le_bytes());
    region[16..24].copy_from_slice(&g.bitmap_blocks.to_le_bytes());
    region[..8].copy_from_slice(&MAGIC.to_le_bytes());
    Ok(g)
}

fn read_u64(region: &[u8], off: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&region[off..off + 8]);
    u64::from_le_bytes(b)
}

/// Verifies the layout of `region` (what `ustor fs check` will run).
pub fn check(region: &[u8]) -> Result<Geometry, FsError> {
    let g = Geometry::for_len(region.len())?;
    if read_u64(region, 0) != MAGIC {
        return Err(FsError::BadMagic);
    }
    let sb_blocks = read_u64(region, 8);
    if sb_blocks != g.blocks || read_u64(region, 16) != g.bitmap_blocks {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_then_check_is_clean() {
        let mut r = vec![0xa5u8; 64 * BLOCK_SIZE];
        let g = format(&mut r).unwrap();
        assert_eq!(
            g,
            Geometry {
                blocks: 64,
                bitmap_start: 1,
                bitmap_blocks: 1
            }
        );
        assert_eq!(check(&r), Ok(g));
    }

    #[test]
    fn too_small_and_bad_magic_refused() {
        assert_eq!(
            format(&mut [0u8; 2 * BLOCK_SIZE]),
            Err(FsError::TooSmall(8192))
        );
        assert_eq!(check(&vec![0u8; 8 * BLOCK_SIZE]), Err(FsError::BadMagic));
    }

    #[test]
    fn corruption_is_found() {
        let mut r = vec![0u8; 64 * BLOCK_SIZE];
        format(&mut r).unwrap();
        r[BLOCK_SIZE] &= !1;
        assert_eq!(check(&r), Err(FsError::MetaNotAllocated(0)));
        format(&mut r).unwrap();
        r[BLOCK_SIZE + 8] = 1;
        assert_eq!(check(&r), Err(FsError::BitBeyondEnd(64)));
        format(&mut r).unwrap();
        r[8] = 7;
        assert!(matches!(check(&r), Err(FsError::SizeMismatch { .. })));
    }
}

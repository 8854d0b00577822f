//! The 128-byte on-region inode and the attributes handed to clients.
//!
//! Layout (little-endian): mode u32 @0, uid u32 @4, gid u32 @8, nlink u32
//! @12, size u64 @16, atime/mtime/ctime ns i64 @24/@32/@40, parent u64 @48
//! (the containing directory, kept for directories only: it is their ".."),
//! 7 direct block pointers @56, single indirect @112, double indirect @120.
//! A block pointer of 0 is a hole (block 0 is the superblock).

use std::time::{SystemTime, UNIX_EPOCH};

pub const S_IFMT: u32 = 0o170000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFLNK: u32 = 0o120000;
/// Direct pointers in the inode.
pub const NDIRECT: usize = 7;
/// Pointers in one indirect block.
pub const PER_BLOCK: u64 = (crate::BLOCK_SIZE / 8) as u64;

/// Byte offset inside the inode of direct pointer `i`, the indirect and the
/// double indirect pointer.
pub const fn direct_off(i: usize) -> usize {
    56 + i * 8
}
pub const IND_OFF: usize = 112;
pub const DIND_OFF: usize = 120;

/// The kinds of file the service stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
}

/// An inode decoded from the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Inode {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub size: u64,
    pub atime_ns: i64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    pub parent: u64,
    pub direct: [u64; NDIRECT],
    pub ind: u64,
    pub dind: u64,
}

/// Now, in nanoseconds since the epoch.
pub fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

impl Inode {
    /// A fresh inode: directories start with two links ("." and the parent's
    /// entry), everything else with one.
    pub fn new(mode: u32, uid: u32, gid: u32, parent: u64) -> Self {
        let t = now_ns();
        let dir = mode & S_IFMT == S_IFDIR;
        Self {
            mode,
            uid,
            gid,
            nlink: if dir { 2 } else { 1 },
            atime_ns: t,
            mtime_ns: t,
            ctime_ns: t,
            parent: if dir { parent } else { 0 },
            ..Self::default()
        }
    }

    pub fn decode(b: &[u8]) -> Self {
        let mut direct = [0u64; NDIRECT];
        for (i, d) in direct.iter_mut().enumerate() {
            *d = u64_at(b, direct_off(i));
        }
        Self {
            mode: u32_at(b, 0),
            uid: u32_at(b, 4),
            gid: u32_at(b, 8),
            nlink: u32_at(b, 12),
            size: u64_at(b, 16),
            atime_ns: u64_at(b, 24) as i64,
            mtime_ns: u64_at(b, 32) as i64,
            ctime_ns: u64_at(b, 40) as i64,
            parent: u64_at(b, 48),
            direct,
            ind: u64_at(b, IND_OFF),
            dind: u64_at(b, DIND_OFF),
        }
    }

    pub fn encode(&self, b: &mut [u8]) {
        b[0..4].copy_from_slice(&self.mode.to_le_bytes());
        b[4..8].copy_from_slice(&self.uid.to_le_bytes());
        b[8..12].copy_from_slice(&self.gid.to_le_bytes());
        b[12..16].copy_from_slice(&self.nlink.to_le_bytes());
        b[16..24].copy_from_slice(&self.size.to_le_bytes());
        b[24..32].copy_from_slice(&self.atime_ns.to_le_bytes());
        b[32..40].copy_from_slice(&self.mtime_ns.to_le_bytes());
        b[40..48].copy_from_slice(&self.ctime_ns.to_le_bytes());
        b[48..56].copy_from_slice(&self.parent.to_le_bytes());
        for (i, d) in self.direct.iter().enumerate() {
            b[direct_off(i)..direct_off(i) + 8].copy_from_slice(&d.to_le_bytes());
        }
        b[IND_OFF..IND_OFF + 8].copy_from_slice(&self.ind.to_le_bytes());
        b[DIND_OFF..DIND_OFF + 8].copy_from_slice(&self.dind.to_le_bytes());
    }

    pub fn is_free(&self) -> bool {
        self.mode == 0
    }

    pub fn kind(&self) -> Option<FileKind> {
        match self.mode & S_IFMT {
            S_IFREG => Some(FileKind::File),
            S_IFDIR => Some(FileKind::Dir),
            S_IFLNK => Some(FileKind::Symlink),
            _ => None,
        }
    }

    pub fn is_dir(&self) -> bool {
        self.kind() == Some(FileKind::Dir)
    }
}

/// What a client sees of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub size: u64,
    pub blocks: u64,
    pub atime_ns: i64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
}

/// Changes asked by setattr; `None` leaves the field alone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime_ns: Option<i64>,
    pub mtime_ns: Option<i64>,
}

/// What statfs reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatFs {
    pub bsize: u32,
    pub blocks: u64,
    pub bfree: u64,
    pub files: u64,
    pub ffree: u64,
    pub namelen: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_round_trip() {
        let mut i = Inode::new(S_IFREG | 0o644, 7, 8, 3);
        i.size = 1 << 40;
        i.direct = [1, 2, 3, 4, 5, 6, 7];
        i.ind = 9;
        i.dind = 10;
        let mut b = [0u8; crate::layout::INODE_SIZE];
        i.encode(&mut b);
        assert_eq!(Inode::decode(&b), i);
        assert_eq!(i.nlink, 1);
        assert_eq!(i.parent, 0);
    }
}

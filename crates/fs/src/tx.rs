//! Metadata transactions through a small redo log.
//!
//! A namespace operation touches several records at once (rename: two
//! directory entries and up to three inodes), which 8-byte atomic pointer
//! updates alone cannot make atomic, so every metadata change goes through a
//! redo log of `LOG_BLOCKS` blocks: the entries are written and persisted,
//! then the 8-byte committed length (the commit point), then the entries are
//! applied in place and persisted, then the length is cleared. Opening a
//! region replays a committed log (replay is idempotent). File data is never
//! logged: it is written into its blocks and persisted before the transaction
//! that makes those blocks reachable (ordered persistence). The block bitmap
//! is not logged either: it is rebuilt from the inodes on open.

use std::collections::{BTreeMap, HashMap};

use crate::inode::Inode;
use crate::layout::{read_u64, Geometry, BLOCK_SIZE, INODE_SIZE, LOG_BLOCKS};
use crate::media::Media;
use crate::FsError;

/// The changes of one operation, applied all or nothing.
#[derive(Default)]
pub(crate) struct Tx {
    writes: Vec<(usize, Vec<u8>)>,
    inodes: BTreeMap<u64, Inode>,
    ptrs: HashMap<usize, u64>,
}

fn log_cap() -> usize {
    LOG_BLOCKS as usize * BLOCK_SIZE - 8
}

impl Tx {
    /// Queues `bytes` for region offset `off`, merged with the previous write
    /// when contiguous so a run of pointers costs one entry.
    pub fn put(&mut self, off: usize, bytes: &[u8]) {
        if let Some((o, b)) = self.writes.last_mut() {
            if *o + b.len() == off {
                b.extend_from_slice(bytes);
                return;
            }
        }
        self.writes.push((off, bytes.to_vec()));
    }

    /// Queues a block pointer in an indirect block; later reads in the same
    /// transaction see it through `ptr`.
    pub fn put_ptr(&mut self, off: usize, v: u64) {
        self.ptrs.insert(off, v);
        self.put(off, &v.to_le_bytes());
    }

    pub fn ptr(&self, region: &[u8], off: usize) -> u64 {
        self.ptrs
            .get(&off)
            .copied()
            .unwrap_or_else(|| read_u64(region, off))
    }

    /// The inode as this transaction sees it.
    pub fn inode(&self, region: &[u8], g: &Geometry, ino: u64) -> Inode {
        self.inodes
            .get(&ino)
            .copied()
            .unwrap_or_else(|| Inode::decode(&region[g.inode_off(ino)..][..INODE_SIZE]))
    }

    pub fn put_inode(&mut self, ino: u64, i: Inode) {
        self.inodes.insert(ino, i);
    }

    fn entries(&self, g: &Geometry) -> Vec<(usize, Vec<u8>)> {
        let mut v = self.writes.clone();
        for (ino, i) in &self.inodes {
            let mut b = vec![0u8; INODE_SIZE];
            i.encode(&mut b);
            v.push((g.inode_off(*ino), b));
        }
        v
    }

    /// Makes the transaction durable and applies it.
    pub fn commit(self, m: &mut dyn Media, g: &Geometry) -> Result<(), FsError> {
        let entries = self.entries(g);
        if entries.is_empty() {
            return Ok(());
        }
        let mut log = Vec::new();
        for (off, b) in &entries {
            log.extend_from_slice(&(*off as u64).to_le_bytes());
            log.extend_from_slice(&(b.len() as u64).to_le_bytes());
            log.extend_from_slice(b);
            log.resize(log.len().next_multiple_of(8), 0);
        }
        if log.len() > log_cap() {
            return Err(FsError::LogFull(log.len()));
        }
        let base = g.log_start as usize * BLOCK_SIZE;
        m.bytes_mut()[base + 8..base + 8 + log.len()].copy_from_slice(&log);
        m.persist(base + 8, log.len())?;
        set_len(m, base, log.len() as u64)?;
        for (off, b) in &entries {
            m.bytes_mut()[*off..*off + b.len()].copy_from_slice(b);
            m.persist(*off, b.len())?;
        }
        set_len(m, base, 0)
    }
}

/// Writes the log's committed length and persists it; an aligned 8-byte
/// store, so it is never seen torn.
fn set_len(m: &mut dyn Media, base: usize, len: u64) -> Result<(), FsError> {
    m.bytes_mut()[base..base + 8].copy_from_slice(&len.to_le_bytes());
    m.persist(base, 8)?;
    Ok(())
}

/// Replays a committed transaction left by a crash. Returns whether there was
/// one. Entries may only target the bitmap, inode table or data blocks.
pub(crate) fn replay(m: &mut dyn Media, g: &Geometry) -> Result<bool, FsError> {
    let base = g.log_start as usize * BLOCK_SIZE;
    let len = read_u64(m.bytes(), base) as usize;
    if len == 0 {
        return Ok(false);
    }
    if len > log_cap() {
        return Err(FsError::Corrupt(format!("redo log length {len}")));
    }
    let lo = g.bitmap_start as usize * BLOCK_SIZE;
    let hi = m.bytes().len();
    let mut p = base + 8;
    let end = base + 8 + len;
    while p < end {
        if p + 16 > end {
            return Err(FsError::Corrupt("torn redo log entry".into()));
        }
        let off = read_u64(m.bytes(), p) as usize;
        let n = read_u64(m.bytes(), p + 8) as usize;
        p += 16;
        if n > end - p || off < lo || off.checked_add(n).map_or(true, |e| e > hi) {
            return Err(FsError::Corrupt(format!("redo log entry {off}+{n}")));
        }
        m.bytes_mut().copy_within(p..p + n, off);
        m.persist(off, n)?;
        p += n.next_multiple_of(8);
    }
    set_len(m, base, 0)?;
    Ok(true)
}

//! The mounted file system: block and inode allocation, the mapping from
//! file offsets to data blocks, and the zero-copy data path (reads and writes
//! are planned as byte ranges of the region that the transport fills or
//! sends from directly).

use crate::inode::{now_ns, Inode, NDIRECT, PER_BLOCK};
use crate::layout::{bit, check_superblock, read_u64, set_bit, Geometry, BLOCK_SIZE, INODE_SIZE};
use crate::media::Media;
use crate::tx::{replay, Tx};
use crate::FsError;
use std::collections::HashMap;

/// Largest write one plan covers (its pointer updates fit the redo log).
pub const MAX_WRITE: usize = 1 << 20;
/// Largest file: direct + single + double indirect blocks.
pub const MAX_FILE_BLOCKS: u64 = NDIRECT as u64 + PER_BLOCK + PER_BLOCK * PER_BLOCK;

/// A piece of a read: bytes of the region, or a hole that reads as zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadSeg {
    Region { off: usize, len: usize },
    Zero(usize),
}

/// A write in progress: the region ranges its payload goes into, in order,
/// and the metadata transaction that makes them part of the file.
pub struct WritePlan {
    pub segs: Vec<(usize, usize)>,
    ino: u64,
    inode: Inode,
    off: u64,
    /// The inode when the write was planned: a change meanwhile (another
    /// connection's write, truncate or unlink) is a conflict at finish.
    before: Inode,
    tx: Tx,
    fresh: Vec<u64>,
}

impl WritePlan {
    /// Whether every block under the payload's segments was allocated by
    /// this plan: nothing of the file's old data lies there, so a write
    /// abandoned midway (its blocks freed) cannot have spoilt the file.
    pub fn all_fresh(&self) -> bool {
        let bs = crate::BLOCK_SIZE;
        self.segs.iter().all(|&(o, n)| {
            (o / bs..=(o + n.max(1) - 1) / bs).all(|b| self.fresh.contains(&(b as u64)))
        })
    }
}

/// A file system on a media region.
pub struct Fs {
    pub(crate) m: Box<dyn Media>,
    pub(crate) g: Geometry,
    pub(crate) free_blocks: u64,
    pub(crate) free_inodes: u64,
    blk_hint: u64,
    ino_hint: u64,
    /// Writes planned and not finished, and zero-copy sends the kernel may
    /// still read ([`Fs::pin_send`]): while any is, freed blocks wait in
    /// `deferred`, so a payload still being received never lands in a block
    /// another file got meanwhile, and a block still being sent is never
    /// handed to another file.
    pins: usize,
    deferred: Vec<u64>,
    /// Payload bytes copied out of the region to redo a write whose inode
    /// changed while its payload was received (`Stats::copied_bytes`).
    pub conflict_copied: u64,
    /// Blocks each recently written inode owns (its `st_blocks`), so a
    /// write's reply (the file's attributes) does not walk the whole block
    /// map: counting a 64 MiB file's 16,400 pointers per 4 KiB write took
    /// 29% of the server's samples. Kept by [`Fs::finish_write`] (plus the
    /// blocks it linked); any other transaction clears it (they are rare
    /// and may free blocks).
    pub(crate) owned: HashMap<u64, u64>,
}

/// Every block an inode owns, indirect blocks included. Errors on a pointer
/// outside the data area.
pub(crate) fn owned_blocks(r: &[u8], g: &Geometry, i: &Inode) -> Result<Vec<u64>, FsError> {
    let ok = |b: u64| {
        if b < g.data_start() || b >= g.blocks {
            Err(FsError::Corrupt(format!(
                "block pointer {b} outside the data area"
            )))
        } else {
            Ok(b)
        }
    };
    let mut v = Vec::new();
    for &d in i.direct.iter().filter(|&&d| d != 0) {
        v.push(ok(d)?);
    }
    let ptrs =
        |b: u64| (0..PER_BLOCK).map(move |k| read_u64(r, b as usize * BLOCK_SIZE + k as usize * 8));
    if i.ind != 0 {
        v.push(ok(i.ind)?);
        for p in ptrs(i.ind).filter(|&p| p != 0) {
            v.push(ok(p)?);
        }
    }
    if i.dind != 0 {
        v.push(ok(i.dind)?);
        for ind in ptrs(i.dind).filter(|&p| p != 0) {
            v.push(ok(ind)?);
            for p in ptrs(ind).filter(|&p| p != 0) {
                v.push(ok(p)?);
            }
        }
    }
    Ok(v)
}

/// The block holding file block `idx` of `i` as `tx` sees the region.
pub(crate) fn bmap_in(r: &[u8], tx: &Tx, i: &Inode, idx: u64) -> u64 {
    let at = |blk: u64, k: u64| tx.ptr(r, blk as usize * BLOCK_SIZE + k as usize * 8);
    if idx < NDIRECT as u64 {
        return i.direct[idx as usize];
    }
    let idx = idx - NDIRECT as u64;
    if idx < PER_BLOCK {
        return if i.ind == 0 { 0 } else { at(i.ind, idx) };
    }
    let idx = idx - PER_BLOCK;
    if i.dind == 0 || idx >= PER_BLOCK * PER_BLOCK {
        return 0;
    }
    let ind = at(i.dind, idx / PER_BLOCK);
    if ind == 0 {
        0
    } else {
        at(ind, idx % PER_BLOCK)
    }
}

impl Fs {
    /// Formats `m` and opens it.
    pub fn format(mut m: Box<dyn Media>) -> Result<Self, FsError> {
        crate::layout::format(m.bytes_mut())?;
        let len = m.bytes().len();
        m.persist(0, len)?;
        Self::open(m)
    }

    /// Opens a formatted region: replays a committed log, frees inodes left
    /// with no links, rebuilds the block bitmap from the inodes.
    pub fn open(mut m: Box<dyn Media>) -> Result<Self, FsError> {
        let g = check_superblock(m.bytes())?;
        replay(&mut *m, &g)?;
        let mut fs = Self {
            m,
            g,
            free_blocks: 0,
            free_inodes: 0,
            blk_hint: 0,
            ino_hint: 1,
            pins: 0,
            deferred: Vec::new(),
            conflict_copied: 0,
            owned: HashMap::new(),
        };
        fs.recover()?;
        Ok(fs)
    }

    fn recover(&mut self) -> Result<(), FsError> {
        let g = self.g;
        let mut used = vec![false; g.blocks as usize];
        used[..g.data_start() as usize].fill(true);
        let mut tx = Tx::default();
        for ino in 1..g.inodes() {
            let i = self.inode(ino);
            if i.is_free() {
                self.free_inodes += 1;
                continue;
            }
            if i.nlink == 0 {
                tx.put_inode(ino, Inode::default());
                self.free_inodes += 1;
                continue;
            }
            for b in owned_blocks(self.m.bytes(), &g, &i)? {
                if std::mem::replace(&mut used[b as usize], true) {
                    return Err(FsError::Corrupt(format!("block {b} owned twice")));
                }
            }
        }
        tx.commit(&mut *self.m, &g)?;
        let r = self.m.bytes_mut();
        for (b, &u) in used.iter().enumerate() {
            set_bit(r, &g, b as u64, u);
        }
        self.m.persist(
            g.bitmap_start as usize * BLOCK_SIZE,
            g.bitmap_blocks as usize * BLOCK_SIZE,
        )?;
        self.free_blocks = used.iter().filter(|&&u| !u).count() as u64;
        Ok(())
    }

    pub fn geometry(&self) -> Geometry {
        self.g
    }

    /// The whole region, for sending read segments from.
    pub fn region(&self) -> &[u8] {
        self.m.bytes()
    }

    /// The whole region, for receiving a write plan's payload into.
    pub fn region_mut(&mut self) -> &mut [u8] {
        self.m.bytes_mut()
    }

    pub(crate) fn inode(&self, ino: u64) -> Inode {
        Inode::decode(&self.m.bytes()[self.g.inode_off(ino)..][..INODE_SIZE])
    }

    /// A live inode, or NotFound for a number out of range or free.
    pub(crate) fn live(&self, ino: u64) -> Result<Inode, FsError> {
        if ino == 0 || ino >= self.g.inodes() {
            return Err(FsError::NotFound);
        }
        let i = self.inode(ino);
        if i.is_free() || i.nlink == 0 {
            return Err(FsError::NotFound);
        }
        Ok(i)
    }

    pub(crate) fn alloc_inode(&mut self, tx: &Tx) -> Result<u64, FsError> {
        let n = self.g.inodes();
        for k in 0..n {
            let ino = (self.ino_hint + k) % n;
            if ino != 0 && tx.inode(self.m.bytes(), &self.g, ino).is_free() {
                self.ino_hint = ino + 1;
                self.free_inodes -= 1;
                return Ok(ino);
            }
        }
        Err(FsError::NoSpace)
    }

    /// Allocates a data block; `zero` clears and persists it (an indirect
    /// block, or a data block the write will not fill).
    pub(crate) fn alloc_block(&mut self, zero: bool) -> Result<u64, FsError> {
        let (lo, n) = (self.g.data_start(), self.g.blocks - self.g.data_start());
        for k in 0..n {
            let b = lo + (self.blk_hint + k) % n;
            if !bit(self.m.bytes(), &self.g, b) {
                set_bit(self.m.bytes_mut(), &self.g, b, true);
                self.blk_hint = b - lo + 1;
                self.free_blocks -= 1;
                if zero {
                    let off = b as usize * BLOCK_SIZE;
                    self.m.bytes_mut()[off..off + BLOCK_SIZE].fill(0);
                    self.m.persist(off, BLOCK_SIZE)?;
                }
                return Ok(b);
            }
        }
        Err(FsError::NoSpace)
    }

    /// Marks blocks free; only after the transaction that unlinked them
    /// committed, so a crash never leaves a block reachable and reused.
    pub(crate) fn free_blocks(&mut self, blocks: &[u64]) {
        if self.pins > 0 {
            self.deferred.extend_from_slice(blocks);
            return;
        }
        for &b in blocks {
            set_bit(self.m.bytes_mut(), &self.g, b, false);
            self.free_blocks += 1;
        }
    }

    /// The block holding file block `idx`, 0 for a hole.
    pub(crate) fn bmap(&self, tx: &Tx, i: &Inode, idx: u64) -> u64 {
        bmap_in(self.m.bytes(), tx, i, idx)
    }

    /// Pointer slot `k` of indirect block `blk`, allocating an indirect
    /// block behind it when empty.
    fn ind_slot(
        &mut self,
        tx: &mut Tx,
        fresh: &mut Vec<u64>,
        blk: u64,
        k: u64,
    ) -> Result<u64, FsError> {
        let off = blk as usize * BLOCK_SIZE + k as usize * 8;
        let p = tx.ptr(self.m.bytes(), off);
        if p != 0 {
            return Ok(p);
        }
        let nb = self.alloc_block(true)?;
        fresh.push(nb);
        tx.put_ptr(off, nb);
        Ok(nb)
    }

    /// Maps file block `idx`, allocating it (and indirect blocks) when it is
    /// a hole. Returns the block and whether it is new.
    pub(crate) fn bmap_alloc(
        &mut self,
        tx: &mut Tx,
        i: &mut Inode,
        idx: u64,
        zero: bool,
        fresh: &mut Vec<u64>,
    ) -> Result<(u64, bool), FsError> {
        let cur = self.bmap(tx, i, idx);
        if cur != 0 {
            return Ok((cur, false));
        }
        if idx >= MAX_FILE_BLOCKS {
            return Err(FsError::TooBig);
        }
        fn top(slot: &mut u64, this: &mut Fs, fresh: &mut Vec<u64>) -> Result<u64, FsError> {
            if *slot == 0 {
                *slot = this.alloc_block(true)?;
                fresh.push(*slot);
            }
            Ok(*slot)
        }
        let (parent, k) = if idx < NDIRECT as u64 {
            let b = self.alloc_block(zero)?;
            fresh.push(b);
            i.direct[idx as usize] = b;
            return Ok((b, true));
        } else if idx < NDIRECT as u64 + PER_BLOCK {
            (top(&mut i.ind, self, fresh)?, idx - NDIRECT as u64)
        } else {
            let rel = idx - NDIRECT as u64 - PER_BLOCK;
            let d = top(&mut i.dind, self, fresh)?;
            (
                self.ind_slot(tx, fresh, d, rel / PER_BLOCK)?,
                rel % PER_BLOCK,
            )
        };
        let b = self.alloc_block(zero)?;
        fresh.push(b);
        tx.put_ptr(parent as usize * BLOCK_SIZE + k as usize * 8, b);
        Ok((b, true))
    }

    /// Plans a read of up to `len` bytes at `off`, clamped to the file size.
    pub fn read_plan(&self, ino: u64, off: u64, len: usize) -> Result<Vec<ReadSeg>, FsError> {
        let i = self.live(ino)?;
        if i.is_dir() {
            return Err(FsError::IsDir);
        }
        let end = i.size.min(off.saturating_add(len as u64));
        let (mut pos, mut segs, tx) = (off, Vec::new(), Tx::default());
        while pos < end {
            let (idx, within) = (pos / BLOCK_SIZE as u64, (pos % BLOCK_SIZE as u64) as usize);
            let n = (BLOCK_SIZE - within).min((end - pos) as usize);
            let b = self.bmap(&tx, &i, idx);
            let seg = if b == 0 {
                ReadSeg::Zero(n)
            } else {
                ReadSeg::Region {
                    off: b as usize * BLOCK_SIZE + within,
                    len: n,
                }
            };
            push_seg(&mut segs, seg);
            pos += n as u64;
        }
        Ok(segs)
    }

    /// Reads into `buf` (a copy: for clients and tests, not the server's
    /// data path). Returns the bytes read.
    pub fn read(&self, ino: u64, off: u64, buf: &mut [u8]) -> Result<usize, FsError> {
        let mut n = 0;
        for s in self.read_plan(ino, off, buf.len())? {
            match s {
                ReadSeg::Region { off, len } => {
                    buf[n..n + len].copy_from_slice(&self.m.bytes()[off..off + len])
                }
                ReadSeg::Zero(len) => buf[n..n + len].fill(0),
            }
            n += match s {
                ReadSeg::Region { len, .. } | ReadSeg::Zero(len) => len,
            };
        }
        Ok(n)
    }

    /// Plans a write of `len` (at most `MAX_WRITE`) bytes at `off`: allocates
    /// the blocks and returns the region ranges the payload goes into.
    pub fn begin_write(&mut self, ino: u64, off: u64, len: usize) -> Result<WritePlan, FsError> {
        let mut i = self.live(ino)?;
        if i.kind() != Some(crate::FileKind::File) {
            return Err(FsError::IsDir);
        }
        let end = off.checked_add(len as u64).ok_or(FsError::TooBig)?;
        if len > MAX_WRITE || end.div_ceil(BLOCK_SIZE as u64) > MAX_FILE_BLOCKS {
            return Err(FsError::TooBig);
        }
        // A write starting past the end leaves a hole; the bytes of the old
        // last block past its size are undefined (a shrink leaves them), so
        // they are zeroed first, as a grow by truncate does.
        self.zero_gap(&Tx::default(), &i, off)?;
        let mut plan = WritePlan {
            segs: Vec::new(),
            ino,
            inode: i,
            off,
            before: i,
            tx: Tx::default(),
            fresh: Vec::new(),
        };
        self.pins += 1;
        let mut pos = off;
        while pos < end {
            let (idx, within) = (pos / BLOCK_SIZE as u64, (pos % BLOCK_SIZE as u64) as usize);
            let n = (BLOCK_SIZE - within).min((end - pos) as usize);
            let partial = n < BLOCK_SIZE;
            let r = self.bmap_alloc(&mut plan.tx, &mut i, idx, partial, &mut plan.fresh);
            let b = match r {
                Ok((b, _)) => b,
                Err(e) => {
                    self.abort_write(plan);
                    return Err(e);
                }
            };
            let o = b as usize * BLOCK_SIZE + within;
            match plan.segs.last_mut() {
                Some((so, sl)) if *so + *sl == o => *sl += n,
                _ => plan.segs.push((o, n)),
            }
            pos += n as u64;
        }
        i.size = i.size.max(end);
        let t = now_ns();
        (i.mtime_ns, i.ctime_ns) = (t, t);
        plan.inode = i;
        Ok(plan)
    }

    /// Makes a planned write durable: the payload first, then the metadata
    /// pointing to it. If the inode changed since `begin_write` (a write
    /// racing on another connection, a truncate), the payload is copied out
    /// of the planned ranges and the write redone on the current inode
    /// (counted in `conflict_copied`).
    pub fn finish_write(&mut self, mut plan: WritePlan) -> Result<(), FsError> {
        if self.live(plan.ino).ok() != Some(plan.before) {
            let mut data = Vec::new();
            for &(o, n) in &plan.segs {
                data.extend_from_slice(&self.m.bytes()[o..o + n]);
            }
            self.conflict_copied += data.len() as u64;
            let (ino, off) = (plan.ino, plan.off);
            self.abort_write(plan);
            return self.write(ino, off, &data);
        }
        let r = (|| {
            for &(o, n) in &plan.segs {
                self.m.persist(o, n)?;
            }
            plan.tx.put_inode(plan.ino, plan.inode);
            plan.tx.commit(&mut *self.m, &self.g)
        })();
        if r.is_err() {
            self.owned.remove(&plan.ino);
            self.free_blocks(&plan.fresh);
        } else {
            self.count_linked(plan.ino, &plan.inode, plan.fresh.len() as u64);
        }
        self.unpin();
        r
    }

    /// After a write committed: its inode owns `linked` more blocks (every
    /// fresh block of the plan is linked by its transaction), or, when the
    /// count was not kept, as many as its block map now holds.
    fn count_linked(&mut self, ino: u64, i: &Inode, linked: u64) {
        if let Some(n) = self.owned.get_mut(&ino) {
            *n += linked;
            return;
        }
        if let Ok(v) = owned_blocks(self.m.bytes(), &self.g, i) {
            self.owned.insert(ino, v.len() as u64);
        }
    }

    /// The blocks inode `ino` owns, indirect blocks included.
    pub(crate) fn owned_count(&self, ino: u64, i: &Inode) -> u64 {
        match self.owned.get(&ino) {
            Some(&n) => n,
            None => owned_blocks(self.m.bytes(), &self.g, i).map_or(0, |v| v.len() as u64),
        }
    }

    /// Drops a planned write (the client vanished): its new blocks go back.
    pub fn abort_write(&mut self, plan: WritePlan) {
        self.free_blocks(&plan.fresh);
        self.unpin();
    }

    /// Keeps freed blocks from reuse until [`Fs::unpin_send`]: a transport
    /// sending from region pages that the kernel reads after the send call
    /// returned (SENDMSG_ZC, until its notification).
    pub fn pin_send(&mut self) {
        self.pins += 1;
    }

    /// Ends a [`Fs::pin_send`].
    pub fn unpin_send(&mut self) {
        self.unpin();
    }

    fn unpin(&mut self) {
        self.pins -= 1;
        if self.pins == 0 {
            let d = std::mem::take(&mut self.deferred);
            self.free_blocks(&d);
        }
    }

    /// Writes `data` at `off` (a copy: for clients and tests).
    pub fn write(&mut self, ino: u64, off: u64, data: &[u8]) -> Result<(), FsError> {
        for (k, chunk) in data.chunks(MAX_WRITE).enumerate() {
            let plan = self.begin_write(ino, off + (k * MAX_WRITE) as u64, chunk.len())?;
            let mut c = 0;
            for &(o, n) in &plan.segs {
                self.m.bytes_mut()[o..o + n].copy_from_slice(&chunk[c..c + n]);
                c += n;
            }
            self.finish_write(plan)?;
        }
        Ok(())
    }

    /// Cuts `i` down to `size` bytes inside `tx`; returns the blocks to free
    /// once the transaction commits. Growing only changes the size (a hole).
    pub(crate) fn truncate_in(
        &mut self,
        tx: &mut Tx,
        i: &mut Inode,
        size: u64,
    ) -> Result<Vec<u64>, FsError> {
        let mut freed = Vec::new();
        if size < i.size {
            self.cut(tx, i, size.div_ceil(BLOCK_SIZE as u64), &mut freed);
        } else {
            self.zero_gap(tx, i, size)?;
        }
        i.size = size;
        Ok(freed)
    }

    /// Bytes past the size in the last block are undefined (a shrink does
    /// not clear them, so a crash before it commits loses nothing); a grow
    /// to `to` zeroes them first. They are invisible until it commits.
    fn zero_gap(&mut self, tx: &Tx, i: &Inode, to: u64) -> Result<(), FsError> {
        let from = i.size;
        let within = (from % BLOCK_SIZE as u64) as usize;
        if to <= from || within == 0 {
            return Ok(());
        }
        let b = self.bmap(tx, i, from / BLOCK_SIZE as u64);
        if b != 0 {
            let end = (to - (from - within as u64)).min(BLOCK_SIZE as u64) as usize;
            let o = b as usize * BLOCK_SIZE;
            self.m.bytes_mut()[o + within..o + end].fill(0);
            self.m.persist(o + within, end - within)?;
        }
        Ok(())
    }

    fn cut(&mut self, tx: &mut Tx, i: &mut Inode, keep: u64, freed: &mut Vec<u64>) {
        for d in i.direct.iter_mut().skip(keep as usize).filter(|d| **d != 0) {
            freed.push(std::mem::take(d));
        }
        let nd = NDIRECT as u64;
        if i.ind != 0 {
            if keep <= nd {
                freed.extend(self.subtree(tx, i.ind, 1));
                i.ind = 0;
            } else {
                self.cut_ind(tx, i.ind, keep - nd, freed);
            }
        }
        if i.dind != 0 {
            let base = nd + PER_BLOCK;
            if keep <= base {
                freed.extend(self.subtree(tx, i.dind, 2));
                i.dind = 0;
                return;
            }
            let rel = keep - base;
            for j in rel / PER_BLOCK..PER_BLOCK {
                let off = i.dind as usize * BLOCK_SIZE + j as usize * 8;
                let ind = tx.ptr(self.m.bytes(), off);
                if ind == 0 {
                    continue;
                }
                if j == rel / PER_BLOCK && rel % PER_BLOCK != 0 {
                    self.cut_ind(tx, ind, rel % PER_BLOCK, freed);
                } else {
                    freed.extend(self.subtree(tx, ind, 1));
                    tx.put_ptr(off, 0);
                }
            }
        }
        debug_assert!(!freed.contains(&0));
    }

    fn cut_ind(&mut self, tx: &mut Tx, ind: u64, from: u64, freed: &mut Vec<u64>) {
        for k in from..PER_BLOCK {
            let off = ind as usize * BLOCK_SIZE + k as usize * 8;
            let p = tx.ptr(self.m.bytes(), off);
            if p != 0 {
                freed.push(p);
                tx.put_ptr(off, 0);
            }
        }
    }

    /// `blk` and every block below it (`depth` levels of pointers).
    fn subtree(&self, tx: &Tx, blk: u64, depth: u32) -> Vec<u64> {
        let mut v = vec![blk];
        if depth > 0 {
            for k in 0..PER_BLOCK {
                let p = tx.ptr(self.m.bytes(), blk as usize * BLOCK_SIZE + k as usize * 8);
                if p != 0 {
                    v.extend(self.subtree(tx, p, depth - 1));
                }
            }
        }
        v
    }
}

fn push_seg(segs: &mut Vec<ReadSeg>, s: ReadSeg) {
    match (segs.last_mut(), s) {
        (Some(ReadSeg::Region { off, len }), ReadSeg::Region { off: o, len: n })
            if *off + *len == o =>
        {
            *len += n
        }
        (Some(ReadSeg::Zero(z)), ReadSeg::Zero(n)) => *z += n,
        _ => segs.push(s),
    }
}

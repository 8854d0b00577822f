//! The namespace: directories of fixed 256-byte entries (inode u64, name
//! length u8, name), and the operations on names, links and attributes.
//! Every operation is one redo-log transaction; blocks it frees go back to
//! the bitmap only after it commits.

use crate::fs::Fs;
use crate::inode::{
    now_ns, Attr, FileKind, Inode, SetAttr, StatFs, S_IFDIR, S_IFLNK, S_IFMT, S_IFREG,
};
use crate::layout::{read_u64, BLOCK_SIZE, ROOT_INO};
use crate::tx::Tx;
use crate::FsError;

/// Bytes of one directory entry.
pub const DIRENT_SIZE: usize = 256;
/// Longest name a directory entry holds.
pub const NAME_MAX: usize = DIRENT_SIZE - 9;
const PER_DIR_BLOCK: usize = BLOCK_SIZE / DIRENT_SIZE;

/// One entry returned by `readdir`; `next` is the cookie to continue from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub next: u64,
    pub ino: u64,
    pub name: Vec<u8>,
    pub kind: FileKind,
}

fn check_name(name: &[u8]) -> Result<(), FsError> {
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0)
    {
        return Err(FsError::Invalid);
    }
    if name.len() > NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    Ok(())
}

fn dirent(ino: u64, name: &[u8]) -> [u8; DIRENT_SIZE] {
    let mut e = [0u8; DIRENT_SIZE];
    e[..8].copy_from_slice(&ino.to_le_bytes());
    e[8] = name.len() as u8;
    e[9..9 + name.len()].copy_from_slice(name);
    e
}

impl Fs {
    fn attr(&self, ino: u64, i: &Inode) -> Attr {
        let blocks = self.owned_count(ino, i);
        Attr {
            ino,
            mode: i.mode,
            uid: i.uid,
            gid: i.gid,
            nlink: i.nlink,
            size: i.size,
            blocks: blocks * (BLOCK_SIZE as u64 / 512),
            atime_ns: i.atime_ns,
            mtime_ns: i.mtime_ns,
            ctime_ns: i.ctime_ns,
        }
    }

    fn dir(&self, tx: &Tx, ino: u64) -> Result<Inode, FsError> {
        self.live(ino)?;
        let d = tx.inode(self.m.bytes(), &self.g, ino);
        if !d.is_dir() {
            return Err(FsError::NotDir);
        }
        Ok(d)
    }

    /// Visits the region offset and inode of every slot of directory `d`.
    fn slots(&self, tx: &Tx, d: &Inode) -> impl Iterator<Item = (usize, u64)> + '_ {
        let n = d.size / BLOCK_SIZE as u64;
        let blocks: Vec<u64> = (0..n).map(|k| self.bmap(tx, d, k)).collect();
        blocks.into_iter().flat_map(move |b| {
            (0..PER_DIR_BLOCK).map(move |s| {
                let o = b as usize * BLOCK_SIZE + s * DIRENT_SIZE;
                (o, read_u64(self.m.bytes(), o))
            })
        })
    }

    fn find(&self, tx: &Tx, d: &Inode, name: &[u8]) -> Option<(usize, u64)> {
        let r = self.m.bytes();
        self.slots(tx, d)
            .find(|&(o, ino)| ino != 0 && &r[o + 9..o + 9 + r[o + 8] as usize] == name)
    }

    /// Adds `name` -> `ino` to directory `dino`, growing it by a block when
    /// every slot is taken.
    fn add_entry(
        &mut self,
        tx: &mut Tx,
        dino: u64,
        name: &[u8],
        ino: u64,
    ) -> Result<Vec<u64>, FsError> {
        let mut d = self.dir(tx, dino)?;
        let slot = self.slots(tx, &d).find(|&(_, i)| i == 0).map(|(o, _)| o);
        let mut fresh = Vec::new();
        let o = match slot {
            Some(o) => o,
            None => {
                let idx = d.size / BLOCK_SIZE as u64;
                let (b, _) = self.bmap_alloc(tx, &mut d, idx, true, &mut fresh)?;
                d.size += BLOCK_SIZE as u64;
                b as usize * BLOCK_SIZE
            }
        };
        tx.put(o, &dirent(ino, name));
        let t = now_ns();
        (d.mtime_ns, d.ctime_ns) = (t, t);
        tx.put_inode(dino, d);
        Ok(fresh)
    }

    fn touch_dir(&self, tx: &mut Tx, dino: u64, nlink_delta: i32) {
        let mut d = tx.inode(self.m.bytes(), &self.g, dino);
        let t = now_ns();
        (d.mtime_ns, d.ctime_ns) = (t, t);
        d.nlink = d.nlink.saturating_add_signed(nlink_delta);
        tx.put_inode(dino, d);
    }

    fn commit(&mut self, tx: Tx, fresh: &[u64], freed: &[u64]) -> Result<(), FsError> {
        // It may link or free any inode's blocks (see `Fs::owned`).
        self.owned.clear();
        if let Err(e) = tx.commit(&mut *self.m, &self.g) {
            self.free_blocks(fresh);
            return Err(e);
        }
        self.free_blocks(freed);
        Ok(())
    }

    pub fn getattr(&self, ino: u64) -> Result<Attr, FsError> {
        let i = self.live(ino)?;
        Ok(self.attr(ino, &i))
    }

    pub fn lookup(&self, dir: u64, name: &[u8]) -> Result<Attr, FsError> {
        let tx = Tx::default();
        let d = self.dir(&tx, dir)?;
        let ino = match name {
            b"." => dir,
            b".." => d.parent,
            _ => self.find(&tx, &d, name).ok_or(FsError::NotFound)?.1,
        };
        self.getattr(ino)
    }

    fn make(
        &mut self,
        dir: u64,
        name: &[u8],
        mode: u32,
        uid: u32,
        gid: u32,
        body: &[u8],
    ) -> Result<Attr, FsError> {
        check_name(name)?;
        let mut tx = Tx::default();
        let d = self.dir(&tx, dir)?;
        if self.find(&tx, &d, name).is_some() {
            return Err(FsError::Exists);
        }
        let ino = self.alloc_inode(&tx)?;
        let mut i = Inode::new(mode, uid, gid, dir);
        let mut fresh = match self.add_entry(&mut tx, dir, name, ino) {
            Ok(f) => f,
            Err(e) => {
                self.free_inodes += 1;
                return Err(e);
            }
        };
        if !body.is_empty() {
            // A symlink's target: its block is unreachable until commit.
            let (b, _) = self.bmap_alloc(&mut tx, &mut i, 0, true, &mut fresh)?;
            let o = b as usize * BLOCK_SIZE;
            self.m.bytes_mut()[o..o + body.len()].copy_from_slice(body);
            self.m.persist(o, body.len())?;
            i.size = body.len() as u64;
        }
        if i.is_dir() {
            self.touch_dir(&mut tx, dir, 1);
        }
        tx.put_inode(ino, i);
        self.commit(tx, &fresh, &[])
            .inspect_err(|_| self.free_inodes += 1)?;
        Ok(self.attr(ino, &i))
    }

    pub fn create(
        &mut self,
        dir: u64,
        name: &[u8],
        mode: u32,
        uid: u32,
        gid: u32,
    ) -> Result<Attr, FsError> {
        self.make(dir, name, S_IFREG | (mode & 0o7777), uid, gid, &[])
    }

    pub fn mkdir(
        &mut self,
        dir: u64,
        name: &[u8],
        mode: u32,
        uid: u32,
        gid: u32,
    ) -> Result<Attr, FsError> {
        self.make(dir, name, S_IFDIR | (mode & 0o7777), uid, gid, &[])
    }

    pub fn symlink(
        &mut self,
        dir: u64,
        name: &[u8],
        target: &[u8],
        uid: u32,
        gid: u32,
    ) -> Result<Attr, FsError> {
        if target.is_empty() || target.len() > BLOCK_SIZE - 1 {
            return Err(FsError::NameTooLong);
        }
        self.make(dir, name, S_IFLNK | 0o777, uid, gid, target)
    }

    pub fn readlink(&self, ino: u64) -> Result<Vec<u8>, FsError> {
        let i = self.live(ino)?;
        if i.kind() != Some(FileKind::Symlink) {
            return Err(FsError::Invalid);
        }
        let o = self.bmap(&Tx::default(), &i, 0) as usize * BLOCK_SIZE;
        Ok(self.m.bytes()[o..o + i.size as usize].to_vec())
    }

    pub fn link(&mut self, ino: u64, dir: u64, name: &[u8]) -> Result<Attr, FsError> {
        check_name(name)?;
        let mut tx = Tx::default();
        let mut i = self.live(ino)?;
        if i.is_dir() {
            return Err(FsError::Perm);
        }
        let d = self.dir(&tx, dir)?;
        if self.find(&tx, &d, name).is_some() {
            return Err(FsError::Exists);
        }
        let fresh = self.add_entry(&mut tx, dir, name, ino)?;
        i.nlink += 1;
        i.ctime_ns = now_ns();
        tx.put_inode(ino, i);
        self.commit(tx, &fresh, &[])?;
        Ok(self.attr(ino, &i))
    }

    /// Drops one link of `ino` inside `tx`; returns blocks to free when it
    /// was the last.
    fn drop_link(&mut self, tx: &mut Tx, ino: u64) -> Result<Vec<u64>, FsError> {
        let mut i = tx.inode(self.m.bytes(), &self.g, ino);
        let last = i.is_dir() || i.nlink <= 1;
        if !last {
            i.nlink -= 1;
            i.ctime_ns = now_ns();
            tx.put_inode(ino, i);
            return Ok(Vec::new());
        }
        let freed = crate::fs::owned_blocks(self.m.bytes(), &self.g, &i)?;
        tx.put_inode(ino, Inode::default());
        self.free_inodes += 1;
        Ok(freed)
    }

    fn is_empty_dir(&self, tx: &Tx, d: &Inode) -> bool {
        self.slots(tx, d).all(|(_, i)| i == 0)
    }

    fn remove(&mut self, dir: u64, name: &[u8], want_dir: bool) -> Result<(), FsError> {
        check_name(name)?;
        let mut tx = Tx::default();
        let d = self.dir(&tx, dir)?;
        let (o, ino) = self.find(&tx, &d, name).ok_or(FsError::NotFound)?;
        let i = self.inode(ino);
        match (want_dir, i.is_dir()) {
            (true, false) => return Err(FsError::NotDir),
            (false, true) => return Err(FsError::IsDir),
            (true, true) if !self.is_empty_dir(&tx, &i) => return Err(FsError::NotEmpty),
            _ => {}
        }
        tx.put(o, &0u64.to_le_bytes());
        self.touch_dir(&mut tx, dir, if want_dir { -1 } else { 0 });
        let freed = self.drop_link(&mut tx, ino)?;
        self.commit(tx, &[], &freed)
    }

    pub fn unlink(&mut self, dir: u64, name: &[u8]) -> Result<(), FsError> {
        self.remove(dir, name, false)
    }

    pub fn rmdir(&mut self, dir: u64, name: &[u8]) -> Result<(), FsError> {
        self.remove(dir, name, true)
    }

    /// Whether `dir` is `anc` or lies below it.
    fn is_under(&self, mut dir: u64, anc: u64) -> bool {
        for _ in 0..self.g.inodes() {
            if dir == anc {
                return true;
            }
            if dir == ROOT_INO {
                return false;
            }
            dir = self.inode(dir).parent;
        }
        false
    }

    /// Renames, replacing an existing target atomically (POSIX rename).
    pub fn rename(
        &mut self,
        sdir: u64,
        sname: &[u8],
        ddir: u64,
        dname: &[u8],
    ) -> Result<(), FsError> {
        check_name(sname)?;
        check_name(dname)?;
        let mut tx = Tx::default();
        let sd = self.dir(&tx, sdir)?;
        let dd = self.dir(&tx, ddir)?;
        let (so, sino) = self.find(&tx, &sd, sname).ok_or(FsError::NotFound)?;
        let target = self.find(&tx, &dd, dname);
        if target.map(|t| t.1) == Some(sino) {
            return Ok(());
        }
        let s = self.inode(sino);
        if s.is_dir() && self.is_under(ddir, sino) {
            return Err(FsError::Invalid);
        }
        let mut fresh = Vec::new();
        let mut freed = Vec::new();
        match target {
            Some((to, tino)) => {
                let t = self.inode(tino);
                match (s.is_dir(), t.is_dir()) {
                    (true, false) => return Err(FsError::NotDir),
                    (false, true) => return Err(FsError::IsDir),
                    (true, true) if !self.is_empty_dir(&tx, &t) => return Err(FsError::NotEmpty),
                    _ => {}
                }
                tx.put(to, &dirent(sino, dname));
                if t.is_dir() {
                    self.touch_dir(&mut tx, ddir, -1);
                }
                freed = self.drop_link(&mut tx, tino)?;
            }
            None => fresh = self.add_entry(&mut tx, ddir, dname, sino)?,
        }
        tx.put(so, &0u64.to_le_bytes());
        self.touch_dir(&mut tx, sdir, 0);
        self.touch_dir(&mut tx, ddir, 0);
        let mut s = tx.inode(self.m.bytes(), &self.g, sino);
        s.ctime_ns = now_ns();
        if s.is_dir() && sdir != ddir {
            s.parent = ddir;
            self.touch_dir(&mut tx, sdir, -1);
            self.touch_dir(&mut tx, ddir, 1);
        }
        tx.put_inode(sino, s);
        self.commit(tx, &fresh, &freed)
    }

    /// Entries of `dir` from cookie `from` (0 = the start), at most `max`.
    pub fn readdir(&self, dir: u64, from: u64, max: usize) -> Result<Vec<DirEntry>, FsError> {
        let tx = Tx::default();
        let d = self.dir(&tx, dir)?;
        let r = self.m.bytes();
        let mut out = Vec::new();
        for (k, (o, ino)) in self.slots(&tx, &d).enumerate().skip(from as usize) {
            if ino == 0 {
                continue;
            }
            if out.len() == max {
                break;
            }
            let kind = self
                .inode(ino)
                .kind()
                .ok_or_else(|| FsError::Corrupt(format!("inode {ino} kind")))?;
            let name = r[o + 9..o + 9 + r[o + 8] as usize].to_vec();
            out.push(DirEntry {
                next: k as u64 + 1,
                ino,
                name,
                kind,
            });
        }
        Ok(out)
    }

    pub fn setattr(&mut self, ino: u64, a: SetAttr) -> Result<Attr, FsError> {
        let mut tx = Tx::default();
        let mut i = self.live(ino)?;
        let mut freed = Vec::new();
        if let Some(size) = a.size {
            if i.kind() != Some(FileKind::File) {
                return Err(if i.is_dir() {
                    FsError::IsDir
                } else {
                    FsError::Invalid
                });
            }
            if size.div_ceil(BLOCK_SIZE as u64) > crate::fs::MAX_FILE_BLOCKS {
                return Err(FsError::TooBig);
            }
            freed = self.truncate_in(&mut tx, &mut i, size)?;
            i.mtime_ns = now_ns();
        }
        if let Some(m) = a.mode {
            i.mode = (i.mode & S_IFMT) | (m & 0o7777);
        }
        i.uid = a.uid.unwrap_or(i.uid);
        i.gid = a.gid.unwrap_or(i.gid);
        i.atime_ns = a.atime_ns.unwrap_or(i.atime_ns);
        i.mtime_ns = a.mtime_ns.unwrap_or(i.mtime_ns);
        i.ctime_ns = now_ns();
        tx.put_inode(ino, i);
        self.commit(tx, &[], &freed)?;
        Ok(self.attr(ino, &i))
    }

    /// Every acknowledged operation is already durable (each write and
    /// transaction is persisted before it returns), so fsync only checks the
    /// file still exists.
    pub fn fsync(&self, ino: u64) -> Result<(), FsError> {
        self.live(ino).map(|_| ())
    }

    pub fn statfs(&self) -> StatFs {
        StatFs {
            bsize: BLOCK_SIZE as u32,
            blocks: self.g.blocks - self.g.data_start(),
            bfree: self.free_blocks,
            files: self.g.inodes() - 1,
            ffree: self.free_inodes,
            namelen: NAME_MAX as u32,
        }
    }
}

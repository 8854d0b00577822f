//! The FUSE file system over a `Client` (`ustor fs mount`): each kernel
//! request becomes one protocol request (inode numbers are the server's;
//! its root is 1, as FUSE's). Caching: the kernel keeps entries and
//! attributes for `ttl`; on open the attributes are fetched fresh
//! (close-to-open consistency) and the page cache is kept
//! (FOPEN_KEEP_CACHE) only while the file's size and mtime are what this
//! client last saw, so another client's change is never served stale after
//! an open. Writes go write-through from the kernel's buffer to the socket
//! without a copy (writev); mmap works over the page cache.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    FileAttr, FileType, Filesystem, KernelConfig, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow,
};
use ustor_fs::{Attr, FileKind, SetAttr};

use crate::Client;

/// The FUSE file system of one mounted export.
pub struct FuseFs {
    c: Arc<Client>,
    ttl: Duration,
    /// (size, mtime) of each file as this client last saw it: an open keeps
    /// the page cache only when the server still says the same.
    seen: HashMap<u64, (u64, i64)>,
}

fn time(ns: i64) -> SystemTime {
    let d = Duration::from_nanos(ns.unsigned_abs());
    if ns >= 0 {
        UNIX_EPOCH + d
    } else {
        UNIX_EPOCH - d
    }
}

fn ns(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i64,
        Err(e) => -(e.duration().as_nanos() as i64),
    }
}

fn kind_of(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        _ => FileType::RegularFile,
    }
}

/// The kernel's view of an attribute.
pub fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: a.ino,
        size: a.size,
        blocks: a.blocks,
        atime: time(a.atime_ns),
        mtime: time(a.mtime_ns),
        ctime: time(a.ctime_ns),
        crtime: time(a.ctime_ns),
        kind: kind_of(a.mode),
        perm: (a.mode & 0o7777) as u16,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: 0,
        blksize: ustor_fs::BLOCK_SIZE as u32,
        flags: 0,
    }
}

fn when(t: Option<TimeOrNow>) -> Option<i64> {
    t.map(|t| match t {
        TimeOrNow::Now => ns(SystemTime::now()),
        TimeOrNow::SpecificTime(t) => ns(t),
    })
}

impl FuseFs {
    pub fn new(c: Arc<Client>, ttl: Duration) -> Self {
        Self {
            c,
            ttl,
            seen: HashMap::new(),
        }
    }

    fn entry(&mut self, r: crate::Result<Attr>, reply: ReplyEntry) {
        match r {
            Ok(a) => reply.entry(&self.ttl, &file_attr(&a), 0),
            Err(e) => reply.error(e.errno()),
        }
    }

    fn note(&mut self, a: &Attr) {
        if a.mode & libc::S_IFMT == libc::S_IFREG {
            self.seen.insert(a.ino, (a.size, a.mtime_ns));
        }
    }
}

impl Filesystem for FuseFs {
    fn init(&mut self, _req: &Request<'_>, cfg: &mut KernelConfig) -> Result<(), libc::c_int> {
        // One protocol request carries up to 1 MiB; so may the kernel's.
        let _ = cfg.set_max_write(ustor_fs::MAX_WRITE as u32);
        let _ = cfg.set_max_readahead(ustor_fs::MAX_WRITE as u32);
        Ok(())
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let r = self.c.lookup(parent, name.as_bytes());
        self.entry(r, reply)
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        match self.c.getattr(ino) {
            Ok(a) => reply.attr(&self.ttl, &file_attr(&a)),
            Err(e) => reply.error(e.errno()),
        }
    }

    fn setattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<u64>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        let s = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime_ns: when(atime),
            mtime_ns: when(mtime),
        };
        match self.c.setattr(ino, &s) {
            Ok(a) => {
                self.note(&a);
                reply.attr(&self.ttl, &file_attr(&a))
            }
            Err(e) => reply.error(e.errno()),
        }
    }

    fn readlink(&mut self, _req: &Request<'_>, ino: u64, reply: ReplyData) {
        match self.c.readlink(ino) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(e.errno()),
        }
    }

    fn mkdir(
        &mut self,
        req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let m = mode & !umask & 0o7777;
        let r = self
            .c
            .mkdir(parent, name.as_bytes(), m, req.uid(), req.gid());
        self.entry(r, reply)
    }

    fn unlink(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        empty(self.c.unlink(parent, name.as_bytes()), reply)
    }

    fn rmdir(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        empty(self.c.rmdir(parent, name.as_bytes()), reply)
    }

    fn symlink(
        &mut self,
        req: &Request<'_>,
        parent: u64,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let (n, t) = (link_name.as_bytes(), target.as_os_str().as_bytes());
        let r = self.c.symlink(parent, n, t, req.uid(), req.gid());
        self.entry(r, reply)
    }

    fn rename(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
        reply: ReplyEmpty,
    ) {
        // RENAME_NOREPLACE/EXCHANGE are not in the protocol.
        if flags != 0 {
            return reply.error(libc::EINVAL);
        }
        let r = self
            .c
            .rename(parent, name.as_bytes(), newparent, newname.as_bytes());
        empty(r, reply)
    }

    fn link(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        newparent: u64,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let r = self.c.link(ino, newparent, newname.as_bytes());
        self.entry(r, reply)
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        // Close-to-open: fresh attributes from the server at every open.
        match self.c.getattr(ino) {
            Ok(a) => {
                let same = self.seen.get(&ino) == Some(&(a.size, a.mtime_ns));
                self.note(&a);
                let keep = if same {
                    fuser::consts::FOPEN_KEEP_CACHE
                } else {
                    0
                };
                reply.opened(0, keep)
            }
            Err(e) => reply.error(e.errno()),
        }
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        match self.c.read(ino, offset as u64, size as usize) {
            Ok(d) => reply.data(&d),
            Err(e) => reply.error(e.errno()),
        }
    }

    fn write(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        data: &[u8],
        _write_flags: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyWrite,
    ) {
        match self.c.write(ino, offset as u64, data) {
            Ok(a) => {
                // Our own write: what the page cache holds is current.
                if let Some(a) = a {
                    self.note(&a);
                } else {
                    self.seen.remove(&ino);
                }
                reply.written(data.len() as u32)
            }
            Err(e) => reply.error(e.errno()),
        }
    }

    fn flush(&mut self, _req: &Request<'_>, _ino: u64, _fh: u64, _lo: u64, reply: ReplyEmpty) {
        // Writes are write-through: nothing is held back at close.
        reply.ok()
    }

    fn fsync(&mut self, _req: &Request<'_>, ino: u64, _fh: u64, _ds: bool, reply: ReplyEmpty) {
        empty(self.c.fsync(ino), reply)
    }

    fn fsyncdir(&mut self, _req: &Request<'_>, ino: u64, _fh: u64, _ds: bool, reply: ReplyEmpty) {
        empty(self.c.fsync(ino), reply)
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        // The offset the kernel hands back is the server's cookie.
        let mut cookie = offset as u64;
        loop {
            let es = match self.c.readdir(ino, cookie, 128) {
                Ok(es) => es,
                Err(e) => return reply.error(e.errno()),
            };
            if es.is_empty() {
                return reply.ok();
            }
            for e in es {
                let k = match e.kind {
                    FileKind::File => FileType::RegularFile,
                    FileKind::Dir => FileType::Directory,
                    FileKind::Symlink => FileType::Symlink,
                };
                if reply.add(e.ino, e.next as i64, k, OsStr::from_bytes(&e.name)) {
                    return reply.ok();
                }
                cookie = e.next;
            }
        }
    }

    fn statfs(&mut self, _req: &Request<'_>, _ino: u64, reply: ReplyStatfs) {
        match self.c.statfs() {
            Ok(s) => reply.statfs(
                s.blocks, s.bfree, s.bfree, s.files, s.ffree, s.bsize, s.namelen, s.bsize,
            ),
            Err(e) => reply.error(e.errno()),
        }
    }

    fn create(
        &mut self,
        req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let m = mode & !umask & 0o7777;
        match self
            .c
            .create(parent, name.as_bytes(), m, req.uid(), req.gid())
        {
            Ok(a) => {
                self.note(&a);
                reply.created(&self.ttl, &file_attr(&a), 0, 0, 0)
            }
            Err(e) => reply.error(e.errno()),
        }
    }
}

fn empty(r: crate::Result<()>, reply: ReplyEmpty) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e.errno()),
    }
}

//! The FUSE file system over a `Client` (`ustor fs mount`): each kernel
//! request becomes one protocol request (inode numbers are the server's;
//! its root is 1, as FUSE's). Caching: the kernel keeps entries and
//! attributes for `ttl`; on open the attributes are fetched fresh
//! (close-to-open consistency) and the page cache is kept
//! (FOPEN_KEEP_CACHE) only while the file's size and mtime are what this
//! client last saw, so another client's change is never served stale after
//! an open. Writes go write-through from the kernel's buffer to the socket
//! without a copy (writev); mmap works over the page cache.
//!
//! Concurrency: reads and writes are sent from fuser's session thread and
//! answered to the kernel by the connection's reader thread as soon as
//! their reply arrives ([`Client::read_then`]), so the kernel's requests
//! overlap on the pipelined connection and a reply wakes one thread of
//! ours, not two; so are lookups and getattrs. The other metadata calls
//! (those that keep state here: open files, the hidden names) are
//! answered on the session thread. readdir lists "." and ".."
//! first (the server's directories hold neither). A file unlinked or
//! renamed over while open here lives on under a hidden name until its
//! last close (as with libfuse), so open descriptors keep working.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    FileAttr, FileType, Filesystem, KernelConfig, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow,
};
use ustor_fs::{Attr, FileKind, SetAttr};

use crate::Client;

/// (size, mtime) of each file as this client last saw it.
type Seen = Arc<Mutex<HashMap<u64, (u64, i64)>>>;

/// The FUSE file system of one mounted export.
pub struct FuseFs {
    c: Arc<Client>,
    ttl: Duration,
    /// (size, mtime) of each file as this client last saw it: an open keeps
    /// the page cache only when the server still says the same.
    seen: Seen,
    opened: Opened,
    /// Ask the kernel for its writeback cache.
    writeback: bool,
}

/// Files open through this mount, and those unlinked (or renamed over)
/// while open: as libfuse does, such a file is renamed to a hidden name
/// instead, so the open descriptors keep reading and writing it, and is
/// unlinked at its last close.
#[derive(Default)]
struct Opened {
    count: HashMap<u64, u32>,
    /// Inode -> (directory, hidden name).
    hidden: HashMap<u64, (u64, Vec<u8>)>,
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
            seen: Seen::default(),
            opened: Opened::default(),
            writeback: false,
        }
    }

    /// With `on`, the kernel's writeback cache: writes are buffered in the
    /// page cache and sent in the background (coalesced into large
    /// writes), at the latest when the file is closed (the kernel flushes
    /// dirty pages before FLUSH) or fsync'ed, so close-to-open holds and
    /// fsync still means durable on the server.
    pub fn writeback(mut self, on: bool) -> Self {
        self.writeback = on;
        self
    }

    /// The inode `name` in `dir` names when it is a file open here whose
    /// last link that name is (an extra lookup only while files are open).
    fn open_last_link(&self, dir: u64, name: &[u8]) -> Option<u64> {
        if self.opened.count.is_empty() {
            return None;
        }
        let a = self.c.lookup(dir, name).ok()?;
        let file = a.mode & libc::S_IFMT == libc::S_IFREG && a.nlink == 1;
        (file && self.opened.count.contains_key(&a.ino)).then_some(a.ino)
    }

    /// Moves an open file's last name out of the way (see [`Opened`]).
    fn hide(&mut self, dir: u64, name: &[u8], ino: u64) -> crate::Result<()> {
        let h = format!(".ustor_hidden{ino:016x}").into_bytes();
        self.c.rename(dir, name, dir, &h)?;
        self.opened.hidden.insert(ino, (dir, h));
        Ok(())
    }

    fn note_open(&mut self, ino: u64) {
        *self.opened.count.entry(ino).or_default() += 1;
    }

    fn entry(&mut self, r: crate::Result<Attr>, reply: ReplyEntry) {
        match r {
            Ok(a) => reply.entry(&self.ttl, &file_attr(&a), 0),
            Err(e) => reply.error(e.errno()),
        }
    }

    fn note(&mut self, a: &Attr) {
        note(&self.seen, a);
    }
}

fn note(seen: &Seen, a: &Attr) {
    if a.mode & libc::S_IFMT == libc::S_IFREG {
        let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
        s.insert(a.ino, (a.size, a.mtime_ns));
    }
}

impl Filesystem for FuseFs {
    fn init(&mut self, _req: &Request<'_>, cfg: &mut KernelConfig) -> Result<(), libc::c_int> {
        // One protocol request carries up to 1 MiB; so may the kernel's.
        let _ = cfg.set_max_write(ustor_fs::MAX_WRITE as u32);
        let _ = cfg.set_max_readahead(ustor_fs::MAX_WRITE as u32);
        if self.writeback {
            cfg.add_capabilities(fuser::consts::FUSE_WRITEBACK_CACHE)
                .map_err(|_| libc::ENOSYS)?;
        }
        Ok(())
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        // Answered from the reader thread, like reads (no state here).
        let ttl = self.ttl;
        self.c
            .lookup_then(parent, name.as_bytes(), move |r| match r {
                Ok(a) => reply.entry(&ttl, &file_attr(&a), 0),
                Err(e) => reply.error(e.errno()),
            });
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        let ttl = self.ttl;
        self.c.getattr_then(ino, move |r| match r {
            Ok(a) => reply.attr(&ttl, &file_attr(&a)),
            Err(e) => reply.error(e.errno()),
        });
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
        let name = name.as_bytes();
        if let Some(ino) = self.open_last_link(parent, name) {
            return empty(self.hide(parent, name, ino), reply);
        }
        empty(self.c.unlink(parent, name), reply)
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
        let (name, newname) = (name.as_bytes(), newname.as_bytes());
        if let Some(ino) = self.open_last_link(newparent, newname) {
            // The source is another inode (the target has one link): the
            // open target lives on under its hidden name.
            if let Err(e) = self.hide(newparent, newname, ino) {
                return reply.error(e.errno());
            }
        }
        empty(self.c.rename(parent, name, newparent, newname), reply)
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
                let same = {
                    let s = self.seen.lock().unwrap_or_else(|e| e.into_inner());
                    s.get(&ino) == Some(&(a.size, a.mtime_ns))
                };
                self.note(&a);
                let keep = if same {
                    fuser::consts::FOPEN_KEEP_CACHE
                } else {
                    0
                };
                self.note_open(ino);
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
        // Sent here, answered from the reader thread: the next request is
        // read meanwhile.
        self.c
            .read_then(ino, offset as u64, size as usize, move |r| match r {
                Ok(d) => reply.data(&d),
                Err(e) => reply.error(e.errno()),
            });
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
        // The payload leaves from the kernel's buffer here (no copy); the
        // reader thread answers the kernel when the reply arrives.
        let (seen, n) = (self.seen.clone(), data.len() as u32);
        self.c
            .write_then(ino, offset as u64, data, move |r| match r {
                Ok(a) => {
                    // Our own write: what the page cache holds is current.
                    match a {
                        Some(a) => note(&seen, &a),
                        None => {
                            seen.lock().unwrap_or_else(|e| e.into_inner()).remove(&ino);
                        }
                    }
                    reply.written(n)
                }
                Err(e) => reply.error(e.errno()),
            });
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
        // Offsets 1 and 2 are "." and ".."; past them the offset the kernel
        // hands back is the server's cookie + 2.
        if offset < 1 && reply.add(ino, 1, FileType::Directory, ".") {
            return reply.ok();
        }
        if offset < 2 {
            let up = match self.c.lookup(ino, b"..") {
                Ok(a) => a.ino,
                Err(e) => return reply.error(e.errno()),
            };
            if reply.add(up, 2, FileType::Directory, "..") {
                return reply.ok();
            }
        }
        let mut cookie = (offset.max(2) - 2) as u64;
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
                if reply.add(e.ino, e.next as i64 + 2, k, OsStr::from_bytes(&e.name)) {
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
                self.note_open(a.ino);
                reply.created(&self.ttl, &file_attr(&a), 0, 0, 0)
            }
            Err(e) => reply.error(e.errno()),
        }
    }

    fn release(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        _flags: i32,
        _lock_owner: Option<u64>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let last = match self.opened.count.get_mut(&ino) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => self.opened.count.remove(&ino).is_some(),
            None => false,
        };
        if let Some((dir, h)) = last.then(|| self.opened.hidden.remove(&ino)).flatten() {
            // Unlinked while open: its hidden name goes with the last close.
            if let Err(e) = self.c.unlink(dir, &h) {
                tracing::warn!(ino, "fs mount: hidden file not removed: {e}");
            }
        }
        reply.ok()
    }
}

fn empty(r: crate::Result<()>, reply: ReplyEmpty) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e.errno()),
    }
}

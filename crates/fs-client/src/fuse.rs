//! The FUSE file system over any [`RemoteFs`] (`ustor fs mount`): one
//! dispatcher, [`FuseFs::dispatch`], turns each decoded kernel request
//! ([`crate::ll::Op`]) into protocol calls and answers through a
//! [`Reply`] sink, the same for both FUSE modes (a /dev/fuse reply is
//! written to the device; a ring reply goes into the queue entry; see
//! `crate::session`). Inode numbers are the server's (its root is 1, as
//! FUSE's).
//!
//! Caching: the kernel keeps entries and attributes for `ttl`; on open the
//! attributes are fetched fresh (close-to-open consistency) and the page
//! cache is kept (FOPEN_KEEP_CACHE) only while the file's size and mtime
//! are what this client last saw, so another client's change is never
//! served stale after an open. Writes go from the kernel's buffer to the
//! transport without a copy of ours; mmap works over the page cache.
//!
//! Concurrency: lookups, getattrs, reads and writes use the `*_then`
//! forms, so with a pipelined client ([`crate::Client`]) they are answered
//! by the connection's reader thread as soon as their reply arrives and
//! the kernel's requests overlap. The other calls are answered where they
//! were received; those that keep state here (open files, hidden names)
//! hold its lock across their calls, so queues on several threads see
//! one order. readdir lists "." and ".." first (the server's directories
//! hold neither). A file unlinked or renamed over while open here lives on
//! under a hidden name until its last close (as with libfuse), so open
//! descriptors keep working.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ustor_fs::{Attr, FileKind, SetAttr};

use crate::ll::{self, reply, AttrOut, InHeader, Op, SetattrIn};
use crate::RemoteFs;

/// Where a request's answer goes: an errno (0: success) and the reply
/// body in pieces (sent back to back). Dropping it unanswered is only
/// right for the requests that take no reply (forgets).
pub trait Reply: Send + 'static {
    fn send(self, errno: i32, body: &[&[u8]]);
}

/// `FOPEN_KEEP_CACHE`.
const KEEP_CACHE: u32 = 1 << 1;

// `fuse_setattr_in.valid` bits.
const FATTR_MODE: u32 = 1 << 0;
const FATTR_UID: u32 = 1 << 1;
const FATTR_GID: u32 = 1 << 2;
const FATTR_SIZE: u32 = 1 << 3;
const FATTR_ATIME: u32 = 1 << 4;
const FATTR_MTIME: u32 = 1 << 5;
const FATTR_ATIME_NOW: u32 = 1 << 7;
const FATTR_MTIME_NOW: u32 = 1 << 8;

/// `fuse_dirent.type` (DT_*).
const DT_DIR: u32 = 4;
const DT_REG: u32 = 8;
const DT_LNK: u32 = 10;

/// The FUSE file system of one mounted export. Clones share the client
/// and the state (one per thread that serves requests).
pub struct FuseFs<F> {
    fs: Arc<F>,
    ttl: (u64, u32),
    writeback: bool,
    st: Arc<State>,
}

impl<F> Clone for FuseFs<F> {
    fn clone(&self) -> Self {
        Self {
            fs: self.fs.clone(),
            ttl: self.ttl,
            writeback: self.writeback,
            st: self.st.clone(),
        }
    }
}

#[derive(Default)]
struct State {
    /// (size, mtime) of each file as this client last saw it: an open
    /// keeps the page cache only when the server still says the same.
    seen: Mutex<HashMap<u64, (u64, i64)>>,
    opened: Mutex<Opened>,
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn ts(ns: i64) -> (u64, u32) {
    let g = 1_000_000_000;
    (ns.div_euclid(g) as u64, ns.rem_euclid(g) as u32)
}

fn now_ns() -> i64 {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i64,
        Err(e) => -(e.duration().as_nanos() as i64),
    }
}

/// The kernel's view of an attribute (`fuse_attr`).
pub fn attr_out(a: &Attr) -> AttrOut {
    let kind = match a.mode & libc::S_IFMT {
        k @ (libc::S_IFDIR | libc::S_IFLNK) => k,
        _ => libc::S_IFREG,
    };
    AttrOut {
        ino: a.ino,
        size: a.size,
        blocks: a.blocks,
        atime: ts(a.atime_ns),
        mtime: ts(a.mtime_ns),
        ctime: ts(a.ctime_ns),
        mode: kind | (a.mode & 0o7777),
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        blksize: ustor_fs::BLOCK_SIZE as u32,
    }
}

/// The protocol's setattr from the kernel's.
fn set_attr(s: &SetattrIn) -> SetAttr {
    let v = s.valid;
    let has = |b: u32| v & b != 0;
    let time = |set: u32, now: u32, secs: u64, nsec: u32| {
        if has(now) {
            Some(now_ns())
        } else {
            has(set).then(|| (secs as i64).saturating_mul(1_000_000_000) + nsec as i64)
        }
    };
    SetAttr {
        mode: has(FATTR_MODE).then_some(s.mode),
        uid: has(FATTR_UID).then_some(s.uid),
        gid: has(FATTR_GID).then_some(s.gid),
        size: has(FATTR_SIZE).then_some(s.size),
        atime_ns: time(FATTR_ATIME, FATTR_ATIME_NOW, s.atime, s.atimensec),
        mtime_ns: time(FATTR_MTIME, FATTR_MTIME_NOW, s.mtime, s.mtimensec),
    }
}

fn empty<R: Reply>(r: R, res: crate::Result<()>) {
    match res {
        Ok(()) => r.send(0, &[]),
        Err(e) => r.send(e.errno(), &[]),
    }
}

fn entry<R: Reply>(r: R, res: crate::Result<Attr>, ttl: (u64, u32)) {
    match res {
        Ok(a) => r.send(0, &[&reply::entry(&attr_out(&a), ttl)]),
        Err(e) => r.send(e.errno(), &[]),
    }
}

fn note(st: &State, a: &Attr) {
    if a.mode & libc::S_IFMT == libc::S_IFREG {
        lock(&st.seen).insert(a.ino, (a.size, a.mtime_ns));
    }
}

impl<F: RemoteFs> FuseFs<F> {
    pub fn new(fs: Arc<F>, ttl: Duration) -> Self {
        Self {
            fs,
            ttl: (ttl.as_secs(), ttl.subsec_nanos()),
            writeback: false,
            st: Arc::default(),
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

    /// The same file system (its state shared) over another client of
    /// the export ([`RemoteFs::for_queue`]).
    pub fn with_remote(&self, fs: Arc<F>) -> Self {
        Self { fs, ..self.clone() }
    }

    /// The client requests go to.
    pub fn remote(&self) -> &Arc<F> {
        &self.fs
    }

    /// The INIT flags this file system asks for (the session adds the
    /// ring's and keeps what the kernel offers).
    pub fn init_flags(&self) -> u64 {
        use ll::init_flags::*;
        let wb = if self.writeback { WRITEBACK_CACHE } else { 0 };
        ASYNC_READ | BIG_WRITES | MAX_PAGES | wb
    }

    /// Answers one request (not INIT: the session answers it) through `r`.
    /// The hot calls are pipelined; the rest go to [`FuseFs::meta`].
    pub fn dispatch<R: Reply>(&self, h: &InHeader, op: Op<'_>, r: R) {
        let (ino, ttl) = (h.nodeid, self.ttl);
        match op {
            Op::Forget { .. } | Op::BatchForget { .. } => drop(r),
            Op::Lookup { name } => self.fs.lookup_then(ino, name, move |a| entry(r, a, ttl)),
            Op::Getattr { .. } => self.fs.getattr_then(ino, move |a| match a {
                Ok(a) => r.send(0, &[&reply::attr(&attr_out(&a), ttl)]),
                Err(e) => r.send(e.errno(), &[]),
            }),
            Op::Read { offset, size, .. } => {
                let len = (size as usize).min(ustor_fs::MAX_WRITE);
                self.fs.read_then(ino, offset, len, move |d| match d {
                    Ok(d) => r.send(0, &[&d]),
                    Err(e) => r.send(e.errno(), &[]),
                })
            }
            Op::Write { offset, data, .. } => {
                let (st, n) = (self.st.clone(), data.len() as u32);
                self.fs.write_then(ino, offset, data, move |a| match a {
                    Ok(a) => {
                        // Our own write: what the page cache holds is current.
                        match a {
                            Some(a) => note(&st, &a),
                            None => drop(lock(&st.seen).remove(&ino)),
                        }
                        r.send(0, &[&reply::write(n)])
                    }
                    Err(e) => r.send(e.errno(), &[]),
                })
            }
            // Writes are write-through (or flushed by the kernel before
            // FLUSH): nothing is held back here at close.
            Op::Flush { .. } | Op::Releasedir { .. } | Op::Destroy => r.send(0, &[]),
            Op::Opendir { .. } => r.send(0, &[&reply::open(0, 0)]),
            Op::Fsync { .. } | Op::Fsyncdir { .. } => empty(r, self.fs.fsync(ino)),
            Op::Readdir { offset, size, .. } => self.readdir(ino, offset, size as usize, r),
            // The kernel checks permissions itself (default_permissions);
            // ENOSYS also stops it sending these (interrupts: the calls
            // are bounded by the client's timeout).
            Op::Access { .. } | Op::Interrupt { .. } | Op::Mknod { .. } | Op::Init { .. } => {
                r.send(libc::ENOSYS, &[])
            }
            op => self.meta(h, op, r),
        }
    }

    /// The calls that change the namespace or keep state here.
    fn meta<R: Reply>(&self, h: &InHeader, op: Op<'_>, r: R) {
        let (ino, ttl, fs) = (h.nodeid, self.ttl, &self.fs);
        match op {
            Op::Setattr(s) => match fs.setattr(ino, &set_attr(&s)) {
                Ok(a) => {
                    note(&self.st, &a);
                    r.send(0, &[&reply::attr(&attr_out(&a), ttl)])
                }
                Err(e) => r.send(e.errno(), &[]),
            },
            Op::Readlink => match fs.readlink(ino) {
                Ok(t) => r.send(0, &[&t]),
                Err(e) => r.send(e.errno(), &[]),
            },
            Op::Mkdir { mode, umask, name } => {
                let m = mode & !umask & 0o7777;
                entry(r, fs.mkdir(ino, name, m, h.uid, h.gid), ttl)
            }
            Op::Symlink { name, target } => {
                entry(r, fs.symlink(ino, name, target, h.uid, h.gid), ttl)
            }
            Op::Link { oldnodeid, name } => entry(r, fs.link(oldnodeid, ino, name), ttl),
            Op::Rmdir { name } => empty(r, fs.rmdir(ino, name)),
            Op::Unlink { name } => {
                let mut o = lock(&self.st.opened);
                match self.open_last_link(&o, ino, name) {
                    Some(f) => empty(r, self.hide(&mut o, ino, name, f)),
                    None => empty(r, fs.unlink(ino, name)),
                }
            }
            Op::Rename {
                newdir,
                flags,
                name,
                newname,
            } => empty(r, self.rename(ino, name, newdir, newname, flags)),
            Op::Open { .. } => self.open(ino, r),
            Op::Create {
                mode, umask, name, ..
            } => {
                let m = mode & !umask & 0o7777;
                match fs.create(ino, name, m, h.uid, h.gid) {
                    Ok(a) => {
                        note(&self.st, &a);
                        *lock(&self.st.opened).count.entry(a.ino).or_default() += 1;
                        r.send(0, &[&reply::create(&attr_out(&a), ttl, 0, 0)])
                    }
                    Err(e) => r.send(e.errno(), &[]),
                }
            }
            Op::Release { .. } => {
                self.release(ino);
                r.send(0, &[])
            }
            Op::Statfs => match fs.statfs() {
                Ok(s) => {
                    let b = reply::statfs(s.blocks, s.bfree, s.files, s.ffree, s.bsize, s.namelen);
                    r.send(0, &[&b])
                }
                Err(e) => r.send(e.errno(), &[]),
            },
            _ => r.send(libc::ENOSYS, &[]),
        }
    }

    /// The inode `name` in `dir` names when it is a file open here whose
    /// last link that name is (an extra lookup only while files are open).
    fn open_last_link(&self, o: &Opened, dir: u64, name: &[u8]) -> Option<u64> {
        if o.count.is_empty() {
            return None;
        }
        let a = self.fs.lookup(dir, name).ok()?;
        let file = a.mode & libc::S_IFMT == libc::S_IFREG && a.nlink == 1;
        (file && o.count.contains_key(&a.ino)).then_some(a.ino)
    }

    /// Moves an open file's last name out of the way (see [`Opened`]).
    fn hide(&self, o: &mut Opened, dir: u64, name: &[u8], ino: u64) -> crate::Result<()> {
        let h = format!(".ustor_hidden{ino:016x}").into_bytes();
        self.fs.rename(dir, name, dir, &h)?;
        o.hidden.insert(ino, (dir, h));
        Ok(())
    }

    fn rename(&self, dir: u64, name: &[u8], nd: u64, nn: &[u8], flags: u32) -> crate::Result<()> {
        // RENAME_NOREPLACE/EXCHANGE are not in the protocol.
        if flags != 0 {
            return Err(crate::ClientError::Errno(libc::EINVAL));
        }
        let mut o = lock(&self.st.opened);
        if let Some(ino) = self.open_last_link(&o, nd, nn) {
            // The source is another inode (the target has one link): the
            // open target lives on under its hidden name.
            self.hide(&mut o, nd, nn, ino)?;
        }
        self.fs.rename(dir, name, nd, nn)
    }

    /// Close-to-open: fresh attributes from the server at every open.
    fn open<R: Reply>(&self, ino: u64, r: R) {
        match self.fs.getattr(ino) {
            Ok(a) => {
                let same = lock(&self.st.seen).get(&ino) == Some(&(a.size, a.mtime_ns));
                note(&self.st, &a);
                *lock(&self.st.opened).count.entry(ino).or_default() += 1;
                let keep = if same { KEEP_CACHE } else { 0 };
                r.send(0, &[&reply::open(0, keep)])
            }
            Err(e) => r.send(e.errno(), &[]),
        }
    }

    fn release(&self, ino: u64) {
        let mut o = lock(&self.st.opened);
        let last = match o.count.get_mut(&ino) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => o.count.remove(&ino).is_some(),
            None => false,
        };
        if let Some((dir, h)) = last.then(|| o.hidden.remove(&ino)).flatten() {
            // Unlinked while open: its hidden name goes with the last close.
            if let Err(e) = self.fs.unlink(dir, &h) {
                tracing::warn!(ino, "fs mount: hidden file not removed: {e}");
            }
        }
    }

    /// Offsets 1 and 2 are "." and ".."; past them the offset the kernel
    /// hands back is the server's cookie + 2. At most `max` bytes.
    fn readdir<R: Reply>(&self, ino: u64, offset: u64, max: usize, r: R) {
        let mut out = Vec::with_capacity(max.min(64 << 10));
        if offset < 1 && !reply::push_dirent(&mut out, max, ino, 1, DT_DIR, b".") {
            return r.send(0, &[&out]);
        }
        if offset < 2 {
            let up = match self.fs.lookup(ino, b"..") {
                Ok(a) => a.ino,
                Err(e) => return r.send(e.errno(), &[]),
            };
            if !reply::push_dirent(&mut out, max, up, 2, DT_DIR, b"..") {
                return r.send(0, &[&out]);
            }
        }
        let mut cookie = offset.max(2) - 2;
        // Budget: each round lists up to 128 entries; it ends when the
        // buffer is full or the directory is.
        loop {
            let es = match self.fs.readdir(ino, cookie, 128) {
                Ok(es) => es,
                Err(e) => return r.send(e.errno(), &[]),
            };
            if es.is_empty() {
                return r.send(0, &[&out]);
            }
            for e in es {
                let k = match e.kind {
                    FileKind::File => DT_REG,
                    FileKind::Dir => DT_DIR,
                    FileKind::Symlink => DT_LNK,
                };
                if !reply::push_dirent(&mut out, max, e.ino, e.next + 2, k, &e.name) {
                    return r.send(0, &[&out]);
                }
                cookie = e.next;
            }
        }
    }
}

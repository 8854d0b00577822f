//! `RemoteFs`: the file operations the FUSE mount (`crate::fuse`) needs
//! from a client of the file service, whatever carries them (TCP's
//! [`Client`], the raw-Ethernet `XdpClient`). The mount is generic over
//! it, so one dispatcher serves every transport and both FUSE modes.
//!
//! The `*_then` forms hand the result to a callback instead of returning
//! it: a pipelined client sends the request and runs the callback on the
//! thread that receives the reply (the mount answers the kernel from
//! there, so several requests are in flight and a reply wakes one thread,
//! not two). Their default methods call the blocking form and run the
//! callback inline, which is right for a client with one request in
//! flight at a time.

use std::sync::Arc;

use ustor_fs::{Attr, DirEntry, SetAttr, StatFs};

use crate::{Client, Result};

/// A client of one export: the calls the FUSE mount makes. Inode numbers
/// are the server's (its root is [`ustor_fs::ROOT_INO`], 1, as FUSE's).
/// Reads and writes take at most [`ustor_fs::MAX_WRITE`] bytes in the
/// `*_then` forms (the mount asks the kernel for no more).
pub trait RemoteFs: Send + Sync + 'static {
    fn lookup(&self, dir: u64, name: &[u8]) -> Result<Attr>;
    fn getattr(&self, ino: u64) -> Result<Attr>;
    fn setattr(&self, ino: u64, a: &SetAttr) -> Result<Attr>;
    fn create(&self, dir: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr>;
    fn mkdir(&self, dir: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr>;
    fn symlink(&self, dir: u64, name: &[u8], target: &[u8], uid: u32, gid: u32) -> Result<Attr>;
    /// Links inode `ino` into `dir` as `name`.
    fn link(&self, ino: u64, dir: u64, name: &[u8]) -> Result<Attr>;
    fn unlink(&self, dir: u64, name: &[u8]) -> Result<()>;
    fn rmdir(&self, dir: u64, name: &[u8]) -> Result<()>;
    fn rename(&self, sdir: u64, sname: &[u8], ddir: u64, dname: &[u8]) -> Result<()>;
    fn readlink(&self, ino: u64) -> Result<Vec<u8>>;
    /// Up to `max` entries of `dir` from `cookie` (0 = the start).
    fn readdir(&self, dir: u64, cookie: u64, max: u32) -> Result<Vec<DirEntry>>;
    fn statfs(&self) -> Result<StatFs>;
    fn fsync(&self, ino: u64) -> Result<()>;
    /// Up to `len` bytes at `off` (fewer at the end of the file).
    fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>>;
    /// Writes `data` at `off`; the file's attribute after the write when
    /// the server sends one.
    fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<Option<Attr>>;

    /// Up to `out.len()` bytes at `off` into `out`; how many. A transport
    /// that can receive straight into `out` (a FUSE ring entry) does.
    fn read_into(&self, ino: u64, off: u64, out: &mut [u8]) -> Result<usize> {
        let d = self.read(ino, off, out.len())?;
        let n = d.len().min(out.len());
        out[..n].copy_from_slice(&d[..n]);
        Ok(n)
    }

    /// The client one FUSE-over-io_uring queue thread uses: one whose
    /// reply wakes the calling thread (so the kernel is answered on its
    /// caller's CPU) when the transport can give one, else this one.
    fn for_queue(self: &Arc<Self>) -> Arc<Self> {
        self.clone()
    }

    /// [`RemoteFs::lookup`], its result handed to `done`.
    fn lookup_then(
        self: &Arc<Self>,
        dir: u64,
        name: &[u8],
        done: impl FnOnce(Result<Attr>) + Send + 'static,
    ) {
        done(self.lookup(dir, name))
    }

    /// [`RemoteFs::getattr`], its result handed to `done`.
    fn getattr_then(self: &Arc<Self>, ino: u64, done: impl FnOnce(Result<Attr>) + Send + 'static) {
        done(self.getattr(ino))
    }

    /// [`RemoteFs::read`], its result handed to `done`.
    fn read_then(
        self: &Arc<Self>,
        ino: u64,
        off: u64,
        len: usize,
        done: impl FnOnce(Result<Vec<u8>>) + Send + 'static,
    ) {
        done(self.read(ino, off, len))
    }

    /// [`RemoteFs::write`], its result handed to `done`. `data` is only
    /// borrowed for the call: it is sent (or copied) before this returns.
    fn write_then(
        self: &Arc<Self>,
        ino: u64,
        off: u64,
        data: &[u8],
        done: impl FnOnce(Result<Option<Attr>>) + Send + 'static,
    ) {
        done(self.write(ino, off, data))
    }
}

impl RemoteFs for Client {
    fn lookup(&self, dir: u64, name: &[u8]) -> Result<Attr> {
        Client::lookup(self, dir, name)
    }
    fn getattr(&self, ino: u64) -> Result<Attr> {
        Client::getattr(self, ino)
    }
    fn setattr(&self, ino: u64, a: &SetAttr) -> Result<Attr> {
        Client::setattr(self, ino, a)
    }
    fn create(&self, dir: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr> {
        Client::create(self, dir, name, mode, uid, gid)
    }
    fn mkdir(&self, dir: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr> {
        Client::mkdir(self, dir, name, mode, uid, gid)
    }
    fn symlink(&self, dir: u64, name: &[u8], target: &[u8], uid: u32, gid: u32) -> Result<Attr> {
        Client::symlink(self, dir, name, target, uid, gid)
    }
    fn link(&self, ino: u64, dir: u64, name: &[u8]) -> Result<Attr> {
        Client::link(self, ino, dir, name)
    }
    fn unlink(&self, dir: u64, name: &[u8]) -> Result<()> {
        Client::unlink(self, dir, name)
    }
    fn rmdir(&self, dir: u64, name: &[u8]) -> Result<()> {
        Client::rmdir(self, dir, name)
    }
    fn rename(&self, sdir: u64, sname: &[u8], ddir: u64, dname: &[u8]) -> Result<()> {
        Client::rename(self, sdir, sname, ddir, dname)
    }
    fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        Client::readlink(self, ino)
    }
    fn readdir(&self, dir: u64, cookie: u64, max: u32) -> Result<Vec<DirEntry>> {
        Client::readdir(self, dir, cookie, max)
    }
    fn statfs(&self) -> Result<StatFs> {
        Client::statfs(self)
    }
    fn fsync(&self, ino: u64) -> Result<()> {
        Client::fsync(self, ino)
    }
    fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        Client::read(self, ino, off, len)
    }
    fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<Option<Attr>> {
        Client::write(self, ino, off, data)
    }
    fn read_into(&self, ino: u64, off: u64, out: &mut [u8]) -> Result<usize> {
        Client::read_into(self, ino, off, out)
    }

    /// A [`Client::solo`]: a connection of its own, read by the queue
    /// thread.
    fn for_queue(self: &Arc<Self>) -> Arc<Self> {
        match self.solo() {
            Ok(c) => Arc::new(c),
            Err(e) => {
                tracing::warn!("fs mount: queue shares the connection: {e}");
                self.clone()
            }
        }
    }

    // Pipelined: answered on the connection's reader thread.
    fn lookup_then(
        self: &Arc<Self>,
        dir: u64,
        name: &[u8],
        done: impl FnOnce(Result<Attr>) + Send + 'static,
    ) {
        Client::lookup_then(self, dir, name, done)
    }
    fn getattr_then(self: &Arc<Self>, ino: u64, done: impl FnOnce(Result<Attr>) + Send + 'static) {
        Client::getattr_then(self, ino, done)
    }
    fn read_then(
        self: &Arc<Self>,
        ino: u64,
        off: u64,
        len: usize,
        done: impl FnOnce(Result<Vec<u8>>) + Send + 'static,
    ) {
        Client::read_then(self, ino, off, len, done)
    }
    fn write_then(
        self: &Arc<Self>,
        ino: u64,
        off: u64,
        data: &[u8],
        done: impl FnOnce(Result<Option<Attr>>) + Send + 'static,
    ) {
        Client::write_then(self, ino, off, data, done)
    }
}

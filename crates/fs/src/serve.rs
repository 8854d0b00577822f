//! The server side of a request, transport-independent: runs a decoded
//! request against the file system of an export and encodes the reply body.
//! Reads answer with region segments (the transport sends them with iovecs
//! into the mapping); writes are planned by `Fs::begin_write` so the
//! transport receives the payload into the data blocks; neither copies
//! (`Stats::copied_bytes` counts any byte we copy, and stays 0 on this path).
//!
//! Confinement: an export is a whole region, its root is the root inode and
//! the root's ".." is itself, so no name or inode number reaches outside it.

use crate::fs::{Fs, ReadSeg};
use crate::inode::{Attr, SetAttr, StatFs};
use crate::ns::DirEntry;
use crate::proto::{self, Request, SET_ATIME, SET_GID, SET_MODE, SET_MTIME, SET_SIZE, SET_UID};
use crate::FsError;

/// Counters of one export (`fs_get_stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub requests: u64,
    pub errors: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Bytes we copied on the data path (payloads go region <-> socket).
    pub copied_bytes: u64,
    /// Payload bytes the kernel copied between the socket and the region
    /// (a plain send or receive; a zero-copy send does not count).
    pub kernel_copied_bytes: u64,
    /// Zero-copy send ops whose notification came (SENDMSG_ZC).
    pub zero_copy_sends: u64,
    /// Of those, the ones the kernel copied after all (loopback, a device
    /// without scatter-gather).
    pub zero_copy_sends_copied: u64,
    /// Read payload bytes that left with no copy at all.
    pub zero_copy_bytes: u64,
}

/// What a request answers, before encoding.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    Empty,
    Attr(Attr),
    Entries(Vec<DirEntry>),
    Link(Vec<u8>),
    StatFs(StatFs),
    /// Region segments to send after the header, in order.
    Data(Vec<ReadSeg>),
}

/// Whether a request changes the file system (refused on a read-only
/// export).
pub fn mutates(req: &Request<'_>) -> bool {
    matches!(
        req,
        Request::Setattr { .. }
            | Request::Create { .. }
            | Request::Mkdir { .. }
            | Request::Symlink { .. }
            | Request::Link { .. }
            | Request::Unlink { .. }
            | Request::Rmdir { .. }
            | Request::Rename { .. }
            | Request::Write { .. }
    )
}

fn opt<T>(mask: u32, bit: u32, v: T) -> Option<T> {
    (mask & bit != 0).then_some(v)
}

/// Runs one request (not Hello/Auth, which the connection handles, nor
/// Write, which goes through `begin_write`/`finish_write`) on inode `ino`.
pub fn handle(
    fs: &mut Fs,
    read_only: bool,
    st: &mut Stats,
    ino: u64,
    req: &Request<'_>,
) -> Result<Reply, FsError> {
    st.requests += 1;
    let r = run(fs, read_only, st, ino, req);
    st.errors += r.is_err() as u64;
    r
}

fn run(
    fs: &mut Fs,
    read_only: bool,
    st: &mut Stats,
    ino: u64,
    req: &Request<'_>,
) -> Result<Reply, FsError> {
    if read_only && mutates(req) {
        return Err(FsError::ReadOnly);
    }
    Ok(match *req {
        Request::Hello { .. } | Request::Auth { .. } | Request::Write { .. } => {
            return Err(FsError::Invalid)
        }
        Request::Lookup { name } => Reply::Attr(fs.lookup(ino, name)?),
        Request::Getattr => Reply::Attr(fs.getattr(ino)?),
        Request::Setattr {
            mask,
            mode,
            uid,
            gid,
            size,
            atime_ns,
            mtime_ns,
        } => {
            let a = SetAttr {
                mode: opt(mask, SET_MODE, mode),
                uid: opt(mask, SET_UID, uid),
                gid: opt(mask, SET_GID, gid),
                size: opt(mask, SET_SIZE, size),
                atime_ns: opt(mask, SET_ATIME, atime_ns),
                mtime_ns: opt(mask, SET_MTIME, mtime_ns),
            };
            Reply::Attr(fs.setattr(ino, a)?)
        }
        Request::Create {
            mode,
            uid,
            gid,
            name,
        } => Reply::Attr(fs.create(ino, name, mode, uid, gid)?),
        Request::Mkdir {
            mode,
            uid,
            gid,
            name,
        } => Reply::Attr(fs.mkdir(ino, name, mode, uid, gid)?),
        Request::Symlink {
            uid,
            gid,
            name,
            target,
        } => Reply::Attr(fs.symlink(ino, name, target, uid, gid)?),
        Request::Link { dir, name } => Reply::Attr(fs.link(ino, dir, name)?),
        Request::Unlink { name } => fs.unlink(ino, name).map(|_| Reply::Empty)?,
        Request::Rmdir { name } => fs.rmdir(ino, name).map(|_| Reply::Empty)?,
        Request::Rename { ddir, sname, dname } => {
            fs.rename(ino, sname, ddir, dname).map(|_| Reply::Empty)?
        }
        Request::Readlink => Reply::Link(fs.readlink(ino)?),
        Request::Readdir { cookie, max } => {
            Reply::Entries(fs.readdir(ino, cookie, (max as usize).min(1024))?)
        }
        Request::Read { off, len } => {
            let segs = fs.read_plan(ino, off, len as usize)?;
            st.bytes_read += segs.iter().map(seg_len).sum::<usize>() as u64;
            Reply::Data(segs)
        }
        Request::Statfs => Reply::StatFs(fs.statfs()),
        Request::Fsync => fs.fsync(ino).map(|_| Reply::Empty)?,
    })
}

pub fn seg_len(s: &ReadSeg) -> usize {
    match *s {
        ReadSeg::Region { len, .. } | ReadSeg::Zero(len) => len,
    }
}

/// Encodes an attribute (64 bytes).
pub fn encode_attr(b: &mut Vec<u8>, a: &Attr) {
    for w in [
        a.ino,
        a.size,
        a.blocks,
        a.atime_ns as u64,
        a.mtime_ns as u64,
        a.ctime_ns as u64,
    ] {
        b.extend_from_slice(&w.to_le_bytes());
    }
    for w in [a.mode, a.uid, a.gid, a.nlink] {
        b.extend_from_slice(&w.to_le_bytes());
    }
}

/// Encodes the reply frame's header and body; for `Data` the body is only
/// its length, the segments follow (sent from the region, zeros for holes).
pub fn encode_reply(tag: u64, op: proto::Op, r: &Result<Reply, FsError>) -> Vec<u8> {
    let mut b = Vec::new();
    let mut extra = 0;
    match r {
        Err(_) | Ok(Reply::Empty) => {}
        Ok(Reply::Attr(a)) => encode_attr(&mut b, a),
        Ok(Reply::Entries(es)) => {
            b.extend_from_slice(&(es.len() as u32).to_le_bytes());
            for e in es {
                b.extend_from_slice(&e.next.to_le_bytes());
                b.extend_from_slice(&e.ino.to_le_bytes());
                b.push(e.kind as u8);
                b.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
                b.extend_from_slice(&e.name);
            }
        }
        Ok(Reply::Link(t)) => b.extend_from_slice(t),
        Ok(Reply::StatFs(s)) => {
            for w in [s.blocks, s.bfree, s.files, s.ffree] {
                b.extend_from_slice(&w.to_le_bytes());
            }
            b.extend_from_slice(&s.bsize.to_le_bytes());
            b.extend_from_slice(&s.namelen.to_le_bytes());
        }
        Ok(Reply::Data(segs)) => extra = segs.iter().map(seg_len).sum::<usize>(),
    }
    let errno = r.as_ref().err().map_or(0, |e| e.errno()) as u64;
    let mut f = proto::encode_header(&proto::Header {
        len: (b.len() + extra) as u32,
        op,
        tag,
        ino: errno,
    });
    f.extend_from_slice(&b);
    f
}

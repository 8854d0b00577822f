//! Our own low-level FUSE wire format (include/uapi/linux/fuse.h, protocol
//! 7.x): the decoder of the kernel's requests for the operations the mount
//! serves and the encoders of their replies.
//!
//! Why our own: fuser 0.15 keeps its parser private and can neither ask for
//! `FUSE_OVER_IO_URING` (a bit of INIT's second flags word) nor read
//! requests from an io_uring queue entry. One decoder serves both
//! transports because a request has the same two parts in both: the
//! per-op header (a fixed struct, possibly empty) and the rest (names, a
//! write's data). On /dev/fuse they follow the 40-byte `fuse_in_header` in
//! one buffer ([`decode`] splits them); in a ring entry the per-op header
//! sits in `op_in` and the rest in the payload buffer ([`decode_op`] takes
//! them apart). Replies likewise: [`Reply`] bodies are the same bytes,
//! after a `fuse_out_header` on /dev/fuse or in the payload buffer of a
//! ring entry.
//!
//! Bad input (short, oversize, names without their NUL, unknown opcodes) is
//! a [`WireError`], answered with the errno FUSE expects; never a panic.

use thiserror::Error;

/// `fuse_in_header`.
pub const IN_HEADER_LEN: usize = 40;
/// `fuse_out_header`.
pub const OUT_HEADER_LEN: usize = 16;
/// `fuse_attr`.
pub const ATTR_LEN: usize = 88;
/// `fuse_entry_out`.
pub const ENTRY_OUT_LEN: usize = 40 + ATTR_LEN;

/// Opcodes (`enum fuse_opcode`) the decoder knows.
pub mod opcode {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const ACCESS: u32 = 34;
    pub const CREATE: u32 = 35;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const RENAME2: u32 = 45;
}

/// INIT flags (first word) and the second word's bits as bits 32..63.
pub mod init_flags {
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const ATOMIC_O_TRUNC: u64 = 1 << 3;
    pub const BIG_WRITES: u64 = 1 << 5;
    pub const AUTO_INVAL_DATA: u64 = 1 << 12;
    pub const WRITEBACK_CACHE: u64 = 1 << 16;
    pub const MAX_PAGES: u64 = 1 << 22;
    /// The second flags word is valid.
    pub const INIT_EXT: u64 = 1 << 30;
    /// Requests may come through io_uring queues (flags2 bit 9).
    pub const OVER_IO_URING: u64 = 1 << 41;
}

/// A request the kernel's bytes did not make.
#[derive(Debug, Error, PartialEq, Eq, Clone)]
pub enum WireError {
    #[error("request shorter than its header ({0} bytes)")]
    Short(usize),
    #[error("header length {len} disagrees with the {got} bytes read")]
    Length { len: u32, got: usize },
    #[error("opcode {0} not handled")]
    Unknown(u32),
    #[error("opcode {op}: argument of {got} bytes, {need} needed")]
    Arg { op: u32, need: usize, got: usize },
    #[error("opcode {0}: a name without its NUL, or an empty one")]
    Name(u32),
}

impl WireError {
    /// The errno the kernel is answered with.
    pub fn errno(&self) -> i32 {
        match self {
            WireError::Unknown(_) => libc::ENOSYS,
            _ => libc::EINVAL,
        }
    }
}

/// `fuse_in_header`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    /// Extension bytes after the arguments, in 8-byte units.
    pub total_extlen: u16,
}

/// `fuse_setattr_in`'s fields the mount uses (`valid`: FATTR_* bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SetattrIn {
    pub valid: u32,
    pub fh: u64,
    pub size: u64,
    pub atime: u64,
    pub mtime: u64,
    pub atimensec: u32,
    pub mtimensec: u32,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// One decoded request (names borrowed, without their NUL).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op<'a> {
    Init {
        major: u32,
        minor: u32,
        max_readahead: u32,
        flags: u64,
    },
    Destroy,
    Lookup {
        name: &'a [u8],
    },
    Forget {
        nlookup: u64,
    },
    /// (nodeid, nlookup) pairs, as raw bytes (16 each).
    BatchForget {
        count: u32,
        items: &'a [u8],
    },
    Getattr {
        fh: Option<u64>,
    },
    Setattr(SetattrIn),
    Readlink,
    Symlink {
        name: &'a [u8],
        target: &'a [u8],
    },
    Mknod {
        mode: u32,
        rdev: u32,
        umask: u32,
        name: &'a [u8],
    },
    Mkdir {
        mode: u32,
        umask: u32,
        name: &'a [u8],
    },
    Unlink {
        name: &'a [u8],
    },
    Rmdir {
        name: &'a [u8],
    },
    Rename {
        newdir: u64,
        flags: u32,
        name: &'a [u8],
        newname: &'a [u8],
    },
    Link {
        oldnodeid: u64,
        name: &'a [u8],
    },
    Open {
        flags: u32,
    },
    Opendir {
        flags: u32,
    },
    Read {
        fh: u64,
        offset: u64,
        size: u32,
    },
    Write {
        fh: u64,
        offset: u64,
        write_flags: u32,
        data: &'a [u8],
    },
    Statfs,
    Release {
        fh: u64,
        flags: u32,
    },
    Releasedir {
        fh: u64,
    },
    Fsync {
        fh: u64,
        datasync: bool,
    },
    Fsyncdir {
        fh: u64,
        datasync: bool,
    },
    Flush {
        fh: u64,
    },
    Readdir {
        fh: u64,
        offset: u64,
        size: u32,
    },
    Access {
        mask: u32,
    },
    Create {
        flags: u32,
        mode: u32,
        umask: u32,
        name: &'a [u8],
    },
    Interrupt {
        unique: u64,
    },
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// Parses a `fuse_in_header` (no length check against anything).
pub fn in_header(b: &[u8]) -> Result<InHeader, WireError> {
    if b.len() < IN_HEADER_LEN {
        return Err(WireError::Short(b.len()));
    }
    Ok(InHeader {
        len: u32_at(b, 0),
        opcode: u32_at(b, 4),
        unique: u64_at(b, 8),
        nodeid: u64_at(b, 16),
        uid: u32_at(b, 24),
        gid: u32_at(b, 28),
        pid: u32_at(b, 32),
        total_extlen: u16_at(b, 36),
    })
}

/// Size of the per-op header (`op_in` of a ring entry; the first argument
/// on /dev/fuse) for `op`. The ops whose first argument is a name have none
/// (the kernel sends them an empty first argument for the ring's sake).
pub fn op_header_len(op: u32) -> Option<usize> {
    use opcode::*;
    Some(match op {
        INIT => 16,
        DESTROY | LOOKUP | READLINK | SYMLINK | UNLINK | RMDIR | STATFS => 0,
        FORGET | RENAME | LINK | ACCESS | MKDIR | OPEN | OPENDIR | INTERRUPT | BATCH_FORGET => 8,
        GETATTR | MKNOD | FSYNC | FSYNCDIR | CREATE | RENAME2 => 16,
        RELEASE | RELEASEDIR | FLUSH => 24,
        READ | WRITE | READDIR => 40,
        SETATTR => 88,
        _ => return None,
    })
}

/// A request read from /dev/fuse: header, then arguments, then
/// `total_extlen * 8` extension bytes (ignored).
pub fn decode(buf: &[u8]) -> Result<(InHeader, Op<'_>), WireError> {
    let h = in_header(buf)?;
    if h.len as usize != buf.len() {
        return Err(WireError::Length {
            len: h.len,
            got: buf.len(),
        });
    }
    let ext = h.total_extlen as usize * 8;
    let args = &buf[IN_HEADER_LEN..];
    let args = &args[..args.len().saturating_sub(ext)];
    let need = op_header_len(h.opcode).ok_or(WireError::Unknown(h.opcode))?;
    // INIT's header grew over the versions: 16 bytes are the minimum.
    let hl = if h.opcode == opcode::INIT {
        args.len().min(64)
    } else {
        need
    };
    if args.len() < hl {
        return Err(WireError::Arg {
            op: h.opcode,
            need,
            got: args.len(),
        });
    }
    let (head, rest) = args.split_at(hl);
    Ok((h, decode_op(h.opcode, head, rest)?))
}

/// One name ending in NUL at the start of `b`; returns it and what follows.
fn name(op: u32, b: &[u8]) -> Result<(&[u8], &[u8]), WireError> {
    let end = b.iter().position(|&c| c == 0).ok_or(WireError::Name(op))?;
    if end == 0 {
        return Err(WireError::Name(op));
    }
    Ok((&b[..end], &b[end + 1..]))
}

/// Decodes an operation from its per-op header `head` and the rest of its
/// arguments `rest` (both transports; see the module docs).
pub fn decode_op<'a>(op: u32, head: &'a [u8], rest: &'a [u8]) -> Result<Op<'a>, WireError> {
    use opcode::*;
    let need = op_header_len(op).ok_or(WireError::Unknown(op))?;
    if head.len() < need {
        return Err(WireError::Arg {
            op,
            need,
            got: head.len(),
        });
    }
    let h = head;
    Ok(match op {
        INIT => Op::Init {
            major: u32_at(h, 0),
            minor: u32_at(h, 4),
            max_readahead: u32_at(h, 8),
            flags: u32_at(h, 12) as u64
                | if h.len() >= 20 {
                    (u32_at(h, 16) as u64) << 32
                } else {
                    0
                },
        },
        DESTROY => Op::Destroy,
        LOOKUP => Op::Lookup {
            name: name(op, rest)?.0,
        },
        FORGET => Op::Forget {
            nlookup: u64_at(h, 0),
        },
        BATCH_FORGET => {
            let count = u32_at(h, 0);
            let n = (count as usize)
                .checked_mul(16)
                .filter(|&n| n <= rest.len());
            let n = n.ok_or(WireError::Arg {
                op,
                need: count as usize * 16,
                got: rest.len(),
            })?;
            Op::BatchForget {
                count,
                items: &rest[..n],
            }
        }
        GETATTR => Op::Getattr {
            // FUSE_GETATTR_FH
            fh: (u32_at(h, 0) & 1 != 0).then(|| u64_at(h, 8)),
        },
        SETATTR => Op::Setattr(SetattrIn {
            valid: u32_at(h, 0),
            fh: u64_at(h, 8),
            size: u64_at(h, 16),
            atime: u64_at(h, 32),
            mtime: u64_at(h, 40),
            atimensec: u32_at(h, 56),
            mtimensec: u32_at(h, 60),
            mode: u32_at(h, 68),
            uid: u32_at(h, 76),
            gid: u32_at(h, 80),
        }),
        READLINK => Op::Readlink,
        SYMLINK => {
            let (name, r) = name(op, rest)?;
            Op::Symlink {
                name,
                target: self::name(op, r)?.0,
            }
        }
        MKNOD => Op::Mknod {
            mode: u32_at(h, 0),
            rdev: u32_at(h, 4),
            umask: u32_at(h, 8),
            name: name(op, rest)?.0,
        },
        MKDIR => Op::Mkdir {
            mode: u32_at(h, 0),
            umask: u32_at(h, 4),
            name: name(op, rest)?.0,
        },
        UNLINK => Op::Unlink {
            name: name(op, rest)?.0,
        },
        RMDIR => Op::Rmdir {
            name: name(op, rest)?.0,
        },
        RENAME | RENAME2 => {
            let (name, r) = name(op, rest)?;
            Op::Rename {
                newdir: u64_at(h, 0),
                flags: if op == RENAME2 { u32_at(h, 8) } else { 0 },
                name,
                newname: self::name(op, r)?.0,
            }
        }
        LINK => Op::Link {
            oldnodeid: u64_at(h, 0),
            name: name(op, rest)?.0,
        },
        OPEN => Op::Open {
            flags: u32_at(h, 0),
        },
        OPENDIR => Op::Opendir {
            flags: u32_at(h, 0),
        },
        READ | READDIR => {
            let (fh, offset, size) = (u64_at(h, 0), u64_at(h, 8), u32_at(h, 16));
            if op == READ {
                Op::Read { fh, offset, size }
            } else {
                Op::Readdir { fh, offset, size }
            }
        }
        WRITE => {
            let size = u32_at(h, 16) as usize;
            if rest.len() < size {
                return Err(WireError::Arg {
                    op,
                    need: size,
                    got: rest.len(),
                });
            }
            Op::Write {
                fh: u64_at(h, 0),
                offset: u64_at(h, 8),
                write_flags: u32_at(h, 20),
                data: &rest[..size],
            }
        }
        STATFS => Op::Statfs,
        RELEASE => Op::Release {
            fh: u64_at(h, 0),
            flags: u32_at(h, 8),
        },
        RELEASEDIR => Op::Releasedir { fh: u64_at(h, 0) },
        FSYNC | FSYNCDIR => {
            let (fh, datasync) = (u64_at(h, 0), u32_at(h, 8) & 1 != 0);
            if op == FSYNC {
                Op::Fsync { fh, datasync }
            } else {
                Op::Fsyncdir { fh, datasync }
            }
        }
        FLUSH => Op::Flush { fh: u64_at(h, 0) },
        ACCESS => Op::Access { mask: u32_at(h, 0) },
        CREATE => Op::Create {
            flags: u32_at(h, 0),
            mode: u32_at(h, 4),
            umask: u32_at(h, 8),
            name: name(op, rest)?.0,
        },
        INTERRUPT => Op::Interrupt {
            unique: u64_at(h, 0),
        },
        _ => return Err(WireError::Unknown(op)),
    })
}

/// `fuse_attr` fields, as the mount fills them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttrOut {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    pub atime: (u64, u32),
    pub mtime: (u64, u32),
    pub ctime: (u64, u32),
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub blksize: u32,
}

fn put_attr(o: &mut Vec<u8>, a: &AttrOut) {
    for v in [a.ino, a.size, a.blocks, a.atime.0, a.mtime.0, a.ctime.0] {
        o.extend_from_slice(&v.to_le_bytes());
    }
    let words = [
        a.atime.1, a.mtime.1, a.ctime.1, a.mode, a.nlink, a.uid, a.gid, 0, a.blksize, 0,
    ];
    for v in words {
        o.extend_from_slice(&v.to_le_bytes());
    }
}

/// Reply bodies (what follows `fuse_out_header`, or a ring entry's payload).
pub mod reply {
    use super::*;

    /// `fuse_entry_out`: the entry and its attributes, both valid `ttl`.
    pub fn entry(a: &AttrOut, ttl: (u64, u32)) -> Vec<u8> {
        let mut o = Vec::with_capacity(ENTRY_OUT_LEN);
        for v in [a.ino, 0, ttl.0, ttl.0] {
            o.extend_from_slice(&v.to_le_bytes());
        }
        o.extend_from_slice(&ttl.1.to_le_bytes());
        o.extend_from_slice(&ttl.1.to_le_bytes());
        put_attr(&mut o, a);
        o
    }

    /// `fuse_attr_out`.
    pub fn attr(a: &AttrOut, ttl: (u64, u32)) -> Vec<u8> {
        let mut o = Vec::with_capacity(16 + ATTR_LEN);
        o.extend_from_slice(&ttl.0.to_le_bytes());
        o.extend_from_slice(&ttl.1.to_le_bytes());
        o.extend_from_slice(&0u32.to_le_bytes());
        put_attr(&mut o, a);
        o
    }

    /// `fuse_open_out`.
    pub fn open(fh: u64, open_flags: u32) -> Vec<u8> {
        let mut o = Vec::with_capacity(16);
        o.extend_from_slice(&fh.to_le_bytes());
        o.extend_from_slice(&open_flags.to_le_bytes());
        o.extend_from_slice(&0u32.to_le_bytes());
        o
    }

    /// CREATE's reply: `fuse_entry_out` then `fuse_open_out`.
    pub fn create(a: &AttrOut, ttl: (u64, u32), fh: u64, open_flags: u32) -> Vec<u8> {
        let mut o = entry(a, ttl);
        o.extend_from_slice(&open(fh, open_flags));
        o
    }

    /// `fuse_write_out`.
    pub fn write(size: u32) -> Vec<u8> {
        let mut o = size.to_le_bytes().to_vec();
        o.extend_from_slice(&0u32.to_le_bytes());
        o
    }

    /// `fuse_statfs_out` (blocks, bfree, bavail, files, ffree; bsize,
    /// namelen, frsize).
    pub fn statfs(
        blocks: u64,
        bfree: u64,
        files: u64,
        ffree: u64,
        bsize: u32,
        namelen: u32,
    ) -> Vec<u8> {
        let mut o = Vec::with_capacity(80);
        for v in [blocks, bfree, bfree, files, ffree] {
            o.extend_from_slice(&v.to_le_bytes());
        }
        for v in [bsize, namelen, bsize, 0] {
            o.extend_from_slice(&v.to_le_bytes());
        }
        o.resize(80, 0);
        o
    }

    /// `fuse_init_out` answering protocol 7.`minor` with `flags` (bits
    /// 32..63 go to `flags2`; INIT_EXT is set when any is); readahead as
    /// large as a write (the kernel keeps the smaller of that and its own).
    pub fn init(minor: u32, flags: u64, max_write: u32, max_pages: u16) -> Vec<u8> {
        let flags = if flags >> 32 != 0 {
            flags | init_flags::INIT_EXT
        } else {
            flags
        };
        let mut o = Vec::with_capacity(64);
        for v in [7u32, minor, max_write, flags as u32] {
            o.extend_from_slice(&v.to_le_bytes());
        }
        o.extend_from_slice(&16u16.to_le_bytes()); // max_background
        o.extend_from_slice(&12u16.to_le_bytes()); // congestion_threshold
        o.extend_from_slice(&max_write.to_le_bytes());
        o.extend_from_slice(&1u32.to_le_bytes()); // time_gran: 1 ns
        o.extend_from_slice(&max_pages.to_le_bytes());
        o.extend_from_slice(&0u16.to_le_bytes()); // map_alignment
        o.extend_from_slice(&((flags >> 32) as u32).to_le_bytes());
        o.resize(64, 0);
        o
    }

    /// Appends one `fuse_dirent` to `buf` if it fits in `max` bytes;
    /// false when it does not (the listing stops there).
    pub fn push_dirent(
        buf: &mut Vec<u8>,
        max: usize,
        ino: u64,
        next: u64,
        kind: u32,
        name: &[u8],
    ) -> bool {
        let len = (24 + name.len() + 7) & !7;
        if buf.len() + len > max {
            return false;
        }
        buf.extend_from_slice(&ino.to_le_bytes());
        buf.extend_from_slice(&next.to_le_bytes());
        buf.extend_from_slice(&(name.len() as u32).to_le_bytes());
        buf.extend_from_slice(&kind.to_le_bytes());
        buf.extend_from_slice(name);
        buf.resize(buf.len() + (len - 24 - name.len()), 0);
        true
    }
}

/// A /dev/fuse reply: `fuse_out_header` (len, -errno, unique) then `body`.
pub fn out_header(unique: u64, errno: i32, body_len: usize) -> [u8; OUT_HEADER_LEN] {
    let mut h = [0u8; OUT_HEADER_LEN];
    h[0..4].copy_from_slice(&((OUT_HEADER_LEN + body_len) as u32).to_le_bytes());
    h[4..8].copy_from_slice(&(-errno).to_le_bytes());
    h[8..16].copy_from_slice(&unique.to_le_bytes());
    h
}

//! The wire protocol of the file service (sans-IO): framed requests and
//! replies on a byte stream. Every frame starts with a 24-byte header:
//! body length u32 (bytes after the header), op u8, 3 reserved bytes, tag
//! u64 (the request id the reply echoes), inode u64 (the object the request
//! is about; for a reply, the status as an errno, 0 = success). A write's
//! body is its offset (u64) and the payload's length (u32), 12 bytes like
//! a read's whole body, followed by the payload: the decoder hands back
//! only the payload's length, so a transport receives the payload straight
//! into the data blocks `Fs::begin_write` planned.
//!
//! Reserved byte 5 of a header is a flags byte. A Read request with
//! [`FLAG_ALIGN`] there asks for its reply's data to start [`READ_DATA_AT`]
//! bytes into the frame: the reply header's byte 5 then counts the zero
//! bytes between the header and the data (0: none, as from a server that
//! does not pad). Why: the kernel's copy of a loopback send lands the data
//! right after the 24-byte header in its socket page, 24 bytes past where
//! it sits in the region's page, and on AMD EPYC a copy whose destination
//! runs 1-31 bytes ahead of its source modulo 4 KiB is 4-8x slower
//! (bench/RESULTS-fs.md).

use thiserror::Error;

use crate::fs::MAX_WRITE;
use crate::ns::NAME_MAX;

/// Bytes of a frame header.
pub const HEADER_LEN: usize = 24;
/// Largest body a frame may carry: a full write plus its offset, or a
/// full read's data and its padding.
pub const MAX_BODY: usize = MAX_WRITE + READ_DATA_AT - HEADER_LEN;
/// A Read request's flag (header byte 5): pad the reply's data to start at
/// [`READ_DATA_AT`].
pub const FLAG_ALIGN: u8 = 1;
/// Where an aligned read reply's data starts in its frame.
pub const READ_DATA_AT: usize = 64;
/// Largest symlink target.
pub const MAX_TARGET: usize = crate::BLOCK_SIZE - 1;
/// Bytes of the nonces and of the MAC of the connect challenge.
pub const NONCE_LEN: usize = 32;
/// The TCP port an export listens on and a mount dials when none is given
/// (`ustor fs mount HOST/EXPORT`, `fs_export` with `listen: "ip"`). Not
/// registered with IANA; chosen clear of NFS (2049), iSCSI (3260) and
/// NVMe/TCP (4420).
pub const DEFAULT_PORT: u16 = 4800;

/// Errors of the protocol layer: each disconnects the client.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ProtoError {
    #[error("frame body of {0} bytes is over the limit")]
    Oversize(u64),
    #[error("unknown op {0}")]
    UnknownOp(u8),
    #[error("body of op {op} malformed: {why}")]
    Malformed { op: u8, why: &'static str },
}

/// A frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub len: u32,
    pub op: Op,
    pub tag: u64,
    pub ino: u64,
}

macro_rules! ops {
    ($($name:ident = $v:literal),* $(,)?) => {
        /// The operations, by their wire code.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(u8)]
        pub enum Op { $($name = $v),* }
        impl Op {
            pub fn from_u8(v: u8) -> Option<Self> {
                match v { $($v => Some(Op::$name),)* _ => None }
            }
        }
    };
}
ops! {
    Hello = 1, Auth = 2, Lookup = 3, Getattr = 4, Setattr = 5, Create = 6,
    Mkdir = 7, Symlink = 8, Link = 9, Unlink = 10, Rmdir = 11, Rename = 12,
    Readlink = 13, Readdir = 14, Read = 15, Write = 16, Statfs = 17, Fsync = 18,
}

/// Which setattr fields are set (bit mask on the wire).
pub const SET_MODE: u32 = 1;
pub const SET_UID: u32 = 2;
pub const SET_GID: u32 = 4;
pub const SET_SIZE: u32 = 8;
pub const SET_ATIME: u32 = 16;
pub const SET_MTIME: u32 = 32;

/// A decoded request; names borrow the receive buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    /// The client's nonce and the export it wants.
    Hello {
        nonce: [u8; NONCE_LEN],
        export: &'a [u8],
    },
    /// HMAC-SHA256 of the two nonces under the export's secret.
    Auth {
        mac: [u8; NONCE_LEN],
    },
    Lookup {
        name: &'a [u8],
    },
    Getattr,
    Setattr {
        mask: u32,
        mode: u32,
        uid: u32,
        gid: u32,
        size: u64,
        atime_ns: i64,
        mtime_ns: i64,
    },
    Create {
        mode: u32,
        uid: u32,
        gid: u32,
        name: &'a [u8],
    },
    Mkdir {
        mode: u32,
        uid: u32,
        gid: u32,
        name: &'a [u8],
    },
    Symlink {
        uid: u32,
        gid: u32,
        name: &'a [u8],
        target: &'a [u8],
    },
    /// Links inode `Header::ino` into `dir` under `name`.
    Link {
        dir: u64,
        name: &'a [u8],
    },
    Unlink {
        name: &'a [u8],
    },
    Rmdir {
        name: &'a [u8],
    },
    /// Renames `Header::ino`/`sname` to `ddir`/`dname`.
    Rename {
        ddir: u64,
        sname: &'a [u8],
        dname: &'a [u8],
    },
    Readlink,
    Readdir {
        cookie: u64,
        max: u32,
    },
    Read {
        off: u64,
        len: u32,
    },
    /// The payload (`len` bytes) follows in the frame; it is not decoded.
    Write {
        off: u64,
        len: u32,
    },
    Statfs,
    Fsync,
}

/// A little-endian reader over a body that reports truncation as an error.
struct Rd<'a> {
    b: &'a [u8],
    op: u8,
}

impl<'a> Rd<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        if self.b.len() < n {
            return Err(ProtoError::Malformed {
                op: self.op,
                why: "truncated",
            });
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u16(&mut self) -> Result<u16, ProtoError> {
        Ok(u16::from_le_bytes(self.bytes(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32, ProtoError> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, ProtoError> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().expect("8")))
    }
    fn arr(&mut self) -> Result<[u8; NONCE_LEN], ProtoError> {
        Ok(self.bytes(NONCE_LEN)?.try_into().expect("nonce"))
    }
    /// A name: u16 length then bytes, at most `max`.
    fn name(&mut self, max: usize) -> Result<&'a [u8], ProtoError> {
        let n = self.u16()? as usize;
        if n == 0 || n > max {
            return Err(ProtoError::Malformed {
                op: self.op,
                why: "name length",
            });
        }
        self.bytes(n)
    }
    fn end(self) -> Result<(), ProtoError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(ProtoError::Malformed {
                op: self.op,
                why: "trailing bytes",
            })
        }
    }
}

/// Decodes a frame header, refusing oversize bodies and unknown ops before
/// any body byte is received.
/// A header's flags byte (byte 5): [`FLAG_ALIGN`] in a Read request, the
/// padding's length in a read reply.
pub fn header_flags(b: &[u8; HEADER_LEN]) -> u8 {
    b[5]
}

pub fn decode_header(b: &[u8; HEADER_LEN]) -> Result<Header, ProtoError> {
    let len = u32::from_le_bytes(b[0..4].try_into().expect("4"));
    if len as usize > MAX_BODY {
        return Err(ProtoError::Oversize(len as u64));
    }
    let op = Op::from_u8(b[4]).ok_or(ProtoError::UnknownOp(b[4]))?;
    let tag = u64::from_le_bytes(b[8..16].try_into().expect("8"));
    let ino = u64::from_le_bytes(b[16..24].try_into().expect("8"));
    Ok(Header { len, op, tag, ino })
}

/// A write's body before its payload: the offset (u64) and the payload's
/// length (u32, the frame's length less this prefix). As long as a read's
/// whole body, so that a server staging a header and this many bytes
/// behind it gets either request whole with one receive, and no payload
/// byte.
pub const WRITE_PREFIX: usize = 12;

/// How many body bytes to receive before `decode_request`: all of them,
/// except for a write, whose payload is received into the region.
pub fn body_prefix(h: &Header) -> usize {
    if h.op == Op::Write {
        WRITE_PREFIX.min(h.len as usize)
    } else {
        h.len as usize
    }
}

/// Decodes a request body (for a write, only its [`WRITE_PREFIX`]).
pub fn decode_request<'a>(h: &Header, body: &'a [u8]) -> Result<Request<'a>, ProtoError> {
    let mut r = Rd {
        b: body,
        op: h.op as u8,
    };
    let req = match h.op {
        Op::Hello => Request::Hello {
            nonce: r.arr()?,
            export: r.name(NAME_MAX)?,
        },
        Op::Auth => Request::Auth { mac: r.arr()? },
        Op::Lookup => Request::Lookup {
            name: r.name(NAME_MAX)?,
        },
        Op::Getattr => Request::Getattr,
        Op::Setattr => Request::Setattr {
            mask: r.u32()?,
            mode: r.u32()?,
            uid: r.u32()?,
            gid: r.u32()?,
            size: r.u64()?,
            atime_ns: r.u64()? as i64,
            mtime_ns: r.u64()? as i64,
        },
        Op::Create | Op::Mkdir => {
            let (mode, uid, gid, name) = (r.u32()?, r.u32()?, r.u32()?, r.name(NAME_MAX)?);
            if h.op == Op::Create {
                Request::Create {
                    mode,
                    uid,
                    gid,
                    name,
                }
            } else {
                Request::Mkdir {
                    mode,
                    uid,
                    gid,
                    name,
                }
            }
        }
        Op::Symlink => Request::Symlink {
            uid: r.u32()?,
            gid: r.u32()?,
            name: r.name(NAME_MAX)?,
            target: r.name(MAX_TARGET)?,
        },
        Op::Link => Request::Link {
            dir: r.u64()?,
            name: r.name(NAME_MAX)?,
        },
        Op::Unlink => Request::Unlink {
            name: r.name(NAME_MAX)?,
        },
        Op::Rmdir => Request::Rmdir {
            name: r.name(NAME_MAX)?,
        },
        Op::Rename => Request::Rename {
            ddir: r.u64()?,
            sname: r.name(NAME_MAX)?,
            dname: r.name(NAME_MAX)?,
        },
        Op::Readlink => Request::Readlink,
        Op::Readdir => Request::Readdir {
            cookie: r.u64()?,
            max: r.u32()?,
        },
        Op::Read => {
            let (off, len) = (r.u64()?, r.u32()?);
            if len as usize > MAX_WRITE {
                return Err(ProtoError::Oversize(len as u64));
            }
            Request::Read { off, len }
        }
        Op::Write => {
            if (h.len as usize) < WRITE_PREFIX {
                return Err(ProtoError::Malformed {
                    op: h.op as u8,
                    why: "truncated",
                });
            }
            if h.len as usize - WRITE_PREFIX > MAX_WRITE {
                return Err(ProtoError::Oversize(h.len.into()));
            }
            let (off, len) = (r.u64()?, r.u32()?);
            if len as usize != h.len as usize - WRITE_PREFIX {
                return Err(ProtoError::Malformed {
                    op: h.op as u8,
                    why: "payload length",
                });
            }
            Request::Write { off, len }
        }
        Op::Statfs => Request::Statfs,
        Op::Fsync => Request::Fsync,
    };
    r.end()?;
    Ok(req)
}

fn put_name(v: &mut Vec<u8>, n: &[u8]) {
    v.extend_from_slice(&(n.len() as u16).to_le_bytes());
    v.extend_from_slice(n);
}

/// Encodes a request frame (header and body; a write's payload is sent
/// after it, and counted in the header's length).
pub fn encode_request(tag: u64, ino: u64, req: &Request<'_>) -> Vec<u8> {
    let mut f = Vec::new();
    encode_request_into(&mut f, tag, ino, req);
    f
}

/// [`encode_request`] into `b` (cleared first): a client that keeps one
/// buffer allocates nothing per request.
pub fn encode_request_into(b: &mut Vec<u8>, tag: u64, ino: u64, req: &Request<'_>) {
    b.clear();
    b.resize(HEADER_LEN, 0);
    let op = match *req {
        Request::Hello { nonce, export } => {
            b.extend_from_slice(&nonce);
            put_name(b, export);
            Op::Hello
        }
        Request::Auth { mac } => {
            b.extend_from_slice(&mac);
            Op::Auth
        }
        Request::Lookup { name } => {
            put_name(b, name);
            Op::Lookup
        }
        Request::Getattr => Op::Getattr,
        Request::Setattr {
            mask,
            mode,
            uid,
            gid,
            size,
            atime_ns,
            mtime_ns,
        } => {
            for w in [mask, mode, uid, gid] {
                b.extend_from_slice(&w.to_le_bytes());
            }
            for w in [size, atime_ns as u64, mtime_ns as u64] {
                b.extend_from_slice(&w.to_le_bytes());
            }
            Op::Setattr
        }
        Request::Create {
            mode,
            uid,
            gid,
            name,
        }
        | Request::Mkdir {
            mode,
            uid,
            gid,
            name,
        } => {
            for w in [mode, uid, gid] {
                b.extend_from_slice(&w.to_le_bytes());
            }
            put_name(b, name);
            if matches!(req, Request::Create { .. }) {
                Op::Create
            } else {
                Op::Mkdir
            }
        }
        Request::Symlink {
            uid,
            gid,
            name,
            target,
        } => {
            b.extend_from_slice(&uid.to_le_bytes());
            b.extend_from_slice(&gid.to_le_bytes());
            put_name(b, name);
            put_name(b, target);
            Op::Symlink
        }
        Request::Link { dir, name } => {
            b.extend_from_slice(&dir.to_le_bytes());
            put_name(b, name);
            Op::Link
        }
        Request::Unlink { name } => {
            put_name(b, name);
            Op::Unlink
        }
        Request::Rmdir { name } => {
            put_name(b, name);
            Op::Rmdir
        }
        Request::Rename { ddir, sname, dname } => {
            b.extend_from_slice(&ddir.to_le_bytes());
            put_name(b, sname);
            put_name(b, dname);
            Op::Rename
        }
        Request::Readlink => Op::Readlink,
        Request::Readdir { cookie, max } => {
            b.extend_from_slice(&cookie.to_le_bytes());
            b.extend_from_slice(&max.to_le_bytes());
            Op::Readdir
        }
        Request::Read { off, len } => {
            b.extend_from_slice(&off.to_le_bytes());
            b.extend_from_slice(&len.to_le_bytes());
            Op::Read
        }
        Request::Write { off, len } => {
            b.extend_from_slice(&off.to_le_bytes());
            b.extend_from_slice(&len.to_le_bytes());
            Op::Write
        }
        Request::Statfs => Op::Statfs,
        Request::Fsync => Op::Fsync,
    };
    let extra = if let Request::Write { len, .. } = *req {
        len as usize
    } else {
        0
    };
    let h = header_bytes(&Header {
        len: (b.len() - HEADER_LEN + extra) as u32,
        op,
        tag,
        ino,
    });
    b[..HEADER_LEN].copy_from_slice(&h);
}

/// Encodes a header (for a reply, `ino` carries the errno).
pub fn encode_header(h: &Header) -> Vec<u8> {
    header_bytes(h).to_vec()
}

/// [`encode_header`] as an array (no allocation).
pub fn header_bytes(h: &Header) -> [u8; HEADER_LEN] {
    let mut f = [0u8; HEADER_LEN];
    f[..4].copy_from_slice(&h.len.to_le_bytes());
    f[4] = h.op as u8;
    f[8..16].copy_from_slice(&h.tag.to_le_bytes());
    f[16..].copy_from_slice(&h.ino.to_le_bytes());
    f
}

/// Decodes a stream of request frames, as a server would, until the bytes
/// run out or one is refused; write payloads are skipped. Returns the number
/// of requests decoded. The fuzz target and the proptests run this.
pub fn decode_stream(mut b: &[u8]) -> Result<usize, ProtoError> {
    let mut n = 0;
    while b.len() >= HEADER_LEN {
        let h = decode_header(b[..HEADER_LEN].try_into().expect("header"))?;
        b = &b[HEADER_LEN..];
        let pre = body_prefix(&h);
        if b.len() < pre {
            break;
        }
        decode_request(&h, &b[..pre])?;
        n += 1;
        b = &b[(h.len as usize).min(b.len())..];
    }
    Ok(n)
}

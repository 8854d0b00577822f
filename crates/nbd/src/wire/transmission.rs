//! Transmission-phase layouts: the 28-byte request header, the 16-byte simple
//! reply, the 20-byte structured chunk header and the chunk payloads.
//!
//! Everything the data path sends is a fixed-size array built on the stack
//! (header plus the fixed part of the payload), so a reply is one small array
//! plus, for reads, the data buffer itself in an iovec: no allocation and no
//! copy of payload.

use super::{
    check_string, reply, Put, Reader, WireError, REQUEST_MAGIC, SIMPLE_REPLY_MAGIC,
    STRUCTURED_REPLY_MAGIC,
};

/// Request header: magic, flags, type, cookie, offset, length.
pub const REQUEST_HEADER_LEN: usize = 28;
/// Simple reply: magic, error, cookie.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Structured reply chunk header: magic, flags, type, cookie, length.
pub const CHUNK_HEADER_LEN: usize = 20;
/// Chunk header plus the offset that starts `NBD_REPLY_TYPE_OFFSET_DATA`.
pub const OFFSET_DATA_PREFIX_LEN: usize = CHUNK_HEADER_LEN + 8;
/// Whole `NBD_REPLY_TYPE_OFFSET_HOLE` chunk.
pub const OFFSET_HOLE_CHUNK_LEN: usize = CHUNK_HEADER_LEN + 12;
/// Whole `NBD_REPLY_TYPE_ERROR` chunk without a message.
pub const ERROR_CHUNK_LEN: usize = CHUNK_HEADER_LEN + 6;
/// Whole `NBD_REPLY_TYPE_ERROR_OFFSET` chunk without a message.
pub const ERROR_OFFSET_CHUNK_LEN: usize = CHUNK_HEADER_LEN + 14;
/// One block-status descriptor: extent length, status flags.
pub const BLOCK_DESCRIPTOR_LEN: usize = 8;

const _: () = assert!(REQUEST_HEADER_LEN == 4 + 2 + 2 + 8 + 8 + 4);
const _: () = assert!(SIMPLE_REPLY_LEN == 4 + 4 + 8);
const _: () = assert!(CHUNK_HEADER_LEN == 4 + 2 + 2 + 8 + 4);
const _: () = assert!(BLOCK_DESCRIPTOR_LEN == 4 + 4);

/// A transmission request header, as sent; validation is in [`crate::request`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl RequestHeader {
    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        let mut b = [0u8; REQUEST_HEADER_LEN];
        Put::new(&mut b)
            .u32(REQUEST_MAGIC)
            .u16(self.flags)
            .u16(self.kind)
            .u64(self.cookie)
            .u64(self.offset)
            .u32(self.length)
            .finish();
        b
    }

    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(buf);
        let magic = r.u32()?;
        if magic != REQUEST_MAGIC {
            return Err(WireError::BadMagic {
                found: magic.into(),
            });
        }
        Ok(Self {
            flags: r.u16()?,
            kind: r.u16()?,
            cookie: r.u64()?,
            offset: r.u64()?,
            length: r.u32()?,
        })
    }
}

/// A simple reply; for a successful read without structured replies the
/// data follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    pub error: u32,
    pub cookie: u64,
}

impl SimpleReply {
    pub fn encode(&self) -> [u8; SIMPLE_REPLY_LEN] {
        let mut b = [0u8; SIMPLE_REPLY_LEN];
        Put::new(&mut b)
            .u32(SIMPLE_REPLY_MAGIC)
            .u32(self.error)
            .u64(self.cookie)
            .finish();
        b
    }

    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(buf);
        let magic = r.u32()?;
        if magic != SIMPLE_REPLY_MAGIC {
            return Err(WireError::BadMagic {
                found: magic.into(),
            });
        }
        Ok(Self {
            error: r.u32()?,
            cookie: r.u64()?,
        })
    }
}

/// A structured reply chunk header; `length` payload bytes follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub length: u32,
}

impl ChunkHeader {
    pub fn encode(&self) -> [u8; CHUNK_HEADER_LEN] {
        let mut b = [0u8; CHUNK_HEADER_LEN];
        self.put(&mut Put::new(&mut b));
        b
    }

    fn put(&self, p: &mut Put<'_>) {
        p.u32(STRUCTURED_REPLY_MAGIC)
            .u16(self.flags)
            .u16(self.kind)
            .u64(self.cookie)
            .u32(self.length);
    }

    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(buf);
        let magic = r.u32()?;
        if magic != STRUCTURED_REPLY_MAGIC {
            return Err(WireError::BadMagic {
                found: magic.into(),
            });
        }
        Ok(Self {
            flags: r.u16()?,
            kind: r.u16()?,
            cookie: r.u64()?,
            length: r.u32()?,
        })
    }

    /// Whether this is the last chunk of its reply.
    pub fn is_done(&self) -> bool {
        self.flags & reply::FLAG_DONE != 0
    }
}

fn done_flag(done: bool) -> u16 {
    if done {
        reply::FLAG_DONE
    } else {
        0
    }
}

/// Header + offset of an `OFFSET_DATA` chunk carrying `data_len` bytes; the
/// data itself goes out of the bdev's buffer in the same `writev`. `None`
/// when `data_len` cannot fit a 32-bit chunk length (caller splits).
pub fn offset_data_prefix(
    cookie: u64,
    done: bool,
    offset: u64,
    data_len: u32,
) -> Option<[u8; OFFSET_DATA_PREFIX_LEN]> {
    let length = data_len.checked_add(8)?;
    let mut b = [0u8; OFFSET_DATA_PREFIX_LEN];
    let mut p = Put::new(&mut b);
    ChunkHeader {
        flags: done_flag(done),
        kind: reply::TYPE_OFFSET_DATA,
        cookie,
        length,
    }
    .put(&mut p);
    p.u64(offset).finish();
    Some(b)
}

/// A whole `OFFSET_HOLE` chunk.
pub fn offset_hole_chunk(
    cookie: u64,
    done: bool,
    offset: u64,
    hole_len: u32,
) -> [u8; OFFSET_HOLE_CHUNK_LEN] {
    let mut b = [0u8; OFFSET_HOLE_CHUNK_LEN];
    let mut p = Put::new(&mut b);
    ChunkHeader {
        flags: done_flag(done),
        kind: reply::TYPE_OFFSET_HOLE,
        cookie,
        length: 12,
    }
    .put(&mut p);
    p.u64(offset).u32(hole_len).finish();
    b
}

/// A `NONE` chunk (always final): success after earlier chunks.
pub fn none_chunk(cookie: u64) -> [u8; CHUNK_HEADER_LEN] {
    ChunkHeader {
        flags: reply::FLAG_DONE,
        kind: reply::TYPE_NONE,
        cookie,
        length: 0,
    }
    .encode()
}

/// A final `ERROR` chunk with no message: the data path's error reply.
pub fn error_chunk(cookie: u64, error: u32) -> [u8; ERROR_CHUNK_LEN] {
    let mut b = [0u8; ERROR_CHUNK_LEN];
    let mut p = Put::new(&mut b);
    ChunkHeader {
        flags: reply::FLAG_DONE,
        kind: reply::TYPE_ERROR,
        cookie,
        length: 6,
    }
    .put(&mut p);
    p.u32(error).u16(0).finish();
    b
}

/// An `ERROR_OFFSET` chunk with no message.
pub fn error_offset_chunk(
    cookie: u64,
    done: bool,
    error: u32,
    offset: u64,
) -> [u8; ERROR_OFFSET_CHUNK_LEN] {
    let mut b = [0u8; ERROR_OFFSET_CHUNK_LEN];
    let mut p = Put::new(&mut b);
    ChunkHeader {
        flags: done_flag(done),
        kind: reply::TYPE_ERROR_OFFSET,
        cookie,
        length: 14,
    }
    .put(&mut p);
    p.u32(error).u16(0).u64(offset).finish();
    b
}

/// One extent of a `BLOCK_STATUS` chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockDescriptor {
    pub length: u32,
    pub flags: u32,
}

/// Appends a `BLOCK_STATUS` chunk for context `context_id` to `out` (a
/// per-connection scratch buffer reused across requests).
pub fn put_block_status(
    out: &mut Vec<u8>,
    cookie: u64,
    done: bool,
    context_id: u32,
    extents: &[BlockDescriptor],
) {
    let length = 4 + extents.len() * BLOCK_DESCRIPTOR_LEN;
    // Callers bound extents (spec: at most 2^20 per chunk), so this fits.
    let length = u32::try_from(length).unwrap_or(u32::MAX);
    let header = ChunkHeader {
        flags: done_flag(done),
        kind: reply::TYPE_BLOCK_STATUS,
        cookie,
        length,
    };
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(&context_id.to_be_bytes());
    for e in extents {
        out.extend_from_slice(&e.length.to_be_bytes());
        out.extend_from_slice(&e.flags.to_be_bytes());
    }
}

/// A decoded structured-chunk payload (client side: tests and fuzzing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkPayload<'a> {
    None,
    OffsetData {
        offset: u64,
        data: &'a [u8],
    },
    OffsetHole {
        offset: u64,
        length: u32,
    },
    /// Context id and the raw descriptor list (a multiple of 8 bytes).
    BlockStatus {
        context_id: u32,
        descriptors: &'a [u8],
    },
    Error {
        error: u32,
        message: &'a str,
    },
    ErrorOffset {
        error: u32,
        message: &'a str,
        offset: u64,
    },
    /// Unknown type; error types (bit 15) still carry an errno.
    Unknown {
        kind: u16,
    },
}

impl<'a> ChunkPayload<'a> {
    pub fn decode(kind: u16, payload: &'a [u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(payload);
        let out = match kind {
            reply::TYPE_NONE => Self::None,
            reply::TYPE_OFFSET_DATA => {
                let offset = r.u64()?;
                let data = r.rest();
                if data.is_empty() {
                    return Err(WireError::BadLength);
                }
                Self::OffsetData { offset, data }
            }
            reply::TYPE_OFFSET_HOLE => Self::OffsetHole {
                offset: r.u64()?,
                length: r.u32()?,
            },
            reply::TYPE_BLOCK_STATUS => {
                let context_id = r.u32()?;
                let descriptors = r.rest();
                if descriptors.is_empty() || descriptors.len() % BLOCK_DESCRIPTOR_LEN != 0 {
                    return Err(WireError::BadLength);
                }
                Self::BlockStatus {
                    context_id,
                    descriptors,
                }
            }
            reply::TYPE_ERROR | reply::TYPE_ERROR_OFFSET => {
                let error = r.u32()?;
                let len = r.u16()? as usize;
                let message = check_string(r.bytes(len)?)?;
                if kind == reply::TYPE_ERROR {
                    Self::Error { error, message }
                } else {
                    Self::ErrorOffset {
                        error,
                        message,
                        offset: r.u64()?,
                    }
                }
            }
            other => {
                r.rest();
                Self::Unknown { kind: other }
            }
        };
        if r.remaining() != 0 {
            return Err(WireError::BadLength);
        }
        Ok(out)
    }
}

/// Iterates the descriptors of a `BLOCK_STATUS` payload.
pub fn block_descriptors(raw: &[u8]) -> impl Iterator<Item = BlockDescriptor> + '_ {
    raw.chunks_exact(BLOCK_DESCRIPTOR_LEN)
        .map(|c| BlockDescriptor {
            length: u32::from_be_bytes([c[0], c[1], c[2], c[3]]),
            flags: u32::from_be_bytes([c[4], c[5], c[6], c[7]]),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_header_bytes() {
        let h = RequestHeader {
            flags: 1,
            kind: 1,
            cookie: 0xaabb,
            offset: 4096,
            length: 512,
        };
        let b = h.encode();
        assert_eq!(
            b,
            [
                0x25, 0x60, 0x95, 0x13, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0xaa, 0xbb, 0, 0, 0, 0, 0, 0,
                0x10, 0, 0, 0, 2, 0
            ]
        );
        assert_eq!(RequestHeader::decode(&b), Ok(h));
        assert!(RequestHeader::decode(&b[..27]).is_err());
        assert_eq!(
            RequestHeader::decode(&[0u8; 28]),
            Err(WireError::BadMagic { found: 0 })
        );
    }

    #[test]
    fn simple_reply_bytes() {
        let b = SimpleReply {
            error: 22,
            cookie: 7,
        }
        .encode();
        assert_eq!(
            b,
            [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 22, 0, 0, 0, 0, 0, 0, 0, 7]
        );
        assert_eq!(
            SimpleReply::decode(&b),
            Ok(SimpleReply {
                error: 22,
                cookie: 7
            })
        );
    }

    #[test]
    fn chunks_decode() {
        let p = offset_data_prefix(9, true, 512, 4096).unwrap();
        let h = ChunkHeader::decode(&p).unwrap();
        assert_eq!(
            (h.kind, h.cookie, h.length, h.is_done()),
            (reply::TYPE_OFFSET_DATA, 9, 4104, true)
        );
        assert_eq!(&p[20..], &512u64.to_be_bytes());
        assert!(offset_data_prefix(9, true, 0, u32::MAX).is_none());

        let e = error_chunk(3, 5);
        let h = ChunkHeader::decode(&e).unwrap();
        assert_eq!(
            ChunkPayload::decode(h.kind, &e[CHUNK_HEADER_LEN..]),
            Ok(ChunkPayload::Error {
                error: 5,
                message: ""
            })
        );
        let e = error_offset_chunk(3, false, 5, 99);
        let h = ChunkHeader::decode(&e).unwrap();
        assert!(!h.is_done());
        assert_eq!(
            ChunkPayload::decode(h.kind, &e[CHUNK_HEADER_LEN..]),
            Ok(ChunkPayload::ErrorOffset {
                error: 5,
                message: "",
                offset: 99
            })
        );
        let hole = offset_hole_chunk(1, true, 8, 16);
        assert_eq!(
            ChunkPayload::decode(reply::TYPE_OFFSET_HOLE, &hole[CHUNK_HEADER_LEN..]),
            Ok(ChunkPayload::OffsetHole {
                offset: 8,
                length: 16
            })
        );
        let n = none_chunk(4);
        assert_eq!(ChunkHeader::decode(&n).unwrap().length, 0);
    }

    #[test]
    fn block_status_roundtrip() {
        let ext = [
            BlockDescriptor {
                length: 4096,
                flags: 3,
            },
            BlockDescriptor {
                length: 512,
                flags: 0,
            },
        ];
        let mut out = Vec::new();
        put_block_status(&mut out, 11, true, 1, &ext);
        let h = ChunkHeader::decode(&out).unwrap();
        assert_eq!(h.length, 4 + 16);
        match ChunkPayload::decode(h.kind, &out[CHUNK_HEADER_LEN..]).unwrap() {
            ChunkPayload::BlockStatus {
                context_id,
                descriptors,
            } => {
                assert_eq!(context_id, 1);
                assert_eq!(block_descriptors(descriptors).collect::<Vec<_>>(), ext);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

//! Reply headers for command outcomes, built on the stack.
//!
//! This module owns the choice between simple and structured replies: a
//! successful read is one `OFFSET_DATA` chunk (flagged done) under
//! structured replies, or a simple reply followed by the data; other
//! successes are a 16-byte simple reply (allowed under structured replies
//! because they carry no payload); errors are an `ERROR` chunk under
//! structured replies (so a refused read is structured, as required) and a
//! simple reply otherwise, except a read whose device I/O failed, which gets
//! an `ERROR_OFFSET` chunk naming where the failed range starts. The data
//! itself never passes through here.

use crate::wire::{self, NbdErrno, SimpleReply};

/// Largest header this module produces (an `ERROR_OFFSET` chunk).
pub const MAX_REPLY_HEADER_LEN: usize = wire::ERROR_OFFSET_CHUNK_LEN;

const _: () = assert!(wire::OFFSET_HOLE_CHUNK_LEN <= MAX_REPLY_HEADER_LEN);
const _: () = assert!(wire::OFFSET_DATA_PREFIX_LEN <= MAX_REPLY_HEADER_LEN);
const _: () = assert!(wire::ERROR_CHUNK_LEN <= MAX_REPLY_HEADER_LEN);
const _: () = assert!(wire::SIMPLE_REPLY_LEN <= MAX_REPLY_HEADER_LEN);

/// A reply header (or a whole payload-less reply) in a fixed array.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ReplyHeader {
    buf: [u8; MAX_REPLY_HEADER_LEN],
    len: u8,
}

impl std::fmt::Debug for ReplyHeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ReplyHeader")
            .field(&self.as_bytes())
            .finish()
    }
}

impl ReplyHeader {
    /// No header: the reply is entirely in its data buffer.
    pub const EMPTY: ReplyHeader = ReplyHeader {
        buf: [0; MAX_REPLY_HEADER_LEN],
        len: 0,
    };

    fn from_slice(bytes: &[u8]) -> Self {
        debug_assert!(bytes.len() <= MAX_REPLY_HEADER_LEN);
        let mut buf = [0u8; MAX_REPLY_HEADER_LEN];
        let len = bytes.len().min(MAX_REPLY_HEADER_LEN);
        buf[..len].copy_from_slice(&bytes[..len]);
        Self {
            buf,
            len: len as u8,
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..usize::from(self.len)]
    }
}

/// Success of any command other than a read.
pub fn ok(cookie: u64) -> ReplyHeader {
    ReplyHeader::from_slice(&SimpleReply { error: 0, cookie }.encode())
}

/// Header that precedes `length` bytes of read data at `offset`.
pub fn read_ok(structured: bool, cookie: u64, offset: u64, length: u32) -> ReplyHeader {
    if !structured {
        return ok(cookie);
    }
    match wire::offset_data_prefix(cookie, true, offset, length) {
        Some(prefix) => ReplyHeader::from_slice(&prefix),
        // Reads are capped at the max payload, far below 4 GiB; reaching
        // this means a bug upstream, so fail the read instead of lying.
        None => error(structured, cookie, NbdErrno::Overflow),
    }
}

/// A successful zero-length read under structured replies (no data chunk
/// may be empty, so only the final `NONE` chunk is sent).
pub fn read_empty(structured: bool, cookie: u64) -> ReplyHeader {
    if structured {
        ReplyHeader::from_slice(&wire::none_chunk(cookie))
    } else {
        ok(cookie)
    }
}

/// Failure of a READ of `length` bytes at `offset` whose device I/O failed
/// (not a refusal: those are [`error`]). Under structured replies this is a
/// final `ERROR_OFFSET` chunk at `offset`: the device reports no finer
/// position than the failed range, whose start lies within the request as
/// the protocol requires, and since no data chunk was sent the client knows
/// that nothing of the request was read. Without structured replies only
/// the errno can be sent.
pub fn read_error(
    structured: bool,
    cookie: u64,
    offset: u64,
    length: u32,
    errno: NbdErrno,
) -> ReplyHeader {
    // A zero-length read never reaches the device, so it cannot fail there.
    debug_assert!(length > 0);
    if structured {
        ReplyHeader::from_slice(&wire::error_offset_chunk(
            cookie,
            true,
            errno.code(),
            offset,
        ))
    } else {
        error(false, cookie, errno)
    }
}

/// Failure of any command.
pub fn error(structured: bool, cookie: u64, errno: NbdErrno) -> ReplyHeader {
    if structured {
        ReplyHeader::from_slice(&wire::error_chunk(cookie, errno.code()))
    } else {
        ReplyHeader::from_slice(
            &SimpleReply {
                error: errno.code(),
                cookie,
            }
            .encode(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{reply, ChunkHeader, ChunkPayload, CHUNK_HEADER_LEN};

    #[test]
    fn simple_replies() {
        assert_eq!(
            ok(5).as_bytes(),
            &SimpleReply {
                error: 0,
                cookie: 5
            }
            .encode()
        );
        assert_eq!(read_ok(false, 5, 0, 4096).as_bytes().len(), 16);
        let e = error(false, 5, NbdErrno::Inval);
        assert_eq!(
            SimpleReply::decode(e.as_bytes()),
            Ok(SimpleReply {
                error: 22,
                cookie: 5
            })
        );
    }

    #[test]
    fn structured_replies() {
        let r = read_ok(true, 5, 1024, 4096);
        let h = ChunkHeader::decode(r.as_bytes()).unwrap();
        assert_eq!(
            (h.kind, h.length, h.is_done()),
            (reply::TYPE_OFFSET_DATA, 4104, true)
        );
        let e = error(true, 6, NbdErrno::Overflow);
        let h = ChunkHeader::decode(e.as_bytes()).unwrap();
        assert!(h.is_done());
        assert_eq!(
            ChunkPayload::decode(h.kind, &e.as_bytes()[CHUNK_HEADER_LEN..]),
            Ok(ChunkPayload::Error {
                error: 75,
                message: ""
            })
        );
        let e = read_error(true, 8, 4096, 512, NbdErrno::Io);
        assert_eq!(e.as_bytes().len(), MAX_REPLY_HEADER_LEN);
        let h = ChunkHeader::decode(e.as_bytes()).unwrap();
        assert_eq!(
            (h.kind, h.cookie, h.is_done()),
            (reply::TYPE_ERROR_OFFSET, 8, true)
        );
        assert_eq!(
            ChunkPayload::decode(h.kind, &e.as_bytes()[CHUNK_HEADER_LEN..]),
            Ok(ChunkPayload::ErrorOffset {
                error: 5,
                message: "",
                offset: 4096
            })
        );
        assert_eq!(
            read_error(false, 8, 4096, 512, NbdErrno::Io).as_bytes(),
            &SimpleReply {
                error: 5,
                cookie: 8
            }
            .encode()
        );
        let n = read_empty(true, 7);
        assert_eq!(
            ChunkHeader::decode(n.as_bytes()).unwrap().kind,
            reply::TYPE_NONE
        );
    }
}

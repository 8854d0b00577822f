//! NBD wire format: constants, fixed-size headers and option payloads as plain
//! structs with `encode`/`decode`.
//!
//! This module owns the byte layouts of the fixed-newstyle NBD protocol and
//! nothing else: no state, no I/O. Every decoder takes untrusted bytes and
//! returns `Result`/`Option`; none can panic on any input (fuzzed by
//! `fuzz/fuzz_targets/nbd_*.rs` and the proptests in this crate). All integers
//! are big-endian on the wire.
//!
//! - [`handshake`]: greeting, client flags, option header, option payloads,
//!   option replies (including the `NBD_REP_INFO` variants).
//! - [`transmission`]: request header, simple reply, structured reply chunk
//!   header and chunk payloads, block-status descriptors.

pub mod handshake;
pub mod transmission;

pub use handshake::*;
pub use transmission::*;

/// `NBDMAGIC`: first 8 bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle magic, also prefixes every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of every fixed-newstyle option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Longest string the protocol allows (export names, messages, queries).
pub const MAX_STRING_LEN: usize = 4096;

/// Handshake flags (server → client, 16 bits).
pub mod handshake_flags {
    pub const FIXED_NEWSTYLE: u16 = 1 << 0;
    pub const NO_ZEROES: u16 = 1 << 1;
}

/// Client flags (client → server, 32 bits).
pub mod client_flags {
    pub const FIXED_NEWSTYLE: u32 = 1 << 0;
    pub const NO_ZEROES: u32 = 1 << 1;
}

/// Transmission flags (16 bits, sent with the export size).
pub mod transmission_flags {
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const SEND_FUA: u16 = 1 << 3;
    pub const ROTATIONAL: u16 = 1 << 4;
    pub const SEND_TRIM: u16 = 1 << 5;
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    pub const SEND_DF: u16 = 1 << 7;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    pub const SEND_RESIZE: u16 = 1 << 9;
    pub const SEND_CACHE: u16 = 1 << 10;
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// Option codes (`NBD_OPT_*`).
pub mod opt {
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const LIST: u32 = 3;
    pub const PEEK_EXPORT: u32 = 4;
    pub const STARTTLS: u32 = 5;
    pub const INFO: u32 = 6;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const LIST_META_CONTEXT: u32 = 9;
    pub const SET_META_CONTEXT: u32 = 10;
    pub const EXTENDED_HEADERS: u32 = 11;
}

/// Option reply types (`NBD_REP_*`); errors have bit 31 set.
pub mod rep {
    pub const ACK: u32 = 1;
    pub const SERVER: u32 = 2;
    pub const INFO: u32 = 3;
    pub const META_CONTEXT: u32 = 4;
    pub const ERR_BIT: u32 = 1 << 31;
    pub const ERR_UNSUP: u32 = ERR_BIT + 1;
    pub const ERR_POLICY: u32 = ERR_BIT + 2;
    pub const ERR_INVALID: u32 = ERR_BIT + 3;
    pub const ERR_PLATFORM: u32 = ERR_BIT + 4;
    pub const ERR_TLS_REQD: u32 = ERR_BIT + 5;
    pub const ERR_UNKNOWN: u32 = ERR_BIT + 6;
    pub const ERR_SHUTDOWN: u32 = ERR_BIT + 7;
    pub const ERR_BLOCK_SIZE_REQD: u32 = ERR_BIT + 8;
    pub const ERR_TOO_BIG: u32 = ERR_BIT + 9;
}

/// `NBD_INFO_*` information types (in `NBD_OPT_INFO`/`GO` and `NBD_REP_INFO`).
pub mod info {
    pub const EXPORT: u16 = 0;
    pub const NAME: u16 = 1;
    pub const DESCRIPTION: u16 = 2;
    pub const BLOCK_SIZE: u16 = 3;
}

/// Request types (`NBD_CMD_*`).
pub mod cmd {
    pub const READ: u16 = 0;
    pub const WRITE: u16 = 1;
    pub const DISC: u16 = 2;
    pub const FLUSH: u16 = 3;
    pub const TRIM: u16 = 4;
    pub const CACHE: u16 = 5;
    pub const WRITE_ZEROES: u16 = 6;
    pub const BLOCK_STATUS: u16 = 7;
}

/// Command flags (`NBD_CMD_FLAG_*`).
pub mod cmd_flags {
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
    pub const FAST_ZERO: u16 = 1 << 4;
}

/// Structured reply chunk flags and types.
pub mod reply {
    pub const FLAG_DONE: u16 = 1 << 0;
    pub const TYPE_NONE: u16 = 0;
    pub const TYPE_OFFSET_DATA: u16 = 1;
    pub const TYPE_OFFSET_HOLE: u16 = 2;
    pub const TYPE_BLOCK_STATUS: u16 = 5;
    pub const TYPE_ERROR: u16 = (1 << 15) + 1;
    pub const TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;
}

/// `base:allocation` status flags.
pub mod state {
    pub const HOLE: u32 = 1 << 0;
    pub const ZERO: u32 = 1 << 1;
}

/// The one metadata context this server knows.
pub const BASE_ALLOCATION: &str = "base:allocation";

/// NBD error values. The protocol restricts the error field to this set; a
/// bdev error is mapped onto one of them before it goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[repr(u32)]
pub enum NbdErrno {
    #[error("NBD_EPERM: operation not permitted")]
    Perm = 1,
    #[error("NBD_EIO: input/output error")]
    Io = 5,
    #[error("NBD_ENOMEM: cannot allocate memory")]
    NoMem = 12,
    #[error("NBD_EINVAL: invalid argument")]
    Inval = 22,
    #[error("NBD_ENOSPC: no space left on device")]
    NoSpc = 28,
    #[error("NBD_EOVERFLOW: value too large")]
    Overflow = 75,
    #[error("NBD_ENOTSUP: operation not supported")]
    NotSup = 95,
    #[error("NBD_ESHUTDOWN: server is shutting down")]
    Shutdown = 108,
}

impl NbdErrno {
    /// The value on the wire.
    pub const fn code(self) -> u32 {
        self as u32
    }

    /// Decodes a wire value; the protocol tells clients to read an unknown
    /// value as `EINVAL`, so unknown values map there rather than failing.
    pub const fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            0 => return None,
            1 => Self::Perm,
            5 => Self::Io,
            12 => Self::NoMem,
            22 => Self::Inval,
            28 => Self::NoSpc,
            75 => Self::Overflow,
            95 => Self::NotSup,
            108 => Self::Shutdown,
            _ => Self::Inval,
        })
    }
}

/// Why a decoder refused its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than the structure needs.
    #[error("truncated: need {need} bytes, have {have}")]
    Truncated { need: usize, have: usize },
    /// A magic number did not match.
    #[error("bad magic {found:#x}")]
    BadMagic { found: u64 },
    /// A length field disagrees with the bytes around it.
    #[error("inconsistent length field")]
    BadLength,
    /// A string is not valid UTF-8, contains NUL, or is longer than 4096.
    #[error("invalid string")]
    BadString,
    /// A value outside what the protocol defines for this field.
    #[error("invalid field value")]
    BadValue,
}

/// Bounds-checked big-endian reader over untrusted bytes; every getter
/// returns `Err(Truncated)` instead of panicking.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub const fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// Bytes not yet consumed.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let have = self.remaining();
        if n > have {
            return Err(WireError::Truncated { need: n, have });
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    pub fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    pub fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    /// The rest of the input.
    pub fn rest(&mut self) -> &'a [u8] {
        let out = &self.buf[self.pos..];
        self.pos = self.buf.len();
        out
    }

    /// A protocol string of exactly `len` bytes.
    pub fn string(&mut self, len: usize) -> Result<&'a str, WireError> {
        if len > MAX_STRING_LEN {
            return Err(WireError::BadString);
        }
        check_string(self.bytes(len)?)
    }
}

/// Validates a protocol string: UTF-8, no NUL, at most 4096 bytes.
pub fn check_string(bytes: &[u8]) -> Result<&str, WireError> {
    if bytes.len() > MAX_STRING_LEN || bytes.contains(&0) {
        return Err(WireError::BadString);
    }
    std::str::from_utf8(bytes).map_err(|_| WireError::BadString)
}

/// Big-endian writer into a fixed array; used by the fixed-size header
/// encoders so a header is built on the stack with no allocation.
pub(crate) struct Put<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl<'a> Put<'a> {
    pub(crate) fn new(buf: &'a mut [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub(crate) fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.buf[self.pos..self.pos + b.len()].copy_from_slice(b);
        self.pos += b.len();
        self
    }

    pub(crate) fn u16(&mut self, v: u16) -> &mut Self {
        self.bytes(&v.to_be_bytes())
    }

    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_be_bytes())
    }

    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_be_bytes())
    }

    /// Asserts the header was filled exactly (an encoder bug, not peer input).
    pub(crate) fn finish(&self) {
        debug_assert_eq!(self.pos, self.buf.len(), "header encoder length mismatch");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magics_spell_ascii() {
        assert_eq!(&NBD_MAGIC.to_be_bytes(), b"NBDMAGIC");
        assert_eq!(&IHAVEOPT.to_be_bytes(), b"IHAVEOPT");
    }

    #[test]
    fn errno_roundtrip() {
        for e in [
            NbdErrno::Perm,
            NbdErrno::Io,
            NbdErrno::NoMem,
            NbdErrno::Inval,
            NbdErrno::NoSpc,
            NbdErrno::Overflow,
            NbdErrno::NotSup,
            NbdErrno::Shutdown,
        ] {
            assert_eq!(NbdErrno::from_code(e.code()), Some(e));
        }
        assert_eq!(NbdErrno::from_code(0), None);
        assert_eq!(NbdErrno::from_code(1234), Some(NbdErrno::Inval));
    }

    #[test]
    fn reader_never_overreads() {
        let mut r = Reader::new(&[1, 2, 3]);
        assert_eq!(r.u16(), Ok(0x0102));
        assert_eq!(r.u16(), Err(WireError::Truncated { need: 2, have: 1 }));
        assert!(r.bytes(usize::MAX).is_err());
        assert_eq!(r.remaining(), 1);
    }

    #[test]
    fn strings_are_checked() {
        assert!(check_string(b"ok").is_ok());
        assert_eq!(check_string(b"a\0b"), Err(WireError::BadString));
        assert_eq!(check_string(&[0xff]), Err(WireError::BadString));
        assert_eq!(check_string(&[b'a'; 4097]), Err(WireError::BadString));
    }
}

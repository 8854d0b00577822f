//! Handshake-phase layouts: greeting, client flags, option header, the
//! payloads of the options this server understands, and option replies.
//!
//! Fixed-size headers encode into arrays; variable replies append to a
//! caller's `Vec<u8>` (the handshake is not on the per-I/O path).

use super::{check_string, Put, Reader, WireError, IHAVEOPT, NBD_MAGIC, OPTION_REPLY_MAGIC};

/// Server greeting: `NBDMAGIC`, `IHAVEOPT`, 16-bit handshake flags.
pub const GREETING_LEN: usize = 18;
/// Client flags: 32 bits.
pub const CLIENT_FLAGS_LEN: usize = 4;
/// Option header: `IHAVEOPT`, option, payload length.
pub const OPTION_HEADER_LEN: usize = 16;
/// Option reply header: magic, option, reply type, payload length.
pub const OPTION_REPLY_HEADER_LEN: usize = 20;
/// Reply to `NBD_OPT_EXPORT_NAME`: size, flags (then 124 zeroes unless NO_ZEROES).
pub const EXPORT_NAME_REPLY_LEN: usize = 10;
/// The reserved zeroes after an `NBD_OPT_EXPORT_NAME` reply.
pub const EXPORT_NAME_ZEROES: usize = 124;

// Compile-time checks that each fixed header is the sum of its fields.
const _: () = assert!(GREETING_LEN == 8 + 8 + 2);
const _: () = assert!(OPTION_HEADER_LEN == 8 + 4 + 4);
const _: () = assert!(OPTION_REPLY_HEADER_LEN == 8 + 4 + 4 + 4);
const _: () = assert!(EXPORT_NAME_REPLY_LEN == 8 + 2);

/// The first message of the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Greeting {
    pub handshake_flags: u16,
}

impl Greeting {
    pub fn encode(&self) -> [u8; GREETING_LEN] {
        let mut b = [0u8; GREETING_LEN];
        Put::new(&mut b)
            .u64(NBD_MAGIC)
            .u64(IHAVEOPT)
            .u16(self.handshake_flags)
            .finish();
        b
    }

    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(buf);
        let magic = r.u64()?;
        if magic != NBD_MAGIC {
            return Err(WireError::BadMagic { found: magic });
        }
        let magic = r.u64()?;
        if magic != IHAVEOPT {
            return Err(WireError::BadMagic { found: magic });
        }
        Ok(Self {
            handshake_flags: r.u16()?,
        })
    }
}

/// Client flags sent in answer to the greeting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientFlags(pub u32);

impl ClientFlags {
    pub fn encode(&self) -> [u8; CLIENT_FLAGS_LEN] {
        self.0.to_be_bytes()
    }

    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        Ok(Self(Reader::new(buf).u32()?))
    }
}

/// Header of a client option; `length` payload bytes follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub length: u32,
}

impl OptionHeader {
    pub fn encode(&self) -> [u8; OPTION_HEADER_LEN] {
        let mut b = [0u8; OPTION_HEADER_LEN];
        Put::new(&mut b)
            .u64(IHAVEOPT)
            .u32(self.option)
            .u32(self.length)
            .finish();
        b
    }

    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(buf);
        let magic = r.u64()?;
        if magic != IHAVEOPT {
            return Err(WireError::BadMagic { found: magic });
        }
        Ok(Self {
            option: r.u32()?,
            length: r.u32()?,
        })
    }
}

/// Payload of `NBD_OPT_INFO` / `NBD_OPT_GO`: export name and the list of
/// `NBD_INFO_*` items the client asks for. Borrowed from the option buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InfoRequest<'a> {
    pub name: &'a str,
    /// Raw big-endian u16 list; always an even length after `decode`.
    requests_raw: &'a [u8],
}

impl<'a> InfoRequest<'a> {
    pub fn decode(payload: &'a [u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(payload);
        let name_len = r.u32()? as usize;
        // The name must leave room for the 16-bit count (spec: <= length - 6).
        if name_len > r.remaining().saturating_sub(2) {
            return Err(WireError::BadLength);
        }
        let name = r.string(name_len)?;
        let count = r.u16()? as usize;
        let requests_raw = r.rest();
        if requests_raw.len() != count * 2 {
            return Err(WireError::BadLength);
        }
        Ok(Self { name, requests_raw })
    }

    /// The `NBD_INFO_*` codes requested, in client order.
    pub fn requests(&self) -> impl Iterator<Item = u16> + 'a {
        self.requests_raw
            .chunks_exact(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
    }

    /// Whether the client asked for `kind`.
    pub fn asks_for(&self, kind: u16) -> bool {
        self.requests().any(|k| k == kind)
    }

    /// Client-side encoder (tests, fuzz seeds).
    pub fn encode(name: &str, requests: &[u16], out: &mut Vec<u8>) {
        out.extend_from_slice(&(name.len() as u32).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(requests.len() as u16).to_be_bytes());
        for r in requests {
            out.extend_from_slice(&r.to_be_bytes());
        }
    }
}

/// Payload of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
/// `decode` validates every query up front so iteration cannot fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaContextRequest<'a> {
    pub export: &'a str,
    pub query_count: u32,
    queries_raw: &'a [u8],
}

impl<'a> MetaContextRequest<'a> {
    pub fn decode(payload: &'a [u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(payload);
        let name_len = r.u32()? as usize;
        let export = r.string(name_len)?;
        let query_count = r.u32()?;
        let queries_raw = r.rest();
        // Walk once to prove the list is well formed; `count` is bounded by
        // the payload length because each query costs at least 4 bytes.
        let mut q = Reader::new(queries_raw);
        for _ in 0..query_count {
            let len = q.u32()? as usize;
            q.string(len)?;
        }
        if q.remaining() != 0 {
            return Err(WireError::BadLength);
        }
        Ok(Self {
            export,
            query_count,
            queries_raw,
        })
    }

    /// The query strings, in client order.
    pub fn queries(&self) -> impl Iterator<Item = &'a str> + 'a {
        let mut r = Reader::new(self.queries_raw);
        std::iter::from_fn(move || {
            let len = r.u32().ok()? as usize;
            r.string(len).ok()
        })
    }

    /// Client-side encoder (tests, fuzz seeds).
    pub fn encode(export: &str, queries: &[&str], out: &mut Vec<u8>) {
        out.extend_from_slice(&(export.len() as u32).to_be_bytes());
        out.extend_from_slice(export.as_bytes());
        out.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            out.extend_from_slice(&(q.len() as u32).to_be_bytes());
            out.extend_from_slice(q.as_bytes());
        }
    }
}

/// Header of a fixed-newstyle option reply; `length` payload bytes follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub reply_type: u32,
    pub length: u32,
}

impl OptionReplyHeader {
    pub fn encode(&self) -> [u8; OPTION_REPLY_HEADER_LEN] {
        let mut b = [0u8; OPTION_REPLY_HEADER_LEN];
        Put::new(&mut b)
            .u64(OPTION_REPLY_MAGIC)
            .u32(self.option)
            .u32(self.reply_type)
            .u32(self.length)
            .finish();
        b
    }

    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(buf);
        let magic = r.u64()?;
        if magic != OPTION_REPLY_MAGIC {
            return Err(WireError::BadMagic { found: magic });
        }
        Ok(Self {
            option: r.u32()?,
            reply_type: r.u32()?,
            length: r.u32()?,
        })
    }
}

/// Appends one option reply (header + payload parts) to `out`.
pub fn put_option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, parts: &[&[u8]]) {
    let length: usize = parts.iter().map(|p| p.len()).sum();
    // Payloads built here are bounded by the catalog and 4096-byte strings.
    let length = u32::try_from(length).unwrap_or(u32::MAX);
    out.extend_from_slice(
        &OptionReplyHeader {
            option,
            reply_type,
            length,
        }
        .encode(),
    );
    for p in parts {
        out.extend_from_slice(p);
    }
}

/// Payload of `NBD_REP_INFO`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InfoReply<'a> {
    /// `NBD_INFO_EXPORT`: size and transmission flags.
    Export { size: u64, flags: u16 },
    /// `NBD_INFO_NAME`: canonical export name.
    Name(&'a str),
    /// `NBD_INFO_DESCRIPTION`: human-readable text.
    Description(&'a str),
    /// `NBD_INFO_BLOCK_SIZE`: size constraints.
    BlockSize { min: u32, preferred: u32, max: u32 },
    /// An information type this decoder does not know (clients ignore it).
    Unknown(u16),
}

impl<'a> InfoReply<'a> {
    /// Appends a complete `NBD_REP_INFO` reply for `option` to `out`.
    pub fn put(&self, option: u32, out: &mut Vec<u8>) {
        use super::info;
        let mut fixed = [0u8; 14];
        let payload: (&[u8], &[u8]) = match *self {
            Self::Export { size, flags } => {
                Put::new(&mut fixed[..12])
                    .u16(info::EXPORT)
                    .u64(size)
                    .u16(flags)
                    .finish();
                (&fixed[..12], &[])
            }
            Self::Name(s) => {
                fixed[..2].copy_from_slice(&info::NAME.to_be_bytes());
                (&fixed[..2], s.as_bytes())
            }
            Self::Description(s) => {
                fixed[..2].copy_from_slice(&info::DESCRIPTION.to_be_bytes());
                (&fixed[..2], s.as_bytes())
            }
            Self::BlockSize {
                min,
                preferred,
                max,
            } => {
                Put::new(&mut fixed)
                    .u16(info::BLOCK_SIZE)
                    .u32(min)
                    .u32(preferred)
                    .u32(max)
                    .finish();
                (&fixed[..], &[])
            }
            Self::Unknown(kind) => {
                fixed[..2].copy_from_slice(&kind.to_be_bytes());
                (&fixed[..2], &[])
            }
        };
        put_option_reply(out, option, super::rep::INFO, &[payload.0, payload.1]);
    }

    /// Decodes an `NBD_REP_INFO` payload (client side: tests, fuzzing).
    pub fn decode(payload: &'a [u8]) -> Result<Self, WireError> {
        use super::info;
        let mut r = Reader::new(payload);
        let kind = r.u16()?;
        let out = match kind {
            info::EXPORT => Self::Export {
                size: r.u64()?,
                flags: r.u16()?,
            },
            info::NAME => Self::Name(check_string(r.rest())?),
            info::DESCRIPTION => Self::Description(check_string(r.rest())?),
            info::BLOCK_SIZE => Self::BlockSize {
                min: r.u32()?,
                preferred: r.u32()?,
                max: r.u32()?,
            },
            other => {
                r.rest();
                Self::Unknown(other)
            }
        };
        if r.remaining() != 0 {
            return Err(WireError::BadLength);
        }
        Ok(out)
    }
}

/// Payload of `NBD_REP_SERVER`: export name, then an optional description.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerReply<'a> {
    pub name: &'a str,
    pub description: &'a str,
}

impl<'a> ServerReply<'a> {
    pub fn put(&self, option: u32, out: &mut Vec<u8>) {
        let len = (self.name.len() as u32).to_be_bytes();
        let parts: [&[u8]; 3] = [&len, self.name.as_bytes(), self.description.as_bytes()];
        put_option_reply(out, option, super::rep::SERVER, &parts);
    }

    pub fn decode(payload: &'a [u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(payload);
        let len = r.u32()? as usize;
        let name = r.string(len)?;
        let description = check_string(r.rest())?;
        Ok(Self { name, description })
    }
}

/// Payload of `NBD_REP_META_CONTEXT`: context id and name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaContextReply<'a> {
    pub id: u32,
    pub name: &'a str,
}

impl<'a> MetaContextReply<'a> {
    pub fn put(&self, option: u32, out: &mut Vec<u8>) {
        let id = self.id.to_be_bytes();
        put_option_reply(
            out,
            option,
            super::rep::META_CONTEXT,
            &[&id, self.name.as_bytes()],
        );
    }

    pub fn decode(payload: &'a [u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(payload);
        let id = r.u32()?;
        Ok(Self {
            id,
            name: check_string(r.rest())?,
        })
    }
}

/// Reply to `NBD_OPT_EXPORT_NAME` (no option reply header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportNameReply {
    pub size: u64,
    pub flags: u16,
}

impl ExportNameReply {
    /// Appends the reply, with the 124 reserved zeroes unless the client
    /// negotiated `NBD_FLAG_C_NO_ZEROES`.
    pub fn put(&self, no_zeroes: bool, out: &mut Vec<u8>) {
        let mut b = [0u8; EXPORT_NAME_REPLY_LEN];
        Put::new(&mut b).u64(self.size).u16(self.flags).finish();
        out.extend_from_slice(&b);
        if !no_zeroes {
            out.extend_from_slice(&[0u8; EXPORT_NAME_ZEROES]);
        }
    }

    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(buf);
        Ok(Self {
            size: r.u64()?,
            flags: r.u16()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::{info, opt, rep};
    use super::*;

    #[test]
    fn greeting_bytes() {
        let g = Greeting { handshake_flags: 3 }.encode();
        assert_eq!(&g[..16], b"NBDMAGICIHAVEOPT");
        assert_eq!(&g[16..], &[0, 3]);
        assert_eq!(Greeting::decode(&g), Ok(Greeting { handshake_flags: 3 }));
        assert!(Greeting::decode(&g[..17]).is_err());
    }

    #[test]
    fn option_header_bytes() {
        let h = OptionHeader {
            option: opt::GO,
            length: 0x0102,
        }
        .encode();
        assert_eq!(h, *b"IHAVEOPT\0\0\0\x07\0\0\x01\x02");
        assert_eq!(
            OptionHeader::decode(&h),
            Ok(OptionHeader {
                option: 7,
                length: 0x102
            })
        );
        let mut bad = h;
        bad[0] = b'X';
        assert!(matches!(
            OptionHeader::decode(&bad),
            Err(WireError::BadMagic { .. })
        ));
    }

    #[test]
    fn info_request_parse() {
        let mut p = Vec::new();
        InfoRequest::encode("disk", &[info::BLOCK_SIZE, info::NAME], &mut p);
        assert_eq!(p, b"\0\0\0\x04disk\0\x02\0\x03\0\x01");
        let r = InfoRequest::decode(&p).unwrap();
        assert_eq!(r.name, "disk");
        assert_eq!(r.requests().collect::<Vec<_>>(), vec![3, 1]);
        assert!(r.asks_for(info::BLOCK_SIZE));
        assert!(!r.asks_for(info::DESCRIPTION));
        // Count disagrees with the bytes present.
        assert_eq!(
            InfoRequest::decode(&p[..p.len() - 1]),
            Err(WireError::BadLength)
        );
        // Name length runs past the count field.
        assert_eq!(
            InfoRequest::decode(b"\0\0\0\x05disk\0\0"),
            Err(WireError::BadLength)
        );
        assert_eq!(
            InfoRequest::decode(b"\xff\xff\xff\xff"),
            Err(WireError::BadLength)
        );
    }

    #[test]
    fn meta_context_parse() {
        let mut p = Vec::new();
        MetaContextRequest::encode("d", &["base:allocation", "qemu:dirty"], &mut p);
        let r = MetaContextRequest::decode(&p).unwrap();
        assert_eq!(r.export, "d");
        assert_eq!(
            r.queries().collect::<Vec<_>>(),
            vec!["base:allocation", "qemu:dirty"]
        );
        assert!(MetaContextRequest::decode(&p[..p.len() - 1]).is_err());
        p.push(0);
        assert_eq!(MetaContextRequest::decode(&p), Err(WireError::BadLength));
        // A huge count with no data fails fast rather than looping.
        assert!(MetaContextRequest::decode(b"\0\0\0\0\xff\xff\xff\xff").is_err());
    }

    #[test]
    fn info_replies_roundtrip() {
        let cases = [
            InfoReply::Export {
                size: 1 << 40,
                flags: 0x1234,
            },
            InfoReply::Name("n"),
            InfoReply::Description("a disk"),
            InfoReply::BlockSize {
                min: 512,
                preferred: 4096,
                max: 1 << 25,
            },
        ];
        for c in cases {
            let mut out = Vec::new();
            c.put(opt::GO, &mut out);
            let h = OptionReplyHeader::decode(&out).unwrap();
            assert_eq!((h.option, h.reply_type), (opt::GO, rep::INFO));
            assert_eq!(h.length as usize, out.len() - OPTION_REPLY_HEADER_LEN);
            assert_eq!(InfoReply::decode(&out[OPTION_REPLY_HEADER_LEN..]), Ok(c));
        }
        let mut out = Vec::new();
        InfoReply::Export { size: 5, flags: 1 }.put(opt::INFO, &mut out);
        assert_eq!(out.len(), OPTION_REPLY_HEADER_LEN + 12);
    }

    #[test]
    fn export_name_reply_zeroes() {
        let mut out = Vec::new();
        ExportNameReply {
            size: 4096,
            flags: 1,
        }
        .put(false, &mut out);
        assert_eq!(out.len(), 134);
        out.clear();
        ExportNameReply {
            size: 4096,
            flags: 1,
        }
        .put(true, &mut out);
        assert_eq!(out, b"\0\0\0\0\0\0\x10\0\0\x01");
    }
}

//! Bodies of the fuzz targets, shared with the proptests so that stable
//! `cargo test` runs them over random bytes too.
//!
//! Each body feeds untrusted bytes to one parser or state machine and checks
//! the invariants that must hold whatever the input: no panic, replies that
//! decode, refusals that keep the stream in sync, accepted commands inside
//! the export.

use crate::export::{BlockSizes, ExportFeatures, ExportInfo, StaticCatalog};
use crate::negotiation::{Event, Limits, Negotiation, Step};
use crate::request::{self, Command, RequestError, TransmissionParams};
use crate::wire::{self, Reader};

fn catalog() -> StaticCatalog {
    let export = |name: &str, alloc: bool, read_only: bool| ExportInfo {
        name: name.into(),
        description: "fuzz".into(),
        size_bytes: 1 << 30,
        block_sizes: BlockSizes {
            min: 512,
            preferred: 4096,
            max_payload: 1 << 21,
        },
        features: ExportFeatures {
            read_only,
            can_flush: true,
            can_trim: true,
            can_write_zeroes: true,
            has_allocation_map: alloc,
            ..Default::default()
        },
    };
    StaticCatalog(vec![export("disk", true, false), export("ro", false, true)])
}

/// Checks that `out` is a sequence of well-formed option replies, or an
/// `NBD_OPT_EXPORT_NAME` reply (which has no header) at the very end.
fn check_option_replies(mut out: &[u8], transmission: bool) {
    while !out.is_empty() {
        let Ok(h) = wire::OptionReplyHeader::decode(out) else {
            assert!(transmission, "undecodable option reply");
            assert!(
                out.len() == wire::EXPORT_NAME_REPLY_LEN || out.len() == 134,
                "bad EXPORT_NAME reply"
            );
            return;
        };
        let end = wire::OPTION_REPLY_HEADER_LEN + h.length as usize;
        assert!(end <= out.len(), "option reply overruns its buffer");
        out = &out[end..];
    }
}

/// Drives a handshake with `data` as everything the client sends.
pub fn option_stream(data: &[u8]) {
    let catalog = catalog();
    let limits = Limits {
        max_option_payload: 4096,
        max_option_discard: 65536,
        ..Limits::default()
    };
    let mut neg = Negotiation::new(limits);
    let mut input = Reader::new(data);
    let mut out = Vec::new();
    let mut step = neg.apply(&catalog, Event::Start, &mut out);
    assert_eq!(out.len(), wire::GREETING_LEN);
    out.clear();
    loop {
        step = match step {
            Step::Read(n) => match input.bytes(n) {
                Ok(bytes) => neg.apply(&catalog, Event::Bytes(bytes), &mut out),
                Err(_) => return,
            },
            Step::Discard(n) => match input.bytes(n as usize) {
                Ok(_) => neg.apply(&catalog, Event::Discarded, &mut out),
                Err(_) => return,
            },
            Step::Transmission(n) => {
                check_option_replies(&out, true);
                assert!(n.params.flags & wire::transmission_flags::HAS_FLAGS != 0);
                return;
            }
            Step::Close(_) => {
                check_option_replies(&out, false);
                return;
            }
        };
        if matches!(step, Step::Read(_) | Step::Discard(_)) {
            check_option_replies(&out, false);
            out.clear();
        }
    }
}

/// Validates a stream of request headers; the first bytes pick the
/// negotiated parameters.
pub fn request_stream(data: &[u8]) {
    let mut input = Reader::new(data);
    let (Ok(flags), Ok(shift), Ok(size)) = (input.u16(), input.array::<1>(), input.u64()) else {
        return;
    };
    let min = 1u32 << (shift[0] % 17);
    let params = TransmissionParams {
        size_bytes: size,
        block_sizes: BlockSizes {
            min,
            preferred: min.max(512),
            max_payload: 1 << 20,
        },
        flags: flags | wire::transmission_flags::HAS_FLAGS,
        structured: shift[0] & 0x80 != 0,
        base_allocation: if shift[0] & 0x40 != 0 { Some(1) } else { None },
        block_size_agreed: true,
    };
    while let Ok(bytes) = input.bytes(wire::REQUEST_HEADER_LEN) {
        let header = wire::RequestHeader::decode(bytes);
        match request::decode(bytes, &params) {
            Ok(req) => check_command(&req.command, &params),
            Err(RequestError::Refused { discard, kind, .. }) => {
                let h = header.expect("refused a header that does not decode");
                assert_eq!(kind, h.kind);
                let expect = if h.kind == wire::cmd::WRITE {
                    h.length
                } else {
                    0
                };
                assert_eq!(
                    discard, expect,
                    "refusal must drain exactly the write payload"
                );
            }
            Err(RequestError::BadMagic(_)) => assert!(header.is_err()),
            Err(RequestError::PayloadTooLarge(n)) => assert!(n > request::MAX_DISCARD_PAYLOAD),
            Err(RequestError::Truncated) => panic!("28 bytes reported truncated"),
        }
    }
}

fn check_command(c: &Command, p: &TransmissionParams) {
    let in_range = |offset: u64, length: u32| {
        let end = offset
            .checked_add(u64::from(length))
            .expect("range overflow accepted");
        assert!(end <= p.size_bytes, "range past the export accepted");
        let min = u64::from(p.block_sizes.min);
        assert_eq!(offset % min, 0, "unaligned offset accepted");
        assert_eq!(u64::from(length) % min, 0, "unaligned length accepted");
    };
    let read_only = p.flags & wire::transmission_flags::READ_ONLY != 0;
    match *c {
        Command::Read { offset, length, .. } => {
            in_range(offset, length);
            assert!(length <= p.block_sizes.max_payload);
        }
        Command::Write { offset, length, .. } => {
            assert!(!read_only);
            in_range(offset, length);
            assert!(length <= p.block_sizes.max_payload);
        }
        Command::Trim { offset, length, .. } | Command::WriteZeroes { offset, length, .. } => {
            assert!(!read_only);
            in_range(offset, length);
        }
        Command::Cache { offset, length } => in_range(offset, length),
        Command::BlockStatus { offset, length, .. } => {
            assert!(p.base_allocation.is_some() && length > 0);
            in_range(offset, length);
        }
        Command::Flush | Command::Disconnect => {}
    }
}

/// Runs every wire decoder over `data`; none may panic.
pub fn wire_decoders(data: &[u8]) {
    let _ = wire::Greeting::decode(data);
    let _ = wire::OptionHeader::decode(data);
    let _ = wire::OptionReplyHeader::decode(data);
    if let Ok(r) = wire::InfoRequest::decode(data) {
        let _ = r.requests().count();
    }
    if let Ok(r) = wire::MetaContextRequest::decode(data) {
        assert_eq!(r.queries().count() as u64, u64::from(r.query_count));
    }
    let _ = wire::InfoReply::decode(data);
    let _ = wire::ServerReply::decode(data);
    let _ = wire::MetaContextReply::decode(data);
    let _ = wire::ExportNameReply::decode(data);
    let _ = wire::SimpleReply::decode(data);
    if let Ok(h) = wire::ChunkHeader::decode(data) {
        let payload = data.get(wire::CHUNK_HEADER_LEN..).unwrap_or(&[]);
        if let Ok(wire::ChunkPayload::BlockStatus { descriptors, .. }) =
            wire::ChunkPayload::decode(h.kind, payload)
        {
            let _ = wire::block_descriptors(descriptors).count();
        }
    }
}

//! Handshake unit tests: scripted clients against an in-memory catalog.

use super::*;
use crate::export::{BlockSizes, ExportFeatures, StaticCatalog};
use crate::wire::{
    transmission_flags as tf, MetaContextReply, OptionReplyHeader, ServerReply, GREETING_LEN,
    OPTION_REPLY_HEADER_LEN,
};

pub(crate) fn export(name: &str, alloc: bool) -> ExportInfo {
    ExportInfo {
        name: name.into(),
        description: format!("{name} disk"),
        size_bytes: 64 << 20,
        block_sizes: BlockSizes {
            min: 512,
            preferred: 4096,
            max_payload: 1 << 21,
        },
        features: ExportFeatures {
            can_flush: true,
            can_trim: true,
            can_write_zeroes: true,
            multi_conn: true,
            has_allocation_map: alloc,
            ..Default::default()
        },
    }
}

fn catalog() -> StaticCatalog {
    StaticCatalog(vec![export("disk", true), export("other", false)])
}

/// A scripted client: drives a `Negotiation` and collects the replies.
struct Client {
    neg: Negotiation,
    cat: StaticCatalog,
    out: Vec<u8>,
}

impl Client {
    /// Greeting consumed, client flags sent.
    fn new(client_flags: u32) -> Self {
        let mut c = Client {
            neg: Negotiation::new(Limits::default()),
            cat: catalog(),
            out: Vec::new(),
        };
        let step = c.neg.apply(&c.cat, Event::Start, &mut c.out);
        assert!(matches!(step, Step::Read(4)));
        assert_eq!(
            Greeting::decode(&c.out),
            Ok(Greeting { handshake_flags: 3 })
        );
        assert_eq!(c.out.len(), GREETING_LEN);
        c.out.clear();
        let step = c.neg.apply(
            &c.cat,
            Event::Bytes(&client_flags.to_be_bytes()),
            &mut c.out,
        );
        assert!(matches!(step, Step::Read(OPTION_HEADER_LEN)), "{step:?}");
        c
    }

    /// Sends one option; returns the step after it (payload fed if asked).
    fn option(&mut self, option: u32, payload: &[u8]) -> Step<usize> {
        self.out.clear();
        let header = OptionHeader {
            option,
            length: payload.len() as u32,
        }
        .encode();
        match self
            .neg
            .apply(&self.cat, Event::Bytes(&header), &mut self.out)
        {
            Step::Read(n) if !payload.is_empty() => {
                assert_eq!(n, payload.len());
                self.neg
                    .apply(&self.cat, Event::Bytes(payload), &mut self.out)
            }
            other => other,
        }
    }

    /// Splits `out` into (reply type, payload) option replies for `option`.
    fn replies(&self, option: u32) -> Vec<(u32, Vec<u8>)> {
        let mut rest = &self.out[..];
        let mut v = Vec::new();
        while !rest.is_empty() {
            let h = OptionReplyHeader::decode(rest).unwrap();
            assert_eq!(h.option, option);
            let end = OPTION_REPLY_HEADER_LEN + h.length as usize;
            v.push((h.reply_type, rest[OPTION_REPLY_HEADER_LEN..end].to_vec()));
            rest = &rest[end..];
        }
        v
    }

    fn reply_types(&self, option: u32) -> Vec<u32> {
        self.replies(option).into_iter().map(|r| r.0).collect()
    }
}

const FIXED: u32 = client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES;

fn go_payload(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut p = Vec::new();
    InfoRequest::encode(name, infos, &mut p);
    p
}

fn meta_payload(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut p = Vec::new();
    MetaContextRequest::encode(name, queries, &mut p);
    p
}

#[test]
fn unknown_client_flags_close() {
    let mut neg = Negotiation::new(Limits::default());
    let cat = catalog();
    let mut out = Vec::new();
    neg.apply(&cat, Event::Start, &mut out);
    let step = neg.apply(&cat, Event::Bytes(&[0, 0, 0, 4]), &mut out);
    assert!(matches!(step, Step::Close(HandshakeEnd::BadClientFlags(4))));
    // Nothing more is accepted once finished.
    let step = neg.apply(&cat, Event::Bytes(&[0; 16]), &mut out);
    assert!(matches!(step, Step::Close(HandshakeEnd::UnexpectedEvent)));
}

#[test]
fn garbage_option_magic_closes() {
    let mut c = Client::new(FIXED);
    let step = c
        .neg
        .apply(&c.cat, Event::Bytes(b"GET / HTTP/1.1\r\n"), &mut c.out);
    assert!(matches!(step, Step::Close(HandshakeEnd::BadOptionMagic)));
}

#[test]
fn export_name_with_and_without_zeroes() {
    for (flags, len) in [(FIXED, 10), (client_flags::FIXED_NEWSTYLE, 134), (0, 134)] {
        let mut c = Client::new(flags);
        let Step::Transmission(n) = c.option(opt::EXPORT_NAME, b"disk") else {
            panic!()
        };
        assert_eq!(c.out.len(), len);
        let r = ExportNameReply::decode(&c.out).unwrap();
        assert_eq!(r.size, 64 << 20);
        assert_eq!(r.flags, n.params.flags);
        assert!(!n.params.structured && !n.params.block_size_agreed);
        assert_eq!(n.handle, 0);
    }
}

#[test]
fn export_name_default_and_unknown() {
    let mut c = Client::new(FIXED);
    assert!(matches!(
        c.option(opt::EXPORT_NAME, b""),
        Step::Transmission(_)
    ));
    let mut c = Client::new(FIXED);
    assert!(matches!(
        c.option(opt::EXPORT_NAME, b"nope"),
        Step::Close(HandshakeEnd::UnknownExport)
    ));
    let mut c = Client::new(FIXED);
    assert!(matches!(
        c.option(opt::EXPORT_NAME, b"\xff"),
        Step::Close(HandshakeEnd::UnknownExport)
    ));
}

#[test]
fn go_sends_info_then_ack() {
    let mut c = Client::new(FIXED);
    let Step::Transmission(n) = c.option(
        opt::GO,
        &go_payload("other", &[info::NAME, info::DESCRIPTION, info::BLOCK_SIZE]),
    ) else {
        panic!()
    };
    let replies = c.replies(opt::GO);
    let infos: Vec<InfoReply<'_>> = replies
        .iter()
        .filter(|r| r.0 == rep::INFO)
        .map(|r| InfoReply::decode(&r.1).unwrap())
        .collect();
    assert_eq!(replies.last().unwrap().0, rep::ACK);
    assert!(infos.contains(&InfoReply::Export {
        size: 64 << 20,
        flags: n.params.flags
    }));
    assert!(infos.contains(&InfoReply::Name("other")));
    assert!(infos.contains(&InfoReply::Description("other disk")));
    assert!(infos.contains(&InfoReply::BlockSize {
        min: 512,
        preferred: 4096,
        max: 1 << 21
    }));
    assert_eq!(n.handle, 1);
    assert!(n.params.block_size_agreed);
}

#[test]
fn info_does_not_end_handshake() {
    let mut c = Client::new(FIXED);
    assert!(matches!(
        c.option(opt::INFO, &go_payload("disk", &[])),
        Step::Read(OPTION_HEADER_LEN)
    ));
    assert_eq!(
        c.reply_types(opt::INFO),
        vec![rep::INFO, rep::INFO, rep::ACK]
    );
    assert!(matches!(
        c.option(opt::INFO, &go_payload("missing", &[])),
        Step::Read(_)
    ));
    assert_eq!(c.reply_types(opt::INFO), vec![rep::ERR_UNKNOWN]);
    // Name length running past the payload.
    assert!(matches!(
        c.option(opt::GO, b"\0\0\0\x09disk\0\0"),
        Step::Read(_)
    ));
    assert_eq!(c.reply_types(opt::GO), vec![rep::ERR_INVALID]);
    // Still usable afterwards.
    assert!(matches!(
        c.option(opt::GO, &go_payload("disk", &[])),
        Step::Transmission(_)
    ));
}

#[test]
fn list_exports() {
    let mut c = Client::new(FIXED);
    c.option(opt::LIST, &[]);
    let replies = c.replies(opt::LIST);
    let names: Vec<_> = replies
        .iter()
        .filter(|r| r.0 == rep::SERVER)
        .map(|r| ServerReply::decode(&r.1).unwrap().name.to_string())
        .collect();
    assert_eq!(names, vec!["disk", "other"]);
    assert_eq!(replies.last().unwrap().0, rep::ACK);
    c.option(opt::LIST, b"x");
    assert_eq!(c.reply_types(opt::LIST), vec![rep::ERR_INVALID]);
}

#[test]
fn starttls_refused_by_policy() {
    let mut c = Client::new(FIXED);
    assert!(matches!(c.option(opt::STARTTLS, &[]), Step::Read(_)));
    assert_eq!(c.reply_types(opt::STARTTLS), vec![rep::ERR_POLICY]);
    c.option(opt::STARTTLS, b"junk");
    assert_eq!(c.reply_types(opt::STARTTLS), vec![rep::ERR_INVALID]);
}

#[test]
fn unknown_options_unsupported() {
    let mut c = Client::new(FIXED);
    for o in [opt::PEEK_EXPORT, opt::EXTENDED_HEADERS, 0, 12, 0xdead_beef] {
        assert!(matches!(c.option(o, b"payload"), Step::Read(_)));
        assert_eq!(c.reply_types(o), vec![rep::ERR_UNSUP]);
    }
}

#[test]
fn abort_acks_and_closes() {
    let mut c = Client::new(FIXED);
    assert!(matches!(
        c.option(opt::ABORT, &[]),
        Step::Close(HandshakeEnd::Abort)
    ));
    assert_eq!(c.reply_types(opt::ABORT), vec![rep::ACK]);
}

#[test]
fn structured_reply_and_df_flag() {
    let mut c = Client::new(FIXED);
    c.option(opt::STRUCTURED_REPLY, b"x");
    assert_eq!(c.reply_types(opt::STRUCTURED_REPLY), vec![rep::ERR_INVALID]);
    c.option(opt::STRUCTURED_REPLY, &[]);
    assert_eq!(c.reply_types(opt::STRUCTURED_REPLY), vec![rep::ACK]);
    let Step::Transmission(n) = c.option(opt::GO, &go_payload("disk", &[])) else {
        panic!()
    };
    assert!(n.params.structured);
    assert_ne!(n.params.flags & tf::SEND_DF, 0);
}

#[test]
fn meta_context_needs_structured_replies() {
    let mut c = Client::new(FIXED);
    c.option(
        opt::SET_META_CONTEXT,
        &meta_payload("disk", &["base:allocation"]),
    );
    assert_eq!(c.reply_types(opt::SET_META_CONTEXT), vec![rep::ERR_INVALID]);
}

#[test]
fn set_meta_context_selects_base_allocation() {
    let mut c = Client::new(FIXED);
    c.option(opt::STRUCTURED_REPLY, &[]);
    c.option(
        opt::SET_META_CONTEXT,
        &meta_payload("disk", &["qemu:dirty-bitmap:x", "base:", "base:allocation"]),
    );
    let replies = c.replies(opt::SET_META_CONTEXT);
    assert_eq!(replies.len(), 2);
    assert_eq!(
        MetaContextReply::decode(&replies[0].1),
        Ok(MetaContextReply {
            id: BASE_ALLOCATION_ID,
            name: BASE_ALLOCATION
        })
    );
    assert_eq!(replies[1].0, rep::ACK);
    let Step::Transmission(n) = c.option(opt::GO, &go_payload("disk", &[])) else {
        panic!()
    };
    assert_eq!(n.params.base_allocation, Some(BASE_ALLOCATION_ID));
}

#[test]
fn meta_context_is_per_export() {
    let mut c = Client::new(FIXED);
    c.option(opt::STRUCTURED_REPLY, &[]);
    c.option(
        opt::SET_META_CONTEXT,
        &meta_payload("disk", &["base:allocation"]),
    );
    // Selected for "disk" but the client goes to the default export by its
    // canonical name "disk" via "": still the same export.
    let Step::Transmission(n) = c.option(opt::GO, &go_payload("", &[])) else {
        panic!()
    };
    assert_eq!(n.params.base_allocation, Some(BASE_ALLOCATION_ID));

    let mut c = Client::new(FIXED);
    c.option(opt::STRUCTURED_REPLY, &[]);
    c.option(
        opt::SET_META_CONTEXT,
        &meta_payload("disk", &["base:allocation"]),
    );
    let Step::Transmission(n) = c.option(opt::GO, &go_payload("other", &[])) else {
        panic!()
    };
    assert_eq!(n.params.base_allocation, None);
}

#[test]
fn failed_set_meta_context_clears_selection() {
    let mut c = Client::new(FIXED);
    c.option(opt::STRUCTURED_REPLY, &[]);
    c.option(
        opt::SET_META_CONTEXT,
        &meta_payload("disk", &["base:allocation"]),
    );
    c.option(opt::SET_META_CONTEXT, b"\0\0");
    assert_eq!(c.reply_types(opt::SET_META_CONTEXT), vec![rep::ERR_INVALID]);
    let Step::Transmission(n) = c.option(opt::GO, &go_payload("disk", &[])) else {
        panic!()
    };
    assert_eq!(n.params.base_allocation, None);
}

#[test]
fn list_meta_context() {
    let mut c = Client::new(FIXED);
    for queries in [&[][..], &["base:"][..], &["base:allocation"][..]] {
        c.option(opt::LIST_META_CONTEXT, &meta_payload("disk", queries));
        let replies = c.replies(opt::LIST_META_CONTEXT);
        assert_eq!(replies.len(), 2, "{queries:?}");
        assert_eq!(
            MetaContextReply::decode(&replies[0].1),
            Ok(MetaContextReply {
                id: 0,
                name: BASE_ALLOCATION
            })
        );
    }
    c.option(
        opt::LIST_META_CONTEXT,
        &meta_payload("disk", &["x-foo:bar"]),
    );
    assert_eq!(c.reply_types(opt::LIST_META_CONTEXT), vec![rep::ACK]);
    // An export whose bdev cannot say has no contexts.
    c.option(opt::LIST_META_CONTEXT, &meta_payload("other", &[]));
    assert_eq!(c.reply_types(opt::LIST_META_CONTEXT), vec![rep::ACK]);
    c.option(opt::LIST_META_CONTEXT, &meta_payload("missing", &[]));
    assert_eq!(
        c.reply_types(opt::LIST_META_CONTEXT),
        vec![rep::ERR_UNKNOWN]
    );
}

#[test]
fn oversized_option_is_discarded_then_refused() {
    let mut c = Client::new(FIXED);
    let len = Limits::default().max_option_payload + 1;
    let header = OptionHeader {
        option: opt::GO,
        length: len,
    }
    .encode();
    assert!(
        matches!(c.neg.apply(&c.cat, Event::Bytes(&header), &mut c.out), Step::Discard(n) if n == len)
    );
    c.out.clear();
    assert!(matches!(
        c.neg.apply(&c.cat, Event::Discarded, &mut c.out),
        Step::Read(OPTION_HEADER_LEN)
    ));
    assert_eq!(c.reply_types(opt::GO), vec![rep::ERR_TOO_BIG]);
    // Past the hard cap: disconnect without reading it.
    let header = OptionHeader {
        option: opt::GO,
        length: u32::MAX,
    }
    .encode();
    assert!(matches!(
        c.neg.apply(&c.cat, Event::Bytes(&header), &mut c.out),
        Step::Close(HandshakeEnd::OptionTooLarge(u32::MAX))
    ));
}

#[test]
fn oversized_export_name_closes() {
    let mut c = Client::new(FIXED);
    let header = OptionHeader {
        option: opt::EXPORT_NAME,
        length: 1 << 20,
    }
    .encode();
    assert!(matches!(
        c.neg.apply(&c.cat, Event::Bytes(&header), &mut c.out),
        Step::Close(HandshakeEnd::OptionTooLarge(_))
    ));
}

#[test]
fn option_count_is_bounded() {
    let mut c = Client::new(FIXED);
    for _ in 0..Limits::default().max_options {
        assert!(matches!(c.option(99, &[]), Step::Read(_)));
    }
    assert!(matches!(
        c.option(99, &[]),
        Step::Close(HandshakeEnd::TooManyOptions)
    ));
}

#[test]
fn wrong_event_closes() {
    let mut c = Client::new(FIXED);
    assert!(matches!(
        c.neg.apply(&c.cat, Event::Discarded, &mut c.out),
        Step::Close(HandshakeEnd::UnexpectedEvent)
    ));
}

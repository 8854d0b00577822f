//! Property tests: wire round-trips, and the fuzz bodies over random bytes
//! (so stable `cargo test` covers what `cargo fuzz` covers on nightly).

use proptest::prelude::*;
use ustor_nbd::fuzzing;
use ustor_nbd::wire::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn request_header_roundtrip(flags: u16, kind: u16, cookie: u64, offset: u64, length: u32) {
        let h = RequestHeader { flags, kind, cookie, offset, length };
        prop_assert_eq!(RequestHeader::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn replies_roundtrip(error: u32, cookie: u64, flags: u16, kind: u16, length: u32) {
        let s = SimpleReply { error, cookie };
        prop_assert_eq!(SimpleReply::decode(&s.encode()), Ok(s));
        let c = ChunkHeader { flags, kind, cookie, length };
        prop_assert_eq!(ChunkHeader::decode(&c.encode()), Ok(c));
    }

    #[test]
    fn option_headers_roundtrip(option: u32, reply_type: u32, length: u32, hflags: u16) {
        let h = OptionHeader { option, length };
        prop_assert_eq!(OptionHeader::decode(&h.encode()), Ok(h));
        let r = OptionReplyHeader { option, reply_type, length };
        prop_assert_eq!(OptionReplyHeader::decode(&r.encode()), Ok(r));
        let g = Greeting { handshake_flags: hflags };
        prop_assert_eq!(Greeting::decode(&g.encode()), Ok(g));
    }

    #[test]
    fn info_request_roundtrip(name in "[a-z0-9/._-]{0,64}", infos in proptest::collection::vec(any::<u16>(), 0..8)) {
        let mut p = Vec::new();
        InfoRequest::encode(&name, &infos, &mut p);
        let r = InfoRequest::decode(&p).unwrap();
        prop_assert_eq!(r.name, name.as_str());
        prop_assert_eq!(r.requests().collect::<Vec<_>>(), infos);
    }

    #[test]
    fn meta_request_roundtrip(name in "[a-z]{0,16}", queries in proptest::collection::vec("[a-z:]{0,24}", 0..6)) {
        let q: Vec<&str> = queries.iter().map(String::as_str).collect();
        let mut p = Vec::new();
        MetaContextRequest::encode(&name, &q, &mut p);
        let r = MetaContextRequest::decode(&p).unwrap();
        prop_assert_eq!(r.export, name.as_str());
        prop_assert_eq!(r.queries().collect::<Vec<_>>(), q);
    }

    #[test]
    fn info_replies_roundtrip(size: u64, flags: u16, min: u32, pref: u32, max: u32, text in "\\PC{0,40}") {
        for reply in [
            InfoReply::Export { size, flags },
            InfoReply::BlockSize { min, preferred: pref, max },
            InfoReply::Name(&text),
            InfoReply::Description(&text),
        ] {
            let mut out = Vec::new();
            reply.put(opt::GO, &mut out);
            let h = OptionReplyHeader::decode(&out).unwrap();
            prop_assert_eq!(h.length as usize + OPTION_REPLY_HEADER_LEN, out.len());
            prop_assert_eq!(InfoReply::decode(&out[OPTION_REPLY_HEADER_LEN..]), Ok(reply));
        }
    }

    #[test]
    fn block_status_roundtrip(cookie: u64, id: u32, ext in proptest::collection::vec((1u32.., any::<u32>()), 1..32)) {
        let ext: Vec<BlockDescriptor> = ext.into_iter().map(|(length, flags)| BlockDescriptor { length, flags }).collect();
        let mut out = Vec::new();
        put_block_status(&mut out, cookie, true, id, &ext);
        let h = ChunkHeader::decode(&out).unwrap();
        match ChunkPayload::decode(h.kind, &out[CHUNK_HEADER_LEN..]).unwrap() {
            ChunkPayload::BlockStatus { context_id, descriptors } => {
                prop_assert_eq!(context_id, id);
                prop_assert_eq!(block_descriptors(descriptors).collect::<Vec<_>>(), ext);
            }
            other => prop_assert!(false, "unexpected {:?}", other),
        }
    }

    #[test]
    fn decoders_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        fuzzing::wire_decoders(&data);
    }

    #[test]
    fn option_stream_never_panics(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::option_stream(&data);
    }

    #[test]
    fn request_stream_never_panics(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::request_stream(&data);
    }
}

/// Random bytes rarely get past the magic; this builds plausible option
/// streams so the option handlers themselves are exercised.
fn option_bytes() -> impl Strategy<Value = Vec<u8>> {
    let one = (
        0u32..13,
        proptest::collection::vec(any::<u8>(), 0..40),
        any::<bool>(),
    )
        .prop_map(|(option, payload, structured_go)| {
            let mut v = Vec::new();
            let payload = if structured_go && (option == opt::GO || option == opt::INFO) {
                let mut p = Vec::new();
                InfoRequest::encode("disk", &[0, 1, 2, 3], &mut p);
                p
            } else if structured_go
                && (option == opt::SET_META_CONTEXT || option == opt::LIST_META_CONTEXT)
            {
                let mut p = Vec::new();
                MetaContextRequest::encode("disk", &["base:allocation", "base:"], &mut p);
                p
            } else {
                payload
            };
            v.extend_from_slice(
                &OptionHeader {
                    option,
                    length: payload.len() as u32,
                }
                .encode(),
            );
            v.extend_from_slice(&payload);
            v
        });
    (any::<u8>(), proptest::collection::vec(one, 0..12)).prop_map(|(cflags, opts)| {
        let mut v = u32::from(cflags & 3).to_be_bytes().to_vec();
        for o in opts {
            v.extend(o);
        }
        v
    })
}

/// Plausible requests: valid magic, small commands, aligned-ish ranges.
fn request_bytes() -> impl Strategy<Value = Vec<u8>> {
    let one = (0u16..10, 0u16..32, any::<u64>(), 0u64..4096, 0u32..8192).prop_map(
        |(kind, flags, cookie, blk, len)| {
            RequestHeader {
                flags,
                kind,
                cookie,
                offset: blk * 512,
                length: len * 16,
            }
            .encode()
            .to_vec()
        },
    );
    (
        any::<u16>(),
        any::<u8>(),
        proptest::collection::vec(one, 1..16),
    )
        .prop_map(|(flags, shift, reqs)| {
            let mut v = flags.to_be_bytes().to_vec();
            v.push(shift);
            v.extend_from_slice(&(1u64 << 21).to_be_bytes());
            for r in reqs {
                v.extend(r);
            }
            v
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

    #[test]
    fn structured_option_streams(data in option_bytes()) {
        fuzzing::option_stream(&data);
    }

    #[test]
    fn structured_request_streams(data in request_bytes()) {
        fuzzing::request_stream(&data);
    }
}

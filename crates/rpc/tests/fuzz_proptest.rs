//! The body of the `rpc_request` fuzz target run as a proptest, so the
//! stream splitter and request decoder see random input in every CI run
//! (cargo-fuzz needs nightly; this does not).

use proptest::prelude::*;
use serde_json::json;
use ustor_rpc::codec::{decode_message, fuzz_stream, Message, StreamDecoder};

/// Fragments that make random input look like JSON-RPC often enough to go
/// past the first byte.
fn jsonish() -> impl Strategy<Value = Vec<u8>> {
    let frag = prop_oneof![
        Just(b"{".to_vec()),
        Just(b"}".to_vec()),
        Just(b"[".to_vec()),
        Just(b"]".to_vec()),
        Just(b"\"".to_vec()),
        Just(b"\\".to_vec()),
        Just(b",".to_vec()),
        Just(b":".to_vec()),
        Just(br#""jsonrpc":"2.0""#.to_vec()),
        Just(br#""method":"m""#.to_vec()),
        Just(br#""id":"#.to_vec()),
        Just(br#""params":"#.to_vec()),
        Just(b"null".to_vec()),
        Just(b"-1.5e3".to_vec()),
        Just(b" \n".to_vec()),
        proptest::collection::vec(any::<u8>(), 0..4),
    ];
    proptest::collection::vec(frag, 0..64).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzz_stream(&data, 256);
    }

    #[test]
    fn jsonish_bytes_never_panic(data in jsonish()) {
        fuzz_stream(&data, 128);
    }

    /// Any sequence of valid requests, split at any points, decodes to the
    /// same requests with the same ids.
    #[test]
    fn valid_requests_survive_any_split(
        ids in proptest::collection::vec(any::<i64>(), 1..8),
        cuts in proptest::collection::vec(any::<usize>(), 0..8),
        text_param in any::<String>(),
        float_param in -1e300f64..1e300,
    ) {
        let params = json!({"s": "}\"{", "t": text_param, "f": float_param, "b": [true, false, null, -0.5e-7]});
        let text: String = ids
            .iter()
            .map(|id| json!({"jsonrpc": "2.0", "method": "m", "params": params, "id": id}).to_string())
            .collect::<Vec<_>>()
            .join(" ");
        let bytes = text.as_bytes();
        // Cut anywhere, even inside a UTF-8 sequence.
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        points.push(bytes.len());
        points.sort();
        let mut dec = StreamDecoder::new(1 << 20);
        let mut got = Vec::new();
        let mut start = 0;
        for p in points {
            dec.push(&bytes[start..p]).unwrap();
            start = p;
            while let Some(v) = dec.next_value().unwrap() {
                match decode_message(v) {
                    Message::Single(Ok(r)) => got.push(r.id.unwrap().as_i64().unwrap()),
                    other => panic!("unexpected {other:?}"),
                }
            }
        }
        prop_assert_eq!(got, ids);
    }
}

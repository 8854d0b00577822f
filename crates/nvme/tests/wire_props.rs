//! The fuzz target bodies as proptests (stable CI runs them).

use proptest::prelude::*;
use ustor_nvme::fuzzing;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn pdu_decoder_never_panics(data in proptest::collection::vec(any::<u8>(), 0..300)) {
        fuzzing::pdu_decode(&data);
    }

    #[test]
    fn pdu_decoder_plausible_headers(ty in 0u8..10, fl in 0u8..16, hlen in prop::sample::select(vec![8u8, 24, 72, 128]),
                                     pdo in any::<u8>(), plen in 0u32..300_000) {
        let mut b = [0u8; 8];
        b[0] = ty; b[1] = fl; b[2] = hlen; b[3] = pdo;
        b[4..8].copy_from_slice(&plen.to_le_bytes());
        fuzzing::pdu_decode(&b);
    }

    #[test]
    fn capsule_parser_never_panics(data in proptest::collection::vec(any::<u8>(), 0..2000)) {
        fuzzing::capsule_parse(&data);
    }

    #[test]
    fn capsule_parser_sgl_ids(id in prop::sample::select(vec![0x01u8, 0x5a, 0x00, 0x40, 0x5b]),
                              addr in any::<u64>(), len in any::<u32>(), extra in 0usize..1100) {
        let mut d = vec![0u8; 64 + extra];
        d[24..32].copy_from_slice(&addr.to_le_bytes());
        d[32..36].copy_from_slice(&len.to_le_bytes());
        d[39] = id;
        fuzzing::capsule_parse(&d);
    }
}

//! Property tests of the AF_XDP transport's frame decoder on arbitrary and
//! on mutated valid input (the fuzz target fs_xdp_frame runs the same
//! `decode_frames` body): never a panic, valid frames decode to what was
//! encoded, and every placement plan stays inside its segment.

use proptest::prelude::*;
use ustor_fs::xdp_wire::*;

fn ctrl(kind: Kind, frag: u16, nfrag: u16, rid: u64) -> Ctrl {
    Ctrl {
        kind,
        rxf: 0,
        frag,
        nfrag,
        session: 3,
        rid,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..4000)) {
        let _ = decode_frames(&b);
        let _ = parse(&b);
        let _ = Grant::decode(&b);
    }

    #[test]
    fn mutated_valid_frames_never_panic(
        msg in proptest::collection::vec(any::<u8>(), 1..5000),
        flips in proptest::collection::vec((any::<u16>(), any::<u8>()), 0..8),
        rid in any::<u64>(),
        frame in BASE_FRAME..=MAX_FRAME,
    ) {
        // A stream of length-prefixed frames carrying `msg`, at any frame
        // size the sender may use.
        let frags: Vec<&[u8]> = fragments(&msg, ctrl_payload(frame)).collect();
        let mut stream = Vec::new();
        for (i, p) in frags.iter().enumerate() {
            let mut f = [0u8; MAX_FRAME];
            let h = ctrl(Kind::Req, i as u16, frags.len() as u16, rid);
            let n = encode_ctrl(&mut f, [1; 6], [2; 6], &h, p);
            prop_assert_eq!(parse(&f[..n]), Ok(Frame::Ctrl { src: [2; 6], hdr: h, payload: p }));
            stream.extend_from_slice(&(n as u16).to_le_bytes());
            stream.extend_from_slice(&f[..n]);
        }
        prop_assert_eq!(decode_frames(&stream), frags.len());
        for (at, x) in flips {
            let i = at as usize % stream.len();
            stream[i] ^= x;
        }
        let _ = decode_frames(&stream);
    }

    #[test]
    fn pieces_cover_the_segment_and_no_slot_leaves_it(
        len in 1usize..(1 << 20),
        mtu in 1500usize..9000,
    ) {
        // The receiving socket's largest frame and the piece it implies.
        let frame = frame_for_mtu(mtu);
        let (chunk, headroom) = chunk_for(frame);
        prop_assert_eq!((chunk - 256 - headroom) as usize, frame);
        let piece = frame - PLACE_HDR;
        let ps: Vec<_> = pieces(len, piece).collect();
        let mut end = len;
        for &(s, l) in &ps {
            prop_assert_eq!(s + l, end);
            prop_assert!(l <= piece && l > 0);
            end = s;
            if placeable(len, piece) {
                // The largest frame in this piece's slot starts PLACE_HDR
                // before the piece and must end inside the segment.
                prop_assert!(s + frame - PLACE_HDR <= len);
            }
        }
        prop_assert_eq!(end, 0);
    }

    #[test]
    fn grants_round_trip(place in any::<bool>(), seq in any::<u8>(), nops in any::<u32>(),
                         frame in BASE_FRAME..=MAX_FRAME,
                         segs in proptest::collection::vec(MAX_FRAME as u32..(1 << 20), 0..64)) {
        let (piece, frag) = ((frame - PLACE_HDR) as u16, ctrl_payload(frame) as u16);
        let g = Grant { place, seq, nops, piece, frag, segs };
        prop_assert_eq!(Grant::decode(&g.encode()), Ok(g));
    }
}

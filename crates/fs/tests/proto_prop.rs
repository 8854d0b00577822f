//! The request decoder: every request survives encode then decode, and any
//! byte stream is decoded or refused with a protocol error, never a panic.

use proptest::prelude::*;
use ustor_fs::proto::{
    body_prefix, decode_header, decode_request, decode_stream, encode_request, ProtoError, Request,
    HEADER_LEN, MAX_BODY, WRITE_PREFIX,
};

fn name() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 1..64)
}

fn round_trip(req: Request<'_>) {
    let f = encode_request(9, 42, &req);
    let h = decode_header(f[..HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!((h.tag, h.ino), (9, 42));
    let body = &f[HEADER_LEN..];
    assert_eq!(decode_request(&h, &body[..body_prefix(&h)]).unwrap(), req);
}

proptest! {
    #[test]
    fn requests_round_trip(a in name(), b in name(), w in any::<(u32, u32, u64)>(), nonce in any::<[u8; 32]>()) {
        round_trip(Request::Hello { nonce, export: &a });
        round_trip(Request::Auth { mac: nonce });
        round_trip(Request::Lookup { name: &a });
        round_trip(Request::Getattr);
        round_trip(Request::Setattr { mask: w.0, mode: w.1, uid: 3, gid: 4, size: w.2, atime_ns: -5, mtime_ns: 6 });
        round_trip(Request::Create { mode: w.0, uid: w.1, gid: 2, name: &a });
        round_trip(Request::Mkdir { mode: w.0, uid: w.1, gid: 2, name: &b });
        round_trip(Request::Symlink { uid: 1, gid: 2, name: &a, target: &b });
        round_trip(Request::Link { dir: w.2, name: &a });
        round_trip(Request::Unlink { name: &a });
        round_trip(Request::Rmdir { name: &b });
        round_trip(Request::Rename { ddir: w.2, sname: &a, dname: &b });
        round_trip(Request::Readlink);
        round_trip(Request::Readdir { cookie: w.2, max: w.0 });
        round_trip(Request::Read { off: w.2, len: w.0 % (1 << 20) });
        round_trip(Request::Write { off: w.2, len: w.0 % (1 << 20) });
        round_trip(Request::Statfs);
        round_trip(Request::Fsync);
    }

    #[test]
    fn any_stream_is_decoded_or_refused(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_stream(&bytes);
    }

    #[test]
    fn corrupted_frames_never_panic(a in name(), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let mut f = encode_request(1, 2, &Request::Rename { ddir: 3, sname: &a, dname: &a });
        let n = f.len();
        for (i, v) in flips {
            f[i % n] ^= v;
        }
        let _ = decode_stream(&f);
    }
}

#[test]
fn oversize_and_unknown_frames_are_refused_from_the_header() {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&((MAX_BODY + 1) as u32).to_le_bytes());
    h[4] = 16;
    assert_eq!(
        decode_header(&h),
        Err(ProtoError::Oversize(MAX_BODY as u64 + 1))
    );
    h[..4].copy_from_slice(&0u32.to_le_bytes());
    h[4] = 200;
    assert_eq!(decode_header(&h), Err(ProtoError::UnknownOp(200)));
    // A name longer than NAME_MAX, trailing bytes, and a read over 1 MiB.
    let long = vec![b'x'; 300];
    let f = encode_request(1, 1, &Request::Lookup { name: &long });
    assert!(matches!(
        decode_stream(&f),
        Err(ProtoError::Malformed { .. })
    ));
    let mut f = encode_request(1, 1, &Request::Getattr);
    f[0] = 1;
    f.push(0);
    assert!(matches!(
        decode_stream(&f),
        Err(ProtoError::Malformed { .. })
    ));
    let f = encode_request(
        1,
        1,
        &Request::Read {
            off: 0,
            len: (1 << 20) + 1,
        },
    );
    assert_eq!(decode_stream(&f), Err(ProtoError::Oversize((1 << 20) + 1)));
}

/// A read's whole body and a write's prefix are the same length, so a
/// server that stages a header and `WRITE_PREFIX` bytes behind it gets
/// either request whole with one receive, and no payload byte; a write
/// whose stated payload length disagrees with its frame is refused.
#[test]
fn read_body_and_write_prefix_fit_one_lookahead() {
    let r = encode_request(1, 2, &Request::Read { off: 7, len: 4096 });
    assert_eq!(r.len(), HEADER_LEN + WRITE_PREFIX);
    let mut w = encode_request(1, 2, &Request::Write { off: 7, len: 4096 });
    assert_eq!(w.len(), HEADER_LEN + WRITE_PREFIX);
    let h = decode_header(w[..HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!(body_prefix(&h), WRITE_PREFIX);
    w[HEADER_LEN + 8] ^= 1;
    assert!(matches!(
        decode_request(&h, &w[HEADER_LEN..]),
        Err(ProtoError::Malformed { .. })
    ));
}

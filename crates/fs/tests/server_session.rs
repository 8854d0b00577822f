//! The server's request path after the handshake, without a socket
//! (`server::replay_session`, also the fuzz target `fs_server`): a valid
//! authenticated session writes and reads, a wrong MAC ends it before any
//! request runs, and arbitrary or corrupted streams never panic.

use hmac::{Hmac, Mac};
use proptest::prelude::*;
use sha2::Sha256;
use ustor_fs::proto::{encode_request, Request, NONCE_LEN};
use ustor_fs::server::replay_session;
use ustor_fs::{Fs, BLOCK_SIZE, ROOT_INO};

fn fresh() -> Fs {
    Fs::format(Box::new(vec![0u8; 512 * BLOCK_SIZE])).unwrap()
}

/// Hello and an Auth answering the harness's fixed server nonce.
fn handshake(secret: &[u8]) -> Vec<u8> {
    let cn = [1u8; NONCE_LEN];
    let mut s = encode_request(
        1,
        0,
        &Request::Hello {
            nonce: cn,
            export: b"fuzz",
        },
    );
    let mut m = Hmac::<Sha256>::new_from_slice(secret).unwrap();
    m.update(&cn);
    m.update(&[9u8; NONCE_LEN]);
    let mac: [u8; NONCE_LEN] = m.finalize().into_bytes().into();
    s.extend(encode_request(2, 0, &Request::Auth { mac }));
    s
}

fn session(secret: &[u8]) -> Vec<u8> {
    let mut s = handshake(secret);
    let create = Request::Create {
        mode: 0o644,
        uid: 0,
        gid: 0,
        name: b"f",
    };
    s.extend(encode_request(3, ROOT_INO, &create));
    // The new file is inode 2 in a fresh file system.
    s.extend(encode_request(4, 2, &Request::Write { off: 10, len: 9000 }));
    s.extend(vec![7u8; 9000]);
    s.extend(encode_request(5, 2, &Request::Read { off: 0, len: 9010 }));
    s
}

#[test]
fn authenticated_session_runs_and_wrong_mac_does_not() {
    assert_eq!(replay_session(fresh(), b"k", false, &session(b"k")), 3);
    assert_eq!(replay_session(fresh(), b"k", false, &session(b"other")), 0);
    // Read-only: create and write refused (the write's payload skipped in
    // step), the read still answered.
    assert_eq!(replay_session(fresh(), b"k", true, &session(b"k")), 3);
}

/// A metadata frame whose body could not fit the staging buffer (only a
/// write's payload may be that long: it is received in place) is refused
/// (EMSGSIZE, then the connection closes) before any of it is staged.
#[test]
fn oversize_metadata_body_is_refused_before_staging() {
    let mut s = handshake(b"");
    let name = vec![b'n'; 100 << 10];
    let mut f = encode_request(3, ROOT_INO, &Request::Lookup { name: b"x" });
    f[0..4].copy_from_slice(&((name.len() + 2) as u32).to_le_bytes());
    f.truncate(ustor_fs::proto::HEADER_LEN);
    s.extend(f);
    s.extend((name.len() as u16).to_le_bytes());
    s.extend(name);
    // Then a valid request, never read: the connection has closed.
    s.extend(encode_request(4, ROOT_INO, &Request::Getattr));
    assert_eq!(replay_session(fresh(), b"", false, &s), 1);
}

/// Write frames with metadata frames between them, every receive taking
/// all it may: no payload byte is ever staged (`replay_session` asserts
/// it), and every request is answered.
#[test]
fn pipelined_writes_and_small_frames_stage_no_payload() {
    let mut s = session(b"");
    for i in 0..8u64 {
        s.extend(encode_request(10 + i, 2, &Request::Getattr));
        let len = 1 + i as u32 * 1000;
        s.extend(encode_request(
            20 + i,
            2,
            &Request::Write { off: i * 4096, len },
        ));
        s.extend(vec![i as u8; len as usize]);
        s.extend(encode_request(
            30 + i,
            ROOT_INO,
            &Request::Lookup { name: b"f" },
        ));
    }
    assert_eq!(replay_session(fresh(), b"", false, &s), 3 + 8 * 3);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn arbitrary_requests_after_auth_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..4096)) {
        let mut s = handshake(b"");
        s.extend(tail);
        replay_session(fresh(), b"", false, &s);
    }

    #[test]
    fn corrupted_sessions_never_panic(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let mut s = session(b"");
        for (at, v) in flips {
            let n = s.len();
            s[at % n] = v;
        }
        replay_session(fresh(), b"", false, &s);
    }
}

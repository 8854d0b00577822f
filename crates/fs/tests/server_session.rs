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

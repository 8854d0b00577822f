//! Fuzz target: the file service's request path with auth
//! (`ustor_fs::server::replay_session`): the handshake's checks, then the
//! connection protocol's staging, write payloads into the region, skips and
//! reply encoding, on a fresh file system. The first byte picks a read-only
//! export; sessions with an empty secret accept any MAC, so the fuzzer gets
//! past the handshake. The same body runs as a proptest on stable in
//! crates/fs/tests/server_session.rs.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let fs = ustor_fs::Fs::format(Box::new(vec![0u8; 256 * ustor_fs::BLOCK_SIZE]))
        .expect("format");
    let secret: &[u8] = if first & 2 != 0 { b"k" } else { b"" };
    ustor_fs::server::replay_session(fs, secret, first & 1 != 0, rest);
});

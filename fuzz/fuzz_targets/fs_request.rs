//! Fuzz target: `ustor_fs::proto::decode_stream`, the file service's request
//! decoder (the same body runs as a proptest on stable in
//! crates/fs/tests/proto_prop.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ustor_fs::proto::decode_stream(data);
});

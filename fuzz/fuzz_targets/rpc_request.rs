//! Arbitrary bytes through the RPC stream splitter and JSON-RPC request
//! decoder, as the server sees a client's stream. The same body runs as a
//! proptest in crates/rpc/tests/fuzz_proptest.rs.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // A small limit so the too-large path is reached too.
    ustor_rpc::codec::fuzz_stream(data, 4096);
});

//! Fuzz target: `ustor_fs::xdp_wire::decode_frames`, the AF_XDP transport's
//! frame parser with fragment reassembly and grant decoding (the same
//! body runs as a proptest on stable in crates/fs/tests/xdp_wire_prop.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ustor_fs::xdp_wire::decode_frames(data);
});

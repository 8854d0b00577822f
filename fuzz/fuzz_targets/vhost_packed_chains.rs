//! Fuzz target: `ustor_vhost::fuzzing::packed_chains` (a hostile driver's
//! packed ring: descriptor ring, indirect tables, buffers, its event
//! suppression structure and the vring base; the same body runs as a
//! proptest on stable in crates/vhost-user/tests/proptests.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ustor_vhost::fuzzing::packed_chains(data);
});

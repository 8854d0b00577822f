//! Fuzz target: `ustor_vhost::fuzzing::ring_chains` (a hostile driver's
//! split ring: descriptor table, avail ring and buffers; the same body runs
//! as a proptest on stable in crates/vhost-user/tests/proptests.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ustor_vhost::fuzzing::ring_chains(data);
});

//! Fuzz target: `ustor_nbd::fuzzing::wire_decoders` (the same body runs as a proptest
//! on stable in crates/nbd/tests/proptests.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ustor_nbd::fuzzing::wire_decoders(data);
});

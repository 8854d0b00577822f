//! Fuzz target: `ustor_vhost::fuzzing::messages` (a frontend's byte stream
//! through the `vhost` crate's message decoder into ustor's backend; the
//! same body runs as a proptest on stable in
//! crates/vhost-user/tests/proptests.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    ustor_vhost::fuzzing::messages(data);
});

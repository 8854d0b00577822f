//! Fuzz target: `ustor_vhost::scsi::fuzzing::scsi_chains` (a hostile
//! driver's split ring walked as virtio-scsi chains; the same body runs as
//! a proptest on stable in crates/vhost-user/tests/proptests.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ustor_vhost::scsi::fuzzing::scsi_chains(data);
});

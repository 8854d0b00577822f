//! Fuzz target: `ustor_vbdev::raid::sb::Superblock::decode`, the record
//! `examine` reads from every bdev registered (any bytes: a record, none,
//! or an error; never a panic).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(sb)) = ustor_vbdev::raid::sb::Superblock::decode(data) {
        assert!((sb.slot as usize) < sb.members.len());
    }
});

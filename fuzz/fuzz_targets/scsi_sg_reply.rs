#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| ustor_scsi::fuzz::sg_reply(data));

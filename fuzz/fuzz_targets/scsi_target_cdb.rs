#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ustor_scsi_target::fuzz::cdb(data);
});

#![no_main]
use libfuzzer_sys::fuzz_target;

// A byte stream from the target through the initiator's receive machine.
fuzz_target!(|data: &[u8]| {
    let _ = ustor_iscsi::fuzz::rx_stream(data);
});

//! Fuzz target: `ustor_fs_client::ll`, the mount's decoder of the kernel's
//! FUSE requests, on /dev/fuse buffers and on ring-entry splits (the same
//! body runs as a proptest on stable in crates/fs-client/tests/ll_prop.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ustor_fs_client::ll::decode(data);
    if data.len() >= 5 {
        let op = u32::from_le_bytes(data[0..4].try_into().unwrap());
        let split = (data[4] as usize).min(data.len() - 5);
        let (head, rest) = data[5..].split_at(split);
        let _ = ustor_fs_client::ll::decode_op(op, head, rest);
    }
});

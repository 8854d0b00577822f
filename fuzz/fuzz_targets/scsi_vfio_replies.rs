//! Fuzz target: the VFIO HBA drivers' decoders of what a device writes into
//! DMA memory: MPT Fusion replies (IOCFacts, SCSI IO, task management,
//! events) and
//! virtio-scsi command responses and events. Unit tests run the same decoders over
//! short and filled inputs on stable (crates/scsi-vfio).
#![no_main]

use libfuzzer_sys::fuzz_target;
use ustor_scsi_vfio::{mpt::event as mpt_event, mpt::wire as mpt, virtio::wire as virtio};

fuzz_target!(|data: &[u8]| {
    let _ = mpt::reply_header(data);
    let _ = mpt::decode_ioc_facts(data);
    let _ = mpt::decode_port_max_devices(data);
    let _ = mpt::decode_tm_reply(data);
    let _ = mpt_event::effect(&mpt_event::decode(data));
    let len = data.first().map_or(0, |&b| u32::from(b) << 9);
    let _ = mpt::outcome(&mpt::decode_io_reply(data), len);
    let _ = virtio::outcome(&virtio::decode_resp(data));
    let _ = virtio::event_wants_rescan(data);
});

//! Bodies of the `scsi_*` protocol fuzz targets, shared with the proptests
//! that run them on stable: each feeds arbitrary bytes to a decoder, which
//! must not panic.

/// Sense decoding (fixed, descriptor, short, odd).
pub fn sense(data: &[u8]) {
    if let Ok(s) = crate::sense::Sense::decode(data) {
        let _ = s.code();
    }
}

/// CDB parsing and UNMAP parameter lists.
pub fn cdb(data: &[u8]) {
    if let Ok(c) = crate::cdb::Command::parse(data) {
        let _ = c.transfer_len(4096);
    }
    crate::cdb::parse_unmap_param(data, 64, |_, _| {});
}

/// INQUIRY, VPD pages, READ CAPACITY(16) and REPORT LUNS data.
pub fn inquiry(data: &[u8]) {
    use crate::inquiry::*;
    let _ = StdInquiry::decode(data);
    let _ = decode_serial(data);
    for d in decode_device_id(data) {
        let _ = d.id();
    }
    let _ = BlockLimits::decode(data);
    let _ = BlockCharacteristics::decode(data);
    let _ = decode_supported(data);
    let _ = crate::capacity::Capacity::decode(data);
    let _ = crate::lun::decode_report_luns(data, 512);
}

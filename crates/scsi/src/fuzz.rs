//! Bodies of the `scsi_*` fuzz targets, shared with the proptests that run
//! them on stable: each feeds arbitrary bytes to a decoder, which must not
//! panic. The protocol decoders' bodies live in `ustor-scsi-proto`.

pub use ustor_scsi_proto::fuzz::{cdb, inquiry, sense};

/// sg v3 reply headers as the kernel returns them on `read()`.
pub fn sg_reply(data: &[u8]) {
    if let Some(r) = crate::sg::hdr::Reply::decode(data) {
        let _ = r.status();
        let _ = (r.sense_len(crate::sense::SENSE_BUF_LEN), r.resid(4096));
    }
}

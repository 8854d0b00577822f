//! SGL descriptors as the NVMe/TCP transport uses them: one data block
//! descriptor in the SQE's DPTR, either
//! - *in-capsule* (SGL Data Block, subtype Offset: `0x01`): the data follows
//!   the SQE in the command capsule, at `address` bytes into the capsule data;
//! - *transport* (Transport SGL Data Block, subtype Transport specific:
//!   `0x5a`): the data moves in H2CData (after R2T) or C2HData PDUs.
//!
//! Anything else (keyed, segment, bit bucket, ...) is refused with the NVMe
//! status the base spec gives for it.

use super::sqe::Status;
use super::{le32, le64, put32, put64};

pub const SGL_DESC_LEN: usize = 16;
/// SGL Data Block descriptor, subtype Offset (in-capsule data).
pub const SGL_ID_INCAPSULE: u8 = 0x01;
/// Transport SGL Data Block descriptor, transport-specific subtype.
pub const SGL_ID_TRANSPORT: u8 = 0x5a;

/// A raw 16-byte SGL descriptor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SglDesc {
    pub address: u64,
    pub length: u32,
    /// Bits 7:4 descriptor type, 3:0 subtype.
    pub id: u8,
}

impl SglDesc {
    pub fn decode(b: &[u8]) -> SglDesc {
        if b.len() < SGL_DESC_LEN {
            return SglDesc::default();
        }
        SglDesc {
            address: le64(b, 0),
            length: le32(b, 8),
            id: b[15],
        }
    }

    pub fn encode(&self, out: &mut [u8]) {
        put64(out, 0, self.address);
        put32(out, 8, self.length);
        out[12..15].fill(0);
        out[15] = self.id;
    }

    pub fn in_capsule(len: u32) -> SglDesc {
        SglDesc {
            address: 0,
            length: len,
            id: SGL_ID_INCAPSULE,
        }
    }

    pub fn transport(len: u32) -> SglDesc {
        SglDesc {
            address: 0,
            length: len,
            id: SGL_ID_TRANSPORT,
        }
    }
}

/// Where a command's data is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataSgl {
    /// No data.
    None,
    /// `len` bytes at `offset` in the capsule's data.
    InCapsule { offset: u32, len: u32 },
    /// `len` bytes moved by R2T/H2CData or C2HData.
    Transport { len: u32 },
}

impl DataSgl {
    pub fn len(&self) -> u32 {
        match *self {
            DataSgl::None => 0,
            DataSgl::InCapsule { len, .. } | DataSgl::Transport { len } => len,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Parses the data descriptor of a command whose capsule carried
/// `incapsule_len` bytes of data. `max_len` caps the transfer (MDTS).
pub fn parse_data_sgl(d: &SglDesc, incapsule_len: u32, max_len: u32) -> Result<DataSgl, Status> {
    if d.length == 0 && incapsule_len == 0 {
        // No data: hosts send a zeroed or a zero-length transport descriptor.
        return Ok(DataSgl::None);
    }
    match d.id {
        SGL_ID_INCAPSULE => {
            // The whole range must lie in what the capsule actually carried.
            let end = d.address.checked_add(u64::from(d.length));
            match end {
                Some(e) if e <= u64::from(incapsule_len) => {}
                _ if d.address > u64::from(incapsule_len) => {
                    return Err(Status::SGL_OFFSET_INVALID)
                }
                _ => return Err(Status::DATA_SGL_LENGTH_INVALID),
            }
            if d.length == 0 {
                return Ok(DataSgl::None);
            }
            Ok(DataSgl::InCapsule {
                offset: d.address as u32,
                len: d.length,
            })
        }
        SGL_ID_TRANSPORT => {
            if d.length > max_len {
                return Err(Status::DATA_SGL_LENGTH_INVALID);
            }
            if incapsule_len != 0 {
                // Data in the capsule that no descriptor points at.
                return Err(Status::DATA_SGL_LENGTH_INVALID);
            }
            if d.length == 0 {
                Ok(DataSgl::None)
            } else {
                Ok(DataSgl::Transport { len: d.length })
            }
        }
        _ => Err(Status::SGL_TYPE_INVALID),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors() {
        let d = SglDesc::transport(4096);
        let mut b = [0u8; 16];
        d.encode(&mut b);
        assert_eq!(b[15], 0x5a);
        assert_eq!(SglDesc::decode(&b), d);
        assert_eq!(
            parse_data_sgl(&d, 0, 1 << 20),
            Ok(DataSgl::Transport { len: 4096 })
        );
        assert_eq!(
            parse_data_sgl(&d, 0, 1024),
            Err(Status::DATA_SGL_LENGTH_INVALID)
        );
        assert_eq!(
            parse_data_sgl(&SglDesc::transport(0), 0, 1024),
            Ok(DataSgl::None)
        );
        let ic = SglDesc::in_capsule(1024);
        assert_eq!(
            parse_data_sgl(&ic, 1024, 4096),
            Ok(DataSgl::InCapsule {
                offset: 0,
                len: 1024
            })
        );
        assert_eq!(
            parse_data_sgl(&ic, 512, 4096),
            Err(Status::DATA_SGL_LENGTH_INVALID)
        );
        let far = SglDesc {
            address: u64::MAX,
            length: 1,
            id: SGL_ID_INCAPSULE,
        };
        assert_eq!(
            parse_data_sgl(&far, 512, 4096),
            Err(Status::SGL_OFFSET_INVALID)
        );
        let keyed = SglDesc {
            id: 0x40,
            length: 8,
            ..Default::default()
        };
        assert_eq!(
            parse_data_sgl(&keyed, 0, 4096),
            Err(Status::SGL_TYPE_INVALID)
        );
        assert_eq!(SglDesc::decode(&[0u8; 3]), SglDesc::default());
    }
}

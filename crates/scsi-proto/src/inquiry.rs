//! INQUIRY data (SPC-4 §6.6) and the VPD pages the mid-layer reads:
//! 0x00 supported pages, 0x80 unit serial number, 0x83 device
//! identification, 0xB0 block limits, 0xB1 block device characteristics.
//!
//! Decoders take any bytes (short pages yield defaults for absent fields,
//! never a panic); encoders serve the emulated HBA.

use serde::Serialize;

pub const VPD_SUPPORTED: u8 = 0x00;
pub const VPD_SERIAL: u8 = 0x80;
pub const VPD_DEVICE_ID: u8 = 0x83;
pub const VPD_BLOCK_LIMITS: u8 = 0xb0;
pub const VPD_BLOCK_CHARACTERISTICS: u8 = 0xb1;

/// Bytes of standard INQUIRY data this crate sends and expects at least.
pub const STD_INQUIRY_LEN: usize = 36;
/// Length of the block limits page (header included).
pub const BLOCK_LIMITS_LEN: usize = 64;

/// Peripheral device types (SPC-4 table 141) the mid-layer names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceType {
    Disk,
    Tape,
    Printer,
    Processor,
    WriteOnce,
    CdDvd,
    Optical,
    MediumChanger,
    StorageArray,
    Enclosure,
    SimplifiedDisk,
    Zoned,
    WellKnownLun,
    Unknown(u8),
}

impl DeviceType {
    pub const fn from_u8(v: u8) -> DeviceType {
        match v & 0x1f {
            0x00 => DeviceType::Disk,
            0x01 => DeviceType::Tape,
            0x02 => DeviceType::Printer,
            0x03 => DeviceType::Processor,
            0x04 => DeviceType::WriteOnce,
            0x05 => DeviceType::CdDvd,
            0x07 => DeviceType::Optical,
            0x08 => DeviceType::MediumChanger,
            0x0c => DeviceType::StorageArray,
            0x0d => DeviceType::Enclosure,
            0x0e => DeviceType::SimplifiedDisk,
            0x14 => DeviceType::Zoned,
            0x1e => DeviceType::WellKnownLun,
            v => DeviceType::Unknown(v),
        }
    }

    pub const fn as_u8(self) -> u8 {
        match self {
            DeviceType::Disk => 0x00,
            DeviceType::Tape => 0x01,
            DeviceType::Printer => 0x02,
            DeviceType::Processor => 0x03,
            DeviceType::WriteOnce => 0x04,
            DeviceType::CdDvd => 0x05,
            DeviceType::Optical => 0x07,
            DeviceType::MediumChanger => 0x08,
            DeviceType::StorageArray => 0x0c,
            DeviceType::Enclosure => 0x0d,
            DeviceType::SimplifiedDisk => 0x0e,
            DeviceType::Zoned => 0x14,
            DeviceType::WellKnownLun => 0x1e,
            DeviceType::Unknown(v) => v,
        }
    }
}

/// Standard INQUIRY data.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StdInquiry {
    /// Peripheral qualifier: 0 connected, 1 not connected, 3 no LUN here.
    pub qualifier: u8,
    pub device_type: DeviceType,
    pub removable: bool,
    pub version: u8,
    pub cmdque: bool,
    pub vendor: String,
    pub product: String,
    pub revision: String,
}

fn ascii(b: &[u8]) -> String {
    b.iter()
        .map(|&c| {
            if (0x20..0x7f).contains(&c) {
                c as char
            } else {
                ' '
            }
        })
        .collect::<String>()
        .trim()
        .to_string()
}

fn field(b: &[u8], from: usize, to: usize) -> &[u8] {
    let to = to.min(b.len());
    b.get(from..to).unwrap_or(&[])
}

fn pad_into(out: &mut [u8], s: &str) {
    out.fill(b' ');
    for (o, c) in out.iter_mut().zip(s.bytes()) {
        *o = c;
    }
}

impl StdInquiry {
    /// Decodes standard INQUIRY data; `None` if not even byte 0 is there.
    pub fn decode(b: &[u8]) -> Option<StdInquiry> {
        let b0 = *b.first()?;
        let at = |i: usize| b.get(i).copied().unwrap_or(0);
        Some(StdInquiry {
            qualifier: b0 >> 5,
            device_type: DeviceType::from_u8(b0),
            removable: at(1) & 0x80 != 0,
            version: at(2),
            cmdque: at(7) & 0x02 != 0,
            vendor: ascii(field(b, 8, 16)),
            product: ascii(field(b, 16, 32)),
            revision: ascii(field(b, 32, 36)),
        })
    }

    pub fn encode(&self, out: &mut [u8; STD_INQUIRY_LEN]) {
        *out = [0; STD_INQUIRY_LEN];
        out[0] = (self.qualifier << 5) | (self.device_type.as_u8() & 0x1f);
        out[1] = if self.removable { 0x80 } else { 0 };
        out[2] = self.version;
        out[3] = 0x02; // response data format 2
        out[4] = (STD_INQUIRY_LEN - 5) as u8;
        out[7] = if self.cmdque { 0x02 } else { 0 };
        pad_into(&mut out[8..16], &self.vendor);
        pad_into(&mut out[16..32], &self.product);
        pad_into(&mut out[32..36], &self.revision);
    }
}

/// The payload of a VPD page after its 4-byte header, bounded by both the
/// page length field and the bytes received; `None` if the header is short
/// or names another page.
pub fn vpd_payload(b: &[u8], page: u8) -> Option<&[u8]> {
    if b.len() < 4 || b[1] != page {
        return None;
    }
    let len = u16::from_be_bytes([b[2], b[3]]) as usize;
    Some(&b[4..(4 + len).min(b.len())])
}

/// Writes a VPD header for `page` with `payload_len` bytes after it.
pub fn vpd_header(out: &mut [u8], device_type: DeviceType, page: u8, payload_len: u16) {
    out[0] = device_type.as_u8() & 0x1f;
    out[1] = page;
    out[2..4].copy_from_slice(&payload_len.to_be_bytes());
}

/// Page 0x80: the unit serial number, trimmed.
pub fn decode_serial(b: &[u8]) -> Option<String> {
    vpd_payload(b, VPD_SERIAL).map(ascii)
}

/// Designator types of page 0x83 (SPC-4 table 459).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DesignatorType {
    VendorSpecific,
    T10VendorId,
    Eui64,
    Naa,
    RelativeTargetPort,
    TargetPortGroup,
    LuGroup,
    Md5,
    ScsiName,
    ProtocolPort,
    Uuid,
    Other(u8),
}

impl DesignatorType {
    fn from_u8(v: u8) -> DesignatorType {
        match v & 0x0f {
            0 => DesignatorType::VendorSpecific,
            1 => DesignatorType::T10VendorId,
            2 => DesignatorType::Eui64,
            3 => DesignatorType::Naa,
            4 => DesignatorType::RelativeTargetPort,
            5 => DesignatorType::TargetPortGroup,
            6 => DesignatorType::LuGroup,
            7 => DesignatorType::Md5,
            8 => DesignatorType::ScsiName,
            9 => DesignatorType::ProtocolPort,
            0xa => DesignatorType::Uuid,
            v => DesignatorType::Other(v),
        }
    }
}

/// One designation descriptor of page 0x83.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Designator {
    pub kind: DesignatorType,
    /// 0 logical unit, 1 target port, 2 target device.
    pub association: u8,
    /// Code set 2/3 (ASCII/UTF-8) kept as text; binary as hex.
    pub value: String,
}

impl Designator {
    /// `naa.6001405...`, `eui.…`, `t10.…` — the id users name devices by.
    pub fn id(&self) -> String {
        let p = match self.kind {
            DesignatorType::Naa => "naa.",
            DesignatorType::Eui64 => "eui.",
            DesignatorType::T10VendorId => "t10.",
            DesignatorType::ScsiName => "",
            DesignatorType::Uuid => "uuid.",
            _ => "vpd83.",
        };
        format!("{p}{}", self.value)
    }
}

/// Most designators taken from one page (a budget on a peer-driven loop).
const MAX_DESIGNATORS: usize = 32;

/// Page 0x83: every well-formed designation descriptor.
pub fn decode_device_id(b: &[u8]) -> Vec<Designator> {
    let Some(p) = vpd_payload(b, VPD_DEVICE_ID) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut pos = 0;
    while pos + 4 <= p.len() && out.len() < MAX_DESIGNATORS {
        let code_set = p[pos] & 0x0f;
        let kind = DesignatorType::from_u8(p[pos + 1]);
        let association = (p[pos + 1] >> 4) & 0x03;
        let len = p[pos + 3] as usize;
        let Some(v) = p.get(pos + 4..pos + 4 + len) else {
            break;
        };
        let value = if code_set == 2 || code_set == 3 {
            ascii(v)
        } else {
            v.iter().map(|x| format!("{x:02x}")).collect()
        };
        out.push(Designator {
            kind,
            association,
            value,
        });
        pos += 4 + len;
    }
    out
}

/// Appends one binary designation descriptor (LU association) to `out`.
pub fn encode_designator(out: &mut Vec<u8>, kind: u8, value: &[u8]) {
    out.extend_from_slice(&[0x01, kind & 0x0f, 0, value.len() as u8]);
    out.extend_from_slice(value);
}

/// Page 0xB0 (SBC-3 §6.6.4): limits the SCSI bdev obeys. Zero means "not
/// reported" (no limit) for every field.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct BlockLimits {
    pub max_compare_write_blocks: u8,
    pub opt_xfer_granularity_blocks: u16,
    pub max_xfer_blocks: u32,
    pub opt_xfer_blocks: u32,
    pub max_unmap_blocks: u32,
    pub max_unmap_descriptors: u32,
    pub unmap_granularity_blocks: u32,
    pub unmap_alignment_blocks: Option<u32>,
    pub max_write_same_blocks: u64,
}

impl BlockLimits {
    pub fn decode(b: &[u8]) -> Option<BlockLimits> {
        let p = vpd_payload(b, VPD_BLOCK_LIMITS)?;
        // Offsets below are page offsets; the payload starts at byte 4.
        let u16_at = |o: usize| {
            field(p, o - 4, o - 2)
                .try_into()
                .map(u16::from_be_bytes)
                .unwrap_or(0)
        };
        let u32_at = |o: usize| {
            field(p, o - 4, o)
                .try_into()
                .map(u32::from_be_bytes)
                .unwrap_or(0)
        };
        let u64_at = |o: usize| {
            field(p, o - 4, o + 4)
                .try_into()
                .map(u64::from_be_bytes)
                .unwrap_or(0)
        };
        let ua = u32_at(32);
        Some(BlockLimits {
            max_compare_write_blocks: p.get(1).copied().unwrap_or(0),
            opt_xfer_granularity_blocks: u16_at(6),
            max_xfer_blocks: u32_at(8),
            opt_xfer_blocks: u32_at(12),
            max_unmap_blocks: u32_at(20),
            max_unmap_descriptors: u32_at(24),
            unmap_granularity_blocks: u32_at(28),
            unmap_alignment_blocks: (ua & 0x8000_0000 != 0).then_some(ua & 0x7fff_ffff),
            max_write_same_blocks: u64_at(36),
        })
    }

    pub fn encode(&self, out: &mut [u8; BLOCK_LIMITS_LEN]) {
        *out = [0; BLOCK_LIMITS_LEN];
        vpd_header(
            out,
            DeviceType::Disk,
            VPD_BLOCK_LIMITS,
            (BLOCK_LIMITS_LEN - 4) as u16,
        );
        out[5] = self.max_compare_write_blocks;
        out[6..8].copy_from_slice(&self.opt_xfer_granularity_blocks.to_be_bytes());
        out[8..12].copy_from_slice(&self.max_xfer_blocks.to_be_bytes());
        out[12..16].copy_from_slice(&self.opt_xfer_blocks.to_be_bytes());
        out[20..24].copy_from_slice(&self.max_unmap_blocks.to_be_bytes());
        out[24..28].copy_from_slice(&self.max_unmap_descriptors.to_be_bytes());
        out[28..32].copy_from_slice(&self.unmap_granularity_blocks.to_be_bytes());
        if let Some(a) = self.unmap_alignment_blocks {
            out[32..36].copy_from_slice(&(a | 0x8000_0000).to_be_bytes());
        }
        out[36..44].copy_from_slice(&self.max_write_same_blocks.to_be_bytes());
    }
}

/// Page 0xB1 (SBC-3 §6.6.2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct BlockCharacteristics {
    /// 0 not reported, 1 non-rotating (SSD), else RPM.
    pub rotation_rate: u16,
    pub form_factor: u8,
    pub fua_behaviour: bool,
}

impl BlockCharacteristics {
    pub fn decode(b: &[u8]) -> Option<BlockCharacteristics> {
        let p = vpd_payload(b, VPD_BLOCK_CHARACTERISTICS)?;
        let at = |o: usize| p.get(o - 4).copied().unwrap_or(0);
        Some(BlockCharacteristics {
            rotation_rate: u16::from_be_bytes([at(4), at(5)]),
            form_factor: at(7) & 0x0f,
            fua_behaviour: at(8) & 0x02 != 0,
        })
    }

    pub fn encode(&self, out: &mut [u8; 64]) {
        *out = [0; 64];
        vpd_header(out, DeviceType::Disk, VPD_BLOCK_CHARACTERISTICS, 60);
        out[4..6].copy_from_slice(&self.rotation_rate.to_be_bytes());
        out[7] = self.form_factor & 0x0f;
        out[8] = if self.fua_behaviour { 0x02 } else { 0 };
    }
}

/// Page 0x00: the page codes listed.
pub fn decode_supported(b: &[u8]) -> Vec<u8> {
    vpd_payload(b, VPD_SUPPORTED)
        .map(|p| p.to_vec())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn std_inquiry_round_trips() {
        let i = StdInquiry {
            qualifier: 0,
            device_type: DeviceType::Disk,
            removable: false,
            version: 6,
            cmdque: true,
            vendor: "USTOR".into(),
            product: "EMUL DISK".into(),
            revision: "0001".into(),
        };
        let mut b = [0; STD_INQUIRY_LEN];
        i.encode(&mut b);
        assert_eq!(StdInquiry::decode(&b), Some(i));
        let short = StdInquiry::decode(&b[..10]).unwrap();
        assert_eq!(short.product, "");
    }

    #[test]
    fn block_limits_round_trip() {
        let l = BlockLimits {
            max_xfer_blocks: 256,
            opt_xfer_blocks: 64,
            max_unmap_blocks: 1 << 20,
            max_unmap_descriptors: 1,
            unmap_granularity_blocks: 8,
            unmap_alignment_blocks: Some(0),
            max_write_same_blocks: 4096,
            ..Default::default()
        };
        let mut b = [0; BLOCK_LIMITS_LEN];
        l.encode(&mut b);
        assert_eq!(BlockLimits::decode(&b), Some(l));
        // A truncated page: present fields only.
        let t = BlockLimits::decode(&b[..16]).unwrap();
        assert_eq!((t.max_xfer_blocks, t.max_unmap_blocks), (256, 0));
    }

    #[test]
    fn device_id_designators() {
        let mut p = vec![0, VPD_DEVICE_ID, 0, 0];
        encode_designator(&mut p, 3, &[0x60, 0x01, 0x40, 0x5a, 1, 2, 3, 4]);
        p.extend_from_slice(&[0x02, 0x08, 0, 4, b'i', b'q', b'n', b'.']);
        let n = (p.len() - 4) as u16;
        p[2..4].copy_from_slice(&n.to_be_bytes());
        let d = decode_device_id(&p);
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].id(), "naa.6001405a01020304");
        assert_eq!(
            (d[1].kind, d[1].value.as_str()),
            (DesignatorType::ScsiName, "iqn.")
        );
        // Descriptor length past the end stops the walk.
        p[7] = 200;
        assert!(decode_device_id(&p).is_empty());
    }

    #[test]
    fn characteristics_and_serial() {
        let c = BlockCharacteristics {
            rotation_rate: 1,
            form_factor: 3,
            fua_behaviour: true,
        };
        let mut b = [0; 64];
        c.encode(&mut b);
        assert_eq!(BlockCharacteristics::decode(&b), Some(c));
        assert_eq!(
            decode_serial(&[0, 0x80, 0, 4, b'a', b'b', b' ', 0]).as_deref(),
            Some("ab")
        );
        assert_eq!(
            decode_supported(&[0, 0, 0, 2, 0x80, 0xb0]),
            vec![0x80, 0xb0]
        );
    }

    proptest! {
        #[test]
        fn decoders_never_panic(data in proptest::collection::vec(any::<u8>(), 0..200), page in any::<u8>()) {
            let mut d = data.clone();
            if d.len() > 1 { d[1] = page; }
            crate::fuzz::inquiry(&d);
            crate::fuzz::inquiry(&data);
        }
    }
}

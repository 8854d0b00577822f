//! READ CAPACITY(16) parameter data (SBC-3 §5.16.2).

use serde::Serialize;

pub const READ_CAPACITY_16_LEN: usize = 32;

/// What READ CAPACITY(16) says about a logical unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Capacity {
    pub num_blocks: u64,
    pub block_size: u32,
    /// log2(logical blocks per physical block).
    pub lbppbe: u8,
    /// Logical block provisioning management enabled (thin: UNMAP works).
    pub lbpme: bool,
    /// Unmapped blocks read as zeroes.
    pub lbprz: bool,
}

impl Capacity {
    /// Decodes; `None` unless the 12 bytes of LBA and block length are there
    /// and the block length is sane.
    pub fn decode(b: &[u8]) -> Option<Capacity> {
        if b.len() < 12 {
            return None;
        }
        let last = u64::from_be_bytes(b[0..8].try_into().ok()?);
        let bs = u32::from_be_bytes(b[8..12].try_into().ok()?);
        if bs == 0 || last == u64::MAX {
            return None;
        }
        let at = |i: usize| b.get(i).copied().unwrap_or(0);
        Some(Capacity {
            num_blocks: last + 1,
            block_size: bs,
            lbppbe: at(13) & 0x0f,
            lbpme: at(14) & 0x80 != 0,
            lbprz: at(14) & 0x40 != 0,
        })
    }

    pub fn encode(&self, out: &mut [u8; READ_CAPACITY_16_LEN]) {
        *out = [0; READ_CAPACITY_16_LEN];
        out[0..8].copy_from_slice(&(self.num_blocks.saturating_sub(1)).to_be_bytes());
        out[8..12].copy_from_slice(&self.block_size.to_be_bytes());
        out[13] = self.lbppbe & 0x0f;
        out[14] = (if self.lbpme { 0x80 } else { 0 }) | (if self.lbprz { 0x40 } else { 0 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_short() {
        let c = Capacity {
            num_blocks: 1 << 30,
            block_size: 4096,
            lbppbe: 0,
            lbpme: true,
            lbprz: true,
        };
        let mut b = [0; READ_CAPACITY_16_LEN];
        c.encode(&mut b);
        assert_eq!(Capacity::decode(&b), Some(c));
        assert_eq!(Capacity::decode(&b[..11]), None);
        assert_eq!(Capacity::decode(&[0xff; 12]), None);
        assert!(!Capacity::decode(&b[..12]).unwrap().lbpme);
    }
}

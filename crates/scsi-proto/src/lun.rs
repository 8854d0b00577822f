//! Logical unit numbers (SAM-5 §4.7) and REPORT LUNS parameter data
//! (SPC-4 §6.33), plus the host:channel:target:lun address the mid-layer
//! names devices by.

use serde::{Deserialize, Serialize};

/// A device's address in the mid-layer, as Linux's H:C:T:L.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Hctl {
    pub host: u32,
    pub channel: u32,
    pub target: u32,
    pub lun: u64,
}

impl std::fmt::Display for Hctl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}:{}:{}:{}",
            self.host, self.channel, self.target, self.lun
        )
    }
}

impl std::str::FromStr for Hctl {
    type Err = ();
    fn from_str(s: &str) -> Result<Hctl, ()> {
        let mut it = s.split(':');
        let mut next = || it.next().ok_or(())?.parse::<u64>().map_err(|_| ());
        let (h, c, t, l) = (next()?, next()?, next()?, next()?);
        if it.next().is_some() || h > u32::MAX as u64 || c > u32::MAX as u64 || t > u32::MAX as u64
        {
            return Err(());
        }
        Ok(Hctl {
            host: h as u32,
            channel: c as u32,
            target: t as u32,
            lun: l,
        })
    }
}

/// Encodes a LUN number as 8 wire bytes, Linux's `int_to_scsilun`: each
/// 16-bit level of the number is one 2-byte addressing level, so LUNs below
/// 256 are peripheral-addressed and flat-space LUNs are `0x4000 | n`.
pub fn encode_lun(lun: u64) -> [u8; 8] {
    let mut b = [0u8; 8];
    for i in 0..4 {
        let level = (lun >> (16 * i)) as u16;
        b[2 * i..2 * i + 2].copy_from_slice(&level.to_be_bytes());
    }
    b
}

/// Decodes 8 wire bytes into a LUN number (Linux's `scsilun_to_int`; the
/// inverse of [`encode_lun`]).
pub fn decode_lun(b: [u8; 8]) -> u64 {
    (0..4).fold(0u64, |acc, i| {
        acc | (u16::from_be_bytes([b[2 * i], b[2 * i + 1]]) as u64) << (16 * i)
    })
}

/// LUNs in REPORT LUNS data, at most `max`; also returns the list length
/// the device claims (larger than what arrived when the buffer was short).
pub fn decode_report_luns(b: &[u8], max: usize) -> (Vec<u64>, u32) {
    if b.len() < 8 {
        return (Vec::new(), 0);
    }
    let list_len = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    let end = (8 + list_len as usize).min(b.len());
    let luns = b[8..end]
        .chunks_exact(8)
        .take(max)
        .map(|c| decode_lun(c.try_into().unwrap_or([0; 8])))
        .collect();
    (luns, list_len)
}

/// Encodes REPORT LUNS data for `luns` into `out` (truncated to its length,
/// as the allocation length demands); returns the bytes written.
pub fn encode_report_luns(luns: &[u64], out: &mut [u8]) -> usize {
    let full = 8 + 8 * luns.len();
    let mut put = |at: usize, b: &[u8]| {
        for (i, x) in b.iter().enumerate() {
            if let Some(o) = out.get_mut(at + i) {
                *o = *x;
            }
        }
    };
    put(0, &((8 * luns.len()) as u32).to_be_bytes());
    put(4, &[0; 4]);
    for (i, l) in luns.iter().enumerate() {
        put(8 + 8 * i, &encode_lun(*l));
    }
    full.min(out.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn hctl_parse_and_print() {
        let h: Hctl = "1:0:2:3".parse().unwrap();
        assert_eq!(h.to_string(), "1:0:2:3");
        assert!("1:0:2".parse::<Hctl>().is_err());
        assert!("1:0:2:3:4".parse::<Hctl>().is_err());
        assert!("sda".parse::<Hctl>().is_err());
    }

    #[test]
    fn report_luns_round_trip_and_truncation() {
        let luns = [0u64, 1, 255, 0x4100, 16383, 70000];
        let mut b = vec![0u8; 8 + 8 * luns.len()];
        encode_report_luns(&luns, &mut b);
        assert_eq!(decode_report_luns(&b, 100), (luns.to_vec(), 48));
        // Short buffer: what arrived, and the length the device wanted.
        let (l, want) = decode_report_luns(&b[..20], 100);
        assert_eq!((l, want), (vec![0], 48));
        assert_eq!(decode_report_luns(&b, 2).0.len(), 2);
    }

    proptest! {
        #[test]
        fn lun_round_trips(lun in 0u64..(1 << 48)) {
            prop_assert_eq!(decode_lun(encode_lun(lun)), lun);
        }
    }
}

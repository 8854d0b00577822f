//! Initiator-group netmasks with SPDK's spelling: `ANY`, an address
//! (`127.0.0.1`, `[::1]`) or a network (`192.168.0.0/16`, `[fd00::]/8`).

use std::net::IpAddr;

/// Whether `peer` is inside `mask`. A mask that does not parse matches
/// nothing (it cannot let anyone in by mistake).
pub fn matches(mask: &str, peer: IpAddr) -> bool {
    if mask.eq_ignore_ascii_case("ANY") {
        return true;
    }
    let (addr, bits) = match mask.rsplit_once('/') {
        Some((a, b)) => match b.parse::<u32>() {
            Ok(b) => (a, Some(b)),
            Err(_) => return false,
        },
        None => (mask, None),
    };
    let addr = addr.trim_start_matches('[').trim_end_matches(']');
    let Ok(net) = addr.parse::<IpAddr>() else {
        return false;
    };
    match (net, peer.to_canonical()) {
        (IpAddr::V4(n), IpAddr::V4(p)) => {
            prefix_eq(n.to_bits().into(), p.to_bits().into(), 32, bits)
        }
        (IpAddr::V6(n), IpAddr::V6(p)) => prefix_eq(n.to_bits(), p.to_bits(), 128, bits),
        _ => false,
    }
}

/// Whether the top `bits` (all when `None`) of two `width`-bit values agree.
fn prefix_eq(net: u128, peer: u128, width: u32, bits: Option<u32>) -> bool {
    let bits = bits.unwrap_or(width);
    if bits > width {
        return false;
    }
    let shift = width - bits;
    bits == 0 || (net >> shift) == (peer >> shift)
}

/// Whether `peer` passes a group's netmasks: an empty list (a group made
/// without any) and an unknown peer pass, as before netmasks were checked.
pub fn allowed(masks: &[String], peer: Option<IpAddr>) -> bool {
    match peer {
        Some(p) if !masks.is_empty() => masks.iter().any(|m| matches(m, p)),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks() {
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        assert!(matches("ANY", lo));
        assert!(matches("127.0.0.1", lo));
        assert!(matches("127.0.0.0/8", lo));
        assert!(matches("0.0.0.0/0", lo));
        assert!(!matches("10.0.0.0/8", lo));
        assert!(!matches("127.0.0.2", lo));
        assert!(!matches("127.0.0.0/33", lo));
        assert!(!matches("garbage", lo));
        let v6: IpAddr = "fd00::5".parse().unwrap();
        assert!(matches("[fd00::]/8", v6));
        assert!(!matches("[::1]", v6));
        assert!(!matches("127.0.0.1", v6));
        assert!(matches("127.0.0.1", "::ffff:127.0.0.1".parse().unwrap()));
        assert!(allowed(&[], Some(lo)));
        assert!(!allowed(&["10.0.0.0/8".into()], Some(lo)));
    }
}

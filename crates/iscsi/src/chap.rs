//! CHAP for iSCSI login (RFC 7143 §12.1.3, RFC 1994): MD5 only
//! (`CHAP_A=5`). One-way (the target checks us) and mutual (we also check
//! the target). Pure functions: the login module carries the keys.

use md5::{Digest, Md5};

/// CHAP algorithm number of MD5.
pub const ALG_MD5: &str = "5";
/// Bytes of the challenges we send (as long as the MD5 output, as RFC 1994
/// advises).
pub const CHALLENGE_LEN: usize = 16;
/// Largest binary value we decode from a peer (caps allocation).
pub const MAX_VALUE_LEN: usize = 1024;

/// Credentials for one direction.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChapSecret {
    pub user: String,
    pub secret: String,
}

/// The CHAP response: MD5(id || secret || challenge) (RFC 1994 §4.1).
pub fn response(id: u8, secret: &[u8], challenge: &[u8]) -> [u8; 16] {
    let mut h = Md5::new();
    h.update([id]);
    h.update(secret);
    h.update(challenge);
    h.finalize().into()
}

/// Encodes binary as an iSCSI hex constant (`0x…`).
pub fn encode_hex(b: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 + b.len() * 2);
    s.push_str("0x");
    for &x in b {
        s.push(HEX[(x >> 4) as usize] as char);
        s.push(HEX[(x & 15) as usize] as char);
    }
    s
}

/// Decodes an iSCSI binary constant: hex (`0x…`, odd length allowed) or
/// base64 (`0b…`) (RFC 7143 §6.1). `None` if malformed or too long.
pub fn decode_binary(v: &str) -> Option<Vec<u8>> {
    let (pfx, body) = (v.get(..2)?, v.get(2..)?);
    match pfx {
        "0x" | "0X" => {
            if body.is_empty() || body.len() > 2 * MAX_VALUE_LEN {
                return None;
            }
            let nib = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
            let b = body.as_bytes();
            let mut out = Vec::with_capacity(b.len().div_ceil(2));
            // An odd count means a leading implicit zero nibble.
            let (first, rest) = if b.len() % 2 == 1 {
                (Some(nib(b[0])?), &b[1..])
            } else {
                (None, b)
            };
            out.extend(first);
            for p in rest.chunks(2) {
                out.push(nib(p[0])? << 4 | nib(p[1])?);
            }
            Some(out)
        }
        "0b" | "0B" => decode_base64(body),
        _ => None,
    }
}

fn decode_base64(s: &str) -> Option<Vec<u8>> {
    if s.is_empty() || s.len() > MAX_VALUE_LEN * 4 / 3 + 4 {
        return None;
    }
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let body = s.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(body.len() * 3 / 4);
    for chunk in body.chunks(4) {
        if chunk.len() == 1 {
            return None;
        }
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= val(c)? << (18 - 6 * i);
        }
        let bytes = acc.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    Some(out)
}

/// Random bytes from the kernel (challenges and identifiers).
pub fn random_bytes(out: &mut [u8]) -> std::io::Result<()> {
    let mut got = 0;
    while got < out.len() {
        // SAFETY: the pointer and length describe the rest of `out`.
        let r = unsafe { libc::getrandom(out[got..].as_mut_ptr().cast(), out.len() - got, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        got += r as usize;
    }
    Ok(())
}

/// Our side of mutual CHAP: the identifier and challenge we sent, to check
/// the target's answer against.
#[derive(Clone, Debug)]
pub struct MutualChallenge {
    pub id: u8,
    pub challenge: [u8; CHALLENGE_LEN],
}

impl MutualChallenge {
    pub fn new() -> std::io::Result<MutualChallenge> {
        let mut b = [0u8; CHALLENGE_LEN + 1];
        random_bytes(&mut b)?;
        let mut challenge = [0u8; CHALLENGE_LEN];
        challenge.copy_from_slice(&b[1..]);
        Ok(MutualChallenge {
            id: b[0],
            challenge,
        })
    }

    /// Checks the target's CHAP_N / CHAP_R against the expected secret.
    pub fn verify(&self, expected: &ChapSecret, name: Option<&str>, resp: Option<&str>) -> bool {
        let Some(r) = resp.and_then(decode_binary) else {
            return false;
        };
        if name != Some(expected.user.as_str()) {
            return false;
        }
        r == response(self.id, expected.secret.as_bytes(), &self.challenge)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn md5_response_known_value() {
        // MD5 of id 0x01 || "secret" || 0x00..0x0f, computed independently
        // (python3 hashlib).
        let ch: Vec<u8> = (0u8..16).collect();
        let r = response(1, b"secret", &ch);
        assert_eq!(encode_hex(&r), "0x740e86463bda3a4d7017d6e0fba0699d");
    }

    #[test]
    fn binary_constants() {
        assert_eq!(decode_binary("0x0a0B"), Some(vec![10, 11]));
        assert_eq!(decode_binary("0xabc"), Some(vec![0x0a, 0xbc]));
        assert_eq!(decode_binary("0bAQID"), Some(vec![1, 2, 3]));
        assert_eq!(decode_binary("0bAQI="), Some(vec![1, 2]));
        assert_eq!(decode_binary("0xzz"), None);
        assert_eq!(decode_binary("12"), None);
        assert_eq!(decode_binary("0x"), None);
        assert_eq!(decode_binary(""), None);
        let b = [0xde, 0xad, 0xbe, 0xef];
        assert_eq!(decode_binary(&encode_hex(&b)).as_deref(), Some(&b[..]));
    }

    #[test]
    fn mutual_verify() {
        let m = MutualChallenge::new().unwrap();
        let s = ChapSecret {
            user: "tgt".into(),
            secret: "target-secret".into(),
        };
        let good = encode_hex(&response(m.id, b"target-secret", &m.challenge));
        assert!(m.verify(&s, Some("tgt"), Some(&good)));
        assert!(!m.verify(&s, Some("other"), Some(&good)));
        let bad = encode_hex(&response(m.id, b"wrong", &m.challenge));
        assert!(!m.verify(&s, Some("tgt"), Some(&bad)));
        assert!(!m.verify(&s, Some("tgt"), None));
    }
}

//! NVMe/TCP and NVMe wire formats: plain structs with encode/decode that
//! never panic on any input, apart from every state machine.
//!
//! - [`pdu`]: the NVMe/TCP transport PDUs (common header, ICReq/ICResp,
//!   capsules, H2CData/C2HData, R2T, termination requests), digests, PDO.
//! - [`sqe`]: the 64-byte submission and 16-byte completion queue entries,
//!   opcodes, status codes, Fabrics command fields.
//! - [`sgl`]: SGL data block descriptors as the TCP transport uses them.
//!
//! Layouts follow the NVMe Base 2.0, NVMe-oF 1.1 and NVMe/TCP transport
//! specifications; all integers are little-endian.

pub mod pdu;
pub mod sgl;
pub mod sqe;

pub use pdu::*;
pub use sgl::*;
pub use sqe::*;

#[inline]
pub(crate) fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

#[inline]
pub(crate) fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

#[inline]
pub(crate) fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

#[inline]
pub(crate) fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

#[inline]
pub(crate) fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

#[inline]
pub(crate) fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Copies `s` into a fixed-width, space-padded ASCII field (SN, MN, FR).
pub fn put_ascii(field: &mut [u8], s: &str) {
    field.fill(b' ');
    let n = s.len().min(field.len());
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// Copies `s` into a NUL-padded string field (NQNs, transport addresses).
pub fn put_cstr(field: &mut [u8], s: &str) {
    field.fill(0);
    let n = s.len().min(field.len().saturating_sub(1));
    field[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// Reads a NUL-terminated (or full-width) string field; `None` if not UTF-8.
pub fn get_cstr(field: &[u8]) -> Option<&str> {
    let end = field.iter().position(|c| *c == 0).unwrap_or(field.len());
    std::str::from_utf8(&field[..end]).ok()
}

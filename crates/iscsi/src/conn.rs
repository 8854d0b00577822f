//! Socket helpers on the reactor's io_uring: exact receives and whole sends
//! of byte buffers, and one PDU read (BHS, then the rest by its lengths).

use std::io;
use std::os::fd::RawFd;

use ustor_runtime::{ops, IoBuf};

use crate::wire::{Bhs, BHS_LEN};

/// Receives exactly `n` bytes.
pub async fn recv_exact(fd: RawFd, n: usize) -> io::Result<Vec<u8>> {
    let mut buf = IoBuf::heap(n);
    let mut got = 0;
    while got < n {
        let (r, b) = ops::recv(fd, buf, got, n - got).await;
        buf = b;
        match r? {
            0 => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            k => got += k,
        }
    }
    Ok(buf[..n].to_vec())
}

/// Sends all of `data`.
pub async fn send_all(fd: RawFd, data: &[u8]) -> io::Result<()> {
    let mut buf = IoBuf::heap(data.len());
    buf.copy_from_slice(data);
    let mut sent = 0;
    while sent < data.len() {
        let (r, b) = ops::send(fd, buf, sent, data.len()).await;
        buf = b;
        match r? {
            0 => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            k => sent += k,
        }
    }
    Ok(())
}

/// Reads one PDU without digests: its BHS and its (unpadded) data segment.
pub async fn read_pdu(fd: RawFd) -> io::Result<(Bhs, Vec<u8>)> {
    let h = recv_exact(fd, BHS_LEN).await?;
    let bhs = Bhs::from_slice(&h).map_err(io::Error::other)?;
    let rest = bhs.rest_len(false, false).map_err(io::Error::other)?;
    let mut data = if rest > 0 {
        recv_exact(fd, rest).await?
    } else {
        Vec::new()
    };
    let ahs = bhs.ahs_len();
    data.drain(..ahs.min(data.len()));
    data.truncate(bhs.data_len());
    Ok((bhs, data))
}

/// A PDU on the wire: header plus padded data.
pub fn pdu_bytes(bhs: &Bhs, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(BHS_LEN + crate::wire::pad4(data.len()));
    out.extend_from_slice(&bhs.0);
    out.extend_from_slice(data);
    out.resize(BHS_LEN + crate::wire::pad4(data.len()), 0);
    out
}

//! Moving PDUs over one connection's socket: [`Wire`] receives a PDU
//! (BHS, AHS, header digest, padded data, data digest, each checked) into
//! buffers it keeps for the connection's life, and queues responses in one
//! send buffer that goes out in one `send` per flush. Both buffers start
//! small and grow to the largest PDU seen (at most
//! MaxRecvDataSegmentLength on receive), so an idle session costs a few
//! KiB, not its negotiated limits.

use std::io;
use std::os::fd::RawFd;

use ustor_iscsi::wire::{pad4, Bhs, BHS_LEN};
use ustor_net::recv::recv_exact;
use ustor_runtime::ops::send_all;
use ustor_runtime::IoBuf;

/// Header bytes we take: BHS, 255 words of AHS, header digest.
const MAX_HEADER: usize = BHS_LEN + 1020 + 4;
/// First size of the send buffer (login answers); it grows to the
/// largest flush.
const FIRST_OUT: usize = 8 << 10;
/// First size of the receive buffer; it grows to the largest data segment.
const FIRST_DATA: usize = 8 << 10;

/// Why a connection ends.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("socket: {0}")]
    Io(#[from] io::Error),
    #[error("header digest mismatch")]
    HeaderDigest,
    #[error("data segment of {0} bytes beyond MaxRecvDataSegmentLength")]
    TooLarge(usize),
    #[error("protocol error: {0}")]
    Protocol(&'static str),
    #[error("login failed")]
    LoginFailed,
    #[error("no answer to a NOP-In ping within {0} s")]
    NopTimeout(u32),
    #[error("the target drained and the initiator did not log out in time")]
    Drained,
    #[error("the initiator took no data for {0} s")]
    SendTimeout(u64),
}

/// One connection's socket, receive buffers and send queue.
pub struct Wire {
    fd: RawFd,
    hdr: IoBuf,
    data: IoBuf,
    data_len: usize,
    out: IoBuf,
    /// A one-byte buffer that stands in for a buffer an operation owns.
    spare: Option<IoBuf>,
    /// Where the last queued header starts (for phase collapse patches).
    last_at: Option<usize>,
    pub header_digest: bool,
    pub data_digest: bool,
    pub max_recv: usize,
    /// PDUs whose data digest failed (the PDU is dropped, not the connection).
    pub data_digest_errors: u64,
}

/// What one receive brought.
pub enum Received {
    Pdu(Bhs),
    /// A PDU whose data digest did not match (to be rejected).
    BadDataDigest(Bhs),
}

impl Wire {
    pub fn new(fd: RawFd, max_recv: usize) -> Wire {
        let mut out = IoBuf::heap(FIRST_OUT);
        out.set_len(0);
        Wire {
            fd,
            hdr: IoBuf::heap(MAX_HEADER),
            data: IoBuf::heap(pad4(max_recv.min(FIRST_DATA)) + 4),
            data_len: 0,
            out,
            spare: Some(IoBuf::heap(1)),
            last_at: None,
            header_digest: false,
            data_digest: false,
            max_recv,
            data_digest_errors: 0,
        }
    }

    /// The connection's socket.
    pub fn fd(&self) -> RawFd {
        self.fd
    }

    /// Sets MaxRecvDataSegmentLength (after login); the receive buffer
    /// grows to it only as larger segments arrive.
    pub fn set_max_recv(&mut self, n: usize) {
        self.max_recv = n;
    }

    async fn exact(&mut self, into_hdr: bool, start: usize, end: usize) -> io::Result<()> {
        // The receive owns the buffer while it runs; an empty stand-in
        // (no allocation) holds its place.
        let slot = if into_hdr {
            &mut self.hdr
        } else {
            &mut self.data
        };
        let buf = std::mem::replace(slot, self.spare.take().unwrap_or_else(|| IoBuf::heap(1)));
        let (res, buf) = recv_exact(self.fd, buf, start, end).await;
        let slot = if into_hdr {
            &mut self.hdr
        } else {
            &mut self.data
        };
        self.spare = Some(std::mem::replace(slot, buf));
        res
    }

    /// Receives the next PDU; its data is [`Wire::data`] until the next call.
    pub async fn recv(&mut self) -> Result<Received, ConnError> {
        self.exact(true, 0, BHS_LEN).await?;
        let b = Bhs::from_slice(&self.hdr.spare_mut()[..BHS_LEN])
            .map_err(|_| ConnError::Protocol("short"))?;
        let hd = if self.header_digest { 4 } else { 0 };
        let hlen = BHS_LEN + b.ahs_len();
        if hlen + hd > BHS_LEN {
            self.exact(true, BHS_LEN, hlen + hd).await?;
        }
        if self.header_digest {
            let h = self.hdr.spare_mut();
            let got = u32::from_le_bytes([h[hlen], h[hlen + 1], h[hlen + 2], h[hlen + 3]]);
            if crc32c::crc32c(&h[..hlen]) != got {
                return Err(ConnError::HeaderDigest);
            }
        }
        let n = b.data_len();
        if n > self.max_recv {
            return Err(ConnError::TooLarge(n));
        }
        let dd = if self.data_digest && n > 0 { 4 } else { 0 };
        self.data_len = n;
        if pad4(n) + 4 > self.data.capacity() {
            // Doubling, bounded by the limit: few reallocations, no more
            // memory than the largest segment needs.
            let want = (pad4(n) + 4).next_power_of_two();
            self.data = IoBuf::heap(want.min(pad4(self.max_recv) + 4));
        }
        if n > 0 {
            self.exact(false, 0, pad4(n) + dd).await?;
        }
        if dd > 0 {
            let d = self.data.spare_mut();
            let at = pad4(n);
            let got = u32::from_le_bytes([d[at], d[at + 1], d[at + 2], d[at + 3]]);
            if crc32c::crc32c(&d[..at]) != got {
                self.data_digest_errors += 1;
                return Ok(Received::BadDataDigest(b));
            }
        }
        Ok(Received::Pdu(b))
    }

    /// The data segment of the last PDU received.
    pub fn data(&mut self) -> &[u8] {
        let n = self.data_len;
        &self.data.spare_mut()[..n]
    }

    /// The AHS of the last PDU received.
    pub fn ahs(&mut self) -> &[u8] {
        let b = Bhs::from_slice(&self.hdr.spare_mut()[..BHS_LEN]).unwrap_or_default();
        let n = b.ahs_len();
        &self.hdr.spare_mut()[BHS_LEN..BHS_LEN + n]
    }

    fn reserve(&mut self, more: usize) {
        let len = self.out.len();
        if len + more > self.out.capacity() {
            let mut bigger = IoBuf::heap((len + more).next_power_of_two());
            bigger.spare_mut()[..len].copy_from_slice(&self.out);
            bigger.set_len(len);
            self.out = bigger;
        }
    }

    fn append(&mut self, bytes: &[u8]) {
        let len = self.out.len();
        self.out.spare_mut()[len..len + bytes.len()].copy_from_slice(bytes);
        self.out.set_len(len + bytes.len());
    }

    /// Queues one PDU (header, digests and padding added here).
    pub fn queue(&mut self, b: &Bhs, data: &[u8]) {
        debug_assert_eq!(b.data_len(), data.len());
        self.reserve(BHS_LEN + 4 + pad4(data.len()) + 4);
        self.last_at = Some(self.out.len());
        self.append(&b.0);
        if self.header_digest {
            self.append(&crc32c::crc32c(&b.0).to_le_bytes());
        }
        if !data.is_empty() {
            self.append(data);
            let pad = [0u8; 3];
            let p = pad4(data.len()) - data.len();
            self.append(&pad[..p]);
            if self.data_digest {
                let d = crc32c::crc32c_append(crc32c::crc32c(data), &pad[..p]);
                self.append(&d.to_le_bytes());
            }
        }
    }

    /// The header of the last queued PDU, if it is still queued.
    pub fn last_header(&self) -> Option<Bhs> {
        let at = self.last_at?;
        Bhs::from_slice(&self.out[at..]).ok()
    }

    /// Replaces the header of the last queued PDU (same data length).
    pub fn patch_last(&mut self, b: &Bhs) {
        let Some(at) = self.last_at else { return };
        let digest = crc32c::crc32c(&b.0).to_le_bytes();
        let hd = self.header_digest;
        let out = self.out.spare_mut();
        out[at..at + BHS_LEN].copy_from_slice(&b.0);
        if hd {
            out[at + BHS_LEN..at + BHS_LEN + 4].copy_from_slice(&digest);
        }
    }

    /// Bytes queued and not yet sent.
    pub fn queued(&self) -> usize {
        self.out.len()
    }

    /// Sends everything queued.
    pub async fn flush(&mut self) -> Result<(), ConnError> {
        self.last_at = None;
        if self.out.is_empty() {
            return Ok(());
        }
        let stand_in = self.spare.take().unwrap_or_else(|| IoBuf::heap(1));
        let buf = std::mem::replace(&mut self.out, stand_in);
        let (res, mut buf) = send_all(self.fd, buf).await;
        buf.set_len(0);
        self.spare = Some(std::mem::replace(&mut self.out, buf));
        res.map_err(ConnError::Io)
    }

    /// Queues one PDU and sends everything queued.
    pub async fn send(&mut self, b: &Bhs, data: &[u8]) -> Result<(), ConnError> {
        self.queue(b, data);
        self.flush().await
    }
}

//! Moving PDUs over one connection's socket: [`Wire`] receives a PDU
//! (BHS, AHS, header digest, padded data, data digest, each checked)
//! through a staging buffer ([`ustor_net::Staging`]): in the full feature
//! phase each receive is greedy, so one `recv` brings a header with its
//! immediate data, or every header an initiator has queued, and a busy
//! connection takes them without waiting a reactor pass; data segments
//! beyond [`COPY_MAX`] land in a buffer of their own. Responses are queued
//! in one send buffer that goes out in one `send` per flush. Buffers start
//! small and grow with the PDUs seen (at most MaxRecvDataSegmentLength on
//! receive), so an idle session costs a few KiB, not its negotiated limits.

use std::io;
use std::os::fd::RawFd;

use ustor_iscsi::wire::{pad4, Bhs, BHS_LEN};
use ustor_net::{RecvMode, Rewind, Seg, Staging, COPY_MAX};
use ustor_runtime::ops::send_all;
use ustor_runtime::IoBuf;

/// Header bytes we take: BHS, 255 words of AHS, header digest.
const MAX_HEADER: usize = BHS_LEN + 1020 + 4;
/// First size of the send buffer (login answers); it grows to the
/// largest flush.
const FIRST_OUT: usize = 8 << 10;
/// First size of the staging buffer: headers and small data segments.
const FIRST_STAGE: usize = 8 << 10;
/// The staging buffer once write data flows: room for a data segment of
/// [`COPY_MAX`] with its header and for several 4 KiB writes per receive.
const FULL_STAGE: usize = 64 << 10;

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
    st: Staging,
    /// Receive as much as is queued (full feature phase), or only what the
    /// PDU needs (login: nothing of what follows is taken).
    greedy: bool,
    /// Staged bytes of the last PDU's data segment (with its padding and
    /// digest), consumed at the next receive.
    held: usize,
    /// The last PDU's BHS and AHS (`hlen` bytes).
    hdr: Box<[u8]>,
    hlen: usize,
    /// Data segments beyond [`COPY_MAX`] (none until one comes).
    big: Option<IoBuf>,
    in_big: bool,
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
    /// A connection's wire for the login: each receive takes only the PDU
    /// it needs.
    pub fn new(fd: RawFd, max_recv: usize) -> Wire {
        let mut out = IoBuf::heap(FIRST_OUT);
        out.set_len(0);
        Wire {
            fd,
            st: Staging::new(FIRST_STAGE, Rewind::Lazy),
            greedy: false,
            held: 0,
            hdr: vec![0u8; MAX_HEADER].into_boxed_slice(),
            hlen: BHS_LEN,
            big: None,
            in_big: false,
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

    /// The wire of the full feature phase: receives are greedy.
    pub fn streaming(fd: RawFd, max_recv: usize) -> Wire {
        Wire {
            greedy: true,
            ..Wire::new(fd, max_recv)
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

    /// Receives until `need` bytes are staged.
    async fn fill(&mut self, need: usize) -> io::Result<()> {
        let cap = if self.greedy { usize::MAX } else { need };
        self.st
            .fill(self.fd, need, || cap, RecvMode::Adaptive)
            .await
            .map(|_| ())
    }

    /// Receives the next PDU; its data is [`Wire::data`] until the next call.
    pub async fn recv(&mut self) -> Result<Received, ConnError> {
        self.st.consume(std::mem::take(&mut self.held));
        self.in_big = false;
        self.fill(BHS_LEN).await?;
        let b = Bhs::from_slice(self.st.peek(BHS_LEN)).map_err(|_| ConnError::Protocol("short"))?;
        let hd = if self.header_digest { 4 } else { 0 };
        let hlen = BHS_LEN + b.ahs_len();
        self.fill(hlen + hd).await?;
        self.st.note_unit();
        let h = self.st.peek(hlen + hd);
        self.hdr[..hlen].copy_from_slice(&h[..hlen]);
        self.hlen = hlen;
        if self.header_digest {
            let got = u32::from_le_bytes([h[hlen], h[hlen + 1], h[hlen + 2], h[hlen + 3]]);
            if crc32c::crc32c(&h[..hlen]) != got {
                return Err(ConnError::HeaderDigest);
            }
        }
        self.st.consume(hlen + hd);
        let n = b.data_len();
        if n > self.max_recv {
            return Err(ConnError::TooLarge(n));
        }
        self.data_len = n;
        if n == 0 {
            return Ok(Received::Pdu(b));
        }
        let dd = if self.data_digest { 4 } else { 0 };
        let seg = pad4(n) + dd;
        let ok = if seg <= COPY_MAX + 8 {
            self.recv_staged(seg).await?
        } else {
            self.recv_big(seg).await?
        };
        if !ok {
            self.data_digest_errors += 1;
            return Ok(Received::BadDataDigest(b));
        }
        Ok(Received::Pdu(b))
    }

    /// A data segment of `seg` bytes (padding and digest included) through
    /// the staging buffer; whether its digest (if any) matched.
    async fn recv_staged(&mut self, seg: usize) -> io::Result<bool> {
        if seg + MAX_HEADER > self.st.capacity() || (self.greedy && seg >= 4096) {
            // Write data flows: room for it and the headers around it.
            self.st.grow(FULL_STAGE.max(seg + MAX_HEADER));
        }
        self.fill(seg).await?;
        self.held = seg;
        Ok(digest_ok(
            self.data_digest,
            self.st.peek(seg),
            self.data_len,
        ))
    }

    /// A data segment beyond [`COPY_MAX`]: straight into its own buffer,
    /// the headers behind it into the staging buffer.
    async fn recv_big(&mut self, seg: usize) -> io::Result<bool> {
        let mut big = match self.big.take() {
            Some(b) if b.capacity() >= seg => b,
            // Doubling, bounded by the limit: few reallocations, no more
            // memory than the largest segment needs.
            _ => IoBuf::heap(
                seg.next_power_of_two()
                    .min(pad4(self.max_recv) + 4)
                    .max(seg),
            ),
        };
        let dst = [Seg {
            ptr: big.as_mut_ptr(),
            len: seg,
        }];
        let tail = if self.greedy { self.st.capacity() } else { 0 };
        // SAFETY: `dst` lies inside `big`, which this frame owns for the
        // whole (synchronous-per-syscall) receive.
        let r = unsafe { self.st.recv_payload(self.fd, &dst, tail) }.await;
        let ok = digest_ok(self.data_digest, &big.spare_mut()[..seg], self.data_len);
        self.big = Some(big);
        self.in_big = true;
        r.map(|_| ok)
    }

    /// The data segment of the last PDU received.
    pub fn data(&mut self) -> &[u8] {
        let n = self.data_len;
        match (&mut self.big, self.in_big) {
            (Some(b), true) => &b.spare_mut()[..n],
            _ => &self.st.staged()[..n],
        }
    }

    /// Whether bytes beyond the last PDU are staged already (the start of
    /// the next one: it needs no receive).
    pub fn more_staged(&self) -> bool {
        self.st.avail() > self.held
    }

    /// The AHS of the last PDU received.
    pub fn ahs(&mut self) -> &[u8] {
        &self.hdr[BHS_LEN..self.hlen]
    }

    fn reserve(&mut self, more: usize) {
        crate::tx::reserve(&mut self.out, more);
    }

    fn append(&mut self, bytes: &[u8]) {
        crate::tx::append(&mut self.out, bytes);
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

/// Whether the data segment `seg` (data, padding, then the digest when
/// `on`) carries the right CRC32C for its `n` data bytes.
fn digest_ok(on: bool, seg: &[u8], n: usize) -> bool {
    if !on {
        return true;
    }
    let at = pad4(n);
    let got = u32::from_le_bytes([seg[at], seg[at + 1], seg[at + 2], seg[at + 3]]);
    crc32c::crc32c(&seg[..at]) == got
}

//! The frames of the file service's raw-Ethernet transport (Transport 2,
//! AF_XDP), sans-IO. Requests and replies are the TCP transport's frames
//! ([`crate::proto`]), carried in control frames; a write's payload is
//! either placed straight into the region by the receiving kernel (the
//! paper's reverse-overwrite) or sent in fragments and copied.
//!
//! A control frame is Ethernet (14 bytes, EtherType [`ETHERTYPE`]) and
//! [`CTRL_HDR`] bytes: kind u8, rxf u8, frag u16, nfrag u16, session u16,
//! rid u64 (little-endian), then one fragment `frag` of `nfrag` of one
//! message. Every fragment but the last has the same length.
//!
//! Frame size: every end receives [`BASE_FRAME`] (a 1500-byte MTU); an end
//! on a larger MTU receives up to [`frame_for_mtu`] (at most
//! [`MAX_FRAME`]) and says so in the `rxf` byte of each control frame it
//! sends ([`frame_code`]). A sender's frames are at most the smaller of its
//! own size and the peer's last announced one; a write's grant names the
//! piece and fragment sizes the server expects.
//!
//! A placed data frame is Ethernet and 2 bytes (kind [`Kind::Data`], a tag)
//! then one piece of the payload: 16 bytes of header in all. The receiver
//! posts fill addresses so that a piece's frame lands with its payload on
//! the piece's bytes in the region and its 16-byte header just before
//! them. Pieces are sent last first ([`pieces`]), so each header lands on
//! bytes of the piece before, which arrives later and overwrites it; only
//! the first piece's header lands outside the payload, on the 16 bytes
//! before it, which the receiver saves and restores. Every piece but the
//! last first is the full piece size (the receiving socket's largest
//! frame less [`PLACE_HDR`]) and the frame of the last piece ends exactly
//! at the payload's end, so no frame of any length up to the largest the
//! socket accepts can write past it.

use thiserror::Error;

/// IEEE 802 local experimental EtherType 1.
pub const ETHERTYPE: u16 = 0x88B5;
/// Ethernet header: destination, source, EtherType.
pub const ETH_LEN: usize = 14;
/// Our control header after the Ethernet header.
pub const CTRL_HDR: usize = 16;
/// The frame every end receives: a 1500-byte MTU (no FCS, no VLAN tag).
/// Control frames go at this size until the peer announced its own.
pub const BASE_FRAME: usize = 1514;
/// The largest frame an end may use: a 4096-byte UMEM chunk after the
/// kernel's 256 bytes of XDP headroom (a chunk larger than a page needs a
/// hugepage UMEM; a veth with an XDP program takes an MTU up to ~3500).
pub const MAX_FRAME: usize = 4096 - 256;
/// Header bytes of a placed data frame (Ethernet, kind, tag): the bytes
/// saved and restored before a placed payload.
pub const PLACE_HDR: usize = 16;
/// Message bytes in one control frame of [`BASE_FRAME`] bytes.
pub const BASE_CTRL_PAYLOAD: usize = ctrl_payload(BASE_FRAME);
/// Payload bytes of a full data frame of [`BASE_FRAME`] bytes.
pub const BASE_PIECE: usize = BASE_FRAME - PLACE_HDR;
/// Largest message: a 1 MiB read reply.
const MAX_MSG: usize = crate::proto::MAX_BODY + crate::proto::HEADER_LEN;
/// Largest number of fragments of one message (at [`BASE_FRAME`]).
pub const MAX_FRAGS: u16 = MAX_MSG.div_ceil(BASE_CTRL_PAYLOAD) as u16;
/// Largest number of segments a grant describes (one frame).
pub const MAX_GRANT_SEGS: usize = (BASE_CTRL_PAYLOAD - 12) / 4;

/// Message bytes in one control frame of `frame` bytes.
pub const fn ctrl_payload(frame: usize) -> usize {
    frame - ETH_LEN - CTRL_HDR
}

/// The `rxf` byte that announces a receive frame of `frame` bytes: 0 for
/// [`BASE_FRAME`] or less, else the size in 16-byte units (rounded down).
pub fn frame_code(frame: usize) -> u8 {
    if frame <= BASE_FRAME {
        0
    } else {
        (frame.min(MAX_FRAME) / 16) as u8
    }
}

/// The receive frame an `rxf` byte announces.
pub fn frame_of_code(code: u8) -> usize {
    let f = code as usize * 16;
    if f <= BASE_FRAME {
        BASE_FRAME
    } else {
        f.min(MAX_FRAME)
    }
}

/// The frame size an end uses on an interface with this MTU: MTU plus the
/// Ethernet header, at most [`MAX_FRAME`], in 16-byte steps above
/// [`BASE_FRAME`] (what [`frame_code`] can announce).
pub fn frame_for_mtu(mtu: usize) -> usize {
    frame_of_code(frame_code(mtu + ETH_LEN))
}

/// UMEM chunk size and headroom of a socket that receives frames of up to
/// `frame` bytes: the kernel drops a longer one (the placement relies on
/// it). 2048-byte chunks for [`BASE_FRAME`], a page above it.
pub fn chunk_for(frame: usize) -> (u32, u32) {
    let chunk = if frame <= BASE_FRAME { 2048 } else { 4096 };
    (chunk, chunk - 256 - frame as u32)
}

/// Errors of the frame decoder: the frame is dropped and counted.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum WireError {
    #[error("frame of {0} bytes is too short")]
    Short(usize),
    #[error("frame of {0} bytes is too long")]
    Long(usize),
    #[error("EtherType {0:#06x} is not ours")]
    EtherType(u16),
    #[error("unknown frame kind {0}")]
    Kind(u8),
    #[error("fragment {frag} of {nfrag} is out of range")]
    Frag { frag: u16, nfrag: u16 },
    #[error("malformed: {0}")]
    Malformed(&'static str),
}

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Client to server: a request (a [`crate::proto`] frame; a write's
    /// carries only header and offset, then the payload's CRC32C, u32).
    Req = 1,
    /// Server to client: the reply (a [`crate::proto`] reply frame).
    Resp = 2,
    /// Padding that consumes one receive buffer (realigns the rx ring).
    Nop = 3,
    /// Server to client: send the write's payload ([`Grant`]).
    Go = 4,
    /// Client to server: a fragment of a write's payload, to be copied.
    WData = 5,
    /// Client to server: a piece to be placed (short header).
    Data = 6,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Req,
            2 => Kind::Resp,
            3 => Kind::Nop,
            4 => Kind::Go,
            5 => Kind::WData,
            6 => Kind::Data,
            _ => return None,
        })
    }
}

/// A control header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ctrl {
    pub kind: Kind,
    /// The sender's receive frame ([`frame_code`]; 0: [`BASE_FRAME`]).
    pub rxf: u8,
    pub frag: u16,
    pub nfrag: u16,
    pub session: u16,
    pub rid: u64,
}

/// A decoded frame; payloads borrow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame<'a> {
    Ctrl {
        src: [u8; 6],
        hdr: Ctrl,
        payload: &'a [u8],
    },
    Data {
        src: [u8; 6],
        tag: u8,
        payload: &'a [u8],
    },
}

/// Writes the Ethernet header.
pub fn put_eth(f: &mut [u8], dst: [u8; 6], src: [u8; 6]) {
    f[..6].copy_from_slice(&dst);
    f[6..12].copy_from_slice(&src);
    f[12..14].copy_from_slice(&ETHERTYPE.to_be_bytes());
}

/// Encodes a control frame into `f` (room for the payload and headers);
/// returns its length.
pub fn encode_ctrl(f: &mut [u8], dst: [u8; 6], src: [u8; 6], h: &Ctrl, payload: &[u8]) -> usize {
    assert!(
        payload.len() <= ctrl_payload(MAX_FRAME),
        "caller splits messages"
    );
    put_eth(f, dst, src);
    let b = &mut f[ETH_LEN..];
    b[0] = h.kind as u8;
    b[1] = h.rxf;
    b[2..4].copy_from_slice(&h.frag.to_le_bytes());
    b[4..6].copy_from_slice(&h.nfrag.to_le_bytes());
    b[6..8].copy_from_slice(&h.session.to_le_bytes());
    b[8..16].copy_from_slice(&h.rid.to_le_bytes());
    b[CTRL_HDR..CTRL_HDR + payload.len()].copy_from_slice(payload);
    ETH_LEN + CTRL_HDR + payload.len()
}

/// Encodes a data frame's header (the piece follows it).
pub fn encode_data_hdr(f: &mut [u8], dst: [u8; 6], src: [u8; 6], tag: u8) {
    put_eth(f, dst, src);
    f[ETH_LEN] = Kind::Data as u8;
    f[ETH_LEN + 1] = tag;
}

/// The tag of piece `i` of grant `seq`: a data frame that lands in the
/// wrong slot (the ring out of step) shows a different one in most cases;
/// the payload CRC catches the rest.
pub fn data_tag(seq: u8, i: usize) -> u8 {
    (i as u8).wrapping_add(seq.wrapping_mul(37))
}

/// Decodes a frame (the wire parser: any bytes in, an error out, never a
/// panic).
pub fn parse(f: &[u8]) -> Result<Frame<'_>, WireError> {
    if f.len() < PLACE_HDR {
        return Err(WireError::Short(f.len()));
    }
    if f.len() > MAX_FRAME {
        return Err(WireError::Long(f.len()));
    }
    let et = u16::from_be_bytes([f[12], f[13]]);
    if et != ETHERTYPE {
        return Err(WireError::EtherType(et));
    }
    let src: [u8; 6] = f[6..12].try_into().expect("6");
    let kind = Kind::from_u8(f[ETH_LEN]).ok_or(WireError::Kind(f[ETH_LEN]))?;
    if kind == Kind::Data {
        return Ok(Frame::Data {
            src,
            tag: f[ETH_LEN + 1],
            payload: &f[PLACE_HDR..],
        });
    }
    if f.len() < ETH_LEN + CTRL_HDR {
        return Err(WireError::Short(f.len()));
    }
    let b = &f[ETH_LEN..];
    let u16at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
    let hdr = Ctrl {
        kind,
        rxf: b[1],
        frag: u16at(2),
        nfrag: u16at(4),
        session: u16at(6),
        rid: u64::from_le_bytes(b[8..16].try_into().expect("8")),
    };
    if hdr.nfrag == 0 || hdr.nfrag > MAX_FRAGS || hdr.frag >= hdr.nfrag {
        return Err(WireError::Frag {
            frag: hdr.frag,
            nfrag: hdr.nfrag,
        });
    }
    let payload = &b[CTRL_HDR..];
    if hdr.frag + 1 < hdr.nfrag && payload.len() < BASE_CTRL_PAYLOAD {
        return Err(WireError::Malformed("a fragment before the last is short"));
    }
    Ok(Frame::Ctrl { src, hdr, payload })
}

/// The pieces of a payload segment of `len` bytes, in sending order (last
/// first), as (offset, length): the last piece ends at `len`, every piece
/// but the first is `piece` bytes (the receiving socket's largest frame
/// less [`PLACE_HDR`]).
pub fn pieces(len: usize, piece: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut end = len;
    std::iter::from_fn(move || {
        if end == 0 {
            return None;
        }
        let start = end.saturating_sub(piece);
        let p = (start, end - start);
        end = start;
        Some(p)
    })
}

/// Whether a segment can be placed: its first piece's frame must fit
/// inside it too (a segment shorter than `piece` is sent in fragments
/// and copied).
pub fn placeable(len: usize, piece: usize) -> bool {
    len >= piece
}

/// What the server asks for a write's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// Placed (data frames, per [`pieces`] of each segment) or copied
    /// (WData fragments of the whole payload).
    pub place: bool,
    /// Grant number within the request (tags of data frames).
    pub seq: u8,
    /// NOP frames to send first: receive buffers posted before the
    /// placement slots.
    pub nops: u32,
    /// Payload bytes of a full data frame: the server socket's largest
    /// frame less [`PLACE_HDR`] (0 on the wire: [`BASE_PIECE`]).
    pub piece: u16,
    /// Payload bytes of every WData fragment but the last (0 on the wire:
    /// [`BASE_CTRL_PAYLOAD`]).
    pub frag: u16,
    /// The payload split into segments, in payload order (placed only).
    pub segs: Vec<u32>,
}

impl Grant {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(12 + 4 * self.segs.len());
        b.push(self.place as u8);
        b.push(self.seq);
        b.extend_from_slice(&(self.segs.len() as u16).to_le_bytes());
        b.extend_from_slice(&self.nops.to_le_bytes());
        b.extend_from_slice(&self.piece.to_le_bytes());
        b.extend_from_slice(&self.frag.to_le_bytes());
        for s in &self.segs {
            b.extend_from_slice(&s.to_le_bytes());
        }
        b
    }

    pub fn decode(b: &[u8]) -> Result<Grant, WireError> {
        if b.len() < 12 || b[0] > 1 {
            return Err(WireError::Malformed("grant header"));
        }
        let n = u16::from_le_bytes([b[2], b[3]]) as usize;
        if n > MAX_GRANT_SEGS || b.len() != 12 + 4 * n {
            return Err(WireError::Malformed("grant segments"));
        }
        let or = |v: u16, d: usize| if v == 0 { d } else { v as usize };
        let piece = or(u16::from_le_bytes([b[8], b[9]]), BASE_PIECE);
        let frag = or(u16::from_le_bytes([b[10], b[11]]), BASE_CTRL_PAYLOAD);
        if !(BASE_PIECE..=MAX_FRAME - PLACE_HDR).contains(&piece)
            || !(BASE_CTRL_PAYLOAD..=ctrl_payload(MAX_FRAME)).contains(&frag)
        {
            return Err(WireError::Malformed("grant frame sizes"));
        }
        let segs: Vec<u32> = b[12..]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4")))
            .collect();
        let place = b[0] == 1;
        if place && segs.iter().any(|&s| !placeable(s as usize, piece)) {
            return Err(WireError::Malformed("grant segment too short to place"));
        }
        Ok(Grant {
            place,
            seq: b[1],
            nops: u32::from_le_bytes(b[4..8].try_into().expect("4")),
            piece: piece as u16,
            frag: frag as u16,
            segs,
        })
    }
}

/// Where an [`Assembly`] writes a message's bytes.
pub trait Sink {
    /// Writes `b` at offset `at` of the message; false when the message
    /// does not fit (the fragment is dropped).
    fn put(&mut self, at: usize, b: &[u8]) -> bool;
}

/// The assembly's own buffer: grows to the message.
impl Sink for Vec<u8> {
    fn put(&mut self, at: usize, b: &[u8]) -> bool {
        if at == self.len() {
            self.extend_from_slice(b);
        } else {
            if self.len() < at + b.len() {
                self.resize(at + b.len(), 0);
            }
            self[at..at + b.len()].copy_from_slice(b);
        }
        true
    }
}

/// A message received into two buffers: its first `head.len()` bytes (the
/// reply header) in `head`, the rest in `body` (a caller's buffer, so a
/// read's data is copied once, from the frame to where it is wanted).
pub struct Split<'a> {
    pub head: &'a mut [u8],
    pub body: &'a mut [u8],
}

impl Sink for Split<'_> {
    fn put(&mut self, at: usize, b: &[u8]) -> bool {
        let h = self.head.len();
        if at + b.len() > h + self.body.len() {
            return false;
        }
        let k = h.saturating_sub(at).min(b.len());
        self.head[at.min(h)..at.min(h) + k].copy_from_slice(&b[..k]);
        if k < b.len() {
            let from = at + k - h;
            self.body[from..from + b.len() - k].copy_from_slice(&b[k..]);
        }
        true
    }
}

/// Reassembles one message from its control fragments. The fragment size
/// is the sender's: every fragment but the last has the length of the
/// first such one that came.
#[derive(Debug, Default)]
pub struct Assembly {
    rid: u64,
    nfrag: u16,
    have: Vec<bool>,
    got: u16,
    buf: Vec<u8>,
    /// Bytes of every fragment but the last (0: none of them came yet).
    unit: usize,
    /// Bytes of the last fragment, once placed.
    last: usize,
    /// The last fragment, while the unit (hence its place) is not known.
    tail: Vec<u8>,
}

impl Assembly {
    /// Adds a fragment; returns the message once all fragments are in. A
    /// fragment of another request id or count starts over; duplicates
    /// and fragments of the wrong length are ignored.
    pub fn add(&mut self, h: &Ctrl, payload: &[u8]) -> Option<&[u8]> {
        let mut buf = std::mem::take(&mut self.buf);
        let n = self.add_to(h, payload, &mut buf);
        self.buf = buf;
        n.map(|n| &self.buf[..n])
    }

    /// Whether some fragments of a message came and others are missing.
    pub fn pending(&self) -> bool {
        self.got > 0 && !self.have.is_empty()
    }

    /// [`Assembly::add`] writing the message into `sink` (the same sink
    /// for every fragment of a message); returns its length once all
    /// fragments are in.
    pub fn add_to(&mut self, h: &Ctrl, payload: &[u8], sink: &mut impl Sink) -> Option<usize> {
        if h.rid != self.rid || h.nfrag != self.nfrag || self.have.is_empty() {
            self.rid = h.rid;
            self.nfrag = h.nfrag;
            // Reused: a message allocated a fresh one before.
            self.have.clear();
            self.have.resize(h.nfrag as usize, false);
            self.got = 0;
            self.unit = 0;
            self.last = 0;
            self.tail.clear();
        }
        let (i, n) = (h.frag as usize, self.have.len());
        if i >= n || self.have[i] {
            return None;
        }
        let last = i + 1 == n;
        if last && n > 1 && self.unit == 0 {
            self.tail = payload.to_vec();
        } else if !self.place(i, last, payload, sink) {
            return None;
        }
        self.have[i] = true;
        self.got += 1;
        if self.got == self.nfrag {
            self.have.clear();
            return Some((n - 1) * self.unit + self.last);
        }
        None
    }

    /// Writes fragment `i` into the message; learns the unit from the
    /// first fragment that is not the last. False: not consistent with
    /// the fragments before, or past the sink's end (dropped).
    fn place(&mut self, i: usize, last: bool, payload: &[u8], sink: &mut impl Sink) -> bool {
        let n = self.have.len();
        if !last && self.unit == 0 {
            if (n - 1) * payload.len() >= MAX_MSG {
                return false;
            }
            self.unit = payload.len();
            if self.have[n - 1] {
                let tail = std::mem::take(&mut self.tail);
                // A last fragment longer than the others: start over.
                if tail.len() > self.unit || !sink.put((n - 1) * self.unit, &tail) {
                    self.have.clear();
                    return false;
                }
                self.last = tail.len();
            }
        } else if !last && payload.len() != self.unit {
            return false;
        }
        if last && n > 1 && payload.len() > self.unit {
            return false;
        }
        if !sink.put(i * self.unit, payload) {
            return false;
        }
        if last {
            self.last = payload.len();
        }
        true
    }
}

/// How many control frames a message of `len` bytes takes at `unit` bytes
/// per fragment.
pub fn nfrags(len: usize, unit: usize) -> u16 {
    len.div_ceil(unit).max(1) as u16
}

/// Splits a message into control-frame payloads of `unit` bytes (the last
/// one shorter).
pub fn fragments(msg: &[u8], unit: usize) -> impl Iterator<Item = &[u8]> {
    let n = nfrags(msg.len(), unit) as usize;
    (0..n).map(move |i| &msg[i * unit..((i + 1) * unit).min(msg.len())])
}

/// Decodes every frame of a byte stream split as u16-length-prefixed
/// frames, feeding control fragments to an [`Assembly`] and grants to
/// their decoder; returns how many frames decoded. The fuzz target and the
/// proptests run this.
pub fn decode_frames(mut b: &[u8]) -> usize {
    let mut asm = Assembly::default();
    let mut n = 0;
    while b.len() >= 2 {
        let len = (u16::from_le_bytes([b[0], b[1]]) as usize).min(b.len() - 2);
        let f = &b[2..2 + len];
        b = &b[2 + len..];
        if let Ok(fr) = parse(f) {
            n += 1;
            if let Frame::Ctrl { hdr, payload, .. } = fr {
                if hdr.kind == Kind::Go {
                    let _ = Grant::decode(payload);
                }
                if let Some(msg) = asm.add(&hdr, payload) {
                    let _ = crate::proto::decode_stream(msg);
                }
            }
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_is_three_pieces_last_first_ending_at_the_end() {
        let p: Vec<_> = pieces(4096, BASE_PIECE).collect();
        assert_eq!(p, vec![(2598, 1498), (1100, 1498), (0, 1100)]);
        assert!(placeable(4096, BASE_PIECE) && !placeable(1024, BASE_PIECE));
        assert_eq!(BASE_PIECE, 1498);
        let (chunk, headroom) = chunk_for(BASE_FRAME);
        assert_eq!((chunk, headroom), (2048, 278));
        assert_eq!(chunk - 256 - headroom, BASE_FRAME as u32);
    }

    #[test]
    fn a_3500_byte_mtu_takes_a_block_in_two_frames() {
        let f = frame_for_mtu(3500);
        assert_eq!(f, 3504);
        assert_eq!(frame_of_code(frame_code(f)), f);
        assert_eq!((frame_for_mtu(1500), frame_code(1514)), (BASE_FRAME, 0));
        assert_eq!(frame_for_mtu(9000), MAX_FRAME);
        let (chunk, headroom) = chunk_for(f);
        assert_eq!(chunk - 256 - headroom, f as u32);
        let p: Vec<_> = pieces(4096, f - PLACE_HDR).collect();
        assert_eq!(p, vec![(608, 3488), (0, 608)]);
        assert_eq!(pieces(1 << 20, f - PLACE_HDR).count(), 301);
    }

    #[test]
    fn control_frames_round_trip_and_fragment() {
        let h = Ctrl {
            kind: Kind::Resp,
            rxf: 0,
            frag: 1,
            nfrag: 3,
            session: 9,
            rid: 77,
        };
        let mut f = [0u8; BASE_FRAME];
        let pl = vec![5u8; BASE_CTRL_PAYLOAD];
        let n = encode_ctrl(&mut f, [1; 6], [2; 6], &h, &pl);
        assert_eq!(n, BASE_FRAME);
        match parse(&f[..n]).unwrap() {
            Frame::Ctrl { src, hdr, payload } => {
                assert_eq!((src, hdr, payload), ([2; 6], h, &pl[..]));
            }
            other => panic!("{other:?}"),
        }
        let msg: Vec<u8> = (0..9000u32).map(|i| (i % 251) as u8).collect();
        // The receiver learns the sender's fragment size; the last
        // fragment may come first.
        for (unit, order) in [
            (BASE_CTRL_PAYLOAD, vec![6usize, 0, 0, 1, 2, 3, 4, 5]),
            (ctrl_payload(frame_for_mtu(3500)), vec![2, 1, 0]),
        ] {
            let frags: Vec<&[u8]> = fragments(&msg, unit).collect();
            let n = nfrags(msg.len(), unit);
            assert_eq!(frags.len(), n as usize);
            let mut asm = Assembly::default();
            let mut out = None;
            for i in order {
                let hd = Ctrl {
                    frag: i as u16,
                    nfrag: n,
                    ..h
                };
                if let Some(m) = asm.add(&hd, frags[i]) {
                    out = Some(m.to_vec());
                }
            }
            assert_eq!(out.as_deref(), Some(&msg[..]), "unit {unit}");
        }
    }

    #[test]
    fn a_message_is_received_into_a_header_and_a_callers_buffer() {
        let msg: Vec<u8> = (0..9000u32).map(|i| (i % 251) as u8).collect();
        for (unit, order) in [
            (BASE_CTRL_PAYLOAD, vec![6usize, 0, 1, 2, 0, 3, 4, 5]),
            (ctrl_payload(frame_for_mtu(3500)), vec![1, 0, 2]),
            (10, (0..900).rev().collect()),
        ] {
            let frags: Vec<&[u8]> = fragments(&msg, unit).collect();
            let nfrag = nfrags(msg.len(), unit);
            let (mut head, mut body) = ([0u8; 24], vec![0u8; msg.len() - 24]);
            let mut asm = Assembly::default();
            let mut done = None;
            for i in order {
                let h = Ctrl {
                    kind: Kind::Resp,
                    rxf: 0,
                    frag: i as u16,
                    nfrag,
                    session: 1,
                    rid: 9,
                };
                let mut sink = Split {
                    head: &mut head,
                    body: &mut body,
                };
                if let Some(n) = asm.add_to(&h, frags[i], &mut sink) {
                    done = Some(n);
                }
            }
            assert_eq!(done, Some(msg.len()), "unit {unit}");
            assert_eq!((&head[..], &body[..]), (&msg[..24], &msg[24..]));
        }
        // A body larger than the caller's buffer never completes.
        let (mut head, mut body) = ([0u8; 24], [0u8; 10]);
        let mut sink = Split {
            head: &mut head,
            body: &mut body,
        };
        assert!(sink.put(30, &[1; 4]));
        assert!(!sink.put(30, &[1; 5]));
        // A piece inside the header, and a message shorter than it.
        assert!(sink.put(2, &[7; 3]));
        assert_eq!(body[6..], [1; 4]);
        assert_eq!(head[..6], [0, 0, 7, 7, 7, 0]);
        let mut asm = Assembly::default();
        let h = Ctrl {
            kind: Kind::Resp,
            rxf: 0,
            frag: 0,
            nfrag: 1,
            session: 1,
            rid: 9,
        };
        let mut sink = Split {
            head: &mut head,
            body: &mut body,
        };
        assert_eq!(asm.add_to(&h, &[5; 10], &mut sink), Some(10));
    }

    #[test]
    fn a_fragment_of_another_length_is_dropped() {
        let h = |frag| Ctrl {
            kind: Kind::Resp,
            rxf: 0,
            frag,
            nfrag: 3,
            session: 1,
            rid: 5,
        };
        let mut asm = Assembly::default();
        assert!(asm.add(&h(0), &[1; 2000]).is_none());
        assert!(asm.add(&h(1), &[2; 1999]).is_none());
        assert!(asm.add(&h(2), &[3; 2001]).is_none());
        assert!(asm.add(&h(2), &[3; 10]).is_none());
        let m = asm.add(&h(1), &[2; 2000]).expect("complete");
        assert_eq!(m.len(), 4010);
        assert_eq!((m[0], m[2000], m[4009]), (1, 2, 3));
        // A last fragment longer than the others (it came first).
        let mut asm = Assembly::default();
        let h2 = |frag| Ctrl {
            nfrag: 2,
            ..h(frag)
        };
        assert!(asm.add(&h2(1), &[3; 2001]).is_none());
        assert!(asm.add(&h2(0), &[1; 2000]).is_none());
    }

    #[test]
    fn malformed_frames_are_errors() {
        let mut f = [0u8; 40];
        put_eth(&mut f, [0; 6], [0; 6]);
        assert_eq!(parse(&f[..10]), Err(WireError::Short(10)));
        f[ETH_LEN] = 99;
        assert_eq!(parse(&f), Err(WireError::Kind(99)));
        f[ETH_LEN] = Kind::Req as u8; // nfrag 0
        assert!(matches!(parse(&f), Err(WireError::Frag { .. })));
        f[12] = 0x08;
        assert_eq!(parse(&f), Err(WireError::EtherType(0x08B5)));
        assert!(Grant::decode(&[1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0]).is_err());
        // A piece size below the base one.
        assert!(Grant::decode(&[0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]).is_err());
    }
}

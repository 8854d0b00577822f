//! Transport options and PDU data alignment, on the wire.
//!
//! Against the real target (raw TCP on 127.0.0.1): C2HData honours the
//! host's HPDA (PDO aligned, zero padding, data intact) and a reserved HPDA
//! gets a C2HTermReq; padded host PDUs are accepted; `c2h_success`,
//! `max_queue_depth` and `max_aq_depth` do what they say.
//!
//! Against a fake controller (a std TCP thread speaking the wire format
//! with scripted faults): the initiator pads its data to the controller's
//! CPDA, takes padded C2HData, and answers malformed PDUs with an
//! H2CTermReq carrying the right FES and FEI before it drops the queue.

#[path = "../common/mod.rs"]
mod common;
mod fake_controller;
mod host;
mod initiator_side;
mod target_side;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use common::*;
use ustor_nvme::nvmf::TransportOpts;
use ustor_nvme::wire::*;

const DG: Digests = Digests {
    header: true,
    data: true,
};

/// One PDU as received: all of its bytes.
struct RawPdu {
    ch: CommonHeader,
    b: Vec<u8>,
}

impl RawPdu {
    fn ty(&self) -> u8 {
        self.ch.pdu_type
    }
    fn header_total(&self) -> usize {
        let hd = if self.ch.flags & flags::HDGSTF != 0 {
            DIGEST_LEN
        } else {
            0
        };
        self.ch.hlen as usize + hd
    }
    fn ddgst_len(&self) -> usize {
        if self.ch.flags & flags::DDGSTF != 0 {
            DIGEST_LEN
        } else {
            0
        }
    }
    /// Where the data starts (termination data follows the header).
    fn pdo(&self) -> usize {
        if self.ch.pdo == 0 {
            self.header_total()
        } else {
            self.ch.pdo as usize
        }
    }
    fn data(&self) -> &[u8] {
        if self.b.len() <= self.header_total() {
            return &[];
        }
        &self.b[self.pdo()..self.b.len() - self.ddgst_len()]
    }
    fn pad(&self) -> &[u8] {
        &self.b[self.header_total()..self.pdo()]
    }
    fn cqe(&self) -> Cqe {
        assert_eq!(self.ty(), PduType::CapsuleResp as u8);
        Cqe::decode(&self.b[CH_LEN..]).unwrap()
    }
    fn data_hdr(&self) -> DataHdr {
        DataHdr::decode(&self.b).unwrap()
    }
    fn term(&self) -> TermReq {
        TermReq::decode(&self.b).unwrap()
    }
    /// The header digest and data digest, when present, are right.
    fn digests_ok(&self) -> bool {
        let hl = self.ch.hlen as usize;
        let hd_ok = self.ch.flags & flags::HDGSTF == 0 || header_digest_ok(&self.b, hl);
        let dd_ok = self.ddgst_len() == 0 || {
            let n = self.b.len();
            crc(self.data()) == u32::from_le_bytes(self.b[n - 4..].try_into().unwrap())
        };
        hd_ok && dd_ok
    }
}

fn read_pdu(s: &mut TcpStream) -> std::io::Result<RawPdu> {
    let mut b = vec![0u8; CH_LEN];
    s.read_exact(&mut b)?;
    let ch = CommonHeader::decode(&b).unwrap();
    let plen = ch.plen as usize;
    assert!((CH_LEN..=1 << 20).contains(&plen), "PLEN {plen}");
    b.resize(plen, 0);
    s.read_exact(&mut b[CH_LEN..])?;
    Ok(RawPdu { ch, b })
}

fn tcp(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

fn ic_req(hpda: u8, dg: Digests) -> [u8; IC_LEN] {
    IcReq {
        pfv: 0,
        hpda,
        digests: dg,
        maxr2t: 0,
    }
    .encode()
}

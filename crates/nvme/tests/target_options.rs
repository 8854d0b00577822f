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

mod common;

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

/// A raw host queue that asks for data alignment `hpda` and may pad the
/// data it sends itself.
struct Raw {
    s: TcpStream,
    dg: Digests,
    cid: u16,
}

impl Raw {
    fn open(port: u16, hpda: u8, dg: Digests) -> Raw {
        let mut s = tcp(port);
        s.write_all(&ic_req(hpda, dg)).unwrap();
        let p = read_pdu(&mut s).unwrap();
        let r = IcResp::decode(&p.b).unwrap();
        assert_eq!((r.cpda, r.digests), (0, dg));
        Raw { s, dg, cid: 0 }
    }

    fn next_cid(&mut self) -> u16 {
        self.cid = self.cid.wrapping_add(1);
        self.cid
    }

    /// Sends a capsule whose in-capsule data starts at the PDO alignment
    /// `pda` asks for (the target advertised CPDA 0; more is still valid).
    fn send_cmd(&mut self, sqe: &Sqe, data: &[u8], pda: u8) {
        let mut h = [0u8; MAX_PADDED_HDR];
        let n = encode_capsule_cmd_pda(&mut h, sqe, self.dg, data.len(), pda);
        let mut v = h[..n].to_vec();
        v.extend_from_slice(data);
        if self.dg.data && !data.is_empty() {
            v.extend_from_slice(&crc(data).to_le_bytes());
        }
        self.s.write_all(&v).unwrap();
    }

    fn send_h2c(&mut self, d: DataHdr, data: &[u8], last: bool, pda: u8) {
        let mut h = [0u8; MAX_PADDED_HDR];
        let fl = if last { flags::LAST_PDU } else { 0 };
        let n = encode_data_hdr_pda(&mut h, PduType::H2CData, &d, fl, self.dg, pda);
        let mut v = h[..n].to_vec();
        v.extend_from_slice(data);
        if self.dg.data {
            v.extend_from_slice(&crc(data).to_le_bytes());
        }
        self.s.write_all(&v).unwrap();
    }

    fn recv(&mut self) -> RawPdu {
        let p = read_pdu(&mut self.s).expect("PDU from the target");
        assert!(p.digests_ok(), "bad digest from the target");
        p
    }

    /// The PDUs up to the command's end: C2HData with SUCCESS, or its
    /// CapsuleResp (returned apart).
    fn wait(&mut self, cid: u16) -> (Vec<RawPdu>, Option<Cqe>) {
        let mut got = Vec::new();
        loop {
            let p = self.recv();
            match PduType::from_u8(p.ty()) {
                Some(PduType::C2HData) => {
                    assert_eq!(p.data_hdr().cccid, cid);
                    let success = p.ch.flags & flags::SUCCESS != 0;
                    got.push(p);
                    if success {
                        return (got, None);
                    }
                }
                Some(PduType::CapsuleResp) => {
                    let c = p.cqe();
                    assert_eq!(c.cid, cid);
                    return (got, Some(c));
                }
                other => panic!("unexpected PDU {other:?}"),
            }
        }
    }

    fn cmd(&mut self, sqe: &mut Sqe, data: &[u8]) -> (Vec<RawPdu>, Cqe) {
        let cid = self.next_cid();
        sqe.set_cid(cid).set_sgl_psdt();
        self.send_cmd(sqe, data, 0);
        let (pdus, c) = self.wait(cid);
        (pdus, c.unwrap_or_else(|| Cqe::new(cid, Status::SUCCESS)))
    }

    fn connect(&mut self, qid: u16, cntlid: u16, sqsize: u16, cattr: u8) -> Cqe {
        let (mut sqe, d) = connect_capsule(qid, cntlid, sqsize, cattr, NQN, HOSTNQN);
        self.cmd(&mut sqe, &d).1
    }

    fn prop(&mut self, offset: u32, set: Option<u64>) -> u64 {
        let mut sqe = Sqe::default();
        PropertyCmd {
            eight_bytes: false,
            offset,
            value: set.unwrap_or(0),
        }
        .encode(&mut sqe, set.is_some());
        let c = self.cmd(&mut sqe, &[]).1;
        assert!(c.status().is_success(), "{}", c.status());
        u64::from(c.dw0)
    }

    /// Admin queue of `sqsize`: connect, enable, 16 I/O queues; the cntlid.
    fn admin(port: u16, hpda: u8, sqsize: u16) -> (Raw, u16) {
        let mut a = Raw::open(port, hpda, Digests::default());
        let c = a.connect(0, 0xffff, sqsize, 0);
        assert!(c.status().is_success(), "{}", c.status());
        a.prop(prop::CC, Some(1 | 6 << 16 | 4 << 20));
        assert_eq!(a.prop(prop::CSTS, None) & 1, 1);
        let mut sqe = Sqe::default();
        sqe.set_opcode(admin::SET_FEATURES)
            .set_cdw(10, 7)
            .set_cdw(11, 15 | 15 << 16);
        assert!(a.cmd(&mut sqe, &[]).1.status().is_success());
        (a, c.dw0 as u16)
    }

    fn io(port: u16, hpda: u8, dg: Digests, cntlid: u16, qid: u16, cattr: u8) -> Raw {
        let mut q = Raw::open(port, hpda, dg);
        let c = q.connect(qid, cntlid, 31, cattr);
        assert!(c.status().is_success(), "{}", c.status());
        q
    }

    fn write(&mut self, slba: u64, data: &[u8]) {
        let mut w = Client::rw_sqe(io::WRITE, slba, (data.len() / 512) as u32, true);
        assert!(self.cmd(&mut w, data).1.status().is_success());
    }
}

/// Checks a C2HData PDU against alignment `hpda`: PDO a multiple of it,
/// past the header, zero padding (none at all for HPDA 0).
fn assert_aligned(p: &RawPdu, hpda: u8) {
    let align = (usize::from(hpda) + 1) * 4;
    let pdo = p.ch.pdo as usize;
    assert_eq!(pdo % align, 0, "PDO {pdo} under HPDA {hpda}");
    assert!(pdo >= p.header_total() && pdo < p.header_total() + align);
    if hpda == 0 {
        assert_eq!(pdo, p.header_total(), "HPDA 0 must not pad");
    }
    assert!(p.pad().iter().all(|&b| b == 0), "padding not zero");
    let want = pdo + p.data_hdr().length as usize + p.ddgst_len();
    assert_eq!(p.ch.plen as usize, want);
}

#[test]
fn c2h_data_is_aligned_to_the_hosts_hpda() {
    let e = env();
    // The admin queue asks for 16-byte alignment too: Identify data obeys.
    let (mut a, cntlid) = Raw::admin(e.port, 3, 31);
    let mut id = Sqe::default();
    id.set_opcode(admin::IDENTIFY)
        .set_cdw(10, 1)
        .set_sgl(SglDesc::transport(4096));
    let (pdus, c) = a.cmd(&mut id, &[]);
    assert!(c.status().is_success());
    assert_eq!(pdus.len(), 1);
    assert_aligned(&pdus[0], 3);
    assert_eq!(get_cstr(&pdus[0].data()[768..1024]), Some(NQN));
    let mut qid = 0;
    for dg in [Digests::default(), DG] {
        for hpda in [3u8, 0, 2, MAX_PDA] {
            qid += 1;
            let mut q = Raw::io(e.port, hpda, dg, cntlid, qid, 0);
            let slba = u64::from(qid) * 256;
            let small = pattern(4096, u64::from(qid));
            q.write(slba, &small);
            let big = pattern(64 << 10, u64::from(qid) + 100);
            for (i, chunk) in big.chunks(8192).enumerate() {
                q.write(slba + 8 + i as u64 * 16, chunk);
            }
            for (nlb, want) in [(8u32, &small), (128, &big)] {
                let at = if nlb == 8 { slba } else { slba + 8 };
                let mut r = Client::rw_sqe(io::READ, at, nlb, false);
                let (pdus, c) = q.cmd(&mut r, &[]);
                assert!(c.status().is_success());
                assert_eq!(pdus.len(), 1);
                assert_aligned(&pdus[0], hpda);
                assert!(pdus[0].data() == &want[..], "read data differs");
            }
        }
    }
}

#[test]
fn reserved_hpda_gets_a_termination_request() {
    let e = env();
    for hpda in [32u8, 255] {
        let mut s = tcp(e.port);
        s.write_all(&ic_req(hpda, Digests::default())).unwrap();
        let p = read_pdu(&mut s).unwrap();
        assert_eq!(p.ty(), PduType::C2HTermReq as u8);
        let t = p.term();
        assert_eq!((t.fes, t.fei), (fes::INVALID_HEADER_FIELD, 10), "{t:?}");
        // The offending ICReq comes back as the request's data.
        assert_eq!(p.data()[..12], ic_req(hpda, Digests::default())[..12]);
        assert!(read_pdu(&mut s).is_err(), "the target must close");
    }
    // The largest valid HPDA still connects.
    let (_a, cntlid) = Client::admin(e.port, Digests::default());
    Raw::io(e.port, MAX_PDA, Digests::default(), cntlid, 1, 0);
}

#[test]
fn padded_host_data_is_accepted() {
    let e = env();
    let (_a, cntlid) = Client::admin(e.port, Digests::default());
    let mut qid = 0;
    for dg in [Digests::default(), DG] {
        for pda in [1u8, 7, MAX_PDA] {
            qid += 1;
            let mut q = Raw::io(e.port, 0, dg, cntlid, qid, 0);
            let slba = u64::from(qid) * 128;
            // In-capsule data after padding.
            let small = pattern(2048, u64::from(pda));
            let mut w = Client::rw_sqe(io::WRITE, slba, 4, true);
            let cid = q.next_cid();
            w.set_cid(cid).set_sgl_psdt();
            q.send_cmd(&w, &small, pda);
            let (_, c) = q.wait(cid);
            assert!(c.unwrap().status().is_success());
            // R2T data in two padded H2CData PDUs.
            let big = pattern(16384, u64::from(pda) + 7);
            let mut w = Client::rw_sqe(io::WRITE, slba + 8, 32, false);
            let cid = q.next_cid();
            w.set_cid(cid).set_sgl_psdt();
            q.send_cmd(&w, &[], 0);
            let r = q.recv();
            assert_eq!(r.ty(), PduType::R2T as u8);
            let ttag = r.data_hdr().ttag;
            for (i, half) in big.chunks(8192).enumerate() {
                let d = DataHdr {
                    cccid: cid,
                    ttag,
                    offset: i as u32 * 8192,
                    length: 8192,
                };
                q.send_h2c(d, half, i == 1, pda);
            }
            let (_, c) = q.wait(cid);
            assert!(c.unwrap().status().is_success());
            for (at, nlb, want) in [(slba, 4u32, &small), (slba + 8, 32, &big)] {
                let mut r = Client::rw_sqe(io::READ, at, nlb, false);
                let (pdus, c) = q.cmd(&mut r, &[]);
                assert!(c.status().is_success());
                assert!(pdus[0].data() == &want[..], "padded write landed wrong");
            }
        }
    }
}

/// Reads on a queue connected with `cattr`: whether the C2HData carried
/// SUCCESS (then no CapsuleResp may follow: the next PDU answers a Flush).
fn read_success_flag(e: &Env, cattr: u8) -> bool {
    let (_a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q = Raw::io(e.port, 0, Digests::default(), cntlid, 1, cattr);
    let data = pattern(4096, 5);
    q.write(0, &data);
    let mut r = Client::rw_sqe(io::READ, 0, 8, false);
    let cid = q.next_cid();
    r.set_cid(cid).set_sgl_psdt();
    q.send_cmd(&r, &[], 0);
    let p = q.recv();
    assert_eq!(p.ty(), PduType::C2HData as u8);
    assert!(p.data() == &data[..]);
    assert_ne!(p.ch.flags & flags::LAST_PDU, 0);
    let success = p.ch.flags & flags::SUCCESS != 0;
    if !success {
        let c = q.recv().cqe();
        assert_eq!(c.cid, cid);
        assert!(c.status().is_success());
    }
    let mut fl = Sqe::default();
    fl.set_opcode(io::FLUSH).set_nsid(1);
    let fcid = q.next_cid();
    fl.set_cid(fcid).set_sgl_psdt();
    q.send_cmd(&fl, &[], 0);
    let c = q.recv().cqe();
    assert_eq!(c.cid, fcid, "a CapsuleResp followed a SUCCESS C2HData");
    success
}

#[test]
fn c2h_success_follows_the_option_and_the_hosts_flow_control() {
    let off = ConnectCmd::CATTR_DISABLE_SQFLOW;
    let e = env();
    assert!(TransportOpts::default().c2h_success);
    assert!(read_success_flag(&e, off), "SQ flow control off: SUCCESS");
    drop(e);
    let e = env();
    assert!(!read_success_flag(&e, 0), "SQ flow control on: no SUCCESS");
    drop(e);
    let opts = TransportOpts {
        c2h_success: false,
        ..TransportOpts::default()
    };
    let e = env_opts(32768, opts);
    assert!(!read_success_flag(&e, off), "c2h_success false: no SUCCESS");
}

#[test]
fn connect_sqsize_is_bounded_by_the_depth_options() {
    let opts = TransportOpts {
        max_queue_depth: 16,
        max_aq_depth: 8,
        ..TransportOpts::default()
    };
    let e = env_opts(32768, opts);
    // Admin queue: SQSIZE is 0's based, so 8 entries is SQSIZE 7.
    let mut a = Raw::open(e.port, 0, Digests::default());
    let c = a.connect(0, 0xffff, 8, 0);
    assert_eq!(c.status(), Status::CONNECT_INVALID_PARAM);
    assert_eq!(c.dw0, 44 << 16, "IATTR 0, IPO: SQSIZE");
    let (_a, cntlid) = Raw::admin(e.port, 0, 7);
    let mut q = Raw::open(e.port, 0, Digests::default());
    let c = q.connect(1, cntlid, 16, 0);
    assert_eq!(c.status(), Status::CONNECT_INVALID_PARAM);
    assert_eq!(c.dw0, 44 << 16);
    let mut q = Raw::open(e.port, 0, Digests::default());
    let c = q.connect(1, cntlid, 15, 0);
    assert!(c.status().is_success(), "{}", c.status());
    q.write(0, &pattern(512, 1));
    drop(e);
    // Options beyond the preallocated slots are held to them.
    let opts = TransportOpts {
        max_queue_depth: 4096,
        ..TransportOpts::default()
    };
    let e = env_opts(32768, opts);
    let (_a, cntlid) = Raw::admin(e.port, 0, 31);
    let mut q = Raw::open(e.port, 0, Digests::default());
    assert_eq!(
        q.connect(1, cntlid, 128, 0).status(),
        Status::CONNECT_INVALID_PARAM
    );
    let mut q = Raw::open(e.port, 0, Digests::default());
    assert!(q.connect(1, cntlid, 127, 0).status().is_success());
}

// ---------------------------------------------------------------------
// A fake controller for the initiator.

/// What the fake controller does wrong, once, on the first I/O queue's
/// first read (or on the admin queue where named).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// ICResp with CPDA 32 (reserved).
    AdminBadCpda,
    /// The Connect response with HLEN 30.
    AdminBadHlen,
    /// C2HData naming a CID with no command.
    C2HIdleCid,
    /// C2HData beyond the read's length.
    C2HOutOfRange,
    /// C2HData with SUCCESS but not LAST_PDU.
    C2HSuccessNotLast,
    /// A CapsuleResp for a CID with no command.
    RespIdleCid,
    /// An R2T for the read.
    R2TForRead,
    /// A CapsuleResp with a wrong header digest.
    BadHeaderDigest,
    /// A CapsuleCmd (hosts send those, controllers do not).
    HostPdu,
}

struct FakeCfg {
    /// CPDA advertised in ICResp.
    cpda: u8,
    /// Alignment the fake uses for its C2HData (PDO past the header).
    c2h_pda: u8,
    fault: Fault,
}

/// What the fake saw.
#[derive(Default)]
struct Seen {
    /// Host PDUs with data, and those whose PDO broke the CPDA or whose
    /// padding was not zero.
    data_pdus: AtomicU32,
    misaligned: AtomicU32,
    fault_done: AtomicBool,
    io_conns: AtomicU32,
    /// Connections that broke the protocol otherwise (bytes after the
    /// H2CTermReq, an unexpected H2CTermReq).
    broken: AtomicU32,
    /// H2CTermReqs: (FES, FEI, data).
    terms: Mutex<Vec<(u16, u32, Vec<u8>)>>,
}

struct Fake {
    port: u16,
    seen: Arc<Seen>,
    terms: mpsc::Receiver<()>,
}

const FAKE_BLOCKS: u64 = 2048;

fn fake(cfg: FakeCfg) -> Fake {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = Arc::new(Seen::default());
    let disk = Arc::new(Mutex::new(pattern(FAKE_BLOCKS as usize * 512, 77)));
    let cfg = Arc::new(cfg);
    let (tx, rx) = mpsc::channel();
    let s2 = seen.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { return };
            let (seen, disk, cfg, tx) = (s2.clone(), disk.clone(), cfg.clone(), tx.clone());
            std::thread::spawn(move || {
                let mut f = FakeConn {
                    s: c,
                    dg: Digests::default(),
                    io: false,
                    first_io: false,
                    cfg,
                    seen,
                    disk,
                };
                // Ends with the host's close (or the fake's verdict).
                if let Err(e) = f.serve() {
                    if e.kind() == std::io::ErrorKind::Other {
                        f.seen.broken.fetch_add(1, Ordering::Relaxed);
                    }
                }
                if !f.seen.terms.lock().unwrap().is_empty() {
                    let _ = tx.send(());
                }
            });
        }
    });
    Fake {
        port,
        seen,
        terms: rx,
    }
}

struct FakeConn {
    s: TcpStream,
    dg: Digests,
    io: bool,
    first_io: bool,
    cfg: Arc<FakeCfg>,
    seen: Arc<Seen>,
    disk: Arc<Mutex<Vec<u8>>>,
}

impl FakeConn {
    fn send(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.s.write_all(b)
    }

    fn resp(&mut self, cid: u16, dw0: u32) -> std::io::Result<()> {
        let mut c = Cqe::new(cid, Status::SUCCESS);
        c.dw0 = dw0;
        let mut h = [0u8; 32];
        let n = encode_capsule_resp(&mut h, &c, self.dg);
        self.send(&h[..n])
    }

    fn c2h(&mut self, cid: u16, off: u32, data: &[u8], fl: u8) -> std::io::Result<()> {
        let d = DataHdr {
            cccid: cid,
            ttag: 0,
            offset: off,
            length: data.len() as u32,
        };
        let mut h = [0u8; MAX_PADDED_HDR];
        let n = encode_data_hdr_pda(&mut h, PduType::C2HData, &d, fl, self.dg, self.cfg.c2h_pda);
        let mut v = h[..n].to_vec();
        v.extend_from_slice(data);
        if self.dg.data {
            v.extend_from_slice(&crc(data).to_le_bytes());
        }
        self.send(&v)
    }

    /// Records a host PDU's data placement against the advertised CPDA.
    fn check_pdo(&self, p: &RawPdu) {
        if p.data().is_empty() {
            return;
        }
        self.seen.data_pdus.fetch_add(1, Ordering::Relaxed);
        let align = (usize::from(self.cfg.cpda) + 1) * 4;
        if p.pdo() % align != 0 || p.pad().iter().any(|&b| b != 0) || !p.digests_ok() {
            self.seen.misaligned.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// After a fault: the host's H2CTermReq, then its close.
    fn expect_term(&mut self) -> std::io::Result<()> {
        self.seen.fault_done.store(true, Ordering::Release);
        loop {
            let p = read_pdu(&mut self.s)?;
            if p.ty() == PduType::H2CTermReq as u8 {
                let t = p.term();
                let d = p.data().to_vec();
                self.seen.terms.lock().unwrap().push((t.fes, t.fei, d));
                // Nothing may follow but the close (a reset when the host
                // closed with our unread bytes queued).
                let mut b = [0u8; 1];
                return match self.s.read(&mut b) {
                    Ok(n) if n > 0 => Err(std::io::Error::other("data after H2CTermReq")),
                    _ => Ok(()),
                };
            }
        }
    }

    fn serve(&mut self) -> std::io::Result<()> {
        let p = read_pdu(&mut self.s)?;
        let req = IcReq::decode(&p.b).map_err(|_| std::io::Error::other("bad ICReq"))?;
        assert_eq!(req.hpda, 0, "the initiator asks for no alignment");
        self.dg = req.digests;
        let mut resp = IcResp {
            pfv: 0,
            cpda: self.cfg.cpda,
            digests: req.digests,
            maxh2cdata: 8192,
        };
        let bad_ic = self.cfg.fault == Fault::AdminBadCpda;
        if bad_ic {
            resp.cpda = 32;
        }
        self.send(&resp.encode())?;
        if bad_ic {
            return self.expect_term();
        }
        loop {
            let p = read_pdu(&mut self.s)?;
            if p.ty() == PduType::H2CTermReq as u8 {
                return Err(std::io::Error::other("unexpected H2CTermReq"));
            }
            self.check_pdo(&p);
            assert_eq!(p.ty(), PduType::CapsuleCmd as u8);
            let sqe = Sqe::from_slice(&p.b[CH_LEN..]).unwrap();
            let data = p.data().to_vec();
            if self.command(&sqe, &data)? {
                return self.expect_term();
            }
        }
    }

    /// Answers one command; true when it injected the fault.
    fn command(&mut self, sqe: &Sqe, data: &[u8]) -> std::io::Result<bool> {
        let cid = sqe.cid();
        match sqe.opcode() {
            admin::FABRICS => match sqe.fctype() {
                fctype::CONNECT => {
                    let c = ConnectCmd::parse(sqe);
                    self.io = c.qid != 0;
                    if self.io {
                        let n = self.seen.io_conns.fetch_add(1, Ordering::AcqRel);
                        self.first_io = n == 0;
                    } else if self.cfg.fault == Fault::AdminBadHlen {
                        let mut h = [0u8; 32];
                        let n =
                            encode_capsule_resp(&mut h, &Cqe::new(cid, Status::SUCCESS), self.dg);
                        h[2] = 30;
                        self.send(&h[..n])?;
                        return Ok(true);
                    }
                    self.resp(cid, 1)?;
                }
                fctype::PROPERTY_GET => {
                    let v = match PropertyCmd::parse(sqe).offset {
                        prop::CAP => 127 | 1 << 16 | 2 << 24,
                        prop::CSTS => 1,
                        _ => 0,
                    };
                    self.resp(cid, v)?;
                }
                _ => self.resp(cid, 0)?,
            },
            admin::IDENTIFY if !self.io => {
                let mut d = vec![0u8; 4096];
                match sqe.cdw(10) & 0xff {
                    // Controller: IOCCSZ for 8 KiB of in-capsule data.
                    1 => d[1792..1796].copy_from_slice(&((8192u32 + 64) / 16).to_le_bytes()),
                    2 => d[0] = 1,
                    // Namespace: NSZE, LBA format 0 of 512 bytes.
                    _ => {
                        d[..8].copy_from_slice(&FAKE_BLOCKS.to_le_bytes());
                        d[130] = 9;
                    }
                }
                self.c2h(cid, 0, &d, flags::LAST_PDU)?;
                self.resp(cid, 0)?;
            }
            admin::SET_FEATURES if !self.io => self.resp(cid, 3 | 3 << 16)?,
            io::READ if self.io => return self.read(sqe),
            io::WRITE if self.io => self.write(sqe, data)?,
            _ => self.resp(cid, 0)?,
        }
        Ok(false)
    }

    fn read(&mut self, sqe: &Sqe) -> std::io::Result<bool> {
        let cid = sqe.cid();
        let at = sqe.slba() as usize * 512;
        let len = (sqe.cdw(12) as usize & 0xffff) * 512 + 512;
        let fault = if self.first_io && !self.seen.fault_done.load(Ordering::Acquire) {
            self.cfg.fault
        } else {
            Fault::None
        };
        let last = flags::LAST_PDU | flags::SUCCESS;
        let idle = (cid + 1) % 128;
        match fault {
            Fault::None | Fault::AdminBadCpda | Fault::AdminBadHlen => {
                let d = self.disk.lock().unwrap()[at..at + len].to_vec();
                // Two PDUs: the second at an offset, both padded.
                let half = len / 2;
                self.c2h(cid, 0, &d[..half], 0)?;
                self.c2h(cid, half as u32, &d[half..], last)?;
                return Ok(false);
            }
            Fault::C2HIdleCid => self.c2h(idle, 0, &vec![0; len], last)?,
            Fault::C2HOutOfRange => self.c2h(cid, len as u32, &[0; 512], last)?,
            Fault::C2HSuccessNotLast => self.c2h(cid, 0, &vec![0; len], flags::SUCCESS)?,
            Fault::RespIdleCid => self.resp(idle, 0)?,
            Fault::R2TForRead => {
                let d = DataHdr {
                    cccid: cid,
                    ttag: 1,
                    offset: 0,
                    length: 512,
                };
                let mut h = [0u8; 32];
                let n = encode_data_hdr(&mut h, PduType::R2T, &d, 0, self.dg);
                self.send(&h[..n])?;
            }
            Fault::BadHeaderDigest => {
                let mut h = [0u8; 32];
                let n = encode_capsule_resp(&mut h, &Cqe::new(cid, Status::SUCCESS), self.dg);
                h[n - 1] ^= 0x5a;
                self.send(&h[..n])?;
            }
            Fault::HostPdu => {
                let mut h = [0u8; 80];
                let n = encode_capsule_cmd(&mut h, &Sqe::default(), self.dg, 0);
                self.send(&h[..n])?;
            }
        }
        Ok(true)
    }

    fn write(&mut self, sqe: &Sqe, data: &[u8]) -> std::io::Result<()> {
        let cid = sqe.cid();
        let at = sqe.slba() as usize * 512;
        let len = (sqe.cdw(12) as usize & 0xffff) * 512 + 512;
        if !data.is_empty() {
            self.disk.lock().unwrap()[at..at + len].copy_from_slice(data);
            return self.resp(cid, 0);
        }
        let d = DataHdr {
            cccid: cid,
            ttag: 5,
            offset: 0,
            length: len as u32,
        };
        let mut h = [0u8; 32];
        let n = encode_data_hdr(&mut h, PduType::R2T, &d, 0, self.dg);
        self.send(&h[..n])?;
        let mut got = 0;
        while got < len {
            let p = read_pdu(&mut self.s)?;
            assert_eq!(p.ty(), PduType::H2CData as u8);
            self.check_pdo(&p);
            let dh = p.data_hdr();
            assert_eq!((dh.cccid, dh.ttag, dh.offset as usize), (cid, 5, got));
            let o = at + got;
            self.disk.lock().unwrap()[o..o + p.data().len()].copy_from_slice(p.data());
            got += p.data().len();
        }
        self.resp(cid, 0)
    }
}

mod host {
    //! The initiator side: a runtime and registry without a target.
    use std::sync::{mpsc, Arc};
    use std::time::Duration;

    use ustor_bdev::{BdevError, Registry};
    use ustor_nvme::initiator::{
        attach_controller, detach_controller, io_queue_stats, AttachParams, DetachParams,
        InitiatorError,
    };
    use ustor_runtime::{IoBuf, Runtime, RuntimeHandle};

    pub struct Host {
        pub handle: RuntimeHandle,
        pub registry: Arc<Registry>,
        _rt: Option<Runtime>,
    }

    /// A runtime of its own (for a fake controller).
    pub fn host() -> Host {
        let rt = super::common::two_reactors();
        let registry = Registry::new(Some(rt.handle()));
        Host {
            handle: rt.handle(),
            registry,
            _rt: Some(rt),
        }
    }

    /// The target's runtime and registry (for the real target).
    pub fn beside(e: &super::Env) -> Host {
        Host {
            handle: e.rt.handle(),
            registry: e.registry.clone(),
            _rt: None,
        }
    }

    impl Host {
        pub fn attach_with(&self, p: &AttachParams) -> Result<String, InitiatorError> {
            Ok(attach_controller(&self.handle, &self.registry, p)?[0].clone())
        }

        pub fn attach(
            &self,
            name: &str,
            port: u16,
            digests: bool,
        ) -> Result<String, InitiatorError> {
            let mut p = AttachParams::tcp(name, "127.0.0.1", &port.to_string(), super::NQN);
            p.hdgst = digests;
            p.ddgst = digests;
            p.reconnect_delay_sec = 1;
            p.ctrlr_loss_timeout_sec = 10;
            self.attach_with(&p)
        }

        pub fn detach(&self, name: &str) {
            detach_controller(&DetachParams { name: name.into() }).unwrap();
        }

        /// Writes `data` at block `slba` through the bdev, then reads it
        /// back; the read data. Bounded: a hang fails the test.
        pub fn write_read(
            &self,
            bdev: &str,
            slba: u64,
            data: Option<Vec<u8>>,
            len: usize,
        ) -> Result<Vec<u8>, BdevError> {
            let (reg, name, h) = (self.registry.clone(), bdev.to_string(), self.handle.clone());
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let r = h.block_on(1, move || async move {
                    let d = reg.open(&name, true, |_| {}).expect("open");
                    let ch = d.channel()?;
                    if let Some(data) = data {
                        let mut b = IoBuf::alloc(data.len()).await;
                        b.copy_from_slice(&data);
                        let nb = (data.len() / 512) as u64;
                        ch.write(slba, nb, b).await.0?;
                    }
                    let mut b = IoBuf::alloc(len).await;
                    b.fill(0xee);
                    let (r, b) = ch.read(slba, (len / 512) as u64, b).await;
                    r?;
                    Ok::<_, BdevError>(b[..].to_vec())
                });
                let _ = tx.send(r.expect("reactor"));
            });
            rx.recv_timeout(Duration::from_secs(30))
                .expect("I/O through the initiator hung")
        }

        /// The I/O queues' coalescing raises and lowers, summed.
        pub fn adaptive_moves(&self, name: &str) -> (u64, u64) {
            let st = io_queue_stats(name).unwrap();
            st.iter().fold((0, 0), |a, q| {
                (a.0 + q.coalesce.raises, a.1 + q.coalesce.lowers)
            })
        }
    }
}

#[test]
fn initiator_pads_to_cpda_and_takes_padded_c2h_data() {
    let h = host::host();
    for (i, digests) in [false, true].into_iter().enumerate() {
        for (cpda, c2h_pda) in [(3u8, 15u8), (0, 2), (MAX_PDA, MAX_PDA)] {
            let f = fake(FakeCfg {
                cpda,
                c2h_pda,
                fault: Fault::None,
            });
            let name = format!("Pad{i}x{cpda}");
            let bdev = h.attach(&name, f.port, digests).unwrap();
            // In-capsule (4 KiB), then R2T (32 KiB in 8 KiB H2CData PDUs).
            for (slba, len) in [(8u64, 4096usize), (64, 32768)] {
                let data = pattern(len, slba + u64::from(cpda));
                let got = h.write_read(&bdev, slba, Some(data.clone()), len).unwrap();
                assert!(got == data, "data through padded PDUs differs");
            }
            // Untouched blocks read as the fake's pattern.
            let disk = pattern(FAKE_BLOCKS as usize * 512, 77);
            let got = h.write_read(&bdev, 1000, None, 8192).unwrap();
            assert!(got[..] == disk[1000 * 512..1000 * 512 + 8192]);
            h.detach(&name);
            // Connect data, the in-capsule write and 4 H2CData PDUs at least.
            assert!(f.seen.data_pdus.load(Ordering::Relaxed) >= 6);
            assert_eq!(f.seen.misaligned.load(Ordering::Relaxed), 0, "CPDA {cpda}");
            assert!(f.seen.terms.lock().unwrap().is_empty());
            assert_eq!(f.seen.broken.load(Ordering::Relaxed), 0);
        }
    }
}

/// Waits for the fake's record of an H2CTermReq.
fn term_of(f: &Fake) -> (u16, u32, Vec<u8>) {
    f.terms
        .recv_timeout(Duration::from_secs(15))
        .expect("no H2CTermReq from the initiator");
    f.seen.terms.lock().unwrap()[0].clone()
}

#[test]
fn malformed_controller_pdus_get_an_h2c_term_req() {
    let h = host::host();
    let inval = fes::INVALID_HEADER_FIELD;
    let cases = [
        (Fault::C2HIdleCid, false, inval, 8, PduType::C2HData),
        (
            Fault::C2HOutOfRange,
            false,
            fes::DATA_OUT_OF_RANGE,
            12,
            PduType::C2HData,
        ),
        (
            Fault::C2HSuccessNotLast,
            true,
            inval,
            ch_off::FLAGS,
            PduType::C2HData,
        ),
        (Fault::RespIdleCid, false, inval, 20, PduType::CapsuleResp),
        (Fault::R2TForRead, true, inval, 8, PduType::R2T),
        (
            Fault::BadHeaderDigest,
            true,
            fes::HEADER_DIGEST_ERROR,
            0,
            PduType::CapsuleResp,
        ),
        (
            Fault::HostPdu,
            false,
            fes::PDU_SEQUENCE_ERROR,
            ch_off::PDU_TYPE,
            PduType::CapsuleCmd,
        ),
    ];
    for (i, (fault, digests, fes_want, fei_want, ty)) in cases.into_iter().enumerate() {
        let f = fake(FakeCfg {
            cpda: 0,
            c2h_pda: 0,
            fault,
        });
        let name = format!("Bad{i}");
        let bdev = h.attach(&name, f.port, digests).unwrap();
        // The read meets the fault; the queue reconnects and retries it
        // on a well-behaved connection.
        let disk = pattern(FAKE_BLOCKS as usize * 512, 77);
        let got = h.write_read(&bdev, 16, None, 4096).unwrap();
        assert!(got[..] == disk[16 * 512..16 * 512 + 4096], "{fault:?}");
        let (fes_got, fei_got, hdr) = term_of(&f);
        assert_eq!((fes_got, fei_got), (fes_want, fei_want), "{fault:?}");
        // The request quotes the offending header.
        assert!(hdr.len() >= CH_LEN, "{fault:?}: {hdr:?}");
        assert_eq!(hdr[0], ty as u8, "{fault:?}");
        assert!(f.seen.io_conns.load(Ordering::Relaxed) >= 2, "{fault:?}");
        assert_eq!(f.seen.broken.load(Ordering::Relaxed), 0, "{fault:?}");
        h.detach(&name);
    }
}

#[test]
fn malformed_admin_pdus_get_an_h2c_term_req() {
    let h = host::host();
    for (i, (fault, fei)) in [
        (Fault::AdminBadCpda, 10),
        (Fault::AdminBadHlen, ch_off::HLEN),
    ]
    .into_iter()
    .enumerate()
    {
        let f = fake(FakeCfg {
            cpda: 0,
            c2h_pda: 0,
            fault,
        });
        assert!(h.attach(&format!("BadAdmin{i}"), f.port, false).is_err());
        let (fes_got, fei_got, hdr) = term_of(&f);
        assert_eq!(
            (fes_got, fei_got),
            (fes::INVALID_HEADER_FIELD, fei),
            "{fault:?}"
        );
        let ty = if fault == Fault::AdminBadCpda {
            PduType::IcResp
        } else {
            PduType::CapsuleResp
        };
        assert_eq!(hdr[0], ty as u8);
    }
}

#[test]
fn initiator_queue_stats_report_adaptive_moves() {
    use ustor_net::coalesce::{CoalesceConfig, Mode};
    let e = env();
    let h = host::beside(&e);
    let port = e.port.to_string();
    let mut p = ustor_nvme::initiator::AttachParams::tcp("Adapt", "127.0.0.1", &port, NQN);
    p.hostnqn = Some(HOSTNQN.into());
    // Adaptive, degree 1, a one-group window: the first group is full, so
    // the first window raises the degree.
    p.coalesce = CoalesceConfig {
        mode: Mode::Adaptive,
        degree: 1,
        min_degree: 1,
        window: 1,
        ..CoalesceConfig::default()
    };
    let bdev = h.attach_with(&p).unwrap();
    for i in 0..8 {
        let d = pattern(4096, i);
        assert_eq!(
            h.write_read(&bdev, i * 8, Some(d.clone()), 4096).unwrap(),
            d
        );
    }
    let (raises, _lowers) = h.adaptive_moves("Adapt");
    assert!(raises >= 1, "adaptive raises not reported");
    h.detach("Adapt");
}

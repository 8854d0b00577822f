//! Against the real target: C2HData alignment to the host's HPDA, padded
//! host PDUs, `c2h_success`, and the queue depth options.

use super::*;

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

//! A fake controller for the initiator: a std TCP thread speaking the
//! wire format with scripted faults.

use super::*;

// ---------------------------------------------------------------------
// A fake controller for the initiator.

/// What the fake controller does wrong, once, on the first I/O queue's
/// first read (or on the admin queue where named).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fault {
    None,
    /// ICResp with CPDA 32 (reserved).
    AdminBadCpda,
    /// ICResp with CPDA 32 on the second connection (the first I/O queue's).
    IoBadCpda,
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

pub(super) struct FakeCfg {
    /// CPDA advertised in ICResp.
    pub(super) cpda: u8,
    /// Alignment the fake uses for its C2HData (PDO past the header).
    pub(super) c2h_pda: u8,
    pub(super) fault: Fault,
}

/// What the fake saw.
#[derive(Default)]
pub(super) struct Seen {
    /// Host PDUs with data, and those whose PDO broke the CPDA or whose
    /// padding was not zero.
    pub(super) data_pdus: AtomicU32,
    pub(super) misaligned: AtomicU32,
    pub(super) fault_done: AtomicBool,
    pub(super) io_conns: AtomicU32,
    /// Connections that broke the protocol otherwise (bytes after the
    /// H2CTermReq, an unexpected H2CTermReq).
    pub(super) broken: AtomicU32,
    /// H2CTermReqs: (FES, FEI, data).
    pub(super) terms: Mutex<Vec<(u16, u32, Vec<u8>)>>,
}

pub(super) struct Fake {
    pub(super) port: u16,
    pub(super) seen: Arc<Seen>,
    pub(super) terms: mpsc::Receiver<()>,
}

pub(super) const FAKE_BLOCKS: u64 = 2048;

pub(super) fn fake(cfg: FakeCfg) -> Fake {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = Arc::new(Seen::default());
    let disk = Arc::new(Mutex::new(pattern(FAKE_BLOCKS as usize * 512, 77)));
    let cfg = Arc::new(cfg);
    let (tx, rx) = mpsc::channel();
    let s2 = seen.clone();
    std::thread::spawn(move || {
        for (nth, c) in l.incoming().enumerate() {
            let Ok(c) = c else { return };
            let (seen, disk, cfg, tx) = (s2.clone(), disk.clone(), cfg.clone(), tx.clone());
            std::thread::spawn(move || {
                let mut f = FakeConn {
                    s: c,
                    dg: Digests::default(),
                    io: false,
                    first_io: false,
                    nth,
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

pub(super) struct FakeConn {
    s: TcpStream,
    dg: Digests,
    io: bool,
    first_io: bool,
    /// Connections accepted before this one.
    nth: usize,
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
        let bad_ic = match self.cfg.fault {
            Fault::AdminBadCpda => self.nth == 0,
            Fault::IoBadCpda => self.nth == 1,
            _ => false,
        };
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
            Fault::None | Fault::AdminBadCpda | Fault::IoBadCpda | Fault::AdminBadHlen => {
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

//! Test harness: a runtime with a malloc bdev and the target listening on
//! 127.0.0.1 (free port), plus a raw NVMe/TCP client on blocking std sockets.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use ustor_bdev::{modules, Registry};
use ustor_nvme::nvmf::{CreateTransportParams, Target, TransportOpts};
use ustor_nvme::wire::*;
use ustor_runtime::{PollMode, Runtime, RuntimeConfig};

pub const NQN: &str = "nqn.2024-01.io.ustor:test";
pub const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001";

pub struct Env {
    pub target: Target,
    pub registry: Arc<Registry>,
    pub port: u16,
    pub rt: Runtime,
}

pub fn env_with(blocks: u64, coalesce: ustor_net::coalesce::CoalesceConfig) -> Env {
    env_opts(
        blocks,
        TransportOpts {
            coalesce,
            ..TransportOpts::default()
        },
    )
}

/// Two reactors, a malloc namespace of `blocks` 512-byte blocks, and the
/// target's TCP transport created with `opts`.
pub fn env_opts(blocks: u64, opts: TransportOpts) -> Env {
    let rt = two_reactors();
    let registry = Registry::new(Some(rt.handle()));
    modules::malloc::create(
        &registry,
        modules::RamOpts {
            name: "Malloc0".into(),
            num_blocks: blocks,
            block_size: 512,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .expect("malloc");
    let target = Target::new(rt.handle(), registry.clone());
    target
        .nvmf_create_transport(&CreateTransportParams {
            trtype: "TCP".into(),
            opts,
        })
        .unwrap();
    let port = target
        .export_local(NQN, "USTOR0001", "ustor test", "Malloc0", "0")
        .unwrap();
    Env {
        target,
        registry,
        port: port.parse().unwrap(),
        rt,
    }
}

pub fn env() -> Env {
    env_with(32768, Default::default())
}

/// A received PDU.
#[derive(Debug)]
pub struct Pdu {
    pub ty: u8,
    pub flags: u8,
    pub hdr: Vec<u8>,
    pub data: Vec<u8>,
}

impl Pdu {
    pub fn cqe(&self) -> Cqe {
        assert_eq!(self.ty, PduType::CapsuleResp as u8, "{self:?}");
        Cqe::decode(&self.hdr[8..]).unwrap()
    }
}

pub struct Client {
    pub s: TcpStream,
    pub dg: Digests,
    pub maxh2c: u32,
    cid: u16,
}

impl Client {
    pub fn connect_raw(port: u16, dg: Digests) -> Client {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_nodelay(true).unwrap();
        let mut c = Client {
            s,
            dg,
            maxh2c: 0,
            cid: 0,
        };
        let req = IcReq {
            pfv: 0,
            hpda: 0,
            digests: dg,
            maxr2t: 0,
        };
        c.s.write_all(&req.encode()).unwrap();
        let mut b = [0u8; 128];
        c.s.read_exact(&mut b).unwrap();
        let r = IcResp::decode(&b).unwrap();
        assert_eq!(r.digests, dg);
        c.maxh2c = r.maxh2cdata;
        c
    }

    pub fn next_cid(&mut self) -> u16 {
        self.cid = self.cid.wrapping_add(1);
        self.cid
    }

    /// Sends a capsule with optional in-capsule data.
    pub fn send_cmd(&mut self, sqe: &Sqe, data: &[u8]) {
        let mut h = [0u8; 80];
        let n = encode_capsule_cmd(&mut h, sqe, self.dg, data.len());
        let mut v = h[..n].to_vec();
        v.extend_from_slice(data);
        if self.dg.data && !data.is_empty() {
            v.extend_from_slice(&crc(data).to_le_bytes());
        }
        self.s.write_all(&v).unwrap();
    }

    pub fn send_h2c(&mut self, cid: u16, ttag: u16, off: u32, data: &[u8], last: bool) {
        let mut h = [0u8; 32];
        let d = DataHdr {
            cccid: cid,
            ttag,
            offset: off,
            length: data.len() as u32,
        };
        let n = encode_data_hdr(
            &mut h,
            PduType::H2CData,
            &d,
            if last { flags::LAST_PDU } else { 0 },
            self.dg,
        );
        let mut v = h[..n].to_vec();
        v.extend_from_slice(data);
        if self.dg.data {
            v.extend_from_slice(&crc(data).to_le_bytes());
        }
        self.s.write_all(&v).unwrap();
    }

    pub fn recv(&mut self) -> std::io::Result<Pdu> {
        let mut ch = [0u8; 8];
        self.s.read_exact(&mut ch)?;
        let c = CommonHeader::decode(&ch).unwrap();
        let mut rest = vec![0u8; c.plen as usize - 8];
        self.s.read_exact(&mut rest)?;
        let mut all = ch.to_vec();
        all.extend_from_slice(&rest);
        let hlen = c.hlen as usize;
        let hd = if c.flags & flags::HDGSTF != 0 {
            assert!(
                header_digest_ok(&all, hlen),
                "bad header digest from target"
            );
            4
        } else {
            0
        };
        let dd = if c.flags & flags::DDGSTF != 0 { 4 } else { 0 };
        let data = if c.plen as usize > hlen + hd {
            let start = if c.pdo != 0 {
                c.pdo as usize
            } else {
                hlen + hd
            };
            let d = all[start..all.len() - dd].to_vec();
            if dd == 4 {
                let want = u32::from_le_bytes(all[all.len() - 4..].try_into().unwrap());
                assert_eq!(crc(&d), want, "bad data digest from target");
            }
            d
        } else {
            Vec::new()
        };
        Ok(Pdu {
            ty: c.pdu_type,
            flags: c.flags,
            hdr: all[..hlen].to_vec(),
            data,
        })
    }

    /// Runs a command; returns (data received, cqe).
    pub fn cmd(&mut self, sqe: &mut Sqe, data: &[u8]) -> (Vec<u8>, Cqe) {
        let cid = self.next_cid();
        sqe.set_cid(cid).set_sgl_psdt();
        self.send_cmd(sqe, data);
        self.wait(cid)
    }

    pub fn wait(&mut self, cid: u16) -> (Vec<u8>, Cqe) {
        let mut got = Vec::new();
        loop {
            let p = self.recv().expect("pdu");
            match PduType::from_u8(p.ty) {
                Some(PduType::C2HData) => {
                    got.extend_from_slice(&p.data);
                    if p.flags & flags::SUCCESS != 0 {
                        return (got, Cqe::new(cid, Status::SUCCESS));
                    }
                }
                Some(PduType::CapsuleResp) => {
                    let c = p.cqe();
                    assert_eq!(c.cid, cid);
                    return (got, c);
                }
                other => panic!("unexpected PDU {other:?}: {p:?}"),
            }
        }
    }

    pub fn fabrics_connect(&mut self, qid: u16, cntlid: u16, subnqn: &str, hostnqn: &str) -> Cqe {
        let (mut sqe, d) = connect_capsule(qid, cntlid, 31, 0, subnqn, hostnqn);
        self.cmd(&mut sqe, &d).1
    }

    pub fn prop_get(&mut self, off: u32, eight: bool) -> u64 {
        let mut sqe = Sqe::default();
        PropertyCmd {
            eight_bytes: eight,
            offset: off,
            value: 0,
        }
        .encode(&mut sqe, false);
        let c = self.cmd(&mut sqe, &[]).1;
        assert!(c.status().is_success());
        u64::from(c.dw0) | u64::from(c.dw1) << 32
    }

    pub fn prop_set(&mut self, off: u32, v: u64) {
        let mut sqe = Sqe::default();
        PropertyCmd {
            eight_bytes: false,
            offset: off,
            value: v,
        }
        .encode(&mut sqe, true);
        assert!(self.cmd(&mut sqe, &[]).1.status().is_success());
    }

    /// Admin queue: connect, enable, set number of queues; returns cntlid.
    pub fn admin(port: u16, dg: Digests) -> (Client, u16) {
        let mut c = Client::connect_raw(port, dg);
        let r = c.fabrics_connect(0, 0xffff, NQN, HOSTNQN);
        assert!(r.status().is_success(), "{}", r.status());
        let cntlid = r.dw0 as u16;
        c.prop_set(prop::CC, 1 | 6 << 16 | 4 << 20);
        assert_eq!(c.prop_get(prop::CSTS, false) & 1, 1);
        let mut sqe = Sqe::default();
        sqe.set_opcode(admin::SET_FEATURES)
            .set_cdw(10, 7)
            .set_cdw(11, 15 | 15 << 16);
        assert!(c.cmd(&mut sqe, &[]).1.status().is_success());
        (c, cntlid)
    }

    pub fn io_queue(port: u16, dg: Digests, cntlid: u16, qid: u16) -> Client {
        let mut c = Client::connect_raw(port, dg);
        let r = c.fabrics_connect(qid, cntlid, NQN, HOSTNQN);
        assert!(r.status().is_success(), "{}", r.status());
        c
    }

    pub fn rw_sqe(op: u8, slba: u64, nlb: u32, incapsule: bool) -> Sqe {
        let mut s = Sqe::default();
        s.set_opcode(op)
            .set_nsid(1)
            .set_slba(slba)
            .set_cdw(12, nlb - 1);
        let len = nlb * 512;
        s.set_sgl(if incapsule {
            SglDesc::in_capsule(len)
        } else {
            SglDesc::transport(len)
        });
        s
    }

    /// Write through R2T/H2CData, split by maxh2cdata.
    pub fn write_r2t(&mut self, slba: u64, data: &[u8]) -> Cqe {
        let mut sqe = Client::rw_sqe(io::WRITE, slba, (data.len() / 512) as u32, false);
        let cid = self.next_cid();
        sqe.set_cid(cid).set_sgl_psdt();
        self.send_cmd(&sqe, &[]);
        let p = self.recv().unwrap();
        if p.ty == PduType::CapsuleResp as u8 {
            return p.cqe();
        }
        assert_eq!(p.ty, PduType::R2T as u8, "{p:?}");
        let r = DataHdr::decode(&p.hdr).unwrap();
        assert_eq!((r.cccid, r.offset, r.length as usize), (cid, 0, data.len()));
        let mut off = 0;
        while off < data.len() {
            let n = (data.len() - off).min(self.maxh2c as usize);
            self.send_h2c(
                cid,
                r.ttag,
                off as u32,
                &data[off..off + n],
                off + n == data.len(),
            );
            off += n;
        }
        self.wait(cid).1
    }

    pub fn read(&mut self, slba: u64, nlb: u32) -> (Vec<u8>, Cqe) {
        let mut sqe = Client::rw_sqe(io::READ, slba, nlb, false);
        self.cmd(&mut sqe, &[])
    }
}

pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A Fabrics Connect command and its data (KATO 10 s on the admin queue,
/// host ID 7s), for any raw client.
pub fn connect_capsule(
    qid: u16,
    cntlid: u16,
    sqsize: u16,
    cattr: u8,
    subnqn: &str,
    hostnqn: &str,
) -> (Sqe, [u8; CONNECT_DATA_LEN]) {
    let mut sqe = Sqe::default();
    ConnectCmd {
        recfmt: 0,
        qid,
        sqsize,
        cattr,
        kato_ms: if qid == 0 { 10_000 } else { 0 },
    }
    .encode(&mut sqe);
    sqe.set_sgl(SglDesc::in_capsule(CONNECT_DATA_LEN as u32));
    let mut d = [0u8; CONNECT_DATA_LEN];
    ConnectData {
        hostid: [7; 16],
        cntlid,
        subnqn: subnqn.into(),
        hostnqn: hostnqn.into(),
    }
    .encode(&mut d);
    (sqe, d)
}

/// A runtime of two unpinned adaptive reactors (cores 0 and 1).
pub fn two_reactors() -> Runtime {
    let cfg = RuntimeConfig {
        cores: vec![0, 1],
        pin: false,
        poll_mode: PollMode::Adaptive,
        ..RuntimeConfig::default()
    };
    Runtime::start(cfg).expect("runtime")
}

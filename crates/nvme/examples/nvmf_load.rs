//! Load generator for the target's LANoT coalescer: the target runs on one
//! reactor (core 0) with a malloc namespace; a pipelined NVMe/TCP client on
//! a plain thread keeps QD 4 KiB reads (or writes) in flight on one I/O
//! queue. Prints IOPS, average latency and the target's sendmsg per I/O.
//!
//! `cargo run --release -p ustor-nvme --example nvmf_load -- MODE QD SECS [read|write]`
//! with MODE = off | fixed | adaptive.

use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use ustor_bdev::{modules, Registry};
use ustor_net::coalesce::{CoalesceConfig, Mode};
use ustor_nvme::nvmf::{
    AddNsParams, CreateSubsystemParams, CreateTransportParams, ListenAddress, ListenerParams,
    NamespaceParams, Target, TransportOpts,
};
use ustor_nvme::wire::*;
use ustor_runtime::{PollMode, Runtime, RuntimeConfig};

const NQN: &str = "nqn.2024-01.io.ustor:bench";
const HOST: &str = "nqn.2024-01.io.ustor:bench-host";

fn pdu(r: &mut impl Read) -> (u8, u8, Vec<u8>) {
    let mut ch = [0u8; 8];
    r.read_exact(&mut ch).unwrap();
    let c = CommonHeader::decode(&ch).unwrap();
    let mut rest = vec![0u8; c.plen as usize - 8];
    r.read_exact(&mut rest).unwrap();
    let mut all = ch.to_vec();
    all.extend_from_slice(&rest);
    (c.pdu_type, c.flags, all)
}

fn capsule(s: &mut TcpStream, sqe: &Sqe, data: &[u8]) {
    let mut h = [0u8; 80];
    let n = encode_capsule_cmd(&mut h, sqe, Digests::default(), data.len());
    let mut v = h[..n].to_vec();
    v.extend_from_slice(data);
    s.write_all(&v).unwrap();
}

fn sync_cmd(s: &mut TcpStream, r: &mut impl Read, sqe: &mut Sqe, data: &[u8]) -> Cqe {
    sqe.set_sgl_psdt();
    capsule(s, sqe, data);
    loop {
        let (ty, _, all) = pdu(r);
        if ty == PduType::CapsuleResp as u8 {
            return Cqe::decode(&all[8..]).unwrap();
        }
    }
}

fn connect(port: u16, qid: u16, cntlid: u16) -> (TcpStream, BufReader<TcpStream>, u16) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_nodelay(true).unwrap();
    let mut r = BufReader::with_capacity(1 << 20, s.try_clone().unwrap());
    let ic = IcReq {
        pfv: 0,
        hpda: 0,
        digests: Digests::default(),
        maxr2t: 0,
    };
    s.write_all(&ic.encode()).unwrap();
    let mut b = [0u8; 128];
    r.read_exact(&mut b).unwrap();
    let mut sqe = Sqe::default();
    ConnectCmd {
        recfmt: 0,
        qid,
        sqsize: 127,
        cattr: 0,
        kato_ms: 0,
    }
    .encode(&mut sqe);
    sqe.set_sgl(SglDesc::in_capsule(1024));
    let mut d = [0u8; 1024];
    ConnectData {
        hostid: [1; 16],
        cntlid,
        subnqn: NQN.into(),
        hostnqn: HOST.into(),
    }
    .encode(&mut d);
    let c = sync_cmd(&mut s, &mut r, &mut sqe, &d);
    assert!(c.status().is_success(), "{}", c.status());
    (s, r, c.dw0 as u16)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = match args.get(1).map(String::as_str).unwrap_or("adaptive") {
        "off" => Mode::Off,
        "fixed" => Mode::Fixed,
        _ => Mode::Adaptive,
    };
    let qd: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(32);
    let secs: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(3);
    let write = args.get(4).map(String::as_str) == Some("write");
    let rt = Runtime::start(RuntimeConfig {
        cores: vec![0],
        pin: true,
        poll_mode: PollMode::Poll,
        ..RuntimeConfig::default()
    })
    .unwrap();
    let reg = Registry::new(Some(rt.handle()));
    modules::malloc::create(
        &reg,
        modules::RamOpts {
            name: "Malloc0".into(),
            num_blocks: 262144,
            block_size: 512,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .unwrap();
    let t = Target::new(rt.handle(), reg);
    let coalesce = CoalesceConfig {
        mode,
        degree: 8,
        timer_us: 20,
        ..Default::default()
    };
    t.nvmf_create_transport(&CreateTransportParams {
        trtype: "TCP".into(),
        opts: TransportOpts {
            coalesce,
            ..Default::default()
        },
    })
    .unwrap();
    t.nvmf_create_subsystem(&CreateSubsystemParams {
        nqn: NQN.into(),
        serial_number: "BENCH".into(),
        model_number: "ustor bench".into(),
        allow_any_host: true,
        max_namespaces: 1,
        min_cntlid: 1,
        max_cntlid: 0xffef,
    })
    .unwrap();
    t.nvmf_subsystem_add_ns(&AddNsParams {
        nqn: NQN.into(),
        namespace: NamespaceParams {
            bdev_name: "Malloc0".into(),
            nsid: 1,
            uuid: None,
            nguid: None,
        },
    })
    .unwrap();
    let l = t
        .nvmf_subsystem_add_listener(&ListenerParams {
            nqn: NQN.into(),
            listen_address: ListenAddress {
                trtype: "TCP".into(),
                adrfam: "IPv4".into(),
                traddr: "127.0.0.1".into(),
                trsvcid: "0".into(),
            },
        })
        .unwrap();
    let port: u16 = l.trsvcid.parse().unwrap();
    let (mut a, mut ar, cntlid) = connect(port, 0, 0xffff);
    let mut cc = Sqe::default();
    PropertyCmd {
        eight_bytes: false,
        offset: prop::CC,
        value: 1 | 6 << 16 | 4 << 20,
    }
    .encode(&mut cc, true);
    sync_cmd(&mut a, &mut ar, &mut cc, &[]);
    let mut nq = Sqe::default();
    nq.set_opcode(admin::SET_FEATURES)
        .set_cdw(10, 7)
        .set_cdw(11, 0);
    sync_cmd(&mut a, &mut ar, &mut nq, &[]);
    let (mut s, mut r, _) = connect(port, 1, cntlid);

    let data = vec![0x5au8; 4096];
    let mut started = vec![Instant::now(); qd];
    let issue = |s: &mut TcpStream, cid: u16, i: u64| {
        let lba = (i * 8 * 7919) % (262144 - 8);
        let mut sqe = Sqe::default();
        sqe.set_opcode(if write { 2 - 1 } else { 2 })
            .set_nsid(1)
            .set_slba(lba)
            .set_cdw(12, 7)
            .set_cid(cid)
            .set_sgl_psdt();
        if write {
            sqe.set_sgl(SglDesc::in_capsule(4096));
            capsule(s, &sqe, &data);
        } else {
            sqe.set_sgl(SglDesc::transport(4096));
            capsule(s, &sqe, &[]);
        }
    };
    let before = t.nvmf_get_stats().unwrap().poll_groups[0].clone();
    let t0 = Instant::now();
    let mut n: u64 = 0;
    let mut lat_ns: u128 = 0;
    for (cid, st) in started.iter_mut().enumerate() {
        *st = Instant::now();
        issue(&mut s, cid as u16, n + cid as u64);
    }
    let mut issued = qd as u64;
    let end = t0 + Duration::from_secs(secs);
    loop {
        let (ty, fl, all) = pdu(&mut r);
        let cid = if ty == PduType::CapsuleResp as u8 {
            Cqe::decode(&all[8..]).unwrap().cid
        } else if ty == PduType::C2HData as u8 && fl & flags::SUCCESS != 0 {
            DataHdr::decode(&all).unwrap().cccid
        } else {
            continue;
        };
        n += 1;
        lat_ns += started[cid as usize].elapsed().as_nanos();
        if Instant::now() < end {
            started[cid as usize] = Instant::now();
            issue(&mut s, cid, issued);
            issued += 1;
        } else if n == issued {
            break;
        }
    }
    let el = t0.elapsed().as_secs_f64();
    let after = t.nvmf_get_stats().unwrap().poll_groups[0].clone();
    let sends = after.sendmsg_calls - before.sendmsg_calls;
    println!(
        "mode={:?} qd={} rw={} iops={:.0} avg_lat_us={:.1} sendmsg_per_io={:.3} degree={} timer_us={} full={} small={} timer={}",
        mode,
        qd,
        if write { "write" } else { "read" },
        n as f64 / el,
        lat_ns as f64 / n as f64 / 1000.0,
        sends as f64 / n as f64,
        after.coalesce.degree,
        after.coalesce.timer_us,
        after.coalesce.full_groups - before.coalesce.full_groups,
        after.coalesce.small_groups - before.coalesce.small_groups,
        after.coalesce.timer_expiries - before.coalesce.timer_expiries,
    );
    drop(s);
    drop(a);
}

//! A load client for one iSCSI session of several connections (MC/S),
//! which libiscsi's iscsi-perf and open-iscsi do not do:
//! `cargo run -p ustor-iscsi-target --example mcs_client -- PORT CONNS QD
//! SECONDS` logs in to `iqn.2016-06.io.spdk:disk1` on 127.0.0.1:PORT with
//! CONNS connections in one session (MaxConnections=CONNS), then keeps QD
//! 4 KiB random READs outstanding on each connection (one thread each,
//! CmdSN shared by the session) for SECONDS and prints
//! `conns=N qd=Q iops=X`. The session's window (the node's queue depth)
//! must hold CONNS x QD commands.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ustor_iscsi::wire::{build, encode_text, opcode, pad4, Bhs, BHS_LEN};

const NODE: &str = "iqn.2016-06.io.spdk:disk1";
const ISID: [u8; 6] = [0x80, 0, 0, 0, 0x4d, 0x43];

fn pdu(mut b: Bhs, data: &[u8]) -> Vec<u8> {
    b.set_data_len(data.len());
    let mut v = b.0.to_vec();
    v.extend_from_slice(data);
    v.resize(BHS_LEN + pad4(data.len()), 0);
    v
}

fn recv(s: &mut TcpStream, data: &mut Vec<u8>) -> std::io::Result<Bhs> {
    let mut h = [0u8; BHS_LEN];
    s.read_exact(&mut h)?;
    let b = Bhs(h);
    data.resize(pad4(b.data_len()), 0);
    s.read_exact(data)?;
    Ok(b)
}

/// One connection of session `tsih` (0: the leading login); its TSIH.
fn login(port: u16, tsih: u16, cid: u16, conns: usize) -> (TcpStream, u16) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mc = conns.to_string();
    let keys = [
        ("InitiatorName", "iqn.2026-11.io.ustor:mcs-client"),
        ("TargetName", NODE),
        ("SessionType", "Normal"),
        ("MaxConnections", mc.as_str()),
        ("ImmediateData", "Yes"),
    ];
    let mut b = build::login(ISID, tsih, 0x100 + cid as u32, 1, 0, 1, 3, true);
    b.set_u16(20, cid);
    s.write_all(&pdu(b, &encode_text(&keys))).expect("login");
    let mut d = Vec::new();
    let r = recv(&mut s, &mut d).expect("login response");
    assert_eq!(r.opcode(), opcode::LOGIN_RESP);
    assert_eq!((r.u8_at(36), r.u8_at(37)), (0, 0), "login refused");
    (s, r.u16_at(14))
}

/// A 4 KiB READ(10) of 512-byte block `lba`.
fn read(itt: u32, cmdsn: u32, lba: u32) -> Vec<u8> {
    let mut cdb = [0u8; 10];
    cdb[0] = 0x28;
    cdb[2..6].copy_from_slice(&lba.to_be_bytes());
    cdb[7..9].copy_from_slice(&8u16.to_be_bytes());
    pdu(
        build::scsi_cmd([0; 8], itt, &cdb, true, false, 4096, cmdsn, 0),
        &[],
    )
}

/// Keeps `qd` READs outstanding on `s` until `stop`; counts completions.
/// Gives the socket back: closing one connection without a logout ends
/// the session (ERL 0), so none closes before all have drained.
fn drive(
    mut s: TcpStream,
    qd: u32,
    cmdsn: &AtomicU32,
    stop: &AtomicBool,
    done: &AtomicU64,
) -> TcpStream {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ s.local_addr().map_or(0, |a| a.port() as u64);
    let mut next_lba = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        ((rng >> 16) % (64 << 11) / 8 * 8) as u32
    };
    let mut itt = 0u32;
    let mut send = |s: &mut TcpStream| {
        itt = itt.wrapping_add(1);
        let n = cmdsn.fetch_add(1, Ordering::Relaxed);
        s.write_all(&read(itt, n, next_lba())).expect("send");
    };
    for _ in 0..qd {
        send(&mut s);
    }
    let mut data = Vec::with_capacity(8192);
    let mut outstanding = qd;
    while outstanding > 0 {
        let b = recv(&mut s, &mut data).expect("receive");
        let last = match b.opcode() {
            opcode::DATA_IN => b.flags() & 0x01 != 0,
            opcode::SCSI_RESP => true,
            _ => false,
        };
        if !last {
            continue;
        }
        done.fetch_add(1, Ordering::Relaxed);
        outstanding -= 1;
        if !stop.load(Ordering::Relaxed) {
            send(&mut s);
            outstanding += 1;
        }
    }
    s
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: u64| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let port = arg(1, 3260) as u16;
    let conns = arg(2, 2).max(1) as usize;
    let qd = arg(3, 16).max(1) as u32;
    let secs = arg(4, 5);
    let (first, tsih) = login(port, 0, 0, conns);
    let mut socks = vec![first];
    for cid in 1..conns {
        socks.push(login(port, tsih, cid as u16, conns).0);
    }
    // The logins did not advance CmdSN: the first command has CmdSN 1.
    let cmdsn = Arc::new(AtomicU32::new(1));
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let threads: Vec<_> = socks
        .into_iter()
        .map(|s| {
            let (c, st, d) = (cmdsn.clone(), stop.clone(), done.clone());
            std::thread::spawn(move || drive(s, qd, &c, &st, &d))
        })
        .collect();
    std::thread::sleep(Duration::from_secs(secs));
    let n = done.load(Ordering::Relaxed);
    let el = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let socks: Vec<TcpStream> = threads
        .into_iter()
        .map(|t| t.join().expect("client thread"))
        .collect();
    drop(socks);
    println!("conns={conns} qd={qd} iops={:.0}", n as f64 / el);
}

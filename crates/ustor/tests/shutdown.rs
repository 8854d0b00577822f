//! SIGTERM stops every target: a `ustor serve` with an NBD client writing
//! (requests in flight) and an NVMe/TCP host (`ustor bench` through the
//! initiator) writing gets SIGTERM, exits 0 in bounded time, reports both
//! targets stopped, and every write the NBD client saw acknowledged is in
//! the backing file afterwards.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use ustor_nbd::wire::{client_flags, cmd, opt, IHAVEOPT, NBD_MAGIC, REQUEST_MAGIC};

const NQN: &str = "nqn.2026-11.io.ustor:shutdown";
const BLOCK: usize = 4096;
/// Distinct 4 KiB slots the NBD client writes (one write each).
const SLOTS: u64 = 32768;

fn disk(dir: &Path, name: &str) -> String {
    let p = dir.join(name);
    std::fs::File::create(&p)
        .unwrap()
        .set_len(SLOTS * BLOCK as u64)
        .unwrap();
    p.to_str().unwrap().to_string()
}

fn config(nbd_file: &str, nvme_file: &str) -> Value {
    json!({"subsystems": [
        {"subsystem": "bdev", "config": [
            {"method": "bdev_uring_create", "params": {"name": "D0", "filename": nbd_file, "direct": false}},
            {"method": "bdev_uring_create", "params": {"name": "D1", "filename": nvme_file, "direct": false}}
        ]},
        {"subsystem": "nbd", "config": [
            {"method": "nbd_server_start", "params": {"listen_address": {"traddr": "127.0.0.1", "trsvcid": "0"}}},
            {"method": "nbd_export_create", "params": {"name": "D0", "bdev_name": "D0"}}
        ]},
        {"subsystem": "nvmf", "config": [
            {"method": "nvmf_create_transport", "params": {"trtype": "TCP"}},
            {"method": "nvmf_create_subsystem", "params": {"nqn": NQN, "allow_any_host": true}},
            {"method": "nvmf_subsystem_add_ns", "params": {"nqn": NQN, "namespace": {"bdev_name": "D1"}}},
            {"method": "nvmf_subsystem_add_listener", "params": {"nqn": NQN,
                "listen_address": {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": "0"}}}
        ]}
    ]})
}

fn nvmf_port(s: &Server) -> u16 {
    let subs = s.ok("nvmf_get_subsystems", Value::Null);
    subs.as_array()
        .unwrap()
        .iter()
        .find(|x| x["nqn"] == NQN)
        .and_then(|x| x["listen_addresses"][0]["trsvcid"].as_str())
        .and_then(|p| p.parse().ok())
        .expect("nvmf listener bound")
}

fn write_ops(s: &Server, bdev: &str) -> u64 {
    let v = s.ok("bdev_get_iostat", json!({"name": bdev}));
    v["bdevs"][0]["num_write_ops"].as_u64().unwrap_or(0)
}

/// The data written to slot `i`.
fn block(i: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|j| (i.wrapping_mul(31) as usize ^ j.wrapping_mul(7)) as u8)
        .collect()
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

/// Connects to export `name` (fixed newstyle, NBD_OPT_EXPORT_NAME).
fn nbd_connect(port: u16, name: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_nodelay(true).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    assert_eq!(be64(&greeting), NBD_MAGIC);
    assert_eq!(be64(&greeting[8..]), IHAVEOPT);
    let flags = client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES;
    s.write_all(&flags.to_be_bytes()).unwrap();
    let mut o = Vec::new();
    o.extend_from_slice(&IHAVEOPT.to_be_bytes());
    o.extend_from_slice(&opt::EXPORT_NAME.to_be_bytes());
    o.extend_from_slice(&(name.len() as u32).to_be_bytes());
    o.extend_from_slice(name.as_bytes());
    s.write_all(&o).unwrap();
    let mut r = [0u8; 10];
    s.read_exact(&mut r).unwrap();
    s
}

/// Writes slot after slot (cookie = slot) without waiting for replies,
/// until the server goes away or every slot is sent.
fn nbd_writer(mut s: TcpStream, stop: Arc<AtomicBool>) {
    for i in 0..SLOTS {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let mut h = Vec::with_capacity(28 + BLOCK);
        h.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        h.extend_from_slice(&0u16.to_be_bytes());
        h.extend_from_slice(&cmd::WRITE.to_be_bytes());
        h.extend_from_slice(&i.to_be_bytes());
        h.extend_from_slice(&(i * BLOCK as u64).to_be_bytes());
        h.extend_from_slice(&(BLOCK as u32).to_be_bytes());
        h.extend_from_slice(&block(i));
        if s.write_all(&h).is_err() {
            return;
        }
    }
}

/// Collects the cookies of successful write replies until EOF; returns
/// the errors of the others.
fn nbd_reader(mut s: TcpStream, acked: Arc<Mutex<Vec<u64>>>) -> Vec<u32> {
    let mut r = [0u8; 16];
    let mut errors = Vec::new();
    while s.read_exact(&mut r).is_ok() {
        match u32::from_be_bytes(r[4..8].try_into().unwrap()) {
            0 => acked.lock().unwrap().push(be64(&r[8..])),
            e => errors.push(e),
        }
    }
    errors
}

fn initiator_config(dir: &Path, port: u16) -> std::path::PathBuf {
    let cfg = json!({"subsystems": [{"subsystem": "bdev", "config": [
        {"method": "bdev_nvme_attach_controller", "params": {
            "name": "Nvme0", "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1",
            "trsvcid": port.to_string(), "subnqn": NQN}}
    ]}]});
    let path = dir.join("initiator.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    path
}

/// Waits for `what`, at most `limit`.
#[track_caller]
fn wait_for(what: &str, limit: Duration, cond: impl FnMut() -> bool) {
    testkit::wait_until(what, limit, cond);
}

#[test]
fn sigterm_drains_and_stops_every_target_with_io_in_flight() {
    let dir = tmpdir("shutdown");
    let (f0, f1) = (disk(&dir, "nbd.img"), disk(&dir, "nvme.img"));
    let mut s = Server::start(&dir, &config(&f0, &f1), &[]);
    let (nbd_port, nvme_port) = (s.nbd_port(), nvmf_port(&s));

    // The NVMe/TCP host: a bench process writing through the initiator.
    let cfg = initiator_config(&dir, nvme_port);
    let mut bench = Command::new(BIN)
        .args(["bench", "--no-pin", "--cores", "1", "-b", "Nvme0n1"])
        .args(["-w", "randwrite", "-t", "60", "-q", "8", "-c"])
        .arg(&cfg)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn ustor bench");
    wait_for("NVMe/TCP writes", Duration::from_secs(20), || {
        write_ops(&s, "D1") > 0
    });

    // The NBD client: writes in flight all the time.
    let sock = nbd_connect(nbd_port, "D0");
    let acked = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (r, a) = (sock.try_clone().unwrap(), acked.clone());
        std::thread::spawn(move || nbd_reader(r, a))
    };
    let writer = {
        let st = stop.clone();
        std::thread::spawn(move || nbd_writer(sock, st))
    };
    wait_for("NBD write replies", Duration::from_secs(20), || {
        acked.lock().unwrap().len() >= 64
    });
    let acked_before = acked.lock().unwrap().len() as u64;

    // SAFETY: kill(2) on the PID of our own child.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let status = testkit::wait_for(
        "ustor serve to exit after SIGTERM",
        Duration::from_secs(20),
        || s.child.try_wait().unwrap(),
    );
    let mut out = String::new();
    s.child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    s.child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    eprintln!("{out}");
    assert_eq!(status.code(), Some(0), "{out}");
    assert!(out.contains("ustor: target nbd stopped"), "{out}");
    assert!(out.contains("ustor: target nvmf stopped"), "{out}");
    assert!(out.contains("stopped cleanly"), "{out}");

    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let errors = reader.join().unwrap();
    // Writes that arrived after the drain began were refused with NBD's
    // ESHUTDOWN (108), never executed; nothing else failed.
    assert!(
        errors.iter().all(|&e| e == 108),
        "writes failed otherwise: {errors:?}"
    );
    // SAFETY: kill(2) on the PID of our own child.
    unsafe { libc::kill(bench.id() as i32, libc::SIGKILL) };
    let _ = bench.wait();

    // Every acknowledged write is in the file.
    let data = std::fs::read(&f0).unwrap();
    let acked = acked.lock().unwrap();
    eprintln!(
        "{} NBD writes acknowledged, {acked_before} before SIGTERM, {} refused (ESHUTDOWN)",
        acked.len(),
        errors.len()
    );
    assert!(acked_before < SLOTS, "every write was done before SIGTERM");
    let bad: Vec<u64> = acked
        .iter()
        .copied()
        .filter(|&i| {
            let at = i as usize * BLOCK;
            data[at..at + BLOCK] != block(i)[..]
        })
        .collect();
    assert!(bad.is_empty(), "acknowledged writes missing: {bad:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

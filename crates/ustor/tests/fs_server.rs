//! The file service's TCP server in a real `ustor serve` process, started
//! from config (`fs_create`, `fs_export`), driven by a raw client speaking
//! the wire protocol (crates/fs/src/proto.rs): the HMAC-SHA256 challenge
//! (a wrong secret refused with EACCES), pipelined creates, writes and
//! reads checked by checksum (holes read as zeros), `fs_get_stats` showing
//! no payload copied by us, malformed frames answered with their errno
//! before the connection closes, and the fs_* RPCs (save_config, delete);
//! the one-copy ablation (`copy_writes`) counts every byte it copies;
//! commits and metadata changes run on the reactor for a region in memory
//! (/dev/shm) and on the sync pool for one that can fault, and either way
//! fsync'ed data survives a SIGKILL.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;
use ustor_fs::proto::{self, encode_request, Op, Request, HEADER_LEN, NONCE_LEN};
use ustor_fs::ROOT_INO;

const SECRET: &str = "correct horse battery staple";

struct Frame {
    op: u8,
    /// Header byte 5: a read reply's padding.
    flags: u8,
    tag: u64,
    errno: u64,
    body: Vec<u8>,
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<Frame> {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h)?;
    let len = u32::from_le_bytes(h[0..4].try_into().unwrap()) as usize;
    let mut body = vec![0; len];
    s.read_exact(&mut body)?;
    Ok(Frame {
        op: h[4],
        flags: h[5],
        tag: u64::from_le_bytes(h[8..16].try_into().unwrap()),
        errno: u64::from_le_bytes(h[16..24].try_into().unwrap()),
        body,
    })
}

/// Connects and runs Hello/Auth; returns the socket and the Auth errno.
fn connect(port: u16, export: &str, secret: &str) -> (TcpStream, u64) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let cn = [7u8; NONCE_LEN];
    let hello = Request::Hello {
        nonce: cn,
        export: export.as_bytes(),
    };
    s.write_all(&encode_request(1, 0, &hello)).unwrap();
    let f = read_frame(&mut s).unwrap();
    assert_eq!((f.op, f.tag), (Op::Hello as u8, 1));
    if f.errno != 0 {
        return (s, f.errno);
    }
    let mut m = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    m.update(&cn);
    m.update(&f.body[..NONCE_LEN]);
    let mac: [u8; NONCE_LEN] = m.finalize().into_bytes().into();
    s.write_all(&encode_request(2, 0, &Request::Auth { mac }))
        .unwrap();
    let f = read_frame(&mut s).unwrap();
    assert_eq!((f.op, f.tag), (Op::Auth as u8, 2));
    (s, f.errno)
}

fn ino_of(attr: &[u8]) -> u64 {
    u64::from_le_bytes(attr[0..8].try_into().unwrap())
}

fn size_of(attr: &[u8]) -> u64 {
    u64::from_le_bytes(attr[8..16].try_into().unwrap())
}

/// The peer closed: a read returns 0 bytes.
fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0))
}

#[test]
fn tcp_server_zero_copy_auth_and_rpcs() {
    let dir = tmpdir("fs-server");
    let region = dir.join("region");
    let cfg = json!({"subsystems": [{"subsystem": "fs", "config": [
        {"method": "fs_create", "params": {"name": "vol", "path": region.to_str().unwrap(), "size": 64u64 << 20}},
        {"method": "fs_export", "params": {"name": "vol", "listen": "127.0.0.1:0", "secret": SECRET}},
    ]}]});
    let srv = Server::start(&dir, &cfg, &[]);
    let ex = srv.ok("fs_get_exports", Value::Null);
    let listen = ex[0]["listen"].as_str().expect("exported").to_string();
    let port: u16 = listen.rsplit(':').next().unwrap().parse().unwrap();

    // A wrong secret and a wrong export name are refused.
    let (mut bad, e) = connect(port, "vol", "wrong");
    assert_eq!(e, libc::EACCES as u64);
    assert!(closed(&mut bad));
    let (_, e) = connect(port, "nope", SECRET);
    assert_eq!(e, libc::ENOENT as u64);
    // A request before authentication is refused.
    let mut pre = TcpStream::connect(("127.0.0.1", port)).unwrap();
    pre.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    pre.write_all(&encode_request(9, ROOT_INO, &Request::Getattr))
        .unwrap();
    assert_eq!(read_frame(&mut pre).unwrap().errno, libc::EACCES as u64);
    assert!(closed(&mut pre));

    let (mut s, e) = connect(port, "vol", SECRET);
    assert_eq!(e, 0);
    let create = Request::Create {
        mode: 0o644,
        uid: 0,
        gid: 0,
        name: b"data.bin",
    };
    s.write_all(&encode_request(10, ROOT_INO, &create)).unwrap();
    let f = read_frame(&mut s).unwrap();
    assert_eq!((f.tag, f.errno), (10, 0));
    let ino = ino_of(&f.body);

    // Pipelined writes: 1 MiB at 0, 5000 bytes at 1 MiB + 100 (a hole
    // before it), and 64 KiB pieces from 2 MiB on.
    let big = pseudo_random(1 << 20, 1);
    let small = pseudo_random(5000, 2);
    let pieces = pseudo_random(8 << 16, 3);
    let mut writes: Vec<(u64, &[u8])> = vec![(0, &big), ((1 << 20) + 100, &small)];
    for (k, c) in pieces.chunks(1 << 16).enumerate() {
        writes.push(((2 << 20) + (k << 16) as u64, c));
    }
    for (k, (off, d)) in writes.iter().enumerate() {
        let req = Request::Write {
            off: *off,
            len: d.len() as u32,
        };
        s.write_all(&encode_request(100 + k as u64, ino, &req))
            .unwrap();
        s.write_all(d).unwrap();
    }
    for _ in 0..writes.len() {
        let f = read_frame(&mut s).unwrap();
        assert_eq!(f.errno, 0, "write tag {}", f.tag);
        assert_eq!(f.op, Op::Write as u8);
    }
    let total = (2 << 20) + pieces.len() as u64;
    s.write_all(&encode_request(11, ino, &Request::Getattr))
        .unwrap();
    assert_eq!(size_of(&read_frame(&mut s).unwrap().body), total);

    // Read it all back in 256 KiB reads, pipelined.
    let mut want = vec![0u8; total as usize];
    for (off, d) in &writes {
        want[*off as usize..*off as usize + d.len()].copy_from_slice(d);
    }
    let chunk = 256 << 10;
    let n = (total as usize).div_ceil(chunk);
    for k in 0..n {
        let req = Request::Read {
            off: (k * chunk) as u64,
            len: chunk as u32,
        };
        s.write_all(&encode_request(1000 + k as u64, ino, &req))
            .unwrap();
    }
    let mut got = vec![0u8; total as usize];
    for _ in 0..n {
        let f = read_frame(&mut s).unwrap();
        assert_eq!(f.errno, 0);
        let at = (f.tag - 1000) as usize * chunk;
        got[at..at + f.body.len()].copy_from_slice(&f.body);
    }
    assert_eq!(sha256(&got), sha256(&want));

    let st = srv.ok("fs_get_stats", json!({"name": "vol"}));
    let st = &st[0];
    assert_eq!(st["copied_bytes"], 0, "{st}");
    let written: usize = writes.iter().map(|w| w.1.len()).sum();
    assert_eq!(st["bytes_written"], written as u64, "{st}");
    assert_eq!(st["bytes_read"], total, "{st}");
    assert_eq!(st["auth_failures"], 1, "{st}");

    // A read asking for aligned data (FLAG_ALIGN): the reply pads the
    // data to start READ_DATA_AT bytes into the frame, and says by how
    // much; a read without the flag is not padded.
    let req = Request::Read {
        off: 4096,
        len: chunk as u32,
    };
    let mut f = encode_request(30, ino, &req);
    f[5] = proto::FLAG_ALIGN;
    s.write_all(&f).unwrap();
    let r = read_frame(&mut s).unwrap();
    let pad = proto::READ_DATA_AT - HEADER_LEN;
    assert_eq!((r.errno, r.flags as usize), (0, pad));
    assert_eq!(r.body.len(), pad + chunk);
    assert!(r.body[..pad].iter().all(|&b| b == 0));
    assert_eq!(sha256(&r.body[pad..]), sha256(&want[4096..4096 + chunk]));
    s.write_all(&encode_request(31, ino, &req)).unwrap();
    let r = read_frame(&mut s).unwrap();
    assert_eq!((r.errno, r.flags, r.body.len()), (0, 0, chunk));

    // Malformed frames: answered with their errno, then the connection
    // closes. Oversize body, unknown op, a name of length 0.
    let mut oversize = encode_request(20, ROOT_INO, &Request::Getattr);
    oversize[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
    let mut unknown = encode_request(21, ROOT_INO, &Request::Getattr);
    unknown[4] = 200;
    let mut empty_name = encode_request(22, ROOT_INO, &Request::Lookup { name: b"x" });
    empty_name[HEADER_LEN..HEADER_LEN + 2].copy_from_slice(&0u16.to_le_bytes());
    for (frame, errno) in [
        (oversize, libc::EMSGSIZE),
        (unknown, libc::ENOSYS),
        (empty_name, libc::EINVAL),
    ] {
        let (mut c, e) = connect(port, "vol", SECRET);
        assert_eq!(e, 0);
        c.write_all(&frame).unwrap();
        let f = read_frame(&mut c).unwrap();
        assert_eq!(f.errno, errno as u64);
        assert!(closed(&mut c));
    }

    // The config dump recreates the volume and its export.
    let cfg = srv.ok("framework_get_config", json!({"name": "fs"}));
    let methods: Vec<&str> = cfg
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["method"].as_str().unwrap())
        .collect();
    assert_eq!(methods, ["fs_create", "fs_export"]);
    // Deleting is refused while a client is connected, then allowed.
    let e = srv.call("fs_delete", json!({"name": "vol"})).unwrap_err();
    assert_eq!(e.code, -libc::EBUSY, "{e:?}");
    drop(s);
    testkit::wait_until("the client gone", Duration::from_secs(10), || {
        srv.ok("fs_get_exports", Value::Null)[0]["connections"] == 0
    });
    srv.ok("fs_delete", json!({"name": "vol"}));
    assert_eq!(srv.ok("fs_get_exports", Value::Null), json!([]));
    let e = srv.call("fs_delete", json!({"name": "vol"})).unwrap_err();
    assert_eq!(e.code, -libc::ENODEV);
    // Recreated from the same region: the data is still there.
    srv.ok(
        "fs_create",
        json!({"name": "vol", "path": region.to_str().unwrap()}),
    );
    let a = srv.ok(
        "fs_export",
        json!({"name": "vol", "listen": "127.0.0.1:0", "secret": SECRET}),
    );
    let port: u16 = a["listen"]
        .as_str()
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let (mut s, e) = connect(port, "vol", SECRET);
    assert_eq!(e, 0);
    let req = Request::Read {
        off: 0,
        len: 1 << 20,
    };
    s.write_all(&encode_request(5, ino, &req)).unwrap();
    assert_eq!(sha256(&read_frame(&mut s).unwrap().body), sha256(&big));
    // A client that vanishes mid-write: its planned blocks go back, the
    // next client writes and reads as usual.
    let req = Request::Write {
        off: 4 << 20,
        len: 1 << 20,
    };
    s.write_all(&encode_request(6, ino, &req)).unwrap();
    s.write_all(&big[..1000]).unwrap();
    drop(s);
    let ex = || srv.ok("fs_get_exports", Value::Null)[0]["connections"].clone();
    testkit::wait_until("the writer gone", Duration::from_secs(10), || ex() == 0);
    let (mut s, _) = connect(port, "vol", SECRET);
    s.write_all(&encode_request(7, ino, &Request::Getattr))
        .unwrap();
    assert_eq!(size_of(&read_frame(&mut s).unwrap().body), total);
    drop(s);

    // A read-only export with a cap of one connection: writes refused with
    // EROFS (the payload skipped, the connection goes on), reads served,
    // a second connection closed at once.
    let ro = dir.join("ro");
    srv.ok(
        "fs_create",
        json!({"name": "ro", "path": ro.to_str().unwrap(), "size": 8u64 << 20}),
    );
    let a = srv.ok(
        "fs_export",
        json!({"name": "ro", "listen": "127.0.0.1:0", "read_only": true, "max_connections": 1}),
    );
    let rport: u16 = a["listen"]
        .as_str()
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let (mut r, e) = connect(rport, "ro", "");
    assert_eq!(e, 0, "no secret: any answer passes");
    let mut second = TcpStream::connect(("127.0.0.1", rport)).unwrap();
    second
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    assert!(closed(&mut second));
    r.write_all(&encode_request(1, ROOT_INO, &create)).unwrap();
    assert_eq!(read_frame(&mut r).unwrap().errno, libc::EROFS as u64);
    let req = Request::Write { off: 0, len: 4096 };
    r.write_all(&encode_request(2, ROOT_INO, &req)).unwrap();
    r.write_all(&[0u8; 4096]).unwrap();
    let f = read_frame(&mut r).unwrap();
    assert_eq!((f.tag, f.errno), (2, libc::EROFS as u64));
    r.write_all(&encode_request(3, ROOT_INO, &Request::Statfs))
        .unwrap();
    let f = read_frame(&mut r).unwrap();
    assert_eq!((f.tag, f.errno), (3, 0));
    drop(r);

    let (code, out) = srv.stop();
    assert_eq!(code, 0, "{out}");
    // The region is consistent after the server is gone.
    let c = std::process::Command::new(BIN)
        .args(["fs", "check", region.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
}

/// Sends `frames` in one write and collects one reply per tag, in the
/// order they come back.
fn pipeline(s: &mut TcpStream, frames: &[Vec<u8>]) -> Vec<Frame> {
    s.write_all(&frames.concat()).unwrap();
    (0..frames.len()).map(|_| read_frame(s).unwrap()).collect()
}

/// Two clients at once, each with many requests in flight on its
/// connection: one pipelines directory creations (committed on the sync
/// pool), writes to one file (each planned on top of the previous one's
/// commit) and getattrs; the other pipelines reads of its own file. Every
/// tag is answered once, in whatever order requests finish; the data reads
/// back; no payload byte was copied; the server had more than one request
/// of a connection in flight.
#[test]
fn two_clients_many_requests_in_flight() {
    let dir = tmpdir("fs-server-two");
    let region = dir.join("region");
    let cfg = json!({"subsystems": [{"subsystem": "fs", "config": [
        {"method": "fs_create", "params": {"name": "vol", "path": region.to_str().unwrap(), "size": 64u64 << 20}},
        {"method": "fs_export", "params": {"name": "vol", "listen": "127.0.0.1:0", "secret": SECRET}},
    ]}]});
    let srv = Server::start(&dir, &cfg, &[]);
    let ex = srv.ok("fs_get_exports", Value::Null);
    let listen = ex[0]["listen"].as_str().unwrap().to_string();
    let port: u16 = listen.rsplit(':').next().unwrap().parse().unwrap();
    let create = |name: &'static [u8]| Request::Create {
        mode: 0o644,
        uid: 0,
        gid: 0,
        name,
    };
    let (mut a, _) = connect(port, "vol", SECRET);
    let (mut b, _) = connect(port, "vol", SECRET);
    let fa = ino_of(&pipeline(&mut a, &[encode_request(3, ROOT_INO, &create(b"a"))])[0].body);
    let fb = ino_of(&pipeline(&mut b, &[encode_request(3, ROOT_INO, &create(b"b"))])[0].body);
    let bdata = pseudo_random(1 << 20, 11);
    let mut w = encode_request(
        4,
        fb,
        &Request::Write {
            off: 0,
            len: 1 << 20,
        },
    );
    w.extend_from_slice(&bdata);
    assert_eq!(pipeline(&mut b, &[w])[0].errno, 0);

    let adata = pseudo_random(32 << 16, 12);
    let writer = std::thread::spawn(move || {
        let mut frames = Vec::new();
        for k in 0..32u64 {
            let name = format!("d{k}");
            let mkdir = Request::Mkdir {
                mode: 0o755,
                uid: 0,
                gid: 0,
                name: name.as_bytes(),
            };
            frames.push(encode_request(100 + k, ROOT_INO, &mkdir));
            let off = k << 16;
            let mut w = encode_request(200 + k, fa, &Request::Write { off, len: 1 << 16 });
            w.extend_from_slice(&adata[off as usize..(off as usize) + (1 << 16)]);
            frames.push(w);
            frames.push(encode_request(300 + k, ROOT_INO, &Request::Getattr));
        }
        let got = pipeline(&mut a, &frames);
        (a, got, adata)
    });
    let mut frames = Vec::new();
    for k in 0..64u64 {
        let req = Request::Read {
            off: k << 14,
            len: 1 << 14,
        };
        frames.push(encode_request(1000 + k, fb, &req));
    }
    let mut back = vec![0u8; 1 << 20];
    for f in pipeline(&mut b, &frames) {
        assert_eq!(f.errno, 0, "read tag {}", f.tag);
        let at = ((f.tag - 1000) << 14) as usize;
        back[at..at + f.body.len()].copy_from_slice(&f.body);
    }
    assert_eq!(sha256(&back), sha256(&bdata));
    let (mut a, got, adata) = writer.join().unwrap();
    let mut tags: Vec<u64> = got.iter().map(|f| f.tag).collect();
    let in_order = tags.windows(2).all(|w| w[0] < w[1]);
    assert!(got.iter().all(|f| f.errno == 0), "a request failed");
    tags.sort();
    let want: Vec<u64> = (0..32).flat_map(|k| [100 + k, 200 + k, 300 + k]).collect();
    let mut want_sorted = want.clone();
    want_sorted.sort();
    assert_eq!(tags, want_sorted, "every tag answered once");
    eprintln!("replies came back in request order: {in_order}");
    let half = |k: u64| {
        encode_request(
            8 + k,
            fa,
            &Request::Read {
                off: k << 20,
                len: 1 << 20,
            },
        )
    };
    let mut fs = pipeline(&mut a, &[half(0), half(1)]);
    fs.sort_by_key(|f| f.tag);
    assert_eq!(
        sha256(&[fs[0].body.clone(), fs[1].body.clone()].concat()),
        sha256(&adata)
    );
    let ls = pipeline(
        &mut a,
        &[encode_request(
            10,
            ROOT_INO,
            &Request::Readdir {
                cookie: 0,
                max: 100,
            },
        )],
    );
    let n = u32::from_le_bytes(ls[0].body[..4].try_into().unwrap());
    assert_eq!(n, 34, "32 directories and 2 files");

    let st = &srv.ok("fs_get_stats", json!({"name": "vol"}))[0];
    assert_eq!(st["copied_bytes"], 0, "{st}");
    assert!(st["max_requests_in_flight"].as_u64().unwrap() > 1, "{st}");
    drop((a, b));
    let (code, out) = srv.stop();
    assert_eq!(code, 0, "{out}");
    let c = std::process::Command::new(BIN)
        .args(["fs", "check", region.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The one-copy ablation (`copy_writes`, for bench/fs.sh): every payload
/// byte is received into a buffer and copied into the region, which
/// `copied_bytes` counts; the data is the same, and save_config keeps the
/// switch.
#[test]
fn one_copy_ablation_counts_every_byte_copied() {
    let dir = tmpdir("fs-server-copy");
    let region = dir.join("region");
    let cfg = json!({"subsystems": [{"subsystem": "fs", "config": [
        {"method": "fs_create", "params": {"name": "vol", "path": region.to_str().unwrap(), "size": 64u64 << 20}},
        {"method": "fs_export", "params": {"name": "vol", "listen": "127.0.0.1:0", "secret": SECRET,
            "copy_writes": true}},
    ]}]});
    let srv = Server::start(&dir, &cfg, &[]);
    let listen = srv.ok("fs_get_exports", Value::Null)[0]["listen"]
        .as_str()
        .unwrap()
        .to_string();
    let c = ustor_fs_client::Client::connect(ustor_fs_client::Config::new(
        &listen,
        "vol",
        SECRET.as_bytes(),
    ))
    .unwrap();
    let f = c.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
    // 3 MiB from 0 (1 MiB requests), then 1000 bytes at an odd offset.
    let data = pseudo_random(3 << 20, 5);
    c.write(f, 0, &data).unwrap();
    let odd = pseudo_random(1000, 6);
    c.write(f, 12_345, &odd).unwrap();
    let mut want = data.clone();
    want[12_345..13_345].copy_from_slice(&odd);
    assert_eq!(sha256(&c.read(f, 0, 3 << 20).unwrap()), sha256(&want));
    let st = &srv.ok("fs_get_stats", json!({"name": "vol"}))[0];
    assert_eq!(st["copied_bytes"], (3 << 20) + 1000, "{st}");
    assert_eq!(st["bytes_written"], (3 << 20) + 1000, "{st}");
    let cfg = srv.ok("framework_get_config", json!({"name": "fs"}));
    let ex = cfg
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["method"] == "fs_export")
        .unwrap();
    assert_eq!(ex["params"]["copy_writes"], true, "{cfg}");
    drop(c);
    let (code, out) = srv.stop();
    assert_eq!(code, 0, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// /dev/shm exists and takes a 16 MiB region (a container's default is
/// 64 MiB).
fn shm_usable() -> Result<(), String> {
    let d = std::path::Path::new("/dev/shm");
    if !d.is_dir() || ustor_fs::media::may_fault(d) {
        return Err("/dev/shm is not a tmpfs".into());
    }
    Ok(())
}

fn export_addr(srv: &Server, name: &str) -> String {
    let ex = srv.ok("fs_get_exports", Value::Null);
    let e = ex.as_array().unwrap().iter().find(|e| e["name"] == name);
    e.expect("exported")["listen"].as_str().unwrap().to_string()
}

/// A region in memory (/dev/shm, where msync does no I/O) has its write
/// commits and metadata changes run on the reactor (`requests_offloaded`
/// stays 0 at QD1: no trip to the sync pool and back); a region that can
/// fault has them on the pool. Either way 4 KiB writes, a setattr and an
/// fsync survive a SIGKILL of the server right after the fsync: the files
/// read back by checksum after the restart and `ustor fs check` is clean.
#[test]
fn commits_run_on_the_reactor_for_a_region_in_memory() {
    testkit::require!(shm_usable(), "/dev/shm as a tmpfs");
    let dir = tmpdir("fs-server-inline");
    let shm = std::path::PathBuf::from(format!("/dev/shm/ustor-fs-inline-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&shm);
    std::fs::create_dir_all(&shm).unwrap();
    let regions = [("mem", shm.join("region")), ("disk", dir.join("region"))];
    let mut calls = Vec::new();
    for (name, path) in &regions {
        calls.push(json!({"method": "fs_create", "params": {"name": name,
            "path": path.to_str().unwrap(), "size": 16u64 << 20}}));
        calls.push(json!({"method": "fs_export", "params": {"name": name,
            "listen": "127.0.0.1:0", "secret": SECRET}}));
    }
    let cfg = json!({"subsystems": [{"subsystem": "fs", "config": calls}]});
    let srv = Server::start(&dir, &cfg, &[]);
    let data = pseudo_random(64 * 4096, 11);
    for (name, path) in &regions {
        let cfg = ustor_fs_client::Config::new(&export_addr(&srv, name), name, SECRET.as_bytes());
        let c = ustor_fs_client::Client::connect(cfg).unwrap();
        let f = c.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
        for (i, d) in data.chunks(4096).enumerate() {
            c.write(f, i as u64 * 4096, d).unwrap();
        }
        let mode = ustor_fs::SetAttr {
            mode: Some(0o600),
            ..Default::default()
        };
        assert_eq!(c.setattr(f, &mode).unwrap().mode & 0o7777, 0o600);
        c.fsync(f).unwrap();
        assert_eq!(sha256(&c.read(f, 0, data.len()).unwrap()), sha256(&data));
        let st = &srv.ok("fs_get_stats", json!({"name": name}))[0];
        let off = st["requests_offloaded"].as_u64().unwrap();
        if ustor_fs::media::may_fault(path) {
            // create, 64 commits, setattr, fsync.
            assert!(off >= 67, "{name}: {st}");
        } else {
            assert_eq!(off, 0, "{name}: {st}");
        }
    }
    assert!(!ustor_fs::media::may_fault(&regions[0].1));
    srv.kill();
    let srv = Server::start(&dir, &cfg, &[]);
    for (name, _) in &regions {
        let cfg = ustor_fs_client::Config::new(&export_addr(&srv, name), name, SECRET.as_bytes());
        let c = ustor_fs_client::Client::connect(cfg).unwrap();
        let a = c.lookup(ROOT_INO, b"f").unwrap();
        assert_eq!(
            (a.size, a.mode & 0o7777),
            (data.len() as u64, 0o600),
            "{name}"
        );
        assert_eq!(
            sha256(&c.read(a.ino, 0, data.len()).unwrap()),
            sha256(&data),
            "{name}"
        );
    }
    let (code, out) = srv.stop();
    assert_eq!(code, 0, "{out}");
    for (name, path) in &regions {
        let ck = std::process::Command::new(BIN)
            .args(["fs", "check"])
            .arg(path)
            .output()
            .unwrap();
        assert!(ck.status.success(), "{name}: {ck:?}");
    }
    let _ = std::fs::remove_dir_all(&shm);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The running kernel is at least `major.minor` (`uname -r`).
fn kernel_at_least(major: u32, minor: u32) -> Result<(), String> {
    let r = std::fs::read_to_string("/proc/sys/kernel/osrelease").map_err(|e| e.to_string())?;
    let mut v = r
        .trim()
        .split(['.', '-'])
        .map(|x| x.parse::<u32>().unwrap_or(0));
    let (a, b) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
    if (a, b) >= (major, minor) {
        Ok(())
    } else {
        Err(format!(
            "kernel {} (SENDMSG_ZC needs {major}.{minor})",
            r.trim()
        ))
    }
}

/// `send_zc`: read replies of 16 KiB and more leave with SENDMSG_ZC. On
/// loopback the kernel copies anyway, and every notification says so:
/// `zero_copy_sends` moves, all of them counted as copied, no byte counted
/// as sent with no copy, every read byte still in `kernel_copied_bytes`.
/// The data reads back the same, small reads (plain sends) too; the
/// blocks of the file come back free after its unlink (each sent group's
/// pin was released by its notification), and save_config keeps the
/// switch.
#[test]
fn zero_copy_reads_on_loopback_are_counted_as_kernel_copies() {
    testkit::require!(
        kernel_at_least(6, 1),
        "Linux 6.1 or later (io_uring SENDMSG_ZC)"
    );
    let dir = tmpdir("fs-server-zc");
    let region = dir.join("region");
    let cfg = json!({"subsystems": [{"subsystem": "fs", "config": [
        {"method": "fs_create", "params": {"name": "vol", "path": region.to_str().unwrap(), "size": 64u64 << 20}},
        {"method": "fs_export", "params": {"name": "vol", "listen": "127.0.0.1:0", "secret": SECRET,
            "send_zc": true}},
    ]}]});
    let srv = Server::start(&dir, &cfg, &[]);
    let c = ustor_fs_client::Client::connect(ustor_fs_client::Config::new(
        &export_addr(&srv, "vol"),
        "vol",
        SECRET.as_bytes(),
    ))
    .unwrap();
    // (After the create: the root directory's block stays.)
    let f = c.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
    let free0 = c.statfs().unwrap().bfree;
    let data = pseudo_random(1 << 20, 21);
    c.write(f, 0, &data).unwrap();
    // Four 256 KiB reads (zero-copy sends) and sixteen of 4 KiB (plain).
    let mut big = Vec::new();
    for k in 0..4u64 {
        big.extend(c.read(f, k << 18, 256 << 10).unwrap());
    }
    assert_eq!(sha256(&big), sha256(&data));
    let mut small = Vec::new();
    for k in 0..16u64 {
        small.extend(c.read(f, k << 12, 4096).unwrap());
    }
    assert_eq!(sha256(&small), sha256(&data[..64 << 10]));
    // Every block back once every notification released its pin.
    c.unlink(ROOT_INO, b"f").unwrap();
    testkit::wait_until(
        "the file's blocks free again",
        Duration::from_secs(10),
        || c.statfs().unwrap().bfree == free0,
    );
    let st = &srv.ok("fs_get_stats", json!({"name": "vol"}))[0];
    let sends = st["zero_copy_sends"].as_u64().unwrap();
    assert!(sends >= 4, "{st}");
    assert_eq!(st["zero_copy_sends_copied"], sends, "loopback copies: {st}");
    assert_eq!(st["zero_copy_bytes"], 0, "{st}");
    let read = (1u64 << 20) + (64 << 10);
    assert_eq!(st["bytes_read"], read, "{st}");
    assert_eq!(st["kernel_copied_bytes"], read + (1 << 20), "{st}");
    assert_eq!(st["copied_bytes"], 0, "{st}");
    let cfg = srv.ok("framework_get_config", json!({"name": "fs"}));
    let ex = cfg
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["method"] == "fs_export");
    assert_eq!(ex.unwrap()["params"]["send_zc"], true, "{cfg}");
    drop(c);
    let (code, out) = srv.stop();
    assert_eq!(code, 0, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

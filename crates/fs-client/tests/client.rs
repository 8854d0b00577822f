//! The client library against a server running the real request handler:
//! handshake (right and wrong secret), every typed call, pipelined requests
//! from several threads on one connection, large reads and writes split
//! into pipelined 1 MiB requests, reconnection after the server went
//! away (idempotent calls retried, a dead server failing in bounded time),
//! and completions (`read_then`/`write_then`, the mount's path) run on the
//! connection's reader thread, failing with ETIMEDOUT when a hung server
//! never answers.

mod common;

use std::sync::atomic::Ordering;
use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{region, TestServer};
use ustor_fs::{SetAttr, ROOT_INO};
use ustor_fs_client::{Client, ClientError, Config};

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn wrong_secret_and_unknown_export_are_refused() {
    let (_d, fs) = region(8 << 20);
    let s = TestServer::start("127.0.0.1:0", fs, "exp", b"sesame");
    let a = s.addr.to_string();
    let e = Client::connect(Config::new(&a, "exp", b"wrong"))
        .err()
        .unwrap();
    assert_eq!(e, ClientError::Auth);
    assert_eq!(e.errno(), libc::EACCES);
    let e = Client::connect(Config::new(&a, "nope", b"sesame"))
        .err()
        .unwrap();
    assert_eq!(e, ClientError::Errno(libc::ENOENT));
    assert!(Client::connect(Config::new(&a, "exp", b"sesame")).is_ok());
}

#[test]
fn namespace_calls_and_data_round_trip() {
    let (_d, fs) = region(64 << 20);
    let s = TestServer::start("127.0.0.1:0", fs, "exp", b"k");
    let c = Client::connect(Config::new(&s.addr.to_string(), "exp", b"k")).unwrap();
    let d = c.mkdir(ROOT_INO, b"dir", 0o755, 1, 2).unwrap();
    assert_eq!(d.mode & libc::S_IFMT, libc::S_IFDIR);
    let f = c.create(d.ino, b"f", 0o644, 1, 2).unwrap();
    assert_eq!((f.uid, f.gid, f.size), (1, 2, 0));
    // 3.5 MiB: four pipelined write requests, then four pipelined reads.
    let data = pattern(1, 3 * (1 << 20) + 512 * 1024);
    let a = c.write(f.ino, 4096, &data).unwrap().expect("attr");
    assert_eq!(a.size, 4096 + data.len() as u64);
    let back = c.read(f.ino, 4096, data.len() + 100).unwrap();
    assert_eq!(back.len(), data.len());
    assert!(back == data, "data differs");
    assert_eq!(c.read(f.ino, 0, 4096).unwrap(), vec![0; 4096]);
    assert_eq!(c.lookup(d.ino, b"f").unwrap().ino, f.ino);
    assert_eq!(
        c.lookup(d.ino, b"missing").err(),
        Some(ClientError::Errno(2))
    );
    let t = c
        .setattr(
            f.ino,
            &SetAttr {
                size: Some(10),
                mode: Some(0o600),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!((t.size, t.mode & 0o7777), (10, 0o600));
    c.symlink(d.ino, b"l", b"f", 0, 0).unwrap();
    let l = c.lookup(d.ino, b"l").unwrap();
    assert_eq!(c.readlink(l.ino).unwrap(), b"f");
    assert_eq!(c.link(f.ino, ROOT_INO, b"hard").unwrap().nlink, 2);
    c.rename(d.ino, b"f", ROOT_INO, b"g").unwrap();
    let mut names: Vec<_> = c
        .readdir(ROOT_INO, 0, 100)
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![b"dir".to_vec(), b"g".to_vec(), b"hard".to_vec()]
    );
    c.fsync(f.ino).unwrap();
    c.unlink(ROOT_INO, b"g").unwrap();
    c.unlink(ROOT_INO, b"hard").unwrap();
    c.unlink(d.ino, b"l").unwrap();
    assert_eq!(
        c.rmdir(ROOT_INO, b"nope").err(),
        Some(ClientError::Errno(2))
    );
    c.rmdir(ROOT_INO, b"dir").unwrap();
    let st = c.statfs().unwrap();
    assert_eq!(st.bsize, 4096);
    assert!(st.bfree > 0 && st.bfree <= st.blocks);
    assert!(c.readdir(ROOT_INO, 0, 100).unwrap().is_empty());
}

#[test]
fn threads_share_one_pipelined_connection() {
    let (_d, fs) = region(64 << 20);
    let s = TestServer::start("127.0.0.1:0", fs, "exp", b"");
    let c = Arc::new(Client::connect(Config::new(&s.addr.to_string(), "exp", b"")).unwrap());
    let ts: Vec<_> = (0..8u64)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                let name = format!("t{t}");
                let f = c.create(ROOT_INO, name.as_bytes(), 0o644, 0, 0).unwrap();
                for i in 0..32u64 {
                    let d = pattern(t * 100 + i, 8192);
                    c.write(f.ino, i * 8192, &d).unwrap();
                }
                for i in 0..32u64 {
                    assert_eq!(
                        c.read(f.ino, i * 8192, 8192).unwrap(),
                        pattern(t * 100 + i, 8192)
                    );
                }
            })
        })
        .collect();
    for t in ts {
        t.join().unwrap();
    }
    assert_eq!(c.reconnects(), 0);
    assert_eq!(c.readdir(ROOT_INO, 0, 100).unwrap().len(), 8);
}

#[test]
fn reconnects_after_the_server_restarts_and_fails_when_it_stays_down() {
    let (_d, fs) = region(16 << 20);
    let mut s = TestServer::start("127.0.0.1:0", fs.clone(), "exp", b"k");
    let addr = s.addr.to_string();
    let mut cfg = Config::new(&addr, "exp", b"k");
    cfg.reconnect_for = Duration::from_secs(2);
    let c = Client::connect(cfg).unwrap();
    let f = c.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap();
    c.write(f.ino, 0, b"before").unwrap();
    // A solo client (a FUSE ring queue's: its own connection, read by the
    // caller) behaves the same.
    let solo = Arc::new(c.solo().unwrap());
    assert_eq!(solo.read(f.ino, 0, 100).unwrap(), b"before");
    s.stop();
    drop(s);
    // Down: a call fails (EIO) within the reconnect window, no hang.
    for c in [&c, &*solo] {
        let t = Instant::now();
        let e = c.getattr(f.ino).err().unwrap();
        assert_eq!(e.errno(), libc::EIO, "{e}");
        assert!(t.elapsed() < Duration::from_secs(10));
    }
    // Back on the same port: the next call reconnects and sees the data.
    let _s = TestServer::start(&addr, fs, "exp", b"k");
    assert_eq!(c.read(f.ino, 0, 100).unwrap(), b"before");
    assert!(c.reconnects() >= 1);
    assert_eq!(solo.read(f.ino, 0, 100).unwrap(), b"before");
    assert!(solo.reconnects() >= 1);
    // The solo client's completions run on the calling thread.
    let (tx, rx) = channel();
    solo.read_then(f.ino, 0, 6, move |r| {
        tx.send((r.unwrap(), std::thread::current().id())).unwrap()
    });
    let (d, t) = rx
        .try_recv()
        .expect("completion ran before read_then returned");
    assert_eq!(
        (d.as_slice(), t),
        (&b"before"[..], std::thread::current().id())
    );
}

#[test]
fn completions_run_on_the_reader_thread_and_time_out_on_a_hung_server() {
    let (_d, fs) = region(16 << 20);
    let s = TestServer::start("127.0.0.1:0", fs, "exp", b"k");
    let mut cfg = Config::new(&s.addr.to_string(), "exp", b"k");
    cfg.timeout = Duration::from_secs(2);
    let c = Arc::new(Client::connect(cfg).unwrap());
    let f = c.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap();
    let (tx, rx) = channel();
    let thread = || std::thread::current().name().map(str::to_string);
    // 16 writes in flight at once, each answered by its completion.
    for i in 0..16u64 {
        let tx = tx.clone();
        c.write_then(f.ino, i * 4096, &pattern(i, 4096), move |r| {
            tx.send((i, r.map(|a| a.map(|a| a.size)), thread()))
                .unwrap()
        });
    }
    let mut done = [false; 16];
    for _ in 0..16 {
        let (i, r, t) = rx.recv_timeout(Duration::from_secs(20)).unwrap();
        assert!(r.unwrap().unwrap() >= (i + 1) * 4096);
        assert_eq!(
            t.as_deref(),
            Some("ustor-fs-rx"),
            "write {i} completed on {t:?}"
        );
        done[i as usize] = true;
    }
    assert!(done.iter().all(|&d| d));
    let (rtx, rrx) = channel();
    for i in 0..16u64 {
        let rtx = rtx.clone();
        c.read_then(f.ino, i * 4096, 4096, move |r| {
            rtx.send((i, r, thread())).unwrap()
        });
    }
    for _ in 0..16 {
        let (i, r, t) = rrx.recv_timeout(Duration::from_secs(20)).unwrap();
        assert_eq!(r.unwrap(), pattern(i, 4096), "read {i}");
        assert_eq!(
            t.as_deref(),
            Some("ustor-fs-rx"),
            "read {i} completed on {t:?}"
        );
    }
    // A server that stops answering: each completion ends with ETIMEDOUT
    // once the timeout has passed, none before, none never.
    s.mute.store(true, Ordering::SeqCst);
    let t = Instant::now();
    c.read_then(f.ino, 0, 4096, move |r| rtx.send((0, r, None)).unwrap());
    c.write_then(f.ino, 0, b"x", move |r| {
        tx.send((1, r.map(|_| None), None)).unwrap()
    });
    let e = rrx
        .recv_timeout(Duration::from_secs(20))
        .unwrap()
        .1
        .unwrap_err();
    assert_eq!(e, ClientError::Timeout(Duration::from_secs(2)), "{e}");
    assert_eq!(e.errno(), libc::ETIMEDOUT);
    let e = rx
        .recv_timeout(Duration::from_secs(20))
        .unwrap()
        .1
        .unwrap_err();
    assert_eq!(e.errno(), libc::ETIMEDOUT, "{e}");
    assert!(t.elapsed() >= Duration::from_secs(2), "{:?}", t.elapsed());
}

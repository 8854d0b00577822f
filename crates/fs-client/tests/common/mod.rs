//! A small threaded file server for the client's tests: the real request
//! handler (`ustor_fs::serve::handle`) and file system on a region file,
//! behind std::net with the Hello/Auth handshake. It copies payloads
//! (`Fs::write`/`Fs::read`), which is fine for checking the client.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ustor_fs::proto::{self, Header, Op, Request, HEADER_LEN, NONCE_LEN};
use ustor_fs::serve::{self, Reply, Stats};
use ustor_fs::{Fs, MappedFile};
use ustor_fs_client::wire::auth_mac;

pub struct TestServer {
    pub addr: SocketAddr,
    pub fs: Arc<Mutex<Fs>>,
    /// While set, requests are read and never answered (a hung server).
    pub mute: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    socks: Arc<Mutex<Vec<TcpStream>>>,
    accept: Option<std::thread::JoinHandle<()>>,
}

/// A fresh region of `size` bytes in a temp file.
pub fn region(size: u64) -> (tempdir::Dir, Arc<Mutex<Fs>>) {
    let d = tempdir::Dir::new();
    let m = MappedFile::create(&d.0.join("region"), size).unwrap();
    let fs = Fs::format(Box::new(m)).unwrap();
    (d, Arc::new(Mutex::new(fs)))
}

pub mod tempdir {
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new() -> Self {
            let p = std::env::temp_dir().join(format!(
                "ustor-fsc-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos()
            ));
            std::fs::create_dir_all(&p).unwrap();
            Self(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl TestServer {
    /// Serves `fs` as export `name` with `secret` on `addr` (port 0: any).
    pub fn start(addr: &str, fs: Arc<Mutex<Fs>>, name: &str, secret: &[u8]) -> Self {
        let l = TcpListener::bind(addr).unwrap();
        let addr = l.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let socks = Arc::new(Mutex::new(Vec::new()));
        let mute = Arc::new(AtomicBool::new(false));
        let (f, s, k, m) = (fs.clone(), stop.clone(), socks.clone(), mute.clone());
        let (name, secret) = (name.as_bytes().to_vec(), secret.to_vec());
        let accept = std::thread::spawn(move || {
            for c in l.incoming() {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(c) = c else { continue };
                k.lock().unwrap().push(c.try_clone().unwrap());
                let (f, n, sec, m) = (f.clone(), name.clone(), secret.clone(), m.clone());
                std::thread::spawn(move || {
                    let _ = conn(c, &f, &n, &sec, &m);
                });
            }
        });
        Self {
            addr,
            fs,
            mute,
            stop,
            socks,
            accept: Some(accept),
        }
    }

    /// Closes the listener and every connection (a server that died).
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(a) = self.accept.take() {
            a.join().unwrap();
        }
        for s in self.socks.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn read_req(c: &mut TcpStream) -> std::io::Result<(Header, Vec<u8>)> {
    let mut h = [0u8; HEADER_LEN];
    c.read_exact(&mut h)?;
    let h = proto::decode_header(&h).map_err(std::io::Error::other)?;
    let mut b = vec![0u8; h.len as usize];
    c.read_exact(&mut b)?;
    Ok((h, b))
}

fn reply(c: &mut TcpStream, tag: u64, op: Op, errno: u64, body: &[u8]) -> std::io::Result<()> {
    let mut f = proto::encode_header(&Header {
        len: body.len() as u32,
        op,
        tag,
        ino: errno,
    });
    f.extend_from_slice(body);
    c.write_all(&f)
}

fn conn(
    mut c: TcpStream,
    fs: &Mutex<Fs>,
    name: &[u8],
    secret: &[u8],
    mute: &AtomicBool,
) -> std::io::Result<()> {
    let (h, b) = read_req(&mut c)?;
    let Ok(Request::Hello { nonce, export }) = proto::decode_request(&h, &b) else {
        return Ok(());
    };
    if export != name {
        return reply(&mut c, h.tag, Op::Hello, 2, &[]);
    }
    let sn = [0x5a; NONCE_LEN];
    reply(&mut c, h.tag, Op::Hello, 0, &sn)?;
    let (h, b) = read_req(&mut c)?;
    let Ok(Request::Auth { mac }) = proto::decode_request(&h, &b) else {
        return Ok(());
    };
    if mac != auth_mac(secret, &nonce, &sn) {
        return reply(&mut c, h.tag, Op::Auth, 13, &[]);
    }
    reply(&mut c, h.tag, Op::Auth, 0, &[])?;
    let mut st = Stats::default();
    loop {
        let (h, b) = read_req(&mut c)?;
        if mute.load(Ordering::SeqCst) {
            continue;
        }
        let pre = proto::body_prefix(&h);
        let req = proto::decode_request(&h, &b[..pre]).map_err(std::io::Error::other)?;
        let mut fs = fs.lock().unwrap();
        let body = match req {
            Request::Write { off, .. } => {
                let r = fs
                    .write(h.ino, off, &b[pre..])
                    .and_then(|_| fs.getattr(h.ino));
                match r {
                    Ok(a) => {
                        let mut v = Vec::new();
                        serve::encode_attr(&mut v, &a);
                        Ok(v)
                    }
                    Err(e) => Err(e),
                }
            }
            Request::Read { off, len } => {
                let mut v = vec![0u8; len as usize];
                fs.read(h.ino, off, &mut v).map(|n| {
                    v.truncate(n);
                    v
                })
            }
            ref r => serve::handle(&mut fs, false, &mut st, h.ino, r).map(|rep| {
                assert!(!matches!(rep, Reply::Data(_)), "reads are handled above");
                serve::encode_reply(h.tag, h.op, &Ok(rep))[HEADER_LEN..].to_vec()
            }),
        };
        drop(fs);
        match body {
            Ok(v) => reply(&mut c, h.tag, h.op, 0, &v)?,
            Err(e) => reply(&mut c, h.tag, h.op, e.errno() as u64, &[])?,
        }
    }
}

//! One TCP connection to a file server: the handshake, a writer shared by
//! the callers (a request's header and payload go out with one vectored
//! write, the payload straight from the caller's buffer), and a reader
//! thread that hands each reply to the caller waiting on its tag. Requests
//! are pipelined: any number may be outstanding, replies come in any order.
//! When the connection breaks every waiting caller gets `Disconnected`.

use std::collections::HashMap;
use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ustor_fs::proto::{self, Header, Request, HEADER_LEN, NONCE_LEN};

use crate::{wire, ClientError, Result};

/// A reply: its errno (0 = success) and body.
#[derive(Debug)]
pub(crate) struct Frame {
    pub errno: u64,
    pub body: Vec<u8>,
}

type Waiter = SyncSender<Result<Frame>>;

#[derive(Default)]
struct Pending {
    map: HashMap<u64, Waiter>,
    /// Why the connection died; set once, new requests fail at once.
    dead: Option<String>,
}

pub(crate) struct Conn {
    w: Mutex<TcpStream>,
    pending: Arc<Mutex<Pending>>,
}

fn io_err(e: std::io::Error) -> ClientError {
    ClientError::Disconnected(e.to_string())
}

/// Reads one frame synchronously (the handshake, before the reader runs).
fn read_frame(s: &mut TcpStream) -> Result<(Header, Vec<u8>)> {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).map_err(io_err)?;
    let h = proto::decode_header(&h).map_err(|e| ClientError::Protocol(e.to_string()))?;
    let mut body = vec![0u8; h.len as usize];
    s.read_exact(&mut body).map_err(io_err)?;
    Ok((h, body))
}

fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut n))
        .map_err(|e| ClientError::Disconnected(format!("no random nonce: {e}")))?;
    Ok(n)
}

/// Hello then Auth: proves the secret without sending it.
fn handshake(s: &mut TcpStream, export: &[u8], secret: &[u8]) -> Result<()> {
    let cn = nonce()?;
    let hello = Request::Hello { nonce: cn, export };
    s.write_all(&proto::encode_request(0, 0, &hello))
        .map_err(io_err)?;
    let (h, body) = read_frame(s)?;
    if h.ino != 0 {
        return Err(ClientError::Errno(h.ino as i32));
    }
    let sn: [u8; NONCE_LEN] = body
        .get(..NONCE_LEN)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| ClientError::Protocol("Hello reply without a nonce".into()))?;
    let mac = wire::auth_mac(secret, &cn, &sn);
    s.write_all(&proto::encode_request(1, 0, &Request::Auth { mac }))
        .map_err(io_err)?;
    let (h, _) = read_frame(s)?;
    match h.ino {
        0 => Ok(()),
        e if e as i32 == libc::EACCES || e as i32 == libc::EPERM => Err(ClientError::Auth),
        e => Err(ClientError::Errno(e as i32)),
    }
}

impl Conn {
    /// Connects, authenticates and starts the reader thread.
    pub fn open(
        addr: &SocketAddr,
        export: &[u8],
        secret: &[u8],
        timeout: Duration,
    ) -> Result<Self> {
        let mut s = TcpStream::connect_timeout(addr, timeout).map_err(io_err)?;
        s.set_nodelay(true).map_err(io_err)?;
        // The handshake must not hang on a server that never answers.
        s.set_read_timeout(Some(timeout)).map_err(io_err)?;
        handshake(&mut s, export, secret)?;
        s.set_read_timeout(None).map_err(io_err)?;
        let pending = Arc::new(Mutex::new(Pending::default()));
        let (r, p) = (s.try_clone().map_err(io_err)?, pending.clone());
        std::thread::Builder::new()
            .name("ustor-fs-rx".into())
            .spawn(move || reader(r, p))
            .map_err(io_err)?;
        Ok(Self {
            w: Mutex::new(s),
            pending,
        })
    }

    /// Whether the connection has died.
    pub fn is_dead(&self) -> bool {
        self.pending.lock().expect("pending").dead.is_some()
    }

    /// Sends a request (`head` is its header and body, `payload` a write's
    /// data, sent without copying it); the reply arrives on the receiver.
    pub fn send(&self, tag: u64, head: &[u8], payload: &[u8]) -> Result<Receiver<Result<Frame>>> {
        let (tx, rx) = sync_channel(1);
        {
            let mut p = self.pending.lock().expect("pending");
            if let Some(why) = &p.dead {
                return Err(ClientError::Disconnected(why.clone()));
            }
            p.map.insert(tag, tx);
        }
        let mut w = self.w.lock().expect("writer");
        if let Err(e) = write_all_vectored(&mut w, head, payload) {
            drop(w);
            self.kill(&e.to_string());
            return Err(io_err(e));
        }
        Ok(rx)
    }

    /// Breaks the connection: every waiting caller gets `Disconnected`.
    pub fn kill(&self, why: &str) {
        let _ = self.w.lock().expect("writer").shutdown(Shutdown::Both);
        fail_all(&self.pending, why);
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Ends the reader thread too (its read returns 0).
        let _ = self.w.get_mut().map(|s| s.shutdown(Shutdown::Both));
    }
}

fn write_all_vectored(w: &mut TcpStream, head: &[u8], payload: &[u8]) -> std::io::Result<()> {
    let (mut a, mut b) = (head, payload);
    while !a.is_empty() || !b.is_empty() {
        let n = w.write_vectored(&[IoSlice::new(a), IoSlice::new(b)])?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        let k = n.min(a.len());
        a = &a[k..];
        b = &b[n - k..];
    }
    Ok(())
}

fn fail_all(p: &Mutex<Pending>, why: &str) {
    let mut p = p.lock().expect("pending");
    p.dead.get_or_insert_with(|| why.to_string());
    for (_, w) in p.map.drain() {
        let _ = w.try_send(Err(ClientError::Disconnected(why.to_string())));
    }
}

/// Hands each reply to its waiter until the stream ends or lies.
fn reader(mut s: TcpStream, p: Arc<Mutex<Pending>>) {
    let why = loop {
        let (h, body) = match read_frame(&mut s) {
            Ok(f) => f,
            Err(e) => break e.to_string(),
        };
        let w = p.lock().expect("pending").map.remove(&h.tag);
        match w {
            Some(w) => {
                let _ = w.try_send(Ok(Frame { errno: h.ino, body }));
            }
            None => break format!("reply with unknown tag {}", h.tag),
        }
    };
    let _ = s.shutdown(Shutdown::Both);
    fail_all(&p, &why);
}

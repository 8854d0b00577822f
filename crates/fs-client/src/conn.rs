//! One TCP connection to a file server: the handshake, a writer shared by
//! the callers (a request's header and payload go out with one vectored
//! write, the payload straight from the caller's buffer), and a reader
//! thread that completes each reply's request: it hands the reply to the
//! caller waiting on its tag, or runs the request's completion itself
//! ([`Conn::send_then`]: the mount answers the kernel from there, so a
//! reply costs one thread wake-up, the reader's). Requests are pipelined:
//! any number may be outstanding, replies come in any order. When the
//! connection breaks every waiting request gets `Disconnected`; a request
//! unanswered for the timeout breaks it (the reader looks every second).

use std::collections::HashMap;
use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ustor_fs::proto::{self, Header, Request, HEADER_LEN, NONCE_LEN};

use crate::{wire, ClientError, Result};

/// How often the reader, idle, looks for requests past their timeout.
const TICK: Duration = Duration::from_secs(1);
/// The reader's buffer: a small reply and its header arrive with one
/// `read`; a body larger than half of it is read straight into place.
const RX_BUF: usize = 64 << 10;

/// A reply: its errno (0 = success) and body.
#[derive(Debug)]
pub(crate) struct Frame {
    pub errno: u64,
    pub body: Vec<u8>,
}

/// A request's completion, run by whoever ends the request (the reader
/// thread with its reply, or the thread that finds the connection dead).
pub(crate) type Done = Box<dyn FnOnce(Result<Frame>) + Send>;

/// Who learns a request's outcome.
enum Waiter {
    /// A caller blocked on the receiver.
    Chan(SyncSender<Result<Frame>>),
    /// A completion to run ([`Conn::send_then`]).
    Call(Done),
}

impl Waiter {
    fn complete(self, r: Result<Frame>) {
        match self {
            Self::Chan(tx) => {
                let _ = tx.try_send(r);
            }
            Self::Call(f) => f(r),
        }
    }
}

#[derive(Default)]
struct Pending {
    /// Tag -> waiter and when the request was sent.
    map: HashMap<u64, (Waiter, Instant)>,
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

/// Connects with TCP_NODELAY and authenticates, every wait bounded by
/// `timeout` (the handshake must not hang on a server that never answers).
fn dial(addr: &SocketAddr, export: &[u8], secret: &[u8], timeout: Duration) -> Result<TcpStream> {
    let mut s = TcpStream::connect_timeout(addr, timeout).map_err(io_err)?;
    s.set_nodelay(true).map_err(io_err)?;
    s.set_read_timeout(Some(timeout)).map_err(io_err)?;
    handshake(&mut s, export, secret)?;
    Ok(s)
}

/// A connection with no reader thread, used by one thread at a time: the
/// caller writes a request and reads its reply itself, so the reply wakes
/// the thread that goes on with it and no other (a FUSE-over-io_uring
/// queue thread, which then commits on its caller's CPU).
pub(crate) struct SyncConn {
    s: TcpStream,
    timeout: Duration,
    /// The first bytes of a reply: its header and a small body arrive
    /// with one receive (one system call instead of two per request).
    rx: Box<[u8]>,
    /// Received bytes of `rx` not yet taken.
    lo: usize,
    hi: usize,
}

/// Room for a reply's header and a 4 KiB read's padding and data.
const SYNC_RX: usize = 8 << 10;

impl SyncConn {
    /// Connects and authenticates.
    pub fn open(
        addr: &SocketAddr,
        export: &[u8],
        secret: &[u8],
        timeout: Duration,
    ) -> Result<Self> {
        // Every wait, the handshake's and each reply's, is bounded.
        let s = dial(addr, export, secret, timeout)?;
        Ok(Self {
            s,
            timeout,
            rx: vec![0u8; SYNC_RX].into_boxed_slice(),
            lo: 0,
            hi: 0,
        })
    }

    /// One request (`head`, then `payload` sent from the caller's buffer)
    /// and its reply. After an error the connection is not to be used
    /// again (a reply may be half read).
    pub fn call(&mut self, tag: u64, head: &[u8], payload: &[u8]) -> Result<Frame> {
        let (h, _) = self.send_then_header(tag, head, payload)?;
        let mut body = vec![0u8; h.len as usize];
        self.body(&mut body)?;
        Ok(Frame { errno: h.ino, body })
    }

    /// Like [`SyncConn::call`] for a request without a payload whose reply
    /// body is received straight into `out` (a FUSE ring entry's buffer:
    /// no copy on our side); returns the errno and the body's length. A
    /// read reply's padding ([`proto::FLAG_ALIGN`]) is skipped. A body
    /// longer than `out` breaks the connection (the server sends no more
    /// than was asked).
    pub fn call_into(&mut self, tag: u64, head: &[u8], out: &mut [u8]) -> Result<(u64, usize)> {
        let (h, flags) = self.send_then_header(tag, head, &[])?;
        let mut n = h.len as usize;
        if h.op == proto::Op::Read && flags > 0 {
            let mut pad = [0u8; proto::READ_DATA_AT];
            let p = flags as usize;
            if p > n || p > pad.len() {
                return Err(ClientError::Protocol(format!("read reply padded by {p}")));
            }
            self.body(&mut pad[..p])?;
            n -= p;
        }
        if n > out.len() {
            return Err(ClientError::Protocol(format!(
                "reply of {n} bytes to a read of {}",
                out.len()
            )));
        }
        self.body(&mut out[..n])?;
        Ok((h.ino, n))
    }

    /// Sends a request and receives its reply's header and flags byte.
    fn send_then_header(&mut self, tag: u64, head: &[u8], payload: &[u8]) -> Result<(Header, u8)> {
        if self.lo != self.hi {
            // One request at a time: nothing may follow a reply.
            return Err(ClientError::Protocol("bytes past a reply".into()));
        }
        write_all_vectored(&mut self.s, head, payload).map_err(io_err)?;
        (self.lo, self.hi) = (0, 0);
        while self.hi < HEADER_LEN {
            match self.s.read(&mut self.rx[self.hi..]) {
                Ok(0) => return Err(eof()),
                Ok(k) => self.hi += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.err(e)),
            }
        }
        let hb: [u8; HEADER_LEN] = self.rx[..HEADER_LEN].try_into().expect("header");
        self.lo = HEADER_LEN;
        let h = proto::decode_header(&hb).map_err(|e| ClientError::Protocol(e.to_string()))?;
        if h.tag != tag {
            return Err(ClientError::Protocol(format!(
                "reply to request {} while {tag} waits",
                h.tag
            )));
        }
        Ok((h, proto::header_flags(&hb)))
    }

    /// The next `body.len()` bytes of the reply: what the first receive
    /// brought, then the rest straight from the socket.
    fn body(&mut self, body: &mut [u8]) -> Result<()> {
        let k = body.len().min(self.hi - self.lo);
        body[..k].copy_from_slice(&self.rx[self.lo..self.lo + k]);
        self.lo += k;
        self.s.read_exact(&mut body[k..]).map_err(|e| self.err(e))
    }

    fn err(&self, e: std::io::Error) -> ClientError {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                ClientError::Timeout(self.timeout)
            }
            _ => io_err(e),
        }
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
        let s = dial(addr, export, secret, timeout)?;
        // The reader wakes every TICK to look for overdue requests.
        s.set_read_timeout(Some(TICK)).map_err(io_err)?;
        let pending = Arc::new(Mutex::new(Pending::default()));
        let (r, p) = (s.try_clone().map_err(io_err)?, pending.clone());
        std::thread::Builder::new()
            .name("ustor-fs-rx".into())
            .spawn(move || reader(Rx::new(r), p, timeout))
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
        match self.send_as(tag, head, payload, Waiter::Chan(tx)) {
            Ok(()) => Ok(rx),
            Err((e, _)) => Err(e),
        }
    }

    /// Sends a request like [`Conn::send`]; once it is sent, `done` runs
    /// exactly once with its reply (on the reader thread) or its failure.
    /// A request that could not be sent gives `done` back, not run (the
    /// caller may send it again on a new connection).
    pub fn send_then(
        &self,
        tag: u64,
        head: &[u8],
        payload: &[u8],
        done: Done,
    ) -> std::result::Result<(), (ClientError, Done)> {
        self.send_as(tag, head, payload, Waiter::Call(done))
            .map_err(|(e, w)| match w {
                Waiter::Call(d) => (e, d),
                Waiter::Chan(_) => unreachable!("sent as a completion"),
            })
    }

    fn send_as(
        &self,
        tag: u64,
        head: &[u8],
        payload: &[u8],
        w: Waiter,
    ) -> std::result::Result<(), (ClientError, Waiter)> {
        {
            let mut p = self.pending.lock().expect("pending");
            if let Some(why) = &p.dead {
                return Err((ClientError::Disconnected(why.clone()), w));
            }
            // In the map before it is sent: the reply may come at once.
            p.map.insert(tag, (w, Instant::now()));
        }
        let mut s = self.w.lock().expect("writer");
        if let Err(e) = write_all_vectored(&mut s, head, payload) {
            drop(s);
            // Not sent (not whole): the caller gets its waiter back, and
            // the others fail with the connection.
            let w = self.pending.lock().expect("pending").map.remove(&tag);
            self.kill(&e.to_string());
            return match w {
                Some((w, _)) => Err((io_err(e), w)),
                // The reader failed it already (the connection died).
                None => Ok(()),
            };
        }
        Ok(())
    }

    /// Breaks the connection: every waiting caller gets `Disconnected`.
    pub fn kill(&self, why: &str) {
        let _ = self.w.lock().expect("writer").shutdown(Shutdown::Both);
        fail_all(&self.pending, why, None);
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

/// Ends every waiting request (outside the lock: a completion may block,
/// e.g. a read sent again on a new connection): with `Timeout` when the
/// connection is dropped because a request waited past the timeout (`late`),
/// else with `Disconnected`.
fn fail_all(p: &Mutex<Pending>, why: &str, late: Option<Duration>) {
    let waiters: Vec<_> = {
        let mut p = p.lock().expect("pending");
        p.dead.get_or_insert_with(|| why.to_string());
        p.map.drain().map(|(_, w)| w).collect()
    };
    for (w, _) in waiters {
        let e = match late {
            Some(t) => ClientError::Timeout(t),
            None => ClientError::Disconnected(why.to_string()),
        };
        w.complete(Err(e));
    }
}

/// Whether a request has waited longer than `timeout`.
fn overdue(p: &Mutex<Pending>, timeout: Duration) -> bool {
    let now = Instant::now();
    let p = p.lock().expect("pending");
    p.map
        .values()
        .any(|(_, sent)| now.duration_since(*sent) >= timeout)
}

/// The reader's side of the socket: frames cut out of a buffer, resumable
/// across the read timeout (a frame may arrive in pieces around a tick).
struct Rx {
    s: TcpStream,
    buf: Box<[u8]>,
    lo: usize,
    hi: usize,
    /// A frame whose body is partly here: header, body, bytes filled.
    part: Option<(Header, Vec<u8>, usize)>,
}

/// Whether an error is the read timeout's.
fn ticked(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

impl Rx {
    fn new(s: TcpStream) -> Self {
        Self {
            s,
            buf: vec![0u8; RX_BUF].into_boxed_slice(),
            lo: 0,
            hi: 0,
            part: None,
        }
    }

    /// The next frame; `None` when the read timeout passed first.
    fn frame(&mut self) -> Result<Option<(Header, Vec<u8>)>> {
        loop {
            if let Some((_, body, n)) = &mut self.part {
                let k = (self.hi - self.lo).min(body.len() - *n);
                body[*n..*n + k].copy_from_slice(&self.buf[self.lo..self.lo + k]);
                (self.lo, *n) = (self.lo + k, *n + k);
                if *n == body.len() {
                    let (h, body, _) = self.part.take().expect("frame");
                    return Ok(Some((h, body)));
                }
                if body.len() - *n >= RX_BUF / 2 {
                    // A large body: straight into place.
                    match self.s.read(&mut body[*n..]) {
                        Ok(0) => return Err(eof()),
                        Ok(k) => *n += k,
                        Err(e) if ticked(&e) => return Ok(None),
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(io_err(e)),
                    }
                    continue;
                }
            } else if self.hi - self.lo >= HEADER_LEN {
                let raw = &self.buf[self.lo..self.lo + HEADER_LEN];
                let h = proto::decode_header(raw.try_into().expect("header"))
                    .map_err(|e| ClientError::Protocol(e.to_string()))?;
                self.lo += HEADER_LEN;
                self.part = Some((h, vec![0u8; h.len as usize], 0));
                continue;
            }
            if !self.fill()? {
                return Ok(None);
            }
        }
    }

    /// Reads more into the buffer; `false` when the read timeout passed.
    fn fill(&mut self) -> Result<bool> {
        if self.lo == self.hi {
            (self.lo, self.hi) = (0, 0);
        } else if self.hi == self.buf.len() {
            self.buf.copy_within(self.lo..self.hi, 0);
            (self.lo, self.hi) = (0, self.hi - self.lo);
        }
        loop {
            match self.s.read(&mut self.buf[self.hi..]) {
                Ok(0) => return Err(eof()),
                Ok(k) => {
                    self.hi += k;
                    return Ok(true);
                }
                Err(e) if ticked(&e) => return Ok(false),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(e)),
            }
        }
    }
}

fn eof() -> ClientError {
    ClientError::Disconnected("connection closed by the server".into())
}

/// Completes each reply's request until the stream ends or lies, or a
/// request waits longer than `timeout`.
fn reader(mut rx: Rx, p: Arc<Mutex<Pending>>, timeout: Duration) {
    let mut late = None;
    let why = loop {
        let (h, body) = match rx.frame() {
            Ok(Some(f)) => f,
            Ok(None) if overdue(&p, timeout) => {
                late = Some(timeout);
                break "request timed out".to_string();
            }
            Ok(None) => continue,
            Err(e) => break e.to_string(),
        };
        let w = p.lock().expect("pending").map.remove(&h.tag);
        match w {
            Some((w, _)) => w.complete(Ok(Frame { errno: h.ino, body })),
            None => break format!("reply with unknown tag {}", h.tag),
        }
    };
    let _ = rx.s.shutdown(Shutdown::Both);
    fail_all(&p, &why, late);
}

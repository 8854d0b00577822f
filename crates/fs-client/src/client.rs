//! `Client`: typed file operations over a `Conn`, with reconnection. A
//! request whose connection broke is sent again on a new connection when
//! it is idempotent (lookup, getattr, setattr, read, write at an offset,
//! readdir, readlink, statfs, fsync); the others (create, mkdir, unlink,
//! rename...) fail with `Disconnected` (EIO), since the server may or may
//! not have done them. Every wait is bounded by `Config::timeout`, and
//! reconnecting gives up after `Config::reconnect_for`: a dead server
//! makes calls fail, never hang.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ustor_fs::proto::{self, Request, MAX_TARGET};
use ustor_fs::{Attr, DirEntry, SetAttr, StatFs, MAX_WRITE, NAME_MAX};

use crate::conn::{Conn, Done, Frame, SyncConn};
use crate::{wire, ClientError, Result};

/// Where and how to connect.
#[derive(Debug, Clone)]
pub struct Config {
    /// HOST:PORT of the server.
    pub addr: String,
    /// The export's name.
    pub export: String,
    /// The export's shared secret (empty when it has none).
    pub secret: Vec<u8>,
    /// How long one request may wait for its reply.
    pub timeout: Duration,
    /// How long to keep trying to reconnect before failing a call.
    pub reconnect_for: Duration,
}

impl Config {
    pub fn new(addr: &str, export: &str, secret: &[u8]) -> Self {
        Self {
            addr: addr.to_string(),
            export: export.to_string(),
            secret: secret.to_vec(),
            timeout: Duration::from_secs(30),
            reconnect_for: Duration::from_secs(10),
        }
    }
}

/// A connection to one export, shared by any number of threads.
pub struct Client {
    cfg: Config,
    conn: Mutex<Option<Arc<Conn>>>,
    /// A client made by [`Client::solo`]: its blocking calls go over this
    /// connection of its own, read by the calling thread.
    solo: Option<Mutex<Option<SyncConn>>>,
    tag: AtomicU64,
    reconnects: AtomicU64,
}

fn idempotent(r: &Request<'_>) -> bool {
    matches!(
        r,
        Request::Lookup { .. }
            | Request::Getattr
            | Request::Setattr { .. }
            | Request::Readlink
            | Request::Readdir { .. }
            | Request::Read { .. }
            | Request::Write { .. }
            | Request::Statfs
            | Request::Fsync
    )
}

/// ENAMETOOLONG for a name or symlink target over the protocol's limits,
/// before it is sent (the server would take the frame as malformed and
/// close the connection).
fn check_names(r: &Request<'_>) -> Result<()> {
    let too_long = |n: &[u8]| n.len() > NAME_MAX;
    let bad = match r {
        Request::Lookup { name }
        | Request::Create { name, .. }
        | Request::Mkdir { name, .. }
        | Request::Link { name, .. }
        | Request::Unlink { name }
        | Request::Rmdir { name } => too_long(name),
        Request::Symlink { name, target, .. } => too_long(name) || target.len() > MAX_TARGET,
        Request::Rename { sname, dname, .. } => too_long(sname) || too_long(dname),
        _ => false,
    };
    if bad {
        return Err(ClientError::Errno(libc::ENAMETOOLONG));
    }
    Ok(())
}

fn resolve(addr: &str) -> Result<Vec<SocketAddr>> {
    let v: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| ClientError::Disconnected(format!("{addr}: {e}")))?
        .collect();
    if v.is_empty() {
        return Err(ClientError::Disconnected(format!("{addr}: no address")));
    }
    Ok(v)
}

impl Client {
    /// Connects and authenticates; fails at once when the server refuses
    /// (a wrong secret is `ClientError::Auth`).
    pub fn connect(cfg: Config) -> Result<Self> {
        let c = Self {
            cfg,
            conn: Mutex::new(None),
            solo: None,
            tag: AtomicU64::new(2),
            reconnects: AtomicU64::new(0),
        };
        let conn = c.dial()?;
        *c.conn.lock().expect("conn") = Some(Arc::new(conn));
        Ok(c)
    }

    /// Another client of the same export for one thread at a time, with
    /// a connection of its own and no reader thread: each call writes its
    /// request and reads the reply on the calling thread, so a reply wakes
    /// that thread only (FUSE over io_uring: the queue thread, which then
    /// answers the kernel on its caller's CPU). Its `*_then` calls run
    /// their completion inline. It redials as [`Client`] does.
    pub fn solo(&self) -> Result<Client> {
        let c = Self {
            cfg: self.cfg.clone(),
            conn: Mutex::new(None),
            solo: Some(Mutex::new(None)),
            tag: AtomicU64::new(2),
            reconnects: AtomicU64::new(0),
        };
        let conn = c.dial_sync()?;
        *c.solo.as_ref().expect("solo").lock().expect("solo") = Some(conn);
        Ok(c)
    }

    fn dial_sync(&self) -> Result<SyncConn> {
        let mut last = ClientError::Disconnected("no address".into());
        for a in resolve(&self.cfg.addr)? {
            let e = self.cfg.export.as_bytes();
            match SyncConn::open(&a, e, &self.cfg.secret, self.cfg.timeout) {
                Ok(c) => return Ok(c),
                Err(err @ (ClientError::Auth | ClientError::Errno(_))) => return Err(err),
                Err(err) => last = err,
            }
        }
        Err(last)
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// How many times the connection was re-established.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    fn dial(&self) -> Result<Conn> {
        let mut last = ClientError::Disconnected("no address".into());
        for a in resolve(&self.cfg.addr)? {
            let e = self.cfg.export.as_bytes();
            match Conn::open(&a, e, &self.cfg.secret, self.cfg.timeout) {
                Ok(c) => return Ok(c),
                Err(err @ (ClientError::Auth | ClientError::Errno(_))) => return Err(err),
                Err(err) => last = err,
            }
        }
        Err(last)
    }

    /// The live connection, reconnecting (with backoff, up to
    /// `reconnect_for`) when it died.
    fn conn(&self) -> Result<Arc<Conn>> {
        let mut g = self.conn.lock().expect("conn");
        if let Some(c) = g.as_ref().filter(|c| !c.is_dead()) {
            return Ok(c.clone());
        }
        *g = None;
        let c = Arc::new(self.redial(|| self.dial())?);
        *g = Some(c.clone());
        Ok(c)
    }

    /// Dials with backoff, up to `reconnect_for`.
    fn redial<T>(&self, dial: impl Fn() -> Result<T>) -> Result<T> {
        let deadline = Instant::now() + self.cfg.reconnect_for;
        let mut pause = Duration::from_millis(20);
        loop {
            match dial() {
                Ok(c) => {
                    self.reconnects.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(addr = %self.cfg.addr, "file service: reconnected");
                    return Ok(c);
                }
                Err(e @ ClientError::Auth) => return Err(e),
                Err(e) if Instant::now() + pause > deadline => return Err(e),
                // Backoff between attempts: the server is restarting.
                Err(_) => std::thread::sleep(pause),
            }
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// One request and its reply over a solo client's own connection
    /// (redialled when it broke; an idempotent request is sent once more).
    fn solo_call(
        &self,
        s: &Mutex<Option<SyncConn>>,
        ino: u64,
        req: &Request<'_>,
        payload: &[u8],
    ) -> Result<Frame> {
        self.solo_with(s, req, |c, tag| {
            c.call(tag, &proto::encode_request(tag, ino, req), payload)
        })
        .and_then(errno)
    }

    /// Runs `f` (one request and its reply) on a solo client's connection
    /// with a fresh tag, redialling it when it broke; an idempotent
    /// request is sent once more.
    fn solo_with<T>(
        &self,
        s: &Mutex<Option<SyncConn>>,
        req: &Request<'_>,
        mut f: impl FnMut(&mut SyncConn, u64) -> Result<T>,
    ) -> Result<T> {
        check_names(req)?;
        let mut g = s.lock().unwrap_or_else(|e| e.into_inner());
        let mut once = || -> Result<T> {
            let c = match g.as_mut() {
                Some(c) => c,
                None => g.insert(self.redial(|| self.dial_sync())?),
            };
            let r = f(c, self.next_tag());
            if r.is_err() {
                *g = None;
            }
            r
        };
        match once() {
            Err(ClientError::Disconnected(_)) if idempotent(req) => once(),
            r => r,
        }
    }

    fn next_tag(&self) -> u64 {
        self.tag.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends a request without waiting: the start of a pipelined call.
    fn submit(&self, ino: u64, req: &Request<'_>, payload: &[u8]) -> Result<Pending> {
        check_names(req)?;
        let conn = self.conn()?;
        let tag = self.next_tag();
        let head = proto::encode_request(tag, ino, req);
        let rx = conn.send(tag, &head, payload)?;
        Ok(Pending { conn, rx })
    }

    /// Sends a read of at most `MAX_WRITE` bytes without waiting for its
    /// reply ([`Client::finish_read`] waits): the mount sends on its
    /// session thread and waits on a worker, so several kernel requests
    /// are in flight at once.
    pub fn start_read(&self, ino: u64, off: u64, len: usize) -> Started {
        let len = len.min(MAX_WRITE);
        let req = Request::Read {
            off,
            len: len as u32,
        };
        Started {
            p: self.submit(ino, &req, &[]),
            read: Some((ino, off, len)),
        }
    }

    /// The bytes a [`Client::start_read`] asked for; sent again on a new
    /// connection if the first one broke.
    pub fn finish_read(&self, s: Started) -> Result<Vec<u8>> {
        // A read that could not be sent already waited out the reconnect
        // window; one sent on a connection that broke is sent again.
        match (self.wait(s.p?), s.read) {
            (Err(ClientError::Disconnected(_)), Some((ino, off, len))) => self.read(ino, off, len),
            (r, _) => Ok(r?.body),
        }
    }

    /// Sends a write of at most `MAX_WRITE` bytes (straight from `data`,
    /// no copy) without waiting for its reply ([`Client::finish_write`]).
    /// A connection that breaks while sending is redialled and the write
    /// sent once more (`data` is still at hand); once it is sent, `data`
    /// is not kept, so a connection that breaks before the reply fails it
    /// with `Disconnected` (EIO).
    pub fn start_write(&self, ino: u64, off: u64, data: &[u8]) -> Started {
        if data.len() > MAX_WRITE {
            return Started {
                p: Err(ClientError::Invalid("write over MAX_WRITE")),
                read: None,
            };
        }
        let req = Request::Write {
            off,
            len: data.len() as u32,
        };
        let p = match self.submit(ino, &req, data) {
            Err(ClientError::Disconnected(_)) => self.submit(ino, &req, data),
            p => p,
        };
        Started { p, read: None }
    }

    /// The attribute a [`Client::start_write`] answered (when the server
    /// sends one).
    pub fn finish_write(&self, s: Started) -> Result<Option<Attr>> {
        wire::decode_write(&s.p.and_then(|p| self.wait(p))?.body)
    }

    /// Sends a request whose reply runs `done` (see [`Conn::send_then`]);
    /// gives `done` back, not run, when it could not be sent.
    fn submit_then(
        &self,
        ino: u64,
        req: &Request<'_>,
        payload: &[u8],
        done: Done,
    ) -> std::result::Result<(), (ClientError, Done)> {
        if let Err(e) = check_names(req) {
            return Err((e, done));
        }
        let conn = match self.conn() {
            Ok(c) => c,
            Err(e) => return Err((e, done)),
        };
        let tag = self.next_tag();
        let head = proto::encode_request(tag, ino, req);
        conn.send_then(tag, &head, payload, done)
    }

    /// Sends an idempotent request without a payload; its reply, decoded,
    /// goes to `done`, which runs on the connection's reader thread as soon
    /// as the reply is in (no other thread is woken: the mount answers the
    /// kernel from there). When the connection breaks after the request
    /// went out, `again` (the same call, synchronous) runs first, from the
    /// thread that saw it break; when no connection could be had within
    /// the reconnect window, `done` gets that error at once.
    fn call_then<T: 'static>(
        &self,
        ino: u64,
        req: &Request<'_>,
        decode: fn(Frame) -> Result<T>,
        again: impl FnOnce() -> Result<T> + Send + 'static,
        done: impl FnOnce(Result<T>) + Send + 'static,
    ) {
        let conn = match check_names(req).and_then(|_| self.conn()) {
            Ok(c) => c,
            Err(e) => return done(Err(e)),
        };
        let on_reply: Done = Box::new(move |r: Result<Frame>| {
            done(match r.and_then(errno) {
                Err(ClientError::Disconnected(_)) => again(),
                r => r.and_then(decode),
            })
        });
        let tag = self.next_tag();
        let head = proto::encode_request(tag, ino, req);
        if let Err((e, d)) = conn.send_then(tag, &head, &[], on_reply) {
            d(Err(e));
        }
    }

    /// Reads at most `MAX_WRITE` bytes at `off`; the bytes go to `done` on
    /// the reader thread ([`Client::call_then`]).
    pub fn read_then(
        self: &Arc<Self>,
        ino: u64,
        off: u64,
        len: usize,
        done: impl FnOnce(Result<Vec<u8>>) + Send + 'static,
    ) {
        let len = len.min(MAX_WRITE);
        if self.solo.is_some() {
            return done(self.read(ino, off, len));
        }
        let req = Request::Read {
            off,
            len: len as u32,
        };
        let c = self.clone();
        let again = move || c.read(ino, off, len);
        self.call_then(ino, &req, |f| Ok(f.body), again, done)
    }

    /// [`Client::lookup`], answered to `done` on the reader thread.
    pub fn lookup_then(
        self: &Arc<Self>,
        dir: u64,
        name: &[u8],
        done: impl FnOnce(Result<Attr>) + Send + 'static,
    ) {
        if self.solo.is_some() {
            return done(self.lookup(dir, name));
        }
        let (c, n) = (self.clone(), name.to_vec());
        let again = move || c.lookup(dir, &n);
        let req = Request::Lookup { name };
        self.call_then(dir, &req, |f| wire::decode_attr(&f.body), again, done)
    }

    /// [`Client::getattr`], answered to `done` on the reader thread.
    pub fn getattr_then(
        self: &Arc<Self>,
        ino: u64,
        done: impl FnOnce(Result<Attr>) + Send + 'static,
    ) {
        if self.solo.is_some() {
            return done(self.getattr(ino));
        }
        let c = self.clone();
        let again = move || c.getattr(ino);
        let req = Request::Getattr;
        self.call_then(ino, &req, |f| wire::decode_attr(&f.body), again, done)
    }

    /// Writes at most `MAX_WRITE` bytes of `data` at `off` (straight from
    /// `data`, no copy) and hands the attribute the server answered to
    /// `done`, on the reader thread as [`Client::read_then`] does. A write
    /// that could not be sent is sent once more on a new connection;
    /// once sent, `data` is not kept, so a connection that breaks before
    /// the reply fails it with `Disconnected` (EIO).
    pub fn write_then(
        &self,
        ino: u64,
        off: u64,
        data: &[u8],
        done: impl FnOnce(Result<Option<Attr>>) + Send + 'static,
    ) {
        if data.len() > MAX_WRITE {
            return done(Err(ClientError::Invalid("write over MAX_WRITE")));
        }
        if self.solo.is_some() {
            return done(self.write(ino, off, data));
        }
        let req = Request::Write {
            off,
            len: data.len() as u32,
        };
        let on_reply: Done = Box::new(move |r: Result<Frame>| {
            done(r.and_then(errno).and_then(|f| wire::decode_write(&f.body)))
        });
        let r = match self.submit_then(ino, &req, data, on_reply) {
            Err((ClientError::Disconnected(_), d)) => self.submit_then(ino, &req, data, d),
            r => r,
        };
        if let Err((e, d)) = r {
            d(Err(e));
        }
    }

    fn wait(&self, p: Pending) -> Result<Frame> {
        let f = match p.rx.recv_timeout(self.cfg.timeout) {
            Ok(r) => r?,
            Err(RecvTimeoutError::Timeout) => {
                p.conn.kill("request timed out");
                return Err(ClientError::Timeout(self.cfg.timeout));
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(ClientError::Disconnected("reader gone".into()))
            }
        };
        errno(f)
    }

    /// One request and its reply; an idempotent request is sent once more
    /// on a new connection if the first one broke.
    fn call(&self, ino: u64, req: &Request<'_>, payload: &[u8]) -> Result<Frame> {
        if let Some(s) = &self.solo {
            return self.solo_call(s, ino, req, payload);
        }
        let r = self.submit(ino, req, payload).and_then(|p| self.wait(p));
        match r {
            Err(ClientError::Disconnected(_)) if idempotent(req) => {
                self.submit(ino, req, payload).and_then(|p| self.wait(p))
            }
            r => r,
        }
    }

    fn attr_call(&self, ino: u64, req: &Request<'_>) -> Result<Attr> {
        wire::decode_attr(&self.call(ino, req, &[])?.body)
    }

    pub fn lookup(&self, dir: u64, name: &[u8]) -> Result<Attr> {
        self.attr_call(dir, &Request::Lookup { name })
    }

    pub fn getattr(&self, ino: u64) -> Result<Attr> {
        self.attr_call(ino, &Request::Getattr)
    }

    pub fn setattr(&self, ino: u64, a: &SetAttr) -> Result<Attr> {
        let req = wire::setattr_request(a);
        self.attr_call(ino, &req)
    }

    pub fn create(&self, dir: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr> {
        let req = Request::Create {
            mode,
            uid,
            gid,
            name,
        };
        self.attr_call(dir, &req)
    }

    pub fn mkdir(&self, dir: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr> {
        let req = Request::Mkdir {
            mode,
            uid,
            gid,
            name,
        };
        self.attr_call(dir, &req)
    }

    pub fn symlink(
        &self,
        dir: u64,
        name: &[u8],
        target: &[u8],
        uid: u32,
        gid: u32,
    ) -> Result<Attr> {
        let req = Request::Symlink {
            uid,
            gid,
            name,
            target,
        };
        self.attr_call(dir, &req)
    }

    /// Links inode `ino` into `dir` as `name`.
    pub fn link(&self, ino: u64, dir: u64, name: &[u8]) -> Result<Attr> {
        self.attr_call(ino, &Request::Link { dir, name })
    }

    pub fn unlink(&self, dir: u64, name: &[u8]) -> Result<()> {
        self.call(dir, &Request::Unlink { name }, &[]).map(drop)
    }

    pub fn rmdir(&self, dir: u64, name: &[u8]) -> Result<()> {
        self.call(dir, &Request::Rmdir { name }, &[]).map(drop)
    }

    pub fn rename(&self, sdir: u64, sname: &[u8], ddir: u64, dname: &[u8]) -> Result<()> {
        let req = Request::Rename { ddir, sname, dname };
        self.call(sdir, &req, &[]).map(drop)
    }

    pub fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        Ok(self.call(ino, &Request::Readlink, &[])?.body)
    }

    /// Up to `max` entries of `dir` from `cookie` (0 = the start).
    pub fn readdir(&self, dir: u64, cookie: u64, max: u32) -> Result<Vec<DirEntry>> {
        wire::decode_entries(&self.call(dir, &Request::Readdir { cookie, max }, &[])?.body)
    }

    pub fn statfs(&self) -> Result<StatFs> {
        wire::decode_statfs(&self.call(ustor_fs::ROOT_INO, &Request::Statfs, &[])?.body)
    }

    pub fn fsync(&self, ino: u64) -> Result<()> {
        self.call(ino, &Request::Fsync, &[]).map(drop)
    }

    /// Reads up to `len` bytes at `off` (fewer at the end of the file). A
    /// read over 1 MiB goes out as pipelined 1 MiB requests.
    pub fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        if len <= MAX_WRITE {
            let req = Request::Read {
                off,
                len: len as u32,
            };
            return Ok(self.call(ino, &req, &[])?.body);
        }
        let mut out = Vec::with_capacity(len);
        let chunks = chunk(off, len);
        for (i, r) in self.pipeline(ino, &chunks, None)?.into_iter().enumerate() {
            let short = r.body.len() < chunks[i].1;
            out.extend_from_slice(&r.body);
            if short {
                break;
            }
        }
        Ok(out)
    }

    /// Reads up to `out.len()` bytes at `off` into `out` (fewer at the end
    /// of the file); the count. A solo client receives the reply straight
    /// into `out` (the FUSE ring's entry: no copy of ours); any other
    /// client reads and copies.
    pub fn read_into(&self, ino: u64, off: u64, out: &mut [u8]) -> Result<usize> {
        let Some(s) = self.solo.as_ref().filter(|_| out.len() <= MAX_WRITE) else {
            let d = self.read(ino, off, out.len())?;
            out[..d.len()].copy_from_slice(&d);
            return Ok(d.len());
        };
        let req = Request::Read {
            off,
            len: out.len() as u32,
        };
        let (e, n) = self.solo_with(s, &req, |c, tag| {
            let mut head = proto::encode_request(tag, ino, &req);
            if out.len() >= ALIGN_MIN {
                // The data starts where the kernel's copies run fast.
                head[5] = proto::FLAG_ALIGN;
            }
            c.call_into(tag, &head, out)
        })?;
        match e {
            0 => Ok(n),
            e => Err(ClientError::Errno(e as i32)),
        }
    }

    /// Writes `data` at `off`; the payload goes from `data` to the socket
    /// without a copy. Returns the file's attribute after the write when
    /// the server sends it. Over 1 MiB goes out as pipelined requests.
    pub fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<Option<Attr>> {
        let chunks = chunk(off, data.len());
        let frames = if chunks.len() == 1 {
            let req = Request::Write {
                off,
                len: data.len() as u32,
            };
            vec![self.call(ino, &req, data)?]
        } else {
            self.pipeline(ino, &chunks, Some((off, data)))?
        };
        let last = frames.last().map(|f| f.body.as_slice()).unwrap_or(&[]);
        wire::decode_write(last)
    }

    /// Sends every chunk before waiting for any reply; if the connection
    /// breaks, the whole batch (idempotent) is sent once more.
    fn pipeline(
        &self,
        ino: u64,
        chunks: &[(u64, usize)],
        data: Option<(u64, &[u8])>,
    ) -> Result<Vec<Frame>> {
        let once = || -> Result<Vec<Frame>> {
            let mut sent = Vec::with_capacity(chunks.len());
            for &(o, n) in chunks {
                let p = match data {
                    Some((base, d)) => {
                        let s = (o - base) as usize;
                        let req = Request::Write {
                            off: o,
                            len: n as u32,
                        };
                        self.submit(ino, &req, &d[s..s + n])?
                    }
                    None => self.submit(
                        ino,
                        &Request::Read {
                            off: o,
                            len: n as u32,
                        },
                        &[],
                    )?,
                };
                sent.push(p);
            }
            sent.into_iter().map(|p| self.wait(p)).collect()
        };
        match once() {
            Err(ClientError::Disconnected(_)) => once(),
            r => r,
        }
    }
}

/// A reply's errno as the error it is (0: the reply itself).
fn errno(f: Frame) -> Result<Frame> {
    match f.errno {
        0 => Ok(f),
        e => Err(ClientError::Errno(e as i32)),
    }
}

/// Reads of this many bytes or more ask for their data aligned
/// ([`proto::FLAG_ALIGN`]): below it the slow copy costs less than the
/// extra receive of the padding.
const ALIGN_MIN: usize = 32 << 10;

/// Splits `len` bytes at `off` into requests of at most `MAX_WRITE`.
fn chunk(off: u64, len: usize) -> Vec<(u64, usize)> {
    let mut v = Vec::new();
    let mut done = 0;
    loop {
        let n = (len - done).min(MAX_WRITE);
        v.push((off + done as u64, n));
        done += n;
        if done >= len {
            return v;
        }
    }
}

/// A read or write sent and not yet answered ([`Client::start_read`],
/// [`Client::start_write`]); it may be waited for on another thread.
pub struct Started {
    p: Result<Pending>,
    /// A read's inode, offset and length: sent again if the connection broke.
    read: Option<(u64, u64, usize)>,
}

/// A request sent and not yet answered.
struct Pending {
    conn: Arc<Conn>,
    rx: Receiver<Result<Frame>>,
}

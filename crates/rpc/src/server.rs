//! The Unix socket server: one control-plane thread ("ustor-rpc") running a
//! level-triggered epoll loop over the listener, the client connections and
//! an eventfd through which handlers on other threads hand back replies.
//! It never runs on an I/O reactor and never blocks on a client: sockets are
//! nonblocking, reads are budgeted per event, and every buffer is bounded.

use crate::conn::{Conn, ConnLimits, READ_CHUNK_BYTES};
use crate::dispatch::{Completion, MethodTable};
use crate::errors::RpcError;
use crate::sys::{lock_file, unix_listen, Epoll, EventFd};
use serde_json::Value;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// SPDK uses /var/tmp/spdk.sock; ustor keeps the directory, not the name.
pub const DEFAULT_SOCKET_PATH: &str = "/var/tmp/ustor.sock";

const TOKEN_LISTENER: u64 = u64::MAX;
const TOKEN_WAKE: u64 = u64::MAX - 1;
/// Connections accepted per listener event before serving others.
const ACCEPTS_PER_EVENT: usize = 64;
const EVENTS_PER_WAIT: usize = 256;

/// Server settings; `Default` gives SPDK-like values.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub path: PathBuf,
    /// Largest request (one JSON value) accepted, in bytes.
    pub max_request_bytes: usize,
    /// Connected clients at once; more are answered with an error and closed.
    pub max_clients: usize,
    /// Requests (messages) a client may have in flight before the server
    /// stops reading from it.
    pub max_in_flight_per_client: usize,
    /// Unsent reply bytes per client before the server stops reading it.
    pub max_output_bytes_per_client: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            path: PathBuf::from(DEFAULT_SOCKET_PATH),
            max_request_bytes: crate::codec::DEFAULT_MAX_REQUEST_BYTES,
            max_clients: 1024,
            max_in_flight_per_client: 128,
            max_output_bytes_per_client: 16 << 20,
        }
    }
}

impl ServerConfig {
    pub fn with_path(path: impl Into<PathBuf>) -> Self {
        ServerConfig {
            path: path.into(),
            ..Default::default()
        }
    }
}

/// Why the server did not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("another RPC server is already listening on {0}")]
    AlreadyRunning(PathBuf),
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> ServerError + 'a {
    move |source| ServerError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Counters, readable while the server runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Clients connected now.
    pub connections: usize,
    pub accepted: u64,
    /// Clients refused because `max_clients` were connected.
    pub refused: u64,
    /// Top-level messages (requests or batches) dispatched.
    pub messages: u64,
}

/// State shared between the server thread and reply senders.
struct Shared {
    replies: Mutex<Vec<(u64, Option<Value>)>>,
    wake: EventFd,
    stop: AtomicBool,
    connections: AtomicUsize,
    accepted: AtomicU64,
    refused: AtomicU64,
    messages: AtomicU64,
}

impl Shared {
    fn post(&self, token: u64, reply: Option<Value>) {
        self.replies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((token, reply));
        self.wake.signal();
    }
}

/// A running server; dropping it shuts it down.
pub struct ServerHandle {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    path: PathBuf,
}

impl std::fmt::Debug for ServerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerHandle")
            .field("path", &self.path)
            .finish()
    }
}

impl ServerHandle {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn stats(&self) -> ServerStats {
        let s = &self.shared;
        ServerStats {
            connections: s.connections.load(Ordering::Relaxed),
            accepted: s.accepted.load(Ordering::Relaxed),
            refused: s.refused.load(Ordering::Relaxed),
            messages: s.messages.load(Ordering::Relaxed),
        }
    }

    /// Stop accepting, close every client, remove the socket file, and wait
    /// for the server thread. Replies still owed are dropped.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake.signal();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("RPC server thread panicked");
            }
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Start serving `table` on `config.path`.
///
/// Like SPDK, a lock file `<path>.lock` guards the path; a socket file left
/// by a dead server is replaced, a live server (one that accepts a
/// connection) makes this fail, and a non-socket file is never removed.
pub fn start(config: ServerConfig, table: MethodTable) -> Result<ServerHandle, ServerError> {
    let path = config.path.clone();
    let lock_path = lock_path_for(&path);
    let lock = lock_file(&lock_path)
        .map_err(io_err("cannot open lock file", &lock_path))?
        .ok_or_else(|| ServerError::AlreadyRunning(path.clone()))?;
    remove_stale_socket(&path)?;
    let backlog = i32::try_from(config.max_clients.clamp(128, 4096)).unwrap_or(1024);
    let listener = unix_listen(&path, 0o600, backlog).map_err(io_err("cannot listen on", &path))?;
    let ino = std::fs::metadata(&path).map(|m| (m.dev(), m.ino())).ok();
    let epoll = Epoll::new().map_err(io_err("epoll_create for", &path))?;
    let wake = EventFd::new().map_err(io_err("eventfd for", &path))?;
    let ev_in = libc::EPOLLIN as u32;
    epoll
        .add(listener.as_raw_fd(), ev_in, TOKEN_LISTENER)
        .and_then(|()| epoll.add(wake.raw(), ev_in, TOKEN_WAKE))
        .map_err(io_err("epoll_ctl for", &path))?;
    let shared = Arc::new(Shared {
        replies: Mutex::new(Vec::new()),
        wake,
        stop: AtomicBool::new(false),
        connections: AtomicUsize::new(0),
        accepted: AtomicU64::new(0),
        refused: AtomicU64::new(0),
        messages: AtomicU64::new(0),
    });
    let mut lp = Loop {
        epoll,
        listener,
        shared: shared.clone(),
        table,
        conns: Vec::new(),
        gens: Vec::new(),
        free: Vec::new(),
        config,
    };
    let owned = Owned {
        path: path.clone(),
        lock_path,
        ino,
        _lock: lock,
    };
    let thread = std::thread::Builder::new()
        .name("ustor-rpc".into())
        .spawn(move || {
            lp.run();
            drop(lp);
            owned.remove();
        })
        .map_err(io_err("cannot spawn server thread for", &path))?;
    tracing::info!("RPC server listening on {}", path.display());
    Ok(ServerHandle {
        shared,
        thread: Some(thread),
        path,
    })
}

fn lock_path_for(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".lock");
    PathBuf::from(s)
}

fn remove_stale_socket(path: &Path) -> Result<(), ServerError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err("cannot stat", path)(e)),
    };
    if !meta.file_type().is_socket() {
        return Err(ServerError::NotASocket(path.to_path_buf()));
    }
    // A server that does not use our lock file (an older ustor, or SPDK
    // itself pointed at the same path) still answers connect().
    if UnixStream::connect(path).is_ok() {
        return Err(ServerError::AlreadyRunning(path.to_path_buf()));
    }
    std::fs::remove_file(path).map_err(io_err("cannot remove stale socket", path))
}

/// Files the server owns and removes on shutdown.
struct Owned {
    path: PathBuf,
    lock_path: PathBuf,
    /// Identity of our socket file: never remove a successor's socket.
    ino: Option<(u64, u64)>,
    _lock: OwnedFd,
}

impl Owned {
    fn remove(self) {
        let same = std::fs::metadata(&self.path)
            .map(|m| Some((m.dev(), m.ino())) == self.ino)
            .unwrap_or(false);
        if same {
            let _ = std::fs::remove_file(&self.path);
        }
        let _ = std::fs::remove_file(&self.lock_path);
        tracing::info!("RPC server on {} stopped", self.path.display());
    }
}

struct Loop {
    epoll: Epoll,
    listener: UnixListener,
    shared: Arc<Shared>,
    table: MethodTable,
    conns: Vec<Option<Conn>>,
    /// Generation per slot, so a late reply never reaches a reused slot.
    gens: Vec<u32>,
    free: Vec<usize>,
    config: ServerConfig,
}

fn token(idx: usize, gen: u32) -> u64 {
    (u64::from(gen) << 32) | idx as u64
}

impl Loop {
    fn run(&mut self) {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; EVENTS_PER_WAIT];
        let mut buf = vec![0u8; READ_CHUNK_BYTES];
        while !self.shared.stop.load(Ordering::Acquire) {
            let n = match self.epoll.wait(&mut events, -1) {
                Ok(n) => n,
                Err(e) => {
                    tracing::error!("RPC server epoll_wait failed: {e}");
                    break;
                }
            };
            for ev in &events[..n] {
                let (tok, flags) = (ev.u64, ev.events);
                match tok {
                    TOKEN_LISTENER => self.accept(),
                    TOKEN_WAKE => self.shared.wake.drain(),
                    t => self.on_conn_event(t, flags, &mut buf),
                }
            }
            self.deliver_replies();
        }
        // Dropping the connections closes them; clients see EOF.
        self.conns.clear();
        self.shared.connections.store(0, Ordering::Relaxed);
    }

    fn completion(&self, tok: u64) -> Completion {
        let shared = self.shared.clone();
        Arc::new(move |reply| shared.post(tok, reply))
    }

    fn accept(&mut self) {
        for _ in 0..ACCEPTS_PER_EVENT {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE and friends: log and retry on the next event
                    // rather than spinning here.
                    tracing::warn!("RPC accept failed: {e}");
                    return;
                }
            };
            if self.shared.connections.load(Ordering::Relaxed) >= self.config.max_clients {
                self.refuse(stream);
                continue;
            }
            if let Err(e) = self.add_conn(stream) {
                tracing::warn!("RPC client setup failed: {e}");
            }
        }
    }

    /// Tell an over-limit client why, best effort, and close it.
    fn refuse(&self, mut stream: UnixStream) {
        self.shared.refused.fetch_add(1, Ordering::Relaxed);
        let e = RpcError::errno_msg(
            libc::EBUSY,
            format!(
                "Too many RPC clients: the limit is {}; try again later",
                self.config.max_clients
            ),
        );
        let reply = crate::codec::encode_response(Value::Null, Err(e));
        let _ = stream.set_nonblocking(true);
        let _ = stream.write_all(format!("{reply}\n").as_bytes());
    }

    fn add_conn(&mut self, stream: UnixStream) -> io::Result<()> {
        stream.set_nonblocking(true)?;
        let limits = ConnLimits {
            max_request_bytes: self.config.max_request_bytes,
            max_in_flight: self.config.max_in_flight_per_client.max(1),
            max_output_bytes: self.config.max_output_bytes_per_client.max(1),
        };
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.conns.push(None);
                self.gens.push(0);
                self.conns.len() - 1
            }
        };
        self.gens[idx] = self.gens[idx].wrapping_add(1);
        let tok = token(idx, self.gens[idx]);
        let mut conn = Conn::new(stream, limits);
        conn.interest = conn.wanted_interest();
        if let Err(e) = self.epoll.add(conn.stream.as_raw_fd(), conn.interest, tok) {
            self.free.push(idx);
            return Err(e);
        }
        self.conns[idx] = Some(conn);
        self.shared.connections.fetch_add(1, Ordering::Relaxed);
        self.shared.accepted.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn slot(&mut self, tok: u64) -> Option<usize> {
        let idx = (tok & 0xffff_ffff) as usize;
        let gen = (tok >> 32) as u32;
        (self.gens.get(idx) == Some(&gen) && matches!(self.conns.get(idx), Some(Some(_))))
            .then_some(idx)
    }

    fn on_conn_event(&mut self, tok: u64, flags: u32, buf: &mut [u8]) {
        let Some(idx) = self.slot(tok) else { return };
        let mk = self.completion(tok);
        let mk = move || mk.clone();
        let table = self.table.clone();
        let Some(conn) = self.conns[idx].as_mut() else {
            return;
        };
        let dispatched_before = conn.in_flight;
        if flags & (libc::EPOLLIN | libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0 {
            conn.on_readable(buf, &table, &mk);
        }
        // HUP: the peer closed both directions. Whatever it sent has been
        // read and dispatched above; nobody is left to read replies.
        if flags & (libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0 {
            conn.dead = true;
        }
        let dispatched = conn.in_flight.saturating_sub(dispatched_before);
        self.shared
            .messages
            .fetch_add(dispatched as u64, Ordering::Relaxed);
        self.settle(idx, tok);
    }

    /// Flush output, then close or re-arm the connection as its state says.
    fn settle(&mut self, idx: usize, tok: u64) {
        let Some(conn) = self.conns[idx].as_mut() else {
            return;
        };
        conn.flush();
        if conn.done() {
            let _ = self.epoll.delete(conn.stream.as_raw_fd());
            self.conns[idx] = None;
            self.free.push(idx);
            self.shared.connections.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        let want = conn.wanted_interest();
        if want != conn.interest {
            if self
                .epoll
                .modify(conn.stream.as_raw_fd(), want, tok)
                .is_err()
            {
                conn.dead = true;
                return self.settle(idx, tok);
            }
            conn.interest = want;
        }
    }

    fn deliver_replies(&mut self) {
        let batch = std::mem::take(
            &mut *self
                .shared
                .replies
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        for (tok, reply) in batch {
            let Some(idx) = self.slot(tok) else { continue };
            let mk = self.completion(tok);
            let mk = move || mk.clone();
            let table = self.table.clone();
            if let Some(conn) = self.conns[idx].as_mut() {
                conn.complete(reply);
                let before = conn.in_flight;
                // Budget freed: dispatch requests that were waiting in the
                // buffer.
                conn.pump(&table, &mk);
                let n = conn.in_flight.saturating_sub(before);
                self.shared.messages.fetch_add(n as u64, Ordering::Relaxed);
            }
            self.settle(idx, tok);
        }
    }
}

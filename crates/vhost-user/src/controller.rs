//! A vhost-user-blk controller and its lifecycle (create, stop), and the
//! [`Endpoint`] every controller type serves on: its Unix socket and the
//! control thread that serves one frontend at a time on it.
//!
//! Control messages are rare and `BackendReqHandler::handle_request` is
//! synchronous (and so are ring stops, which wait for the ring's reactor):
//! each controller has one control thread that blocks on its socket, so
//! no reactor ever waits on a frontend and an idle controller costs no CPU.
//! The data path (the rings) runs on the reactors. One frontend at a time
//! (a second one waits in the listen backlog until the first leaves); a
//! frontend must send its first message within [`HANDSHAKE_TIMEOUT`] and
//! finish any message it starts within [`MESSAGE_TIMEOUT`].

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use ustor_bdev::Registry;
use ustor_runtime::RuntimeHandle;
use vhost::vhost_user::{BackendReqHandler, Error as VuError};

use crate::backend::{Backend, VhostDevice};
use crate::device::BlkDevice;
use crate::VhostError;

/// A frontend must send its first message within this after connecting.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A message once begun must arrive whole within this.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(5);

/// What `vhost_create_blk_controller` asks for.
#[derive(Clone, Debug)]
pub struct BlkControllerConfig {
    pub name: String,
    pub socket: PathBuf,
    pub bdev: String,
    /// Reactors the rings are spread over (ring `i` on `reactors[i % n]`).
    pub reactors: Vec<usize>,
    pub read_only: bool,
    pub num_queues: u16,
    /// How long a busy ring polls after its last request before sleeping.
    pub poll_window: Duration,
    /// Offer packed virtqueues (VIRTIO_F_RING_PACKED) besides split ones.
    pub packed_ring: bool,
}

/// A running controller.
pub struct BlkController {
    pub config: BlkControllerConfig,
    dev: Arc<BlkDevice>,
    ep: Endpoint,
}

impl BlkController {
    /// Opens and claims the bdev, binds the socket (replacing a stale one)
    /// and starts serving.
    pub fn create(
        registry: &Registry,
        rt: RuntimeHandle,
        config: BlkControllerConfig,
    ) -> Result<Arc<BlkController>, VhostError> {
        if config.num_queues == 0 || config.num_queues > 64 {
            return Err(VhostError::Invalid("num_queues must be 1..=64".into()));
        }
        if config.reactors.is_empty() {
            return Err(VhostError::Invalid("cpumask selects no reactor".into()));
        }
        // The bdev's events (resize, hot-remove) go to the device, made
        // after the open.
        let target: Arc<OnceLock<Weak<BlkDevice>>> = Arc::default();
        let t = target.clone();
        let desc = registry.open(&config.bdev, !config.read_only, move |ev| {
            if let Some(d) = t.get().and_then(Weak::upgrade) {
                d.on_event(ev);
            }
        })?;
        desc.claim(&format!("vhost controller {}", config.name))?;
        let mut dev = BlkDevice::new(desc, config.num_queues, config.read_only);
        dev.poll_window = config.poll_window;
        dev.packed_ring = config.packed_ring;
        let dev = Arc::new(dev);
        let _ = target.set(Arc::downgrade(&dev));
        let ep = Endpoint::start(
            &config.name,
            &config.socket,
            dev.clone(),
            rt,
            config.reactors.clone(),
        )
        .inspect_err(|_| dev.desc.release_claim())?;
        Ok(Arc::new(BlkController { config, dev, ep }))
    }

    pub fn device(&self) -> &Arc<BlkDevice> {
        &self.dev
    }

    /// Whether a frontend is connected now.
    pub fn connected(&self) -> bool {
        self.ep.connected()
    }

    /// The connected frontend's process ID (SO_PEERCRED), when one is
    /// connected.
    pub fn frontend_pid(&self) -> Option<i32> {
        self.ep.frontend_pid()
    }

    /// Frontends served since creation.
    pub fn connections_served(&self) -> u64 {
        self.ep.connections_served()
    }

    /// Disconnects the frontend (its rings drain first), stops listening,
    /// removes the socket and releases the bdev. Idempotent.
    pub fn stop(&self) {
        if self.ep.stop() {
            self.dev.desc.release_claim();
        }
    }
}

impl Drop for BlkController {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A controller's socket and the control thread serving it, whatever the
/// device type.
pub(crate) struct Endpoint {
    socket: PathBuf,
    listener_fd: RawFd,
    _listener: UnixListener,
    conn: Arc<Mutex<Option<UnixStream>>>,
    stopping: Arc<AtomicBool>,
    connections: Arc<AtomicU64>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Endpoint {
    /// Binds `socket` (replacing a stale one) and serves `dev` on it.
    pub(crate) fn start<D: VhostDevice>(
        name: &str,
        socket: &Path,
        dev: Arc<D>,
        rt: RuntimeHandle,
        reactors: Vec<usize>,
    ) -> Result<Endpoint, VhostError> {
        let listener = bind(socket).map_err(VhostError::Socket)?;
        let own = listener.try_clone().map_err(VhostError::Socket)?;
        let ep = Endpoint {
            socket: socket.to_path_buf(),
            listener_fd: own.as_raw_fd(),
            _listener: own,
            conn: Arc::default(),
            stopping: Arc::default(),
            connections: Arc::default(),
            thread: Mutex::new(None),
        };
        let (conn, stopping, count) =
            (ep.conn.clone(), ep.stopping.clone(), ep.connections.clone());
        let t = std::thread::Builder::new()
            .name(format!("vhost-{name}"))
            .spawn(move || serve(listener, dev, rt, reactors, conn, stopping, count))
            .map_err(VhostError::Socket)?;
        *ep.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(t);
        Ok(ep)
    }

    pub(crate) fn connected(&self) -> bool {
        self.conn.lock().map(|c| c.is_some()).unwrap_or(false)
    }

    /// The connected frontend's process ID (SO_PEERCRED).
    pub(crate) fn frontend_pid(&self) -> Option<i32> {
        let g = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let fd = g.as_ref()?.as_raw_fd();
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: getsockopt on a socket we hold open (the lock keeps it),
        // writing at most `len` bytes into `cred`.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&mut cred as *mut libc::ucred).cast(),
                &mut len,
            )
        };
        (r == 0).then_some(cred.pid)
    }

    pub(crate) fn connections_served(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// Disconnects the frontend (its rings drain first), stops listening
    /// and removes the socket; true the first time (the caller then
    /// releases what the device holds).
    pub(crate) fn stop(&self) -> bool {
        self.stopping.store(true, Ordering::Release);
        // SAFETY: shutdown on a socket we own; wakes the blocked accept.
        unsafe { libc::shutdown(self.listener_fd, libc::SHUT_RDWR) };
        if let Some(s) = self.conn.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let t = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(t) = t else { return false };
        let _ = t.join();
        let _ = std::fs::remove_file(&self.socket);
        true
    }
}

fn bind(path: &Path) -> std::io::Result<UnixListener> {
    // A socket file left by a killed process: connecting fails, so it is
    // stale and may go (a live one is refused as in use).
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::from_raw_os_error(libc::EADDRINUSE));
        }
        std::fs::remove_file(path)?;
    }
    UnixListener::bind(path)
}

/// The control thread: one frontend at a time until stopped.
fn serve<D: VhostDevice>(
    listener: UnixListener,
    dev: Arc<D>,
    rt: RuntimeHandle,
    reactors: Vec<usize>,
    conn: Arc<Mutex<Option<UnixStream>>>,
    stopping: Arc<AtomicBool>,
    count: Arc<AtomicU64>,
) {
    while !stopping.load(Ordering::Acquire) {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(_) if stopping.load(Ordering::Acquire) => break,
            Err(e) => {
                tracing::warn!("vhost: accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if !wait_readable(&stream, Some(HANDSHAKE_TIMEOUT)) {
            tracing::warn!("vhost: frontend sent nothing within {HANDSHAKE_TIMEOUT:?}; closed");
            continue;
        }
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        *conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(clone);
        if stopping.load(Ordering::Acquire) {
            break;
        }
        count.fetch_add(1, Ordering::Relaxed);
        let _ = stream.set_read_timeout(Some(MESSAGE_TIMEOUT));
        let backend = Arc::new(Mutex::new(Backend::new(
            dev.clone(),
            rt.clone(),
            reactors.clone(),
        )));
        let mut h = BackendReqHandler::from_stream(stream, backend.clone());
        serve_frontend(&mut h, &dev);
        backend.lock().unwrap_or_else(|e| e.into_inner()).reset();
        dev.set_notifier(None);
        *conn.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// Handles messages until the frontend leaves or breaks the protocol.
fn serve_frontend<D: VhostDevice>(h: &mut BackendReqHandler<Mutex<Backend<D>>>, dev: &D) {
    let fd = h.as_raw_fd();
    loop {
        if !wait_fd(fd, None) {
            return;
        }
        match crate::notify::take_backend_channel(fd) {
            Ok(None) => {}
            Ok(Some(ch)) => {
                dev.set_notifier(Some(ch));
                continue;
            }
            Err(e) => {
                tracing::debug!("vhost: SET_BACKEND_REQ_FD: {e}");
                return;
            }
        }
        match h.handle_request() {
            Ok(()) => {}
            Err(e) if ends_connection(&e) => return,
            // A request refused (answered with an error where the
            // protocol has a reply); the connection goes on.
            Err(e) => tracing::debug!("vhost: request refused: {e}"),
        }
    }
}

/// Errors after which the connection cannot go on: the frontend left, or
/// the byte stream no longer holds whole messages.
pub(crate) fn ends_connection(e: &VuError) -> bool {
    matches!(
        e,
        VuError::Disconnected
            | VuError::PartialMessage
            | VuError::SocketBroken(_)
            | VuError::SocketError(_)
            | VuError::SocketRetry(_)
            | VuError::InvalidMessage
            | VuError::IncorrectFds
            | VuError::OversizedMsg
    )
}

fn wait_readable(s: &UnixStream, timeout: Option<Duration>) -> bool {
    wait_fd(s.as_raw_fd(), timeout)
}

/// Blocks until `fd` is readable (or hung up); false on timeout or error.
fn wait_fd(fd: RawFd, timeout: Option<Duration>) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.map(|d| d.as_millis() as i32).unwrap_or(-1);
    loop {
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        return r > 0;
    }
}

//! An export over raw Ethernet (`fs_export` with transport "xdp"): one
//! AF_XDP socket on an interface's queue, served by a task on a reactor.
//!
//! The socket's UMEM is a scratch area (receive and send buffers) followed
//! by a second shared mapping of the volume's region file: the same pages
//! the file system sees, so a write's payload frames are placed by the
//! kernel straight into the blocks `Fs::begin_write` planned
//! ([`crate::xdp_wire`] says how). The task polls the receive ring while
//! frames come; after [`SPIN`] empty passes it sleeps on the socket's fd
//! through the reactor's io_uring (a poll), unless the export asked for
//! busy polling. Nothing else wakes an idle export but a [`Notify`]
//! (`stop`, a request finished on the offload pool) and the engine's own
//! deadlines (a grant's, idle sessions'). Requests run in [`session`].

mod session;

use std::future::Future;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use ustor_net::xdp::{self, AttachMode, Desc, XdpProgram, XskConfig, XskSocket};
use ustor_runtime::RuntimeHandle;

use super::{ExportSvc, FsServerError};
use crate::xdp_wire::{self as w, ETHERTYPE};

/// Bytes of the UMEM before the region: receive buffers, then send
/// buffers, a chunk each ([`w::chunk_for`]: up to a page).
const SCRATCH: u64 = 8 << 20;
const RX_BUFS: u64 = 1024;
const TX_BUFS: u64 = 512;
/// Ring slots: room for every receive buffer plus the placement slots of
/// a 1 MiB write (about 700) and a re-grant of it.
const RING: u32 = 4096;
/// Empty passes before the task sleeps on the fd.
const SPIN: u32 = 64;

/// Counters of an xdp export (`fs_get_stats`'s `xdp`).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub frames_rx: AtomicU64,
    pub frames_tx: AtomicU64,
    /// Payload bytes the kernel placed straight into the region.
    pub placed_bytes: AtomicU64,
    /// Payload bytes we copied: write fragments into the region, read
    /// data into send buffers.
    pub copied_bytes: AtomicU64,
    /// Grants sent again and replies resent for a repeated request id.
    pub retransmits: AtomicU64,
    /// Frames dropped: malformed, of no session, out of step.
    pub drops: AtomicU64,
    pub sessions: AtomicU64,
    /// Placements whose client went silent: the socket was rebuilt.
    pub grants_expired: AtomicU64,
    /// Sessions dropped after [`session::SESSION_IDLE`] with no frame.
    pub sessions_expired: AtomicU64,
}

/// `fs_get_stats`'s `xdp` object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct XdpStatsInfo {
    pub frames_rx: u64,
    pub frames_tx: u64,
    pub placed_bytes: u64,
    pub copied_bytes: u64,
    pub retransmits: u64,
    pub drops: u64,
    pub sessions: u64,
    #[serde(default)]
    pub grants_expired: u64,
    #[serde(default)]
    pub sessions_expired: u64,
}

impl Counters {
    pub(crate) fn info(&self) -> XdpStatsInfo {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        XdpStatsInfo {
            frames_rx: l(&self.frames_rx),
            frames_tx: l(&self.frames_tx),
            placed_bytes: l(&self.placed_bytes),
            copied_bytes: l(&self.copied_bytes),
            retransmits: l(&self.retransmits),
            drops: l(&self.drops),
            sessions: l(&self.sessions),
            grants_expired: l(&self.grants_expired),
            sessions_expired: l(&self.sessions_expired),
        }
    }
}

pub(crate) fn bump(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

/// A running xdp export; dropping it stops the task and detaches the
/// program.
pub(crate) struct XdpExport {
    pub ifname: String,
    pub counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    notify: Arc<Notify>,
}

impl Drop for XdpExport {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.notify.wake();
    }
}

/// Wakes the export's task from another thread (the control thread's
/// `stop`, the offload pool's finished requests).
#[derive(Default)]
pub(crate) struct Notify {
    flag: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Notify {
    pub(crate) fn wake(&self) {
        self.flag.store(true, Ordering::Release);
        let w = self.waker.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = w {
            w.wake();
        }
    }

    fn poll(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.flag.swap(false, Ordering::AcqRel) {
            return Poll::Ready(());
        }
        *self.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(cx.waker().clone());
        // A wake between the check and the store found no waker.
        if self.flag.swap(false, Ordering::AcqRel) {
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

/// The UMEM mapping: anonymous scratch, then the region file mapped again.
struct Umem {
    ptr: *mut u8,
    len: usize,
}

impl Drop for Umem {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map_umem` mapped; the socket that
        // registered it is dropped first (field order of `Engine`).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn map_umem(path: &Path, region: u64) -> std::io::Result<Umem> {
    let len = (SCRATCH + region) as usize;
    // SAFETY: a fresh anonymous mapping for the whole UMEM.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let umem = Umem {
        ptr: ptr.cast(),
        len,
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    // SAFETY: replaces the tail of our own fresh mapping with a shared
    // mapping of the region file (the same page cache pages the volume's
    // mapping uses).
    let r = unsafe {
        libc::mmap(
            umem.ptr.add(SCRATCH as usize).cast(),
            region as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            f.as_raw_fd(),
            0,
        )
    };
    if r == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(umem)
}

/// Parameters of an xdp export beyond `ExportParams` (parsed from
/// `listen`: `IFNAME` or `IFNAME:QUEUE`).
#[derive(Debug, Clone)]
pub(crate) struct XdpParams {
    pub ifname: String,
    pub queue: u32,
    pub busy_poll: bool,
    pub native: bool,
    pub max_sessions: usize,
    /// The MTU its frames may use ([`w::frame_for_mtu`]).
    pub mtu: usize,
    /// How long to keep polling after the last busy pass (`spin_us`).
    pub spin: Duration,
}

impl XdpParams {
    pub(crate) fn parse(listen: &str) -> Result<(String, u32), FsServerError> {
        let (name, q) = match listen.rsplit_once(':') {
            Some((n, q)) => (
                n,
                q.parse()
                    .map_err(|_| FsServerError::Invalid(format!("queue in {listen}")))?,
            ),
            None => (listen, 0),
        };
        if name.is_empty() || name.len() > 15 {
            return Err(FsServerError::Invalid(format!("interface name {name}")));
        }
        Ok((name.to_string(), q))
    }
}

fn xdp_err(e: xdp::XdpError) -> FsServerError {
    match e {
        xdp::XdpError::Sys { what, source } => FsServerError::Io(std::io::Error::new(
            source.kind(),
            format!("{what}: {source}"),
        )),
        e => FsServerError::Invalid(e.to_string()),
    }
}

/// Starts serving `svc` on the interface (in this thread's namespace).
pub(crate) fn start(
    rt: &RuntimeHandle,
    reactor: usize,
    svc: Arc<ExportSvc>,
    p: &XdpParams,
) -> Result<XdpExport, FsServerError> {
    let idx = xdp::ifindex(&p.ifname).map_err(xdp_err)?;
    let mac = xdp::mac_address(&p.ifname).map_err(xdp_err)?;
    let if_mtu = xdp::mtu(&p.ifname).map_err(xdp_err)? as usize;
    if p.mtu < 1500 || p.mtu > if_mtu {
        return Err(FsServerError::Invalid(format!(
            "mtu {} (from 1500 up to {}'s, {if_mtu})",
            p.mtu, p.ifname
        )));
    }
    let frame = w::frame_for_mtu(p.mtu);
    let umem = map_umem(&svc.vol.path, svc.vol.size)?;
    let mut cfg = XskConfig::new(idx, p.queue);
    let (chunk, headroom) = w::chunk_for(frame);
    (cfg.chunk_size, cfg.headroom, cfg.ring_size) = (chunk, headroom, RING);
    // SAFETY: `umem` is page-aligned, read-write, and moves into the
    // engine with the socket, which drops first.
    let xsk = unsafe { XskSocket::with_area(cfg, umem.ptr, umem.len) }.map_err(xdp_err)?;
    let mode = if p.native {
        AttachMode::Native
    } else {
        AttachMode::Generic
    };
    let prog = XdpProgram::attach(idx, ETHERTYPE, p.queue + 1, mode).map_err(xdp_err)?;
    prog.register(p.queue, xsk.as_raw_fd()).map_err(xdp_err)?;
    let counters = Arc::new(Counters::default());
    let stop = Arc::new(AtomicBool::new(false));
    let notify = Arc::new(Notify::default());
    let inbox = Arc::new(session::Inbox::new(notify.clone()));
    let engine = session::Engine::new(
        xsk,
        prog,
        umem,
        svc,
        mac,
        counters.clone(),
        p.max_sessions,
        inbox,
        frame,
    )?;
    let (busy, spin, st, nt) = (p.busy_poll, p.spin, stop.clone(), notify.clone());
    // The engine holds raw pointers (not Send): hand it over in a box the
    // reactor thread alone unpacks.
    let cell = SendCell(engine);
    rt.spawn_on(reactor, move || {
        let cell = cell;
        run(cell.0, busy, spin, st, nt)
    })
    .map_err(|e| FsServerError::Invalid(format!("reactor: {e:?}")))?;
    Ok(XdpExport {
        ifname: p.ifname.clone(),
        counters,
        stop,
        notify,
    })
}

struct SendCell(session::Engine);
// SAFETY: the engine is moved to one reactor thread before first use and
// never shared; its raw pointers are into mappings it owns.
unsafe impl Send for SendCell {}

/// The reactor task: poll while busy, sleep on the fd when idle (after
/// [`SPIN`] empty passes and `spin` since the last busy one).
async fn run(
    mut e: session::Engine,
    busy_poll: bool,
    spin: Duration,
    stop: Arc<AtomicBool>,
    notify: Arc<Notify>,
) {
    let mut idle = 0u32;
    let mut busy_at = Instant::now();
    // One poll of the fd at a time, kept across waits that ended by the
    // timer or a notification (a dropped op would stay in flight).
    let mut ready = None;
    while !stop.load(Ordering::Acquire) {
        if e.step() {
            idle = 0;
            if !spin.is_zero() {
                busy_at = Instant::now();
            }
            ustor_runtime::yield_now().await;
            continue;
        }
        idle = idle.saturating_add(1);
        if busy_poll || idle < SPIN {
            ustor_runtime::yield_now().await;
            continue;
        }
        if !spin.is_zero() && busy_at.elapsed() < spin {
            // The kernel's CPU too: a client on this CPU (everything
            // pinned to one) runs instead of waiting for our time slice
            // to end, which made a spin without it cost 2x at QD1.
            std::thread::yield_now();
            ustor_runtime::yield_now().await;
            continue;
        }
        let fd = ready
            .get_or_insert_with(|| ustor_runtime::ops::poll_ready(e.fd(), libc::POLLIN as u32));
        if idle_wait(fd, e.next_wake(), &notify).await {
            ready = None;
        }
    }
}

/// Sleeps until a frame comes (the poll `fd` completes: returns true),
/// `notify` is woken, or `wake`.
async fn idle_wait<F: Future + Unpin>(fd: &mut F, wake: Option<Instant>, notify: &Notify) -> bool {
    let mut timer = wake.map(|t| ustor_runtime::sleep(t.saturating_duration_since(Instant::now())));
    std::future::poll_fn(|cx| {
        if Pin::new(&mut *fd).poll(cx).is_ready() {
            return Poll::Ready(true);
        }
        let fired = timer
            .as_mut()
            .is_some_and(|t| Pin::new(t).poll(cx).is_ready());
        if fired || notify.poll(cx).is_ready() {
            return Poll::Ready(false);
        }
        Poll::Pending
    })
    .await
}

/// The engine's descriptor of a frame it sends from buffer `addr`.
pub(crate) fn desc(addr: u64, len: usize) -> Desc {
    Desc {
        addr,
        len: len as u32,
    }
}

pub(crate) const fn scratch() -> (u64, u64, u64) {
    (SCRATCH, RX_BUFS, TX_BUFS)
}

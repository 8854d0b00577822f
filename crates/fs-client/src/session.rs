//! A FUSE session of our own: the mount (mount(2) as root, else
//! fusermount3 handing us the /dev/fuse descriptor), the /dev/fuse loop
//! (INIT, and every request the kernel sends there), and in uring mode one
//! `fuse_uring::Queues` per possible CPU, each on a thread pinned to its
//! CPU: a request goes to the queue of the CPU its caller runs on, so the
//! commit that wakes the caller is made on that CPU. Both paths decode
//! with [`crate::ll`] and answer through the same dispatcher
//! ([`FuseFs::dispatch`]).
//!
//! Why not fuser: its parser is private, it cannot ask for
//! FUSE_OVER_IO_URING, and its replies are typed (a ring reply is bytes in
//! a queue entry); one decoder and one dispatcher for both modes is less
//! code than an adapter per mode.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use crate::fuse::{FuseFs, Reply};
use crate::fuse_uring::{self, Body, Queues};
use crate::ll::{self, init_flags, Op};
use crate::RemoteFs;

/// Which FUSE transport the mount runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FuseMode {
    /// Requests read from and answered on /dev/fuse.
    Classic,
    /// FUSE over io_uring (fails when the kernel does not offer it).
    Uring,
    /// The ring when `/sys/module/fuse/parameters/enable_uring` is Y and
    /// the kernel offers it at INIT, else classic.
    Auto,
}

impl std::str::FromStr for FuseMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "classic" => Ok(Self::Classic),
            "uring" => Ok(Self::Uring),
            "auto" => Ok(Self::Auto),
            _ => Err(format!("{s}: expected classic, uring or auto")),
        }
    }
}

/// Ring entries per queue: requests of one CPU wait in them while its
/// thread answers the one before.
const PER_QUEUE: usize = 2;
/// Room for the largest request on /dev/fuse: a write's headers and data.
const DEV_BUF: usize = ustor_fs::MAX_WRITE + 4096;

/// Runs once FUSE is initialised, with the mode it runs in.
pub type OnInit = Box<dyn FnOnce(&Stats) + Send>;

/// What a session did (printed by `ustor fs mount` when it ends).
#[derive(Debug, Default)]
pub struct Stats {
    /// The mode the kernel granted: set at INIT.
    pub uring: std::sync::atomic::AtomicBool,
    /// Queues registered on the ring.
    pub queues: AtomicUsize,
    /// Requests answered through the ring.
    pub ring_commits: Arc<AtomicU64>,
    /// Requests read from /dev/fuse (INIT included).
    pub dev_requests: AtomicU64,
}

impl Stats {
    pub fn mode(&self) -> &'static str {
        if self.uring.load(Ordering::Relaxed) {
            "uring"
        } else {
            "classic"
        }
    }
}

/// A /dev/fuse reply: `fuse_out_header` and the body, one writev.
struct DevReply {
    dev: Arc<File>,
    unique: u64,
}

impl Reply for DevReply {
    fn send(self, errno: i32, body: &[&[u8]]) {
        let n: usize = if errno == 0 {
            body.iter().map(|b| b.len()).sum()
        } else {
            0
        };
        let head = ll::out_header(self.unique, errno, n);
        let mut iov = vec![libc::iovec {
            iov_base: head.as_ptr() as *mut _,
            iov_len: head.len(),
        }];
        if errno == 0 {
            iov.extend(body.iter().map(|b| libc::iovec {
                iov_base: b.as_ptr() as *mut _,
                iov_len: b.len(),
            }));
        }
        // SAFETY: the iovecs name live buffers borrowed for the call. The
        // error (ENOENT: the request was interrupted meanwhile) needs no
        // handling: the kernel already gave up on it.
        unsafe { libc::writev(self.dev.as_raw_fd(), iov.as_ptr(), iov.len() as i32) };
    }
}

/// A ring reply: handed back to the queue's thread, which writes it into
/// the entry and commits it.
struct RingReply(mpsc::SyncSender<fuse_uring::Answer>);

impl Reply for RingReply {
    fn send(self, errno: i32, body: &[&[u8]]) {
        let _ = self.0.send((errno, body.concat()));
    }
}

/// A mounted FUSE connection: its descriptor and how to unmount it.
pub struct Mounted {
    pub dev: Arc<File>,
    mountpoint: PathBuf,
    root: bool,
}

// SAFETY: geteuid has no preconditions.
fn is_root() -> bool {
    unsafe { libc::geteuid() == 0 }
}

/// Mounts `mountpoint` with the mount options `opts` (fsname, subtype,
/// default_permissions, allow_other...).
pub fn mount(mountpoint: &Path, fsname: &str, opts: &str) -> io::Result<Mounted> {
    let root = is_root();
    let dev = if root {
        mount_sys(mountpoint, fsname, opts)?
    } else {
        fusermount(mountpoint, &format!("fsname={fsname},subtype=ustor,{opts}"))?
    };
    Ok(Mounted {
        dev: Arc::new(dev),
        mountpoint: mountpoint.to_path_buf(),
        root,
    })
}

fn cstr(b: &[u8]) -> io::Result<std::ffi::CString> {
    std::ffi::CString::new(b).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn mount_sys(mp: &Path, fsname: &str, opts: &str) -> io::Result<File> {
    let dev = File::options().read(true).write(true).open("/dev/fuse")?;
    // SAFETY: getuid/getgid have no preconditions.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let data = format!(
        "fd={},rootmode=40000,user_id={uid},group_id={gid},{opts}",
        dev.as_raw_fd()
    );
    let (src, tgt) = (cstr(fsname.as_bytes())?, cstr(mp.as_os_str().as_bytes())?);
    let (ty, data) = (cstr(b"fuse.ustor")?, cstr(data.as_bytes())?);
    // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            ty.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            data.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(dev)
}

/// fusermount3 mounts for an unprivileged user and passes the /dev/fuse
/// descriptor back over the socket named by `_FUSE_COMMFD`.
fn fusermount(mp: &Path, opts: &str) -> io::Result<File> {
    let (ours, theirs) = UnixStream::pair()?;
    // The child's end must survive exec.
    // SAFETY: fcntl on a descriptor we own.
    unsafe { libc::fcntl(theirs.as_raw_fd(), libc::F_SETFD, 0) };
    let st = Command::new("fusermount3")
        .arg("-o")
        .arg(opts)
        .arg("--")
        .arg(mp)
        .env("_FUSE_COMMFD", theirs.as_raw_fd().to_string())
        .status()?;
    drop(theirs);
    if !st.success() {
        return Err(io::Error::other(format!("fusermount3: {st}")));
    }
    recv_fd(ours.as_raw_fd())
}

fn recv_fd(sock: RawFd) -> io::Result<File> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: msghdr over local buffers; CMSG_* walk only inside `cbuf`
    // (its length is given), and the descriptor read is checked to be an
    // SCM_RIGHTS payload before it is taken over.
    unsafe {
        let mut m: libc::msghdr = std::mem::zeroed();
        m.msg_iov = &mut iov;
        m.msg_iovlen = 1;
        m.msg_control = cbuf.as_mut_ptr().cast();
        m.msg_controllen = std::mem::size_of_val(&cbuf) as _;
        if libc::recvmsg(sock, &mut m, 0) < 0 {
            return Err(io::Error::last_os_error());
        }
        let c = libc::CMSG_FIRSTHDR(&m);
        if c.is_null() || (*c).cmsg_level != libc::SOL_SOCKET || (*c).cmsg_type != libc::SCM_RIGHTS
        {
            return Err(io::Error::other("fusermount3 passed no descriptor"));
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const RawFd);
        Ok(File::from_raw_fd(fd))
    }
}

impl Mounted {
    /// Unmounts (lazily: a busy mount goes once its users leave); the
    /// session's loops then end.
    pub fn unmount(&self) -> io::Result<()> {
        if self.root {
            let p = cstr(self.mountpoint.as_os_str().as_bytes())?;
            // SAFETY: umount2(2) of a NUL-terminated path.
            if unsafe { libc::umount2(p.as_ptr(), libc::MNT_DETACH) } != 0 {
                return Err(io::Error::last_os_error());
            }
            return Ok(());
        }
        let st = Command::new("fusermount3")
            .args(["-u", "-z", "--"])
            .arg(&self.mountpoint)
            .status()?;
        st.success()
            .then_some(())
            .ok_or_else(|| io::Error::other(format!("fusermount3 -u: {st}")))
    }
}

/// Serves /dev/fuse until the connection ends (unmounted: Ok), answering
/// INIT with `fs`'s flags (and the ring's when `mode` allows and the
/// kernel offers it; the queues start right after, then `on_init` runs)
/// and every other request through `fs`. Returns the ring threads, to be
/// joined.
pub fn serve<F: RemoteFs>(
    dev: Arc<File>,
    fs: FuseFs<F>,
    mode: FuseMode,
    stats: Arc<Stats>,
    mut on_init: Option<OnInit>,
) -> io::Result<Vec<JoinHandle<io::Error>>> {
    let mut buf = vec![0u8; DEV_BUF];
    let mut rings = Vec::new();
    // Budget: one request per round, until the connection ends.
    loop {
        // SAFETY: read(2) into our buffer, within its length.
        let n = unsafe { libc::read(dev.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // Interrupted before we read it, or a signal.
                Some(libc::ENOENT | libc::EINTR | libc::EAGAIN) => continue,
                Some(libc::ENODEV) => return Ok(rings),
                _ => return Err(e),
            }
        }
        stats.dev_requests.fetch_add(1, Ordering::Relaxed);
        let req = &buf[..n as usize];
        let Ok(h) = ll::in_header(req) else { continue };
        let r = DevReply {
            dev: dev.clone(),
            unique: h.unique,
        };
        match ll::decode(req) {
            Ok((_, Op::Init { minor, flags, .. })) => {
                let want = init_reply(&fs, mode, minor, flags, &stats, r)?;
                if want {
                    rings = start_rings(dev.clone(), &fs, &stats);
                }
                if let Some(f) = on_init.take() {
                    f(&stats)
                }
            }
            Ok((_, op)) => fs.dispatch(&h, op, r),
            Err(e) if no_reply(h.opcode) => tracing::debug!("fs mount: {e}"),
            Err(e) => r.send(e.errno(), &[]),
        }
    }
}

fn no_reply(op: u32) -> bool {
    matches!(op, ll::opcode::FORGET | ll::opcode::BATCH_FORGET)
}

/// Answers INIT; true when the ring was granted (its queues are to start).
fn init_reply<F: RemoteFs>(
    fs: &FuseFs<F>,
    mode: FuseMode,
    minor: u32,
    offered: u64,
    stats: &Stats,
    r: DevReply,
) -> io::Result<bool> {
    let ring = match mode {
        FuseMode::Classic => false,
        FuseMode::Auto => fuse_uring::enabled(),
        FuseMode::Uring => true,
    };
    let granted = (fs.init_flags() | if ring { init_flags::OVER_IO_URING } else { 0 }) & offered;
    let uring = granted & init_flags::OVER_IO_URING != 0;
    if mode == FuseMode::Uring && !uring {
        r.send(libc::EPROTO, &[]);
        return Err(io::Error::other(
            "the kernel does not offer FUSE over io_uring (needs Linux 6.14+ with \
             CONFIG_FUSE_IO_URING and /sys/module/fuse/parameters/enable_uring set to Y)",
        ));
    }
    let max = ustor_fs::MAX_WRITE;
    let body = ll::reply::init(minor, granted, max as u32, (max / 4096) as u16);
    r.send(0, &[&body]);
    stats.uring.store(uring, Ordering::Relaxed);
    let m = stats.mode();
    tracing::info!(mode = m, "fs mount: FUSE initialised");
    Ok(uring)
}

/// One thread per possible CPU, pinned to it, serving that CPU's queue.
fn start_rings<F: RemoteFs>(
    dev: Arc<File>,
    fs: &FuseFs<F>,
    stats: &Arc<Stats>,
) -> Vec<JoinHandle<io::Error>> {
    (0..fuse_uring::possible_cpus())
        .map(|q| {
            let (dev, stats) = (dev.clone(), stats.clone());
            let fs = fs.with_remote(fs.remote().for_queue());
            // Named so that placement tools (bench/fs.sh) can leave the
            // queue threads on their CPUs.
            std::thread::Builder::new()
                .name(format!("fuse-ring-{q}"))
                .spawn(move || ring_thread(dev, fs, q, stats))
        })
        .filter_map(|t| {
            t.map_err(|e| tracing::warn!("fs mount: no ring thread: {e}"))
                .ok()
        })
        .collect()
}

fn ring_thread<F: RemoteFs>(
    dev: Arc<File>,
    fs: FuseFs<F>,
    q: usize,
    stats: Arc<Stats>,
) -> io::Error {
    if let Err(e) = pin(q) {
        // An offline CPU: its queue is still needed, unpinned.
        tracing::debug!(q, "fs mount: queue thread not pinned: {e}");
    }
    let payload = ustor_fs::MAX_WRITE;
    let mut qs = match Queues::new(dev.as_raw_fd(), &[q as u16], PER_QUEUE, payload) {
        Ok(qs) => qs,
        Err(e) => {
            tracing::warn!(q, "fs mount: ring queue not registered: {e}");
            return e;
        }
    };
    qs.commits = stats.ring_commits.clone();
    stats.queues.fetch_add(1, Ordering::Relaxed);
    qs.serve_placed(|h, op, out| {
        let op = match op {
            Ok(op) => op,
            Err(e) => return Some((e.errno(), Body::Placed(0))),
        };
        if let Op::Read { offset, size, .. } = op {
            // Straight from the socket into the entry (no copy of ours).
            let n = (size as usize).min(out.len());
            return Some(
                match fs.remote().read_into(h.nodeid, offset, &mut out[..n]) {
                    Ok(k) => (0, Body::Placed(k)),
                    Err(e) => (e.errno(), Body::Placed(0)),
                },
            );
        }
        let (tx, rx) = mpsc::sync_channel(1);
        fs.dispatch(h, op, RingReply(tx));
        // Every request on the ring takes a reply (forgets come through
        // /dev/fuse); one that lost its sink is answered EIO.
        let (e, b) = rx.recv().unwrap_or((libc::EIO, Vec::new()));
        Some((e, Body::Bytes(b)))
    })
}

fn pin(cpu: usize) -> io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET stays inside it for
    // cpu < CPU_SETSIZE (checked); sched_setaffinity reads it.
    unsafe {
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A mount served on a background thread (tests, programs that embed the
/// mount); unmounted, and its threads joined, when dropped.
pub struct Background {
    m: Mounted,
    thread: Option<JoinHandle<io::Result<Vec<JoinHandle<io::Error>>>>>,
    pub stats: Arc<Stats>,
}

/// Mounts `fs` on `mountpoint` (options as for [`mount`]) and serves it
/// in the background.
pub fn spawn<F: RemoteFs>(
    fs: FuseFs<F>,
    mountpoint: &Path,
    fsname: &str,
    opts: &str,
    mode: FuseMode,
) -> io::Result<Background> {
    let m = mount(mountpoint, fsname, opts)?;
    let stats = Arc::new(Stats::default());
    let (dev, st) = (m.dev.clone(), stats.clone());
    let thread = std::thread::spawn(move || serve(dev, fs, mode, st, None));
    Ok(Background {
        m,
        thread: Some(thread),
        stats,
    })
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Err(e) = self.m.unmount() {
            tracing::warn!("fs mount: unmount: {e}");
        }
        let rings = self.thread.take().and_then(|t| t.join().ok());
        for t in rings.into_iter().flatten().flatten() {
            let _ = t.join();
        }
    }
}

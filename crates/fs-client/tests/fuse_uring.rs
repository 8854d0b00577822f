//! FUSE over io_uring against the real kernel: a small read-only file
//! system (one 200 KiB file) mounted on our own /dev/fuse descriptor, INIT
//! answered with FUSE_OVER_IO_URING (flags2), one ring entry per queue
//! registered, and the requests served from the ring with our own decoder
//! (`ll`): the file reads back byte for byte through the mount, and the
//! ring answered requests (commits > 0), so the mount really ran over
//! io_uring. Sets /sys/module/fuse/parameters/enable_uring to Y for the
//! test and restores what it was.

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::time::Duration;

use ustor_fs_client::fuse_uring::{self, Queues};
use ustor_fs_client::ll::{self, reply, AttrOut, InHeader, Op};

const PARAM: &str = "/sys/module/fuse/parameters/enable_uring";
const FILE_LEN: usize = 200 << 10;
const PAYLOAD: usize = 128 << 10;

fn data() -> Vec<u8> {
    (0..FILE_LEN).map(|i| (i * 31 + i / 4096) as u8).collect()
}

fn attr(ino: u64) -> AttrOut {
    let (mode, size, nlink) = if ino == 1 {
        (libc::S_IFDIR | 0o755, 0, 2)
    } else {
        (libc::S_IFREG | 0o644, FILE_LEN as u64, 1)
    };
    AttrOut {
        ino,
        size,
        blocks: size.div_ceil(512),
        mode,
        nlink,
        blksize: 4096,
        ..Default::default()
    }
}

/// The test file system: root (1) holding "f" (2).
fn handle(h: &InHeader, op: Result<Op<'_>, ll::WireError>, file: &[u8]) -> Option<(i32, Vec<u8>)> {
    let op = match op {
        Ok(op) => op,
        Err(e) => return Some((e.errno(), Vec::new())),
    };
    let ttl = (1, 0);
    Some(match op {
        Op::Forget { .. } | Op::BatchForget { .. } | Op::Interrupt { .. } => return None,
        Op::Lookup { name } if h.nodeid == 1 && name == b"f" => (0, reply::entry(&attr(2), ttl)),
        Op::Lookup { .. } => (libc::ENOENT, Vec::new()),
        Op::Getattr { .. } if h.nodeid <= 2 => (0, reply::attr(&attr(h.nodeid), ttl)),
        Op::Open { .. } | Op::Opendir { .. } => (0, reply::open(0, 0)),
        Op::Read { offset, size, .. } => {
            let s = (offset as usize).min(file.len());
            let e = (s + size as usize).min(file.len());
            (0, file[s..e].to_vec())
        }
        Op::Release { .. } | Op::Releasedir { .. } | Op::Flush { .. } | Op::Access { .. } => {
            (0, Vec::new())
        }
        Op::Statfs => (0, reply::statfs(100, 50, 10, 5, 4096, 255)),
        _ => (libc::ENOSYS, Vec::new()),
    })
}

/// Runs the /dev/fuse side: INIT (asking for the ring), then whatever
/// else the kernel sends there, until the unmount.
fn dev_loop(fd: OwnedFd, file: Vec<u8>, init_done: std::sync::mpsc::Sender<u64>) {
    let mut f = std::fs::File::from(fd);
    let mut buf = vec![0u8; PAYLOAD + 4096];
    // Budget: one request per round, until the connection ends.
    loop {
        let n = match f.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(_) => return,
        };
        let (h, op) = match ll::decode(&buf[..n]) {
            Ok((h, op)) => (h, Ok(op)),
            Err(e) => match ll::in_header(&buf[..n]) {
                Ok(h) => (h, Err(e)),
                Err(_) => return,
            },
        };
        let ans = if let Ok(Op::Init { minor, flags, .. }) = op {
            assert_ne!(
                flags & ll::init_flags::OVER_IO_URING,
                0,
                "the kernel offers the ring"
            );
            let want = ll::init_flags::ASYNC_READ
                | ll::init_flags::BIG_WRITES
                | ll::init_flags::MAX_PAGES
                | ll::init_flags::OVER_IO_URING;
            let _ = init_done.send(minor as u64);
            Some((
                0,
                reply::init(minor, want & flags, PAYLOAD as u32, (PAYLOAD / 4096) as u16),
            ))
        } else {
            handle(&h, op, &file)
        };
        let Some((errno, body)) = ans else { continue };
        let mut out = ll::out_header(h.unique, errno, body.len()).to_vec();
        out.extend_from_slice(&body);
        // SAFETY: plain write(2) of an owned buffer on our descriptor.
        unsafe { libc::write(f.as_raw_fd(), out.as_ptr().cast(), out.len()) };
    }
}

fn can_run() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("root (mount(2) of /dev/fuse, enable_uring)".into());
    }
    if !std::path::Path::new("/dev/fuse").exists() {
        return Err("/dev/fuse".into());
    }
    if !std::path::Path::new(PARAM).exists() {
        return Err("a kernel with FUSE over io_uring (CONFIG_FUSE_IO_URING, 6.14+)".into());
    }
    Ok(())
}

#[test]
fn a_mount_served_over_io_uring_reads_back_its_file() {
    testkit::require!(
        can_run(),
        "root, /dev/fuse and Linux 6.14+ with CONFIG_FUSE_IO_URING"
    );
    let before = std::fs::read_to_string(PARAM).unwrap();
    std::fs::write(PARAM, "Y").expect("enable_uring");
    let restore = Restore(before.trim().to_string());
    assert!(fuse_uring::enabled());

    let dir = std::env::temp_dir().join(format!("ustor-fuse-uring-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .unwrap();
    let fd = OwnedFd::from(dev);
    let opts = format!("fd={},rootmode=40000,user_id=0,group_id=0", fd.as_raw_fd());
    let c = |s: &str| std::ffi::CString::new(s).unwrap();
    let (src, tgt, ty, o) = (
        c("ustor-test"),
        c(dir.to_str().unwrap()),
        c("fuse.ustor-test"),
        c(&opts),
    );
    // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            ty.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            o.as_ptr().cast(),
        )
    };
    assert_eq!(r, 0, "mount: {}", std::io::Error::last_os_error());

    let raw = fd.as_raw_fd();
    let (tx, rx) = std::sync::mpsc::channel();
    let file = data();
    let dev_thread = {
        let f = file.clone();
        std::thread::spawn(move || dev_loop(fd, f, tx))
    };
    rx.recv_timeout(Duration::from_secs(10))
        .expect("INIT answered");
    // The ring lives on the thread that serves it (its commands complete
    // as task work of the submitting thread).
    let (ctx, crx) = std::sync::mpsc::channel();
    let ring_thread = {
        let f = file.clone();
        std::thread::spawn(move || {
            let qids: Vec<u16> = (0..fuse_uring::possible_cpus() as u16).collect();
            let mut qs = Queues::new(raw, &qids, 2, PAYLOAD).expect("ring entries registered");
            ctx.send(qs.commits.clone()).unwrap();
            qs.serve(|h, op| handle(h, op, &f))
        })
    };
    let commits = crx
        .recv_timeout(Duration::from_secs(10))
        .expect("queues set up");
    // Requests reach the ring once every queue has its entries: read the
    // file (fresh, O_DIRECT-free but uncached: a new open each round)
    // until the ring has answered some.
    let path = dir.join("f");
    let mut got = Vec::new();
    testkit::wait_until(
        "requests answered through the ring",
        Duration::from_secs(10),
        || {
            got = std::fs::read(&path).unwrap();
            commits.load(Ordering::Relaxed) > 0
        },
    );
    assert!(got == file, "the file read through the mount differs");
    let st = nix_statfs(&dir);
    assert_eq!(st, 100, "statfs through the mount");
    // SAFETY: umount2(2) of the path we mounted.
    let r = unsafe { libc::umount2(tgt.as_ptr(), libc::MNT_DETACH) };
    assert_eq!(r, 0, "umount: {}", std::io::Error::last_os_error());
    let end = ring_thread.join().unwrap();
    dev_thread.join().unwrap();
    assert!(commits.load(Ordering::Relaxed) > 0);
    // The unmount ends the ring's commands with the connection's error.
    let ended = [libc::ENOTCONN, libc::ECONNABORTED, libc::ENODEV];
    assert!(
        ended.contains(&end.raw_os_error().unwrap_or(0)),
        "ring ended with {end}"
    );
    drop(restore);
    let _ = std::fs::remove_dir(&dir);
}

fn nix_statfs(p: &std::path::Path) -> u64 {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    // SAFETY: statfs(2) into a zeroed struct we own.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::statfs(c.as_ptr(), &mut s) };
    assert_eq!(r, 0);
    s.f_blocks as u64
}

/// Puts enable_uring back as it was, also when the test fails.
struct Restore(String);

impl Drop for Restore {
    fn drop(&mut self) {
        let _ = std::fs::write(PARAM, &self.0);
    }
}

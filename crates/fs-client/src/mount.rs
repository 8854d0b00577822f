//! Mounting an export (`ustor fs mount`): parses `HOST[:PORT]/EXPORT`, reads
//! the secret (a file or `USTOR_FS_SECRET`, never the command line),
//! connects (any [`RemoteFs`]), mounts through /dev/fuse (classic or over
//! io_uring, `crate::session`) and serves until the file system is
//! unmounted (`umount MOUNTPOINT`) or the process gets SIGINT/SIGTERM,
//! which unmount it first so no dead mount is left behind.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::fuse::FuseFs;
use crate::session::{self, FuseMode, OnInit, Stats};
use crate::RemoteFs;

/// Splits `HOST[:PORT]/EXPORT` into the address and the export's name;
/// without a port, [`ustor_fs::proto::DEFAULT_PORT`]. An IPv6 host goes
/// in brackets (`[::1]:4800/e`, `[::1]/e`).
pub fn parse_target(t: &str) -> Result<(String, String), String> {
    let bad = || format!("{t}: expected HOST[:PORT]/EXPORT");
    let (addr, export) = t.rsplit_once('/').ok_or_else(bad)?;
    if export.is_empty() || addr.is_empty() {
        return Err(bad());
    }
    let addr = match addr.rsplit_once(':') {
        // A bracketed IPv6 host without a port, or a name with no port.
        _ if addr.ends_with(']') => format!("{addr}:{}", ustor_fs::proto::DEFAULT_PORT),
        None => format!("{addr}:{}", ustor_fs::proto::DEFAULT_PORT),
        Some((h, p))
            if p.parse::<u16>().is_ok()
                && !h.is_empty()
                && (!h.contains(':') || h.starts_with('[') && h.ends_with(']')) =>
        {
            addr.to_string()
        }
        Some(_) => return Err(bad()),
    };
    Ok((addr, export.to_string()))
}

/// The secret from `file`, else from `USTOR_FS_SECRET`, else empty; a
/// trailing newline in the file is not part of it.
pub fn read_secret(file: Option<&Path>) -> std::io::Result<Vec<u8>> {
    let mut s = match file {
        Some(f) => std::fs::read(f)?,
        None => std::env::var_os("USTOR_FS_SECRET")
            .map(|v| std::os::unix::ffi::OsStrExt::as_bytes(v.as_os_str()).to_vec())
            .unwrap_or_default(),
    };
    while s.last().is_some_and(|&b| b == b'\n' || b == b'\r') {
        s.pop();
    }
    Ok(s)
}

/// What `ustor fs mount` was asked.
pub struct MountRequest<'a> {
    /// The file system's name in the mount table (`HOST:PORT/EXPORT`).
    pub fsname: String,
    pub mountpoint: &'a Path,
    pub ttl: Duration,
    pub allow_other: bool,
    /// The kernel's writeback cache ([`FuseFs::writeback`]).
    pub writeback: bool,
    /// Classic /dev/fuse, FUSE over io_uring, or the ring when offered.
    pub mode: FuseMode,
    /// Called once FUSE is initialised, with the mode it runs in.
    pub on_init: Option<OnInit>,
}

fn signal_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise and fill a local set.
    unsafe {
        let mut s: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut s);
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGUSR1] {
            libc::sigaddset(&mut s, sig);
        }
        s
    }
}

/// Connects with `connect` (any [`RemoteFs`]), mounts, and serves until
/// unmounted or signalled; returns what the session did.
pub fn mount<F: RemoteFs>(
    r: MountRequest<'_>,
    connect: impl FnOnce() -> Result<Arc<F>, String>,
) -> Result<Arc<Stats>, String> {
    // Block the signals before any thread starts, so every thread inherits
    // the mask and this one takes them with sigwait.
    let set = signal_set();
    // SAFETY: the set is initialised; no old mask is asked for.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    let remote = connect()?;
    if r.mode == FuseMode::Uring && !crate::fuse_uring::enabled() {
        return Err("--fuse-mode uring: /sys/module/fuse/parameters/enable_uring is not Y".into());
    }
    let mut opts = "default_permissions".to_string();
    if r.allow_other {
        opts.push_str(",allow_other");
    }
    let fs = FuseFs::new(remote, r.ttl).writeback(r.writeback);
    let m = session::mount(r.mountpoint, &r.fsname, &opts)
        .map_err(|e| format!("mount {}: {e}", r.mountpoint.display()))?;
    let stats = Arc::new(Stats::default());
    let (dev, st, mode) = (m.dev.clone(), stats.clone(), r.mode);
    let on_init = r.on_init;
    let run = std::thread::spawn(move || {
        let res = session::serve(dev, fs, mode, st, on_init);
        // Wakes the sigwait below: the file system was unmounted (or the
        // session failed, and is unmounted there).
        // SAFETY: kill on our own pid with a blocked, waited-for signal.
        unsafe { libc::kill(libc::getpid(), libc::SIGUSR1) };
        res
    });
    tracing::info!(fsname = %r.fsname, mountpoint = %r.mountpoint.display(), "mounted");
    let mut sig = 0;
    // SAFETY: the set is initialised and `sig` is a valid out pointer.
    unsafe { libc::sigwait(&set, &mut sig) };
    if sig != libc::SIGUSR1 {
        let _ = m.unmount();
    }
    let res = run
        .join()
        .map_err(|_| "session thread panicked".to_string())?;
    if sig == libc::SIGUSR1 && res.is_err() {
        // The session ended on an error with the mount still there: no
        // dead mount is left behind.
        let _ = m.unmount();
    }
    let rings = res.map_err(|e| format!("serving {}: {e}", r.mountpoint.display()))?;
    for t in rings {
        let e = t.join().map_err(|_| "ring thread panicked".to_string())?;
        tracing::debug!("fs mount: ring queue ended: {e}");
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_or_explain() {
        assert_eq!(
            parse_target("127.0.0.1:4800/data").unwrap(),
            ("127.0.0.1:4800".into(), "data".into())
        );
        assert_eq!(
            parse_target("[::1]:9/e").unwrap(),
            ("[::1]:9".into(), "e".into())
        );
        // No port: the default one.
        assert_eq!(
            parse_target("fs.example/data").unwrap(),
            ("fs.example:4800".into(), "data".into())
        );
        assert_eq!(
            parse_target("[::1]/e").unwrap(),
            ("[::1]:4800".into(), "e".into())
        );
        for bad in [
            "host:port/e",
            ":1/e",
            "h:1/",
            "h:1",
            "h:70000/e",
            "/e",
            "::1/e",
        ] {
            assert!(parse_target(bad).is_err(), "{bad}");
        }
    }
}

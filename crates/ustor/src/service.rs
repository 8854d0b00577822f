//! Running `ustor serve` as a service: systemd's readiness protocol
//! (sd_notify: `READY=1` once the targets listen, `RELOADING=1` around a
//! reload, `STOPPING=1` at SIGTERM) and the reload itself (SIGHUP).
//!
//! sd_notify is one datagram to the Unix socket named by `NOTIFY_SOCKET`
//! (a path, or `@name` in the abstract namespace); without that variable
//! (not started by systemd) nothing is sent.

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::time::Duration;

/// Sends `state` (newline-separated `KEY=VALUE` lines) to the service
/// manager, if there is one. Failure is logged, never fatal: the manager
/// may be gone while we shut down.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(Path::new(&path), state) {
        tracing::warn!("sd_notify to {}: {e}", path.to_string_lossy());
    }
}

fn send(path: &Path, state: &str) -> std::io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    let bytes = path.as_os_str().as_encoded_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        sock.send_to_addr(state.as_bytes(), &addr)?;
    } else {
        sock.send_to(state.as_bytes(), path)?;
    }
    Ok(())
}

/// `RELOADING=1` must carry the monotonic clock (systemd 253's
/// `Type=notify-reload` checks it; older managers ignore it).
pub fn monotonic_usec() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000
}

/// What a reload did.
#[derive(Debug, Default)]
pub struct Reloaded {
    pub created: usize,
    pub existed: usize,
    pub failed: usize,
}

/// Reload = apply the config file again, creating what it names that does
/// not exist yet: each call runs in order; one answered "File exists"
/// (-EEXIST) is an object already there and is kept as it is; any other
/// failure is logged and skipped. Nothing running is changed or deleted,
/// so a reload never drops a connection; removing an object is an RPC
/// (`bdev_malloc_delete`, ...).
pub fn reload(table: &ustor_rpc::MethodTable, path: &Path) -> Result<Reloaded, String> {
    let calls = ustor_rpc::load_config(path).map_err(|e| e.to_string())?;
    let mut r = Reloaded::default();
    for c in &calls {
        match table.call_blocking(&c.method, c.params.clone(), Duration::from_secs(30)) {
            Ok(_) => r.created += 1,
            Err(e) if e.code == -libc::EEXIST => r.existed += 1,
            Err(e) => {
                r.failed += 1;
                tracing::warn!(
                    method = %c.method,
                    "reload: {} ({}) failed: {}",
                    c.method,
                    c.location(),
                    e.message
                );
            }
        }
    }
    Ok(r)
}

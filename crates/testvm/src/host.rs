//! Host-side helpers for interop tests: free ports, waiting for a server to
//! listen, running a server process that is stopped by PID when the test
//! ends (even on panic), and checksums of host files to compare with what
//! the guest reports.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::assets::describe;
use crate::error::{GuestError, Result};

/// A TCP port on 127.0.0.1 that was free a moment ago. (Another process
/// can take it before the server binds; tests retry on bind failure if that
/// matters to them.)
pub fn free_port() -> Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| GuestError::io("bind 127.0.0.1:0 to find a free port", e))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| GuestError::io("local_addr of probe socket", e))
}

/// Waits until something accepts TCP connections on 127.0.0.1:`port`.
pub fn wait_for_port(port: u16, timeout: Duration) -> Result<()> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut last = None;
    let up = testkit::try_wait_for(timeout, || {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            Ok(_) => Some(()),
            Err(e) => {
                last = Some(e);
                None
            }
        }
    });
    up.ok_or_else(|| {
        GuestError::io(
            format!("nothing listens on {addr} after {timeout:?}"),
            last.unwrap_or_else(|| std::io::ErrorKind::TimedOut.into()),
        )
    })
}

/// Waits until `path` exists (a unix socket a daemon creates).
pub fn wait_for_path(path: &Path, timeout: Duration) -> Result<()> {
    testkit::try_wait_for(timeout, || path.exists().then_some(())).ok_or_else(|| GuestError::Io {
        what: format!("{} did not appear within {timeout:?}", path.display()),
        source: std::io::ErrorKind::NotFound.into(),
    })
}

/// A server process owned by a test. Its output goes to a log file; it is
/// killed by PID on drop, so a failing assertion never leaks a server.
#[derive(Debug)]
pub struct Server {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Server {
    /// Spawns `cmd` with stdout and stderr appended to `log`.
    pub fn spawn(name: &str, mut cmd: Command, log: &Path) -> Result<Self> {
        let out = File::create(log)
            .map_err(|e| GuestError::io(format!("create {}", log.display()), e))?;
        let err = out
            .try_clone()
            .map_err(|e| GuestError::io("dup server log", e))?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        let child = cmd
            .spawn()
            .map_err(|e| GuestError::io(format!("spawn {name}: `{}`", describe(&cmd)), e))?;
        Ok(Server {
            name: name.to_string(),
            child: Some(child),
            log: log.to_path_buf(),
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The server's output so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Fails if the server has already exited (e.g. could not bind).
    pub fn check_running(&mut self) -> Result<()> {
        let Some(child) = self.child.as_mut() else {
            return Err(GuestError::Asset(format!("{} already stopped", self.name)));
        };
        match child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(GuestError::Command {
                cmd: self.name.clone(),
                status: status.to_string(),
                stderr: self.log(),
            }),
            Err(e) => Err(GuestError::io(format!("wait {}", self.name), e)),
        }
    }

    /// Sends SIGTERM, waits up to `grace`, then SIGKILL. Returns the log.
    pub fn stop(&mut self, grace: Duration) -> String {
        if let Some(mut child) = self.child.take() {
            if let Ok(pid) = libc::pid_t::try_from(child.id()) {
                // SAFETY: signalling the PID of a child we spawned and have
                // not yet reaped, so it cannot have been recycled.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
            // Some(true): exited; Some(false): cannot tell; None: still up.
            let exited = testkit::try_wait_for(grace, || match child.try_wait() {
                Ok(Some(_)) => Some(true),
                Ok(None) => None,
                Err(_) => Some(false),
            });
            if exited != Some(true) {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        self.log()
    }

    /// Waits up to `timeout` for the process to exit on its own (a daemon
    /// told to quit through its control interface); kills it after that.
    /// Returns true if it exited by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        let exited = testkit::try_wait_for(timeout, || child.try_wait().ok().flatten());
        if exited.is_some() {
            return true;
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Fills `len` bytes of `path` at `offset` with pseudo-random data from a
/// seed (xorshift), so host and guest never agree by accident on zeros.
pub fn write_pattern(path: &Path, offset: u64, len: usize, seed: u64) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| GuestError::io(format!("open {}", path.display()), e))?;
    let mut x = seed | 1;
    let mut buf = vec![0u8; len];
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let bytes = x.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
    f.seek(SeekFrom::Start(offset))
        .and_then(|_| f.write_all(&buf))
        .and_then(|_| f.sync_all())
        .map_err(|e| GuestError::io(format!("write pattern to {}", path.display()), e))
}

/// md5 (hex) of `len` bytes of `path` at `offset`, computed by `md5sum` so
/// it is the same algorithm and format busybox prints in the guest.
pub fn md5_range(path: &Path, offset: u64, len: usize) -> Result<String> {
    let mut f =
        File::open(path).map_err(|e| GuestError::io(format!("open {}", path.display()), e))?;
    let mut buf = vec![0u8; len];
    f.seek(SeekFrom::Start(offset))
        .and_then(|_| f.read_exact(&mut buf))
        .map_err(|e| GuestError::io(format!("read {} bytes of {}", len, path.display()), e))?;
    md5_bytes(&buf)
}

/// md5 (hex) of a byte slice via `md5sum`.
pub fn md5_bytes(data: &[u8]) -> Result<String> {
    let mut child = Command::new("md5sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| GuestError::io("spawn md5sum", e))?;
    let mut stdin = child
        .stdin
        .take()
        .ok_or_else(|| GuestError::Asset("md5sum has no stdin".into()))?;
    let data = data.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&data));
    let out = child
        .wait_with_output()
        .map_err(|e| GuestError::io("wait md5sum", e))?;
    writer
        .join()
        .map_err(|_| GuestError::Asset("md5sum writer thread panicked".into()))?
        .map_err(|e| GuestError::io("feed md5sum", e))?;
    if !out.status.success() {
        return Err(GuestError::Command {
            cmd: "md5sum".into(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .map(str::to_string)
        .ok_or_else(|| GuestError::Asset("md5sum printed nothing".into()))
}

/// Checks an ext4 image on the host with `e2fsck -f -n` (read-only): what
/// the guest wrote through a target must be a consistent file system when
/// read straight from the backing file.
pub fn fsck_image(image: &Path) -> Result<()> {
    crate::assets::run_cmd(Command::new("e2fsck").arg("-f").arg("-n").arg(image)).map(|_| ())
}

/// md5 of a file inside an ext4 image, read on the host with `debugfs`
/// (no mount, no privileges).
pub fn ext4_file_md5(image: &Path, file: &str) -> Result<String> {
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(format!("cat {file}"))
        .arg(image)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| GuestError::io("spawn debugfs", e))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    // debugfs exits 0 even when the file is missing; it says so on stderr.
    if !out.status.success() || stderr.contains("not found") {
        return Err(GuestError::Command {
            cmd: format!("debugfs -R 'cat {file}' {}", image.display()),
            status: out.status.to_string(),
            stderr: stderr.into_owned(),
        });
    }
    md5_bytes(&out.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn md5_of_known_vector() {
        // RFC 1321 test vector.
        assert_eq!(
            md5_bytes(b"abc").expect("md5"),
            "900150983cd24fb0d6963f7d28e17f72"
        );
    }

    #[test]
    fn pattern_round_trip() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("img");
        std::fs::write(&p, vec![0u8; 8192]).expect("create");
        write_pattern(&p, 4096, 4096, 7).expect("pattern");
        let data = std::fs::read(&p).expect("read");
        assert!(data[..4096].iter().all(|&b| b == 0));
        assert!(data[4096..].iter().any(|&b| b != 0));
        assert_eq!(
            md5_range(&p, 4096, 4096).expect("md5 range"),
            md5_bytes(&data[4096..]).expect("md5 bytes")
        );
    }
}

/// A tgtd (Debian `tgt`) serving one iSCSI target with LUN 1 on a backing
/// file, listening on 127.0.0.1 on its own portal and control ports (so a
/// system tgtd is untouched). tgtd ignores SIGTERM: stopping goes through
/// `tgtadm --op delete --mode system`, then by PID.
#[derive(Debug)]
pub struct Tgtd {
    server: Server,
    port: u16,
    control: u16,
}

impl Tgtd {
    /// Starts tgtd, waits until it listens, creates target `iqn` with LUN 1
    /// on `backing` and allows every initiator. Output goes to `log`.
    pub fn start(iqn: &str, backing: &Path, log: &Path) -> Result<Tgtd> {
        let port = free_port()?;
        let control = 20000 + port % 10000;
        let mut cmd = Command::new("tgtd");
        cmd.arg("-f")
            .arg("--iscsi")
            .arg(format!("portal=127.0.0.1:{port}"))
            .arg("-C")
            .arg(control.to_string());
        let server = Server::spawn("tgtd", cmd, log)?;
        let mut t = Tgtd {
            server,
            port,
            control,
        };
        wait_for_port(port, Duration::from_secs(10))?;
        // The portal can listen before the control socket answers (a CI
        // run's first tgtadm failed with ENOTCONN): wait until it does.
        let mut last = None;
        let sys = ["--lld", "iscsi", "--op", "show", "--mode", "sys"];
        let ready = testkit::try_wait_for(Duration::from_secs(10), || match t.admin(&sys) {
            Ok(_) => Some(()),
            Err(e) => {
                last = Some(e);
                None
            }
        });
        if ready.is_none() {
            return Err(last.expect("tried at least once"));
        }
        let backing = backing.to_string_lossy();
        let tid = ["--lld", "iscsi", "--tid", "1"];
        t.admin(&[&tid[..], &["--op", "new", "--mode", "target", "-T", iqn]].concat())?;
        t.admin(
            &[
                &tid[..],
                &[
                    "--op",
                    "new",
                    "--mode",
                    "logicalunit",
                    "--lun",
                    "1",
                    "-b",
                    &backing,
                ],
            ]
            .concat(),
        )?;
        t.admin(&[&tid[..], &["--op", "bind", "--mode", "target", "-I", "ALL"]].concat())?;
        t.server.check_running()?;
        Ok(t)
    }

    /// The iSCSI portal port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Runs `tgtadm -C <control> args...`.
    pub fn admin(&mut self, args: &[&str]) -> Result<String> {
        let out = Command::new("tgtadm")
            .arg("-C")
            .arg(self.control.to_string())
            .args(args)
            .output()
            .map_err(|e| GuestError::io(format!("running tgtadm {args:?}"), e))?;
        if !out.status.success() {
            return Err(GuestError::Command {
                cmd: format!("tgtadm {}", args.join(" ")),
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Errors if tgtd has exited.
    pub fn check_running(&mut self) -> Result<()> {
        self.server.check_running()
    }

    pub fn log(&self) -> String {
        self.server.log()
    }

    /// Deletes the target and the system through tgtadm, then waits for the
    /// process (killed by PID after 10 s). Idempotent.
    pub fn stop(&mut self) {
        let _ = self.admin(&[
            "--lld", "iscsi", "--op", "delete", "--mode", "target", "--tid", "1", "--force",
        ]);
        let _ = self.admin(&["--op", "delete", "--mode", "system"]);
        self.server.wait_exit(Duration::from_secs(10));
    }
}

impl Drop for Tgtd {
    fn drop(&mut self) {
        self.stop();
    }
}

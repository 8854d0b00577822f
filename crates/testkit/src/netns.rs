//! Two network namespaces joined by a veth pair, for tests of raw-Ethernet
//! transports (AF_XDP) that must not touch the host's interfaces. Names are
//! unique per process and call; dropping the value deletes both
//! namespaces (and with them the veth), also when the test panics.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// The namespaces `a` and `b`, with `if_a` in `a` and `if_b` in `b`, both
/// up, MTU 1500, no addresses.
#[derive(Debug)]
pub struct VethNs {
    pub a: String,
    pub b: String,
    pub if_a: String,
    pub if_b: String,
}

/// Whether this process can make namespaces: root and `ip` (iproute2).
pub fn check() -> Result<(), String> {
    crate::program("ip")?;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("root (network namespaces and AF_XDP need CAP_NET_ADMIN and CAP_BPF)".into());
    }
    Ok(())
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

impl VethNs {
    pub fn create() -> Result<VethNs, String> {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let tag = format!("ustor-{}-{n}", std::process::id());
        let v = VethNs {
            a: format!("{tag}-a"),
            b: format!("{tag}-b"),
            if_a: "veth-a".into(),
            if_b: "veth-b".into(),
        };
        // From here on, drop cleans up whatever was made.
        ip(&["netns", "add", &v.a])?;
        ip(&["netns", "add", &v.b])?;
        ip(&[
            "link", "add", &v.if_a, "netns", &v.a, "type", "veth", "peer", "name", &v.if_b,
            "netns", &v.b,
        ])?;
        for (ns, dev) in [(&v.a, &v.if_a), (&v.b, &v.if_b)] {
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(v)
    }

    /// Moves the calling thread into namespace `ns` (sockets it opens
    /// afterwards, and the interface names it resolves, are that
    /// namespace's). Other threads stay where they are.
    pub fn enter(ns: &str) -> Result<(), String> {
        let f =
            std::fs::File::open(format!("/run/netns/{ns}")).map_err(|e| format!("{ns}: {e}"))?;
        use std::os::fd::AsRawFd;
        // SAFETY: setns on a namespace file we hold open.
        if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(format!("setns {ns}: {}", std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Runs `f` on a thread inside namespace `ns` and returns its result.
    pub fn within<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let ns = ns.to_string();
        std::thread::spawn(move || {
            Self::enter(&ns).expect("enter the namespace");
            f()
        })
        .join()
        .expect("thread inside the namespace")
    }

    /// `ip netns exec NS PROGRAM`, to start a process inside `ns`.
    pub fn command(ns: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).arg(program);
        c
    }
}

impl Drop for VethNs {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end in it, and so the pair.
        for ns in [&self.a, &self.b] {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

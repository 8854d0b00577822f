//! `ustor fs mount HOST[:PORT]/EXPORT MOUNTPOINT`: mounts an export of the
//! file service through FUSE (crates/fs-client), classic /dev/fuse or FUSE
//! over io_uring (`--fuse-mode`), and serves it in the foreground until it
//! is unmounted or the process is interrupted. It prints the mode once
//! FUSE is initialised and what each path served when it ends.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

mod xdp;

use clap::Args;
use ustor_fs_client::mount::{mount, parse_target, read_secret, MountRequest};
use ustor_fs_client::session::{FuseMode, Stats};
use ustor_fs_client::{Client, Config, RemoteFs};

#[derive(Args)]
pub struct MountArgs {
    /// The export: HOST[:PORT]/EXPORT (port 4800 when none is given; an
    /// IPv6 host in brackets).
    target: String,
    /// Where to mount it (an existing directory).
    mountpoint: PathBuf,
    /// File holding the export's secret (else USTOR_FS_SECRET; never on
    /// the command line).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Seconds the kernel caches entries and attributes.
    #[arg(long, default_value_t = 1.0)]
    attr_timeout: f64,
    /// Seconds a request may wait for its reply before failing with EIO.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
    /// Seconds to keep reconnecting to a server that went away before
    /// failing calls with EIO.
    #[arg(long, default_value_t = 10)]
    reconnect: u64,
    /// Let other users than the one mounting access the file system.
    #[arg(long)]
    allow_other: bool,
    /// Let the kernel cache writes (FUSE's writeback cache): a write
    /// returns once it is in the page cache and reaches the server in the
    /// background, at close or at fsync (close-to-open still holds). Off:
    /// every write is durable on the server when it returns.
    #[arg(long)]
    writeback: bool,
    /// How the kernel's requests arrive: classic (/dev/fuse), uring (FUSE
    /// over io_uring, one queue per CPU; needs Linux 6.14+ and
    /// /sys/module/fuse/parameters/enable_uring set to Y), or auto (the
    /// ring when the kernel offers it).
    #[arg(long, default_value = "auto")]
    fuse_mode: FuseMode,
}

/// The client for the target's transport.
fn connect_remote(cfg: Config) -> Result<Arc<impl RemoteFs>, String> {
    let target = format!("{}/{}", cfg.addr, cfg.export);
    Client::connect(cfg)
        .map(Arc::new)
        .map_err(|e| format!("{target}: {e}"))
}

fn print_mode(mp: PathBuf) -> Box<dyn FnOnce(&Stats) + Send> {
    Box::new(move |s: &Stats| {
        println!(
            "ustor fs mount: {} mounted, fuse mode {}",
            mp.display(),
            s.mode()
        );
    })
}

pub fn run(a: MountArgs) -> i32 {
    // Raw Ethernet (AF_XDP): fs_mount/xdp.rs.
    if a.target.starts_with("xdp://") {
        return xdp::run(a);
    }
    let (addr, export) = match parse_target(&a.target) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("ustor fs mount: {e}");
            return 2;
        }
    };
    let secret = match read_secret(a.secret_file.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ustor fs mount: secret file: {e}");
            return 2;
        }
    };
    let mut cfg = Config::new(&addr, &export, &secret);
    cfg.timeout = Duration::from_secs(a.timeout.max(1));
    cfg.reconnect_for = Duration::from_secs(a.reconnect);
    let req = MountRequest {
        fsname: format!("{addr}/{export}"),
        mountpoint: &a.mountpoint,
        ttl: Duration::from_secs_f64(a.attr_timeout.max(0.0)),
        allow_other: a.allow_other,
        writeback: a.writeback,
        mode: a.fuse_mode,
        on_init: Some(print_mode(a.mountpoint.clone())),
    };
    match mount(req, || connect_remote(cfg)) {
        Ok(s) => {
            println!(
                "ustor fs mount: ended; fuse mode {}, {} queues, {} requests over the ring, \
                 {} over /dev/fuse",
                s.mode(),
                s.queues.load(Ordering::Relaxed),
                s.ring_commits.load(Ordering::Relaxed),
                s.dev_requests.load(Ordering::Relaxed)
            );
            0
        }
        Err(e) => {
            eprintln!("ustor fs mount: {e}");
            1
        }
    }
}

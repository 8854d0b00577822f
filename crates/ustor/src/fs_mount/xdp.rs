//! `ustor fs mount xdp://IFNAME[@MAC]/EXPORT MOUNTPOINT`: the same mount
//! over the raw-Ethernet client (`ustor_fs_client::xdp`), run in the
//! network namespace of the interface (e.g. under `nsenter --net=...`).
//! `--reconnect` does not apply: the client resends each request until
//! `--timeout`, and runs the handshake again when the server lost its
//! session.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ustor_fs_client::mount::{mount, read_secret, MountRequest};
use ustor_fs_client::xdp::{XdpClient, XdpConfig};

use super::{print_mode, MountArgs};

pub(super) fn run(a: MountArgs) -> i32 {
    let secret = match read_secret(a.secret_file.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ustor fs mount: secret file: {e}");
            return 2;
        }
    };
    let mut cfg = match XdpConfig::parse(&a.target, &secret) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ustor fs mount: {}: {e}", a.target);
            return 2;
        }
    };
    cfg.timeout = Duration::from_secs(a.timeout.max(1));
    let target = a.target.clone();
    let req = MountRequest {
        fsname: a.target.clone(),
        mountpoint: &a.mountpoint,
        ttl: Duration::from_secs_f64(a.attr_timeout.max(0.0)),
        allow_other: a.allow_other,
        writeback: a.writeback,
        mode: a.fuse_mode,
        on_init: Some(print_mode(a.mountpoint.clone())),
    };
    let connect = move || {
        XdpClient::connect(cfg)
            .map(Arc::new)
            .map_err(|e| format!("{target}: {e}"))
    };
    match mount(req, connect) {
        Ok(s) => {
            println!(
                "ustor fs mount: ended; fuse mode {}, {} requests over the ring, {} over /dev/fuse",
                s.mode(),
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

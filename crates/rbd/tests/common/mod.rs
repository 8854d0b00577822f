//! The one-node Ceph cluster an rbd test binary starts for itself
//! (`scripts/ceph-cluster.sh` through `testkit::ceph`: one mon, one
//! memstore OSD) and stops at process exit, and the `rbd` CLI against it.

use std::path::PathBuf;
use std::sync::OnceLock;

use testkit::ceph::Cluster;

pub use testkit::ceph::rbd;

static CLUSTER: OnceLock<Cluster> = OnceLock::new();

extern "C" fn stop_cluster() {
    if let Some(c) = CLUSTER.get() {
        c.stop();
        let _ = std::fs::remove_dir_all(c.dir());
    }
}

/// Starts the binary's cluster in a directory named after `tag`; returns
/// the directory and its ceph.conf, or `None` (skip, or a panic under
/// CI=true) without Ceph's programs. Once per process.
pub fn start_cluster(tag: &str) -> Option<(PathBuf, String)> {
    for p in ["ceph-mon", "ceph-osd", "ceph", "rbd"] {
        if !testkit::need(p) {
            return None;
        }
    }
    let dir = std::env::temp_dir().join(format!("ustor-rbd-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cluster = Cluster::start(dir.clone(), &[]);
    let conf = cluster.conf();
    if CLUSTER.set(cluster).is_err() {
        panic!("one cluster per test binary");
    }
    // SAFETY: registers a plain function to run at process exit (after the
    // rbd module's own hook that closes open images: registered later).
    unsafe { libc::atexit(stop_cluster) };
    Some((dir, conf))
}

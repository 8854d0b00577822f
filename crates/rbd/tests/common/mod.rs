//! The one-node Ceph cluster an rbd test binary starts for itself
//! (`scripts/ceph-cluster.sh`: one mon, one memstore OSD) and stops at
//! process exit, and the `rbd` CLI against it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

static DIR: OnceLock<PathBuf> = OnceLock::new();

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster.sh")
}

extern "C" fn stop_cluster() {
    if let Some(d) = DIR.get() {
        let _ = Command::new(script()).arg("stop").arg(d).status();
        let _ = std::fs::remove_dir_all(d);
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
    let out = Command::new(script())
        .arg("start")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ceph-cluster.sh start: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    DIR.set(dir.clone()).expect("one cluster per test binary");
    // SAFETY: registers a plain function to run at process exit (after the
    // rbd module's own hook that closes open images: registered later).
    unsafe { libc::atexit(stop_cluster) };
    let conf = dir.join("ceph.conf").display().to_string();
    Some((dir, conf))
}

/// Runs the `rbd` CLI against `conf` (bounded to 30 s); its stdout.
pub fn rbd(conf: &str, args: &[&str]) -> Vec<u8> {
    let t = std::time::Instant::now();
    let out = Command::new("timeout")
        .args(["30", "rbd", "-c", conf])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "rbd {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("rbd {args:?}: {:.1} s", t.elapsed().as_secs_f64());
    out.stdout
}

//! A one-node Ceph cluster for the rbd tests: `scripts/ceph-cluster.sh`
//! run on a directory of the test's (one mon and one OSD on 127.0.0.1; the
//! script's options choose memstore or bluestore and the auth), the
//! cluster's `ceph.conf`, and the `rbd` CLI against it. Each test binary
//! owns its cluster and decides when it stops (at exit, or on drop).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// `scripts/ceph-cluster.sh` of this checkout.
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster.sh")
}

/// A cluster started in `dir`. Not stopped on drop: a binary that shares
/// one cluster between its tests stops it at process exit.
pub struct Cluster {
    dir: PathBuf,
}

impl Cluster {
    /// Starts a cluster in `dir` with the script's `extra` options
    /// (`--store bluestore`, `--auth cephx`, ...); panics with the
    /// script's output when it fails.
    pub fn start(dir: PathBuf, extra: &[&str]) -> Cluster {
        let c = Cluster { dir };
        c.script(&["start"], extra);
        c
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The cluster's config file, for `-c` and `config_file`.
    pub fn conf(&self) -> String {
        self.dir.join("ceph.conf").display().to_string()
    }

    /// Runs `ceph-cluster.sh CMD... DIR EXTRA...` (`stop-osd`,
    /// `start-osd`, `restart`, ...); panics with its output when it fails.
    pub fn script(&self, cmd: &[&str], extra: &[&str]) {
        let out = Command::new(script())
            .args(cmd)
            .arg(&self.dir)
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "ceph-cluster.sh {cmd:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Stops the cluster, ignoring failure (for exit hooks and drops).
    pub fn stop(&self) {
        let _ = Command::new(script()).arg("stop").arg(&self.dir).status();
    }

    /// `rbd -c CONF args...`; see [`rbd`].
    pub fn rbd(&self, args: &[&str]) -> Vec<u8> {
        rbd(&self.conf(), args)
    }
}

/// Runs the `rbd` CLI against `conf`, bounded to 30 s so a lost cluster
/// fails the test instead of hanging it; its stdout, or a panic with its
/// stderr.
pub fn rbd(conf: &str, args: &[&str]) -> Vec<u8> {
    let out = Command::new("timeout")
        .args(["30", "rbd", "-c", conf])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "rbd {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

//! The rbd tests' fixture: the one-node Ceph cluster this test binary
//! shares (started once with `scripts/ceph-cluster.sh`, stopped at exit),
//! its `rbd` CLI, the configs and `ustor bench` runs the tests build on it,
//! and the reader of the librados/librbd threads of a server (placement
//! checks). A module of the rbd test binary, so the cluster stays one.

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use super::common::*;
use serde_json::{json, Value};
use testkit::ceph::Cluster;

/// The cluster this binary shares, or why there is none.
pub struct Ceph {
    cluster: Cluster,
}

static CEPH: OnceLock<Option<Ceph>> = OnceLock::new();

extern "C" fn stop_cluster() {
    if let Some(Some(c)) = CEPH.get() {
        c.cluster.stop();
    }
}

/// The shared cluster (started on first use), or `None` after a skip.
pub fn ceph() -> Option<&'static Ceph> {
    CEPH.get_or_init(|| {
        for p in ["ceph-mon", "ceph-osd", "ceph", "rbd", "rados", "python3"] {
            if !have(p) {
                return None;
            }
        }
        let cluster = Cluster::start(tmpdir("ceph"), &["--auth", "cephx"]);
        // SAFETY: registers a plain function to run at process exit.
        unsafe { libc::atexit(stop_cluster) };
        Some(Ceph { cluster })
    })
    .as_ref()
}

impl Ceph {
    pub fn conf(&self) -> String {
        self.cluster.conf()
    }

    /// Runs `rbd -c CONF args...` (under a timeout) and returns stdout.
    pub fn rbd(&self, args: &[&str]) -> Vec<u8> {
        self.cluster.rbd(args)
    }

    pub fn create_image(&self, name: &str, mib: u64) {
        self.rbd(&[
            "create",
            "--size",
            &format!("{mib}M"),
            &format!("rbd/{name}"),
        ]);
    }

    pub fn register(&self, name: &str) -> Value {
        json!({"method": "bdev_rbd_register_cluster",
               "params": {"name": name, "config_file": self.conf()}})
    }
}

pub fn rbd_bdev(name: &str, image: &str) -> Value {
    json!({"method": "bdev_rbd_create", "params": {"name": name, "cluster_name": "c1",
        "pool_name": "rbd", "rbd_name": image, "block_size": 4096}})
}

pub fn bdev_config(calls: Vec<Value>) -> Value {
    json!({"subsystems": [{"subsystem": "bdev", "config": calls}]})
}

pub fn bench(cfg: &Path, args: &[&str]) -> (i32, Value, String) {
    let out = Command::new("timeout")
        .args(["60", BIN, "bench", "--no-pin", "--json", "-c"])
        .arg(cfg)
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let v = serde_json::from_str(&text).unwrap_or(Value::Null);
    let log = format!("{text}{}", String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), v, log)
}

/// A thread of the server that librados/librbd made.
pub struct CephThread {
    pub tid: String,
    pub name: String,
    /// `Cpus_allowed_list`.
    pub cpus: String,
    /// Scheduling policy (`/proc/.../stat` field 41: 0 SCHED_OTHER, 3
    /// SCHED_BATCH).
    pub policy: u32,
}

/// The threads of `pid` that librados/librbd made (their names:
/// msgr-worker-*, ms_dispatch, io_context_pool, fn_anonymous, ...).
pub fn ceph_threads(pid: u32) -> Vec<CephThread> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let base = e.path();
        let name = std::fs::read_to_string(base.join("comm")).unwrap_or_default();
        let name = name.trim().to_string();
        let ceph_made = [
            "msgr-worker",
            "ms_dispatch",
            "io_context_pool",
            "ceph_timer",
            "safe_timer",
            "fn_anonymous",
            "finisher",
            "taskfin_librbd",
            "tp_librbd",
            "ms_local",
            "service",
        ]
        .iter()
        .any(|p| name.starts_with(p));
        if !ceph_made {
            continue;
        }
        let status = std::fs::read_to_string(base.join("status")).unwrap_or_default();
        let cpus = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap_or("")
            .trim()
            .to_string();
        // Fields after the command's closing parenthesis start at field 3.
        let stat = std::fs::read_to_string(base.join("stat")).unwrap_or_default();
        let policy = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(41 - 3)?.parse().ok())
            .unwrap_or(u32::MAX);
        let tid = e.file_name().to_string_lossy().into_owned();
        v.push(CephThread {
            tid,
            name,
            cpus,
            policy,
        });
    }
    v
}

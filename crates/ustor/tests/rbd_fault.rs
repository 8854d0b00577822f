//! The rbd bdev when its OSD dies, against a one-node bluestore cluster
//! (one mon, one OSD on a sparse file, no auth) that this test binary
//! starts once with `scripts/ceph-cluster.sh` and stops at exit. With a
//! short `op_timeout_s`, I/O in flight when the OSD is killed fails with
//! an error in bounded time (nothing hangs), on the direct path (ustor's
//! own deadline) and on librbd's (Ceph's op timeout, which ustor turns on
//! for such an image);
//! after the OSD restarts the same ustor process serves I/O again and the
//! data is intact (bluestore keeps it). The same holds when the whole
//! cluster (mon and OSD) stops and comes back.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use testkit::ceph::Cluster;

/// Seconds an I/O may take before it fails (`op_timeout_s`).
const OSD_OP_TIMEOUT: u64 = 3;

/// One bluestore cluster, stopped when dropped (also on a failed assert).
struct Ceph {
    cluster: Cluster,
}

impl Drop for Ceph {
    fn drop(&mut self) {
        self.cluster.stop();
    }
}

impl Ceph {
    fn start() -> Option<Ceph> {
        for p in ["ceph-mon", "ceph-osd", "ceph", "rbd", "rados", "qemu-img"] {
            if !have(p) {
                return None;
            }
        }
        let cluster = Cluster::start(
            tmpdir("ceph-bluestore"),
            &["--store", "bluestore", "--auth", "none"],
        );
        Some(Ceph { cluster })
    }

    fn script(&self, cmd: &[&str], extra: &[&str]) {
        self.cluster.script(cmd, extra);
    }

    fn conf(&self) -> String {
        self.cluster.conf()
    }

    /// Runs `rbd -c CONF args...` (under a timeout); its stdout.
    fn rbd(&self, args: &[&str]) -> Vec<u8> {
        self.cluster.rbd(args)
    }

    /// The bdev-subsystem calls: the cluster (short I/O time limit) and
    /// one rbd bdev `r0` on `image`.
    fn bdev_calls(&self, image: &str) -> Value {
        json!([
            {"method": "bdev_rbd_register_cluster", "params": {"name": "c1",
                "config_file": self.conf(),
                "op_timeout_s": OSD_OP_TIMEOUT}},
            {"method": "bdev_rbd_create", "params": {"name": "r0", "cluster_name": "c1",
                "pool_name": "rbd", "rbd_name": image, "block_size": 4096}}
        ])
    }

    /// Whether some client has `image` open (its header has a watcher).
    fn watched(&self, image: &str) -> bool {
        let s = self.rbd(&["status", &format!("rbd/{image}")]);
        String::from_utf8_lossy(&s).contains("watcher=")
    }
}

/// `qemu-img convert` (under a timeout): exit status and stderr.
fn qemu_img(args: &[&str]) -> (bool, String) {
    let out = Command::new("timeout")
        .arg("60")
        .arg("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn osd_killed_mid_io_fails_in_bounded_time_and_resumes_after_restart() {
    let Some(c) = Ceph::start() else { return };
    let dir = tmpdir("rbd-fault");

    // 1. In flight: a randwrite bench runs while the OSD is killed. Its
    // I/Os fail after the op timeout (counted as errors) and the run ends
    // on time; without the timeout they would wait for the OSD forever.
    // The image takes the direct path (layering only): ustor's deadline.
    c.rbd(&[
        "create",
        "--size",
        "16M",
        "--image-feature",
        "layering",
        "rbd/busy",
    ]);
    let cfg = dir.join("bench.json");
    let conf = json!({"subsystems": [{"subsystem": "bdev", "config": c.bdev_calls("busy")}]});
    std::fs::write(&cfg, conf.to_string()).unwrap();
    let run_s = 8;
    let t0 = Instant::now();
    let bench = Command::new("timeout")
        .args(["90", BIN, "bench", "--no-pin", "--json", "-c"])
        .arg(&cfg)
        .args([
            "-b",
            "r0",
            "-w",
            "randwrite",
            "-q",
            "8",
            "-t",
            &run_s.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The image is open (so I/O is under way) once its header is watched.
    testkit::wait_until("bench opened the image", Duration::from_secs(20), || {
        c.watched("busy")
    });
    c.script(&["stop-osd"], &[]);
    let out = bench.wait_with_output().unwrap();
    let took = t0.elapsed();
    let text = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    let log = format!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        out.status.code(),
        Some(1),
        "bench must report errors: {log}"
    );
    let errors = report["total"]["errors"].as_u64().unwrap_or(0);
    assert!(errors > 0, "no I/O failed: {log}");
    // The run's length, plus one op timeout for the last I/Os, plus slack
    // for the connect and a shared machine.
    let bound = Duration::from_secs(run_s + OSD_OP_TIMEOUT + 12);
    assert!(took < bound, "bench took {took:?} (bound {bound:?}): {log}");
    c.script(&["start-osd"], &[]);

    // 2. One ustor process across an OSD restart: data written before,
    // I/O failing (in bounded time) while the OSD is down, then the same
    // bdev reads it back intact and takes new writes that Ceph's own
    // client reads back.
    let data = pseudo_random(8 << 20, 0xfa17);
    let src = dir.join("src.img");
    std::fs::write(&src, &data).unwrap();
    let src_s = src.display().to_string();
    c.rbd(&["import", &src_s, "rbd/kept"]);
    let cfg = json!({"subsystems": [
        {"subsystem": "bdev", "config": c.bdev_calls("kept")},
        {"subsystem": "nbd", "config": [
            {"method": "nbd_server_start", "params": {"listen_address": {"traddr": "127.0.0.1", "trsvcid": "0"}}},
            {"method": "nbd_export_create", "params": {"name": "r0", "bdev_name": "r0"}}
        ]}
    ]});
    let s = Server::start(&dir, &cfg, &[]);
    // Ceph's default features keep this image on librbd's path: bounded by
    // Ceph's op timeout, which ustor turned on for it after connecting.
    let b = s.ok("bdev_get_bdevs", json!({"name": "r0"}));
    assert_eq!(b[0]["driver_specific"]["rbd"]["data_path"], "librbd", "{b}");
    let url = format!("nbd://127.0.0.1:{}/r0", s.nbd_port());
    let back = dir.join("back.img");
    let back_s = back.display().to_string();

    c.script(&["stop-osd"], &[]);
    let t0 = Instant::now();
    let (ok, err) = qemu_img(&[&url, &back_s]);
    let took = t0.elapsed();
    assert!(!ok, "a read with the OSD down succeeded");
    let bound = Duration::from_secs(OSD_OP_TIMEOUT + 15);
    assert!(took < bound, "the failing read took {took:?}: {err}");
    // The server is alive and still has the bdev.
    let b = s.ok("bdev_get_bdevs", json!({"name": "r0"}));
    assert_eq!(b[0]["name"], "r0");

    c.script(&["start-osd"], &[]);
    let (ok, err) = qemu_img(&[&url, &back_s]);
    assert!(ok, "read after the OSD restarted: {err}");
    assert_eq!(sha256(&std::fs::read(&back).unwrap()), sha256(&data));
    let fresh = pseudo_random(8 << 20, 0xbeef);
    std::fs::write(&src, &fresh).unwrap();
    let (ok, err) = qemu_img(&["-n", &src_s, &url]);
    assert!(ok, "write after the OSD restarted: {err}");
    let exported = c.rbd(&["export", "rbd/kept", "-"]);
    assert_eq!(sha256(&exported), sha256(&fresh));

    // 3. The whole cluster (mon and OSD) goes and comes back: I/O fails in
    // bounded time while it is away, the server keeps its bdev, and once
    // the same cluster returns the same bdev serves the data again (the
    // client finds the mon again on its own; nothing is re-registered).
    c.script(&["stop"], &[]);
    let t0 = Instant::now();
    let (ok, err) = qemu_img(&[&url, &back_s]);
    let took = t0.elapsed();
    assert!(!ok, "a read with the cluster down succeeded");
    assert!(took < bound, "the failing read took {took:?}: {err}");
    let health = || {
        s.ok("bdev_get_bdevs", json!({"name": "r0"}))[0]["driver_specific"]["rbd"]["health"].clone()
    };
    assert_eq!(health()["state"], "failing", "{}", health());
    c.script(&["restart"], &[]);
    let (ok, err) = qemu_img(&[&url, &back_s]);
    assert!(ok, "read after the cluster returned: {err}");
    assert_eq!(sha256(&std::fs::read(&back).unwrap()), sha256(&fresh));
    assert_eq!(health()["state"], "ok", "{}", health());
    s.stop();
}

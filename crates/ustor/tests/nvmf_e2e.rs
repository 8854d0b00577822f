//! NVMe/TCP end to end with real processes: `ustor bench --verify` runs
//! through the ustor initiator (`bdev_nvme_attach_controller` in the bench's
//! config) against a ustor target in a separate `ustor serve` process.
//!
//! - `verified_bench_through_initiator_against_target_process`: randrw at
//!   QD 1 and 32, 4 KiB and 128 KiB, header+data digests off and on.
//! - `bench_survives_target_kill_and_restart`: the target (a uring bdev on
//!   a file, so the data outlives the process) is SIGKILLed mid-run and
//!   restarted on the same port; the bench reconnects, retries, verifies.
//! - `bench_fails_in_bounded_time_when_target_stays_dead`: the target is
//!   killed for good; with a short ctrlr_loss_timeout_sec the bench reports
//!   I/O errors and exits non-zero instead of hanging.
//!
//! Ports are picked by the target (trsvcid "0") and read back through
//! `nvmf_get_subsystems`; every process is started here and stopped by PID.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const NQN: &str = "nqn.2026-11.io.ustor:e2e";

/// The tests are timing-sensitive (kill after N seconds, bounded failure
/// time) and the machine may have two cores: run them one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Target config: `bdev` (one bdev-creating call, bdev named "Disk0")
/// exported as namespace 1 of `NQN`, listening on 127.0.0.1:`port`.
fn target_config(bdev: Value, port: &str) -> Value {
    json!({"subsystems": [
        {"subsystem": "bdev", "config": [bdev]},
        {"subsystem": "nvmf", "config": [
            {"method": "nvmf_create_transport", "params": {"trtype": "TCP"}},
            {"method": "nvmf_create_subsystem", "params": {"nqn": NQN, "allow_any_host": true}},
            {"method": "nvmf_subsystem_add_ns", "params": {"nqn": NQN, "namespace": {"bdev_name": "Disk0"}}},
            {"method": "nvmf_subsystem_add_listener", "params": {"nqn": NQN,
                "listen_address": {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": port}}}
        ]}
    ]})
}

fn malloc_bdev(mib: u64) -> Value {
    json!({"method": "bdev_malloc_create", "params": {"name": "Disk0", "num_blocks": (mib << 20) / 512, "block_size": 512}})
}

fn uring_bdev(file: &Path) -> Value {
    json!({"method": "bdev_uring_create", "params": {"name": "Disk0", "filename": file.to_str().unwrap()}})
}

/// The TCP port the target's listener bound. The RPC server answers while
/// `-c` is still being applied, so wait until the listener is there.
fn bound_port(s: &Server) -> u16 {
    let subs = || s.ok("nvmf_get_subsystems", Value::Null);
    let port = testkit::try_wait_for(Duration::from_secs(10), || {
        subs()
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["nqn"] == NQN && x["namespaces"].as_array().is_some_and(|n| !n.is_empty()))
            .and_then(|x| x["listen_addresses"][0]["trsvcid"].as_str())
            .and_then(|p| p.parse().ok())
            .filter(|p| *p != 0)
    });
    port.unwrap_or_else(|| panic!("no bound listener in {}", subs()))
}

/// Starts a target on `port` (0: a free one) and returns it with its port.
fn start_target(dir: &Path, bdev: Value, port: u16) -> (Server, u16) {
    let s = Server::start(dir, &target_config(bdev, &port.to_string()), &[]);
    let p = bound_port(&s);
    if port != 0 {
        assert_eq!(p, port);
    }
    (s, p)
}

/// Reads the target's bdev "Disk0" has completed.
fn target_reads(s: &Server) -> u64 {
    let v = s.ok("bdev_get_iostat", json!({"name": "Disk0"}));
    v["bdevs"][0]["num_read_ops"].as_u64().unwrap_or(0)
}

/// Waits until the bench is in its timed phase (attach and verify prefill
/// done) and the target has served `at_least` of its reads.
fn wait_for_reads(s: &Server, b: &mut Bench, at_least: u64) {
    let read = testkit::try_wait_for(Duration::from_secs(20), || {
        if let Ok(Some(st)) = b.child.try_wait() {
            panic!("bench exited ({st}) before reading:\n{}", b.log());
        }
        (target_reads(s) >= at_least).then_some(())
    });
    assert!(read.is_some(), "bench never read: {}", b.log());
}

/// SIGKILLs our own target child and reaps it.
fn kill_target(mut s: Server) {
    // SAFETY: kill(2) on the PID of a child we spawned and have not reaped.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGKILL) };
    let _ = s.child.wait();
}

/// Writes the bench's config: one `bdev_nvme_attach_controller` (bdev
/// "Nvme0n1") with `extra` merged into its params.
fn initiator_config(dir: &Path, port: u16, extra: Value) -> PathBuf {
    let mut params = json!({
        "name": "Nvme0", "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1",
        "trsvcid": port.to_string(), "subnqn": NQN,
    });
    for (k, v) in extra.as_object().unwrap() {
        params[k] = v.clone();
    }
    let cfg = json!({"subsystems": [{"subsystem": "bdev", "config": [
        {"method": "bdev_nvme_attach_controller", "params": params}
    ]}]});
    let path = dir.join(format!("bench-{}.json", rand_tag()));
    std::fs::write(&path, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    path
}

/// A running `ustor bench --json` child, killed by PID if still running
/// when dropped.
struct Bench {
    child: Child,
    out: PathBuf,
    err: PathBuf,
}

impl Bench {
    fn spawn(dir: &Path, cfg: &Path, args: &[&str]) -> Bench {
        let tag = rand_tag();
        let out = dir.join(format!("bench-{tag}.out"));
        let err = dir.join(format!("bench-{tag}.err"));
        let child = Command::new(BIN)
            .args(["bench", "--json", "--no-pin", "-b", "Nvme0n1"])
            .arg("-c")
            .arg(cfg)
            .args(if args.contains(&"--cores") {
                &[][..]
            } else {
                &["--cores", "1"][..]
            })
            .args(args)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .expect("spawn ustor bench");
        Bench { child, out, err }
    }

    /// Waits at most `limit` for the bench to exit: its exit status, the
    /// JSON report (Null if none) and everything it printed.
    fn wait(mut self, limit: Duration) -> (i32, Value, String) {
        let Some(status) = testkit::try_wait_for(limit, || self.child.try_wait().unwrap()) else {
            // SAFETY: kill(2) on our own child's PID.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
            let _ = self.child.wait();
            panic!(
                "ustor bench still running after {limit:?} (hung):\n{}",
                self.log()
            );
        };
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        let v = serde_json::from_str(&text).unwrap_or(Value::Null);
        (status.code().unwrap_or(-1), v, self.log())
    }

    fn log(&self) -> String {
        format!(
            "--- stdout\n{}\n--- stderr\n{}",
            std::fs::read_to_string(&self.out).unwrap_or_default(),
            std::fs::read_to_string(&self.err).unwrap_or_default()
        )
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: kill(2) on our own child's PID.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
            let _ = self.child.wait();
        }
    }
}

fn u(v: &Value, k: &str) -> u64 {
    v["total"][k].as_u64().unwrap_or(0)
}

#[test]
fn verified_bench_through_initiator_against_target_process() {
    let _g = serial();
    let dir = tmpdir("nvmf-e2e-verify");
    let (target, port) = start_target(&dir, malloc_bdev(8), 0);
    for digests in [false, true] {
        let cfg = initiator_config(&dir, port, json!({"hdgst": digests, "ddgst": digests}));
        for bs in ["4K", "128K"] {
            for qd in ["1", "32"] {
                let what = format!("bs {bs} qd {qd} digests {digests}");
                let t0 = Instant::now();
                let b = Bench::spawn(
                    &dir,
                    &cfg,
                    &[
                        "-w", "randrw", "--verify", "--bs", bs, "--qd", qd, "-t", "0.5",
                    ],
                );
                let (code, v, log) = b.wait(Duration::from_secs(30));
                assert_eq!(code, 0, "{what}: {log}");
                assert!(u(&v, "ios") > 0, "{what}: {log}");
                assert_eq!(u(&v, "errors"), 0, "{what}: {log}");
                assert_eq!(v["total"]["verify_errors"], 0, "{what}: {log}");
                eprintln!("{what}: {} I/Os in {:?}", u(&v, "ios"), t0.elapsed());
            }
        }
    }
    // The target served every bench and is still healthy.
    let (code, out) = target.stop();
    assert_eq!(code, 0, "{out}");
}

#[test]
fn bench_survives_target_kill_and_restart() {
    let _g = serial();
    let dir = tmpdir("nvmf-e2e-restart");
    // A file, not malloc: what was written before the kill is still there
    // after the restart (O_DIRECT: acknowledged writes are in the file).
    let file = dir.join("disk.img");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let (target, port) = start_target(&dir, uring_bdev(&file), 0);
    let cfg = initiator_config(
        &dir,
        port,
        json!({"ctrlr_loss_timeout_sec": 20, "reconnect_delay_sec": 1, "hdgst": true, "ddgst": true}),
    );
    // Two reactors: two I/O queues reconnect and resend.
    let mut b = Bench::spawn(
        &dir,
        &cfg,
        &[
            "-w",
            "randrw",
            "--verify",
            "--qd",
            "32",
            "-t",
            "6",
            "--cores",
            "0,1",
            "--log-level",
            "info",
        ],
    );
    // Kill the target with I/O under way (and acknowledged writes in the
    // file), and restart it only once the bench has seen the loss.
    wait_for_reads(&target, &mut b, 1000);
    let killed = Instant::now();
    kill_target(target);
    testkit::wait_until(
        "the bench to log the lost connection",
        Duration::from_secs(20),
        || b.log().contains("lost; reconnecting"),
    );
    // Same config, same port.
    let (target, _) = start_target(&dir, uring_bdev(&file), port);
    let (code, v, log) = b.wait(Duration::from_secs(40));
    eprintln!("bench finished {:?} after the kill", killed.elapsed());
    assert_eq!(code, 0, "{log}");
    assert!(u(&v, "ios") > 0, "{log}");
    assert_eq!(u(&v, "errors"), 0, "{log}");
    assert_eq!(v["total"]["verify_errors"], 0, "{log}");
    assert!(
        log.contains("lost; reconnecting") && log.contains("reconnected"),
        "no reconnect in the bench's log: {log}"
    );
    // The bench went on against the restarted target (reads it verified).
    assert!(target_reads(&target) > 0, "{log}");
    let (code, out) = target.stop();
    assert_eq!(code, 0, "{out}");
}

#[test]
fn bench_fails_in_bounded_time_when_target_stays_dead() {
    let _g = serial();
    let dir = tmpdir("nvmf-e2e-dead");
    let (target, port) = start_target(&dir, malloc_bdev(8), 0);
    let cfg = initiator_config(
        &dir,
        port,
        json!({"ctrlr_loss_timeout_sec": 2, "reconnect_delay_sec": 1}),
    );
    let mut b = Bench::spawn(
        &dir,
        &cfg,
        &[
            "-w",
            "randrw",
            "--verify",
            "--qd",
            "32",
            "-t",
            "3",
            "--log-level",
            "info",
        ],
    );
    // Kill the target with I/O under way.
    wait_for_reads(&target, &mut b, 1000);
    let killed = Instant::now();
    kill_target(target);
    let (code, v, log) = b.wait(Duration::from_secs(30));
    let took = killed.elapsed();
    eprintln!("bench exited {code} {took:?} after the kill");
    assert_eq!(code, 1, "{log}");
    assert!(u(&v, "errors") > 0, "no I/O errors reported: {log}");
    assert_eq!(v["total"]["verify_errors"], 0, "{log}");
    assert!(took < Duration::from_secs(15), "took {took:?}: {log}");
    assert!(log.contains("failed after"), "{log}");
}

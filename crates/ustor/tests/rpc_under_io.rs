//! The control plane stays responsive while the data path is loaded: RPCs
//! answer during heavy verified NBD I/O from fio, the I/O finishes clean,
//! and the idle server then costs almost no CPU.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

#[test]
fn rpc_answers_during_heavy_io() {
    if !testkit::need("fio") {
        return;
    }
    let dir = tmpdir("rpcio");
    let s = Server::start(&dir, &exported_config(64), &[]);
    let port = s.nbd_port();
    let mut fio = Command::new("fio")
        // fio leaves verify state files in its working directory.
        .current_dir(&dir)
        .args([
            "--name=load",
            "--ioengine=nbd",
            &format!("--uri=nbd://127.0.0.1:{port}/Malloc0"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
            "--size=48M",
            "--verify=crc32c",
            "--do_verify=1",
            "--numjobs=1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut calls = 0;
    let mut worst = Duration::ZERO;
    let mut ops_seen = Vec::new();
    let t0 = Instant::now();
    while fio.try_wait().unwrap().is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "fio did not finish"
        );
        let c0 = Instant::now();
        let st = s.ok("bdev_get_iostat", json!({"name": "Malloc0"}));
        let _ = s.ok("bdev_get_bdevs", Value::Null);
        let _ = s.ok("nbd_get_stats", Value::Null);
        worst = worst.max(c0.elapsed());
        ops_seen.push(st["bdevs"][0]["num_write_ops"].as_u64().unwrap());
        calls += 1;
        // Pacing of the workload (an RPC round every 20 ms), not a wait.
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = fio.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "fio failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("verify: bad"),
        "fio verify failed"
    );
    eprintln!("{calls} RPC rounds during I/O, worst {worst:?}");
    assert!(calls >= 3, "too few RPC rounds during I/O ({calls})");
    // Typically under 50 ms here; the bound leaves room for a noisy CI
    // host while still catching a control plane queued behind the I/O.
    assert!(
        worst < Duration::from_secs(2),
        "an RPC took {worst:?} under load"
    );
    assert!(
        ops_seen.windows(2).any(|w| w[1] > w[0]),
        "iostat never moved during I/O: {ops_seen:?}"
    );
    let (code, log) = s.stop();
    assert_eq!(code, 0, "{log}");
}

/// CPU ticks (user + sys) of a process.
fn cpu_ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let f: Vec<&str> = s[s.rfind(')').unwrap() + 2..].split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[test]
fn idle_server_uses_almost_no_cpu() {
    let dir = tmpdir("idle");
    let s = Server::start(&dir, &exported_config(16), &["--cores", "0,1"]);
    // Measure from a settled server: init and config done, and both reactors
    // idle enough to have gone to sleep.
    s.ok("framework_wait_init", Value::Null);
    testkit::wait_until(
        "both reactors to go to sleep",
        Duration::from_secs(10),
        || {
            let r = s.ok("framework_get_reactors", Value::Null);
            let rs = r["reactors"].as_array().cloned().unwrap_or_default();
            rs.len() == 2 && rs.iter().all(|x| x["sleeps"].as_u64() > Some(0))
        },
    );
    let pid = s.child.id();
    let c0 = cpu_ticks(pid);
    let t0 = Instant::now();
    // The workload: 3 s of idling whose CPU time is measured.
    std::thread::sleep(Duration::from_secs(3));
    let used = cpu_ticks(pid) - c0;
    // SAFETY: sysconf has no side effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let pct = used as f64 / hz / t0.elapsed().as_secs_f64() * 100.0;
    assert!(
        pct < 2.0,
        "idle server with two reactors used {pct:.2}% CPU"
    );
    let _ = s.stop();
}

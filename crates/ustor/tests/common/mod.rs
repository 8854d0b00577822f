//! Starting and stopping `ustor serve` processes for the binary's tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};
use ustor_rpc::RpcClient;

pub const BIN: &str = env!("CARGO_BIN_EXE_ustor");

pub fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ustor-bin-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A `ustor serve` child, stopped by PID (SIGTERM) when dropped.
pub struct Server {
    pub child: Child,
    pub sock: PathBuf,
}

impl Server {
    /// Starts `ustor serve -r <dir>/rpc.sock -c <config>` and waits for RPC.
    pub fn start(dir: &Path, config: &Value, extra: &[&str]) -> Server {
        let cfg = dir.join(format!("config-{}.json", rand_tag()));
        std::fs::write(&cfg, serde_json::to_vec_pretty(config).unwrap()).unwrap();
        Self::start_with(dir, &["-c", cfg.to_str().unwrap()], extra)
    }

    pub fn start_with(dir: &Path, args: &[&str], extra: &[&str]) -> Server {
        let sock = dir.join(format!("rpc-{}.sock", rand_tag()));
        let child = Command::new(BIN)
            .arg("serve")
            .arg("-r")
            .arg(&sock)
            .args(["--no-pin", "--log-level", "warn"])
            .args(args)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn ustor serve");
        let mut s = Server { child, sock };
        let up = testkit::try_wait_for(Duration::from_secs(20), || {
            if RpcClient::connect(&s.sock).is_ok() {
                return Some(());
            }
            if let Ok(Some(st)) = s.child.try_wait() {
                let out = s.child.wait_with_output_lossy();
                panic!("ustor serve exited early ({st}): {out}");
            }
            None
        });
        assert!(up.is_some(), "ustor serve did not open its RPC socket");
        // Config is applied before the banner; wait until a method answers.
        let _ = s.call("spdk_get_version", Value::Null);
        s
    }

    pub fn call(&self, method: &str, params: Value) -> Result<Value, ustor_rpc::RpcError> {
        RpcClient::connect(&self.sock)?.call(method, params)
    }

    pub fn ok(&self, method: &str, params: Value) -> Value {
        self.call(method, params)
            .unwrap_or_else(|e| panic!("{method}: {e:?}"))
    }

    /// The NBD port the server bound (config may ask for port 0).
    pub fn nbd_port(&self) -> u16 {
        let cfg = self.ok("framework_get_config", json!({"name": "nbd"}));
        cfg.as_array()
            .and_then(|a| a.iter().find(|c| c["method"] == "nbd_server_start"))
            .and_then(|c| c["params"]["listen_address"]["trsvcid"].as_str())
            .and_then(|p| p.parse().ok())
            .expect("nbd server running")
    }

    /// SIGKILL and wait (a crash: nothing is drained or removed).
    pub fn kill(mut self) {
        // SAFETY: kill(2) on our own child's PID.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        let _ = self.child.wait();
    }

    /// SIGTERM and wait: returns the exit code and what it printed.
    pub fn stop(mut self) -> (i32, String) {
        // SAFETY: kill(2) on our own child's PID.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let out = self.child.wait_with_output_lossy();
        let code = self
            .child
            .try_wait()
            .ok()
            .flatten()
            .and_then(|s| s.code())
            .unwrap_or(-1);
        (code, out)
    }
}

trait OutputLossy {
    fn wait_with_output_lossy(&mut self) -> String;
}

impl OutputLossy for Child {
    fn wait_with_output_lossy(&mut self) -> String {
        use std::io::Read;
        let _ = self.wait();
        let mut s = String::new();
        if let Some(o) = self.stdout.as_mut() {
            let _ = o.read_to_string(&mut s);
        }
        if let Some(e) = self.stderr.as_mut() {
            let _ = e.read_to_string(&mut s);
        }
        s
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: kill(2) on our own child's PID.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
            let _ = self.child.wait();
        }
    }
}

pub fn rand_tag() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{}", N.fetch_add(1, Ordering::Relaxed))
}

pub fn empty_config() -> Value {
    json!({"subsystems": []})
}

/// A config with a malloc bdev exported by NBD and NVMe/TCP on free ports.
pub fn exported_config(mib: u64) -> Value {
    json!({"subsystems": [
        {"subsystem": "bdev", "config": [
            {"method": "bdev_malloc_create", "params": {"name": "Malloc0", "num_blocks": (mib << 20) / 512, "block_size": 512}}
        ]},
        {"subsystem": "nbd", "config": [
            {"method": "nbd_server_start", "params": {"listen_address": {"traddr": "127.0.0.1", "trsvcid": "0"}}},
            {"method": "nbd_export_create", "params": {"name": "Malloc0", "bdev_name": "Malloc0"}}
        ]},
        {"subsystem": "nvmf", "config": [
            {"method": "nvmf_create_transport", "params": {"trtype": "TCP"}},
            {"method": "nvmf_create_subsystem", "params": {"nqn": "nqn.2026-11.io.ustor:t1", "allow_any_host": true}},
            {"method": "nvmf_subsystem_add_ns", "params": {"nqn": "nqn.2026-11.io.ustor:t1", "namespace": {"bdev_name": "Malloc0"}}},
            {"method": "nvmf_subsystem_add_listener", "params": {"nqn": "nqn.2026-11.io.ustor:t1",
                "listen_address": {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": "0"}}}
        ]}
    ]})
}

/// Whether `cmd` is installed; a skip message, or a failure under
/// `CI=true`, when it is not (`testkit::need`).
pub fn have(cmd: &str) -> bool {
    testkit::need(cmd)
}

/// A free TCP port on 127.0.0.1 (for peers that cannot take port 0).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Receives sd_notify datagrams on `sock` until one has the line `want`
/// (they arrive in order); panics after 30 s.
pub fn expect_notify(sock: &std::os::unix::net::UnixDatagram, want: &str) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        assert!(!left.is_zero(), "no `{want}` notification");
        sock.set_read_timeout(Some(left)).unwrap();
        let n = sock.recv(&mut buf).expect("sd_notify datagram");
        let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
        if msg.lines().any(|l| l == want) {
            return msg;
        }
    }
}

/// sha256sum's hex digest of `data` (the same tool the tests compare
/// against on the other side, e.g. `rbd export | sha256sum`).
pub fn sha256(data: &[u8]) -> String {
    use std::io::Write;
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(data).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout)[..64].to_string()
}

/// `len` bytes of xorshift output from `seed`: data no block repeats.
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

//! Shared helpers for the integration tests: a test server with dummy
//! methods on a unique socket path, and a raw client that sends arbitrary
//! bytes and reads back JSON values.
#![allow(dead_code)]

use serde::Deserialize;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use ustor_rpc::{
    parse_params, MethodTable, RpcError, ServerConfig, ServerHandle, StreamDecoder, RPC_ANY_STATE,
    RPC_RUNTIME, RPC_STARTUP,
};

/// Values `slow` has replied with (its reply sent to the server, whether or
/// not the client is still there), for tests that wait for that.
static SLOW_REPLIED: std::sync::Mutex<Vec<Value>> = std::sync::Mutex::new(Vec::new());

/// Whether `slow` has sent its reply carrying `value`.
pub fn slow_replied(value: &Value) -> bool {
    SLOW_REPLIED.lock().unwrap().contains(value)
}

/// A socket path unique to this process and call.
pub fn sock_path(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("ustor-rpc-{}-{tag}-{n}.sock", std::process::id()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Create {
    name: String,
    block_size: u32,
    #[serde(default)]
    num_blocks: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Slow {
    ms: u64,
    #[serde(default)]
    value: Value,
}

/// Dummy methods: echo, create (typed params, "exists" → -EEXIST), slow
/// (answers from another thread after `ms`), fail (errno), startup_only.
pub fn test_table() -> MethodTable {
    let t = MethodTable::new();
    t.register_sync("echo", RPC_ANY_STATE, Ok).unwrap();
    t.register_sync("create", RPC_RUNTIME, |p| {
        let c: Create = parse_params(p)?;
        if c.name == "exists" {
            return Err(RpcError::errno(libc::EEXIST));
        }
        Ok(json!({"name": c.name, "bytes": u64::from(c.block_size) * c.num_blocks.unwrap_or(1)}))
    })
    .unwrap();
    t.register("slow", RPC_ANY_STATE, |p, reply| {
        match parse_params::<Slow>(p) {
            Ok(s) => {
                std::thread::spawn(move || {
                    // The method's work: answering late is what it tests.
                    std::thread::sleep(Duration::from_millis(s.ms));
                    reply.ok(s.value.clone());
                    SLOW_REPLIED.lock().unwrap().push(s.value);
                });
            }
            Err(e) => reply.err(e),
        }
    })
    .unwrap();
    t.register_sync("fail", RPC_ANY_STATE, |p| {
        let errno = p.get("errno").and_then(Value::as_i64).unwrap_or(22) as i32;
        Err(RpcError::errno(errno))
    })
    .unwrap();
    t.register_sync("startup_only", RPC_STARTUP, |_| Ok(json!(true)))
        .unwrap();
    t.register_alias("create_old", "create", true).unwrap();
    t
}

pub fn start_with(tag: &str, f: impl FnOnce(&mut ServerConfig)) -> (ServerHandle, PathBuf) {
    let path = sock_path(tag);
    let mut cfg = ServerConfig::with_path(&path);
    f(&mut cfg);
    let h = ustor_rpc::start(cfg, test_table()).expect("server starts");
    (h, path)
}

pub fn start(tag: &str) -> (ServerHandle, PathBuf) {
    start_with(tag, |_| {})
}

/// A client that speaks raw bytes.
pub struct Raw {
    pub s: UnixStream,
    dec: StreamDecoder,
}

impl Raw {
    pub fn connect(path: &std::path::Path) -> Raw {
        let s = UnixStream::connect(path).expect("connect");
        Raw {
            s,
            dec: StreamDecoder::new(64 << 20),
        }
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).expect("send");
    }

    pub fn send_json(&mut self, v: &Value) {
        self.send(v.to_string().as_bytes());
    }

    /// The next JSON value from the server, or None on EOF/timeout.
    pub fn recv(&mut self) -> Option<Value> {
        self.recv_within(Duration::from_secs(10))
    }

    pub fn recv_within(&mut self, timeout: Duration) -> Option<Value> {
        let deadline = Instant::now() + timeout;
        let mut buf = [0u8; 4096];
        loop {
            if let Ok(Some(v)) = self.dec.next_value() {
                return Some(v);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            self.s.set_read_timeout(Some(left)).unwrap();
            match self.s.read(&mut buf) {
                Ok(0) => return None,
                Ok(n) => self.dec.push(&buf[..n]).unwrap(),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return None,
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return None,
                Err(_) => return None,
            }
        }
    }

    /// Send one request and return the reply.
    pub fn call(&mut self, v: Value) -> Value {
        self.send_json(&v);
        self.recv().expect("a reply")
    }

    /// True when the server closed the connection (EOF or reset).
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 64];
        self.s
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                Err(_) => return true,
            }
        }
    }
}

pub fn req(method: &str, params: Value, id: Value) -> Value {
    json!({"jsonrpc": "2.0", "method": method, "params": params, "id": id})
}

/// Wait until `f` holds (for counters that settle asynchronously).
#[track_caller]
pub fn eventually(what: &str, f: impl Fn() -> bool) {
    testkit::wait_until(what, Duration::from_secs(10), f);
}

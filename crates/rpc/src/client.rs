//! A blocking JSON-RPC client for the `ustor rpc` CLI and for tests: same
//! framing as SPDK's `JSONRPCClient` (values back to back, params omitted
//! when empty), plus `save_config` assembled the way SPDK's `rpc.py
//! save_config` does it, and the pretty-printer the CLI uses for results.

use crate::codec::{encode_request, StreamDecoder};
use crate::errors::RpcError;
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// SPDK's client waits 60 s for a reply by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest reply accepted (config dumps of big setups are large).
pub const MAX_REPLY_BYTES: usize = 256 << 20;

/// A connection to an RPC server.
#[derive(Debug)]
pub struct RpcClient {
    stream: UnixStream,
    decoder: StreamDecoder,
    next_id: u64,
    timeout: Duration,
    path: PathBuf,
}

impl RpcClient {
    /// Connect to the server's Unix socket. Failure carries the errno
    /// (e.g. -111 "Connection refused", -2 for a missing socket).
    pub fn connect(path: impl AsRef<Path>) -> Result<Self, RpcError> {
        let path = path.as_ref().to_path_buf();
        let stream = UnixStream::connect(&path).map_err(|e| {
            let errno = e.raw_os_error().unwrap_or(libc::EIO);
            RpcError::errno_msg(
                errno,
                format!(
                    "cannot connect to {}: {} (is the ustor server running?)",
                    path.display(),
                    crate::errors::strerror(errno)
                ),
            )
        })?;
        Ok(RpcClient {
            stream,
            decoder: StreamDecoder::new(MAX_REPLY_BYTES),
            next_id: 1,
            timeout: DEFAULT_TIMEOUT,
            path,
        })
    }

    /// How long [`RpcClient::call`] waits for a reply.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout.max(Duration::from_millis(1));
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Call `method` and wait for its reply. `params` null or `{}` sends no
    /// params, like SPDK's client.
    pub fn call(&mut self, method: &str, params: Value) -> Result<Value, RpcError> {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&encode_request(Some(json!(id)), method, Some(&params)))?;
        let reply = self.recv_reply(id)?;
        if let Some(e) = reply.get("error") {
            return Err(RpcError::from_json(e));
        }
        reply
            .get("result")
            .cloned()
            .ok_or_else(|| RpcError::internal(format!("reply without result or error: {reply}")))
    }

    /// Send a notification (no reply is expected or read).
    pub fn notify(&mut self, method: &str, params: Value) -> Result<(), RpcError> {
        self.send(&encode_request(None, method, Some(&params)))
    }

    fn send(&mut self, req: &Value) -> Result<(), RpcError> {
        let bytes = serde_json::to_vec(req).map_err(RpcError::internal)?;
        self.stream
            .write_all(&bytes)
            .map_err(|e| RpcError::from_io(&e))
    }

    /// Read until the reply with `id` (or an id-null error: the server's
    /// answer to a request it could not parse) arrives.
    fn recv_reply(&mut self, id: u64) -> Result<Value, RpcError> {
        let deadline = Instant::now() + self.timeout;
        let mut buf = vec![0u8; 64 << 10];
        loop {
            while let Some(v) = self.decoder.next_value().map_err(|e| e.to_rpc_error())? {
                let rid = v.get("id");
                if rid == Some(&json!(id)) || rid == Some(&Value::Null) {
                    return Ok(v);
                }
                tracing::debug!("skipping reply for another request: {v}");
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RpcError::errno_msg(
                    libc::ETIMEDOUT,
                    format!("timeout after {:?} waiting for a reply", self.timeout),
                ));
            }
            self.stream
                .set_read_timeout(Some(left))
                .map_err(|e| RpcError::from_io(&e))?;
            match self.stream.read(&mut buf) {
                Ok(0) => {
                    return Err(RpcError::errno_msg(
                        libc::ECONNRESET,
                        "connection closed by the server before it replied",
                    ))
                }
                Ok(n) => self.decoder.push(&buf[..n]).map_err(|e| e.to_rpc_error())?,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(RpcError::from_io(&e)),
            }
        }
    }
}

/// Results as the CLI prints them: JSON indented by 2 like SPDK's rpc.py.
pub fn to_pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
}

/// An error as the CLI prints it, in the shape of SPDK's rpc.py message.
pub fn format_error(method: &str, params: &Value, e: &RpcError) -> String {
    format!(
        "request:\n{}\nGot JSON-RPC error response\nresponse:\n{}",
        to_pretty(&json!({"method": method, "params": params})),
        to_pretty(&e.to_json())
    )
}

/// The live configuration as `{"subsystems": [{"subsystem", "config"}]}`,
/// assembled like SPDK's `save_config`: `framework_get_subsystems`, then
/// `framework_get_config` for each subsystem kept. `only` restricts the
/// output to the named subsystems and everything they depend on.
pub fn save_config(client: &mut RpcClient, only: Option<&[&str]>) -> Result<Value, RpcError> {
    let subs = client.call("framework_get_subsystems", Value::Null)?;
    let subs = subs
        .as_array()
        .ok_or_else(|| RpcError::internal("framework_get_subsystems did not return an array"))?;
    let mut names = Vec::with_capacity(subs.len());
    // Each subsystem's full dependency set; SPDK lists subsystems in init
    // order, so dependencies are always seen first.
    let mut deps: HashMap<String, BTreeSet<String>> = HashMap::new();
    for s in subs {
        let name = s["subsystem"]
            .as_str()
            .ok_or_else(|| RpcError::internal(format!("bad subsystem entry: {s}")))?;
        let mut set = BTreeSet::from([name.to_string()]);
        for d in s["depends_on"].as_array().into_iter().flatten() {
            if let Some(d) = d.as_str() {
                set.extend(deps.get(d).cloned().unwrap_or_default());
                set.insert(d.to_string());
            }
        }
        deps.insert(name.to_string(), set);
        names.push(name.to_string());
    }
    let keep: BTreeSet<String> = match only {
        None => names.iter().cloned().collect(),
        Some(list) => {
            let mut keep = BTreeSet::new();
            for s in list {
                let set = deps.get(*s).ok_or_else(|| {
                    RpcError::invalid_param("subsystems", format!("unknown subsystem `{s}`"))
                })?;
                keep.extend(set.iter().cloned());
            }
            keep
        }
    };
    let mut out = Vec::new();
    for name in names.iter().filter(|n| keep.contains(*n)) {
        let config = client.call("framework_get_config", json!({ "name": name }))?;
        out.push(json!({"subsystem": name, "config": config}));
    }
    Ok(json!({ "subsystems": out }))
}

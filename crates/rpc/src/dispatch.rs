//! Method registry and dispatch: [`MethodTable`] maps method names (and
//! deprecated aliases) to asynchronous handlers, enforces SPDK's
//! startup/runtime state masks, answers built-in methods (`rpc_get_methods`,
//! `framework_get_subsystems`, `framework_get_config`) and turns decoded
//! messages (single or batch) into replies. It knows nothing about sockets:
//! the server hands it a completion callback per message.

use crate::codec::{encode_response, Entry, Message, Request};
use crate::errors::RpcError;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::Duration;

/// SPDK_RPC_STARTUP: the `--wait-for-rpc` state, before `framework_start_init`.
pub const RPC_STARTUP: u32 = 0x1;
/// SPDK_RPC_RUNTIME: after the framework is initialized.
pub const RPC_RUNTIME: u32 = 0x2;
/// Allowed in both states.
pub const RPC_ANY_STATE: u32 = RPC_STARTUP | RPC_RUNTIME;

/// SPDK's message for a runtime-only method called in the startup state.
pub const MSG_ONLY_AFTER_INIT: &str =
    "Method may only be called after framework is initialized using framework_start_init RPC.";
/// SPDK's message for a startup-only method called at runtime.
pub const MSG_ONLY_BEFORE_INIT: &str = "Method may only be called before framework is initialized. Use --wait-for-rpc command line parameter and then issue this RPC.";

#[path = "builtins.rs"]
mod builtins;

type Deliver = Box<dyn FnOnce(Result<Value, RpcError>) + Send>;
/// A method handler: gets the params (an object or array, `{}` when the
/// client sent none) and must answer through the [`Replier`] exactly once,
/// now or later, from any thread.
pub type Handler = Arc<dyn Fn(Value, Replier) + Send + Sync>;
/// Called once per message with its reply (`None` when no reply is due:
/// notifications).
pub type Completion = Arc<dyn Fn(Option<Value>) + Send + Sync>;

/// The one-shot answer channel of a request. It is `Send`, so a handler can
/// move it into a message for a reactor thread and answer from there. If it
/// is dropped unanswered (a bug in a handler, or a panic), the client gets
/// -32603 "Internal error: no reply" instead of waiting forever.
pub struct Replier {
    deliver: Option<Deliver>,
}

impl Replier {
    /// A replier that hands the result to `f`. The server builds these; tests
    /// and in-process callers ([`MethodTable::call_blocking`]) may too.
    pub fn new(f: impl FnOnce(Result<Value, RpcError>) + Send + 'static) -> Self {
        Replier {
            deliver: Some(Box::new(f)),
        }
    }

    /// Answer with a result.
    pub fn ok(self, result: Value) {
        self.send(Ok(result));
    }

    /// Answer with an error.
    pub fn err(self, error: RpcError) {
        self.send(Err(error));
    }

    /// Answer with either.
    pub fn send(mut self, result: Result<Value, RpcError>) {
        if let Some(f) = self.deliver.take() {
            f(result);
        }
    }
}

impl Drop for Replier {
    fn drop(&mut self) {
        if let Some(f) = self.deliver.take() {
            tracing::error!("RPC handler dropped its replier without answering");
            f(Err(RpcError::internal("no reply")));
        }
    }
}

impl std::fmt::Debug for Replier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replier")
            .field("answered", &self.deliver.is_none())
            .finish()
    }
}

/// Why a registration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    #[error("RPC method `{0}` is already registered")]
    Duplicate(String),
    #[error("alias `{alias}` points to unknown method `{target}`")]
    UnknownTarget { alias: String, target: String },
    #[error("subsystem `{subsystem}` depends on unknown subsystem `{depends_on}`")]
    UnknownDependency {
        subsystem: String,
        depends_on: String,
    },
    #[error("subsystem `{0}` is already registered")]
    DuplicateSubsystem(String),
}

enum Slot {
    Method {
        handler: Handler,
        mask: u32,
    },
    Alias {
        target: String,
        deprecated: bool,
        warned: AtomicBool,
    },
}

struct Subsystem {
    name: String,
    depends_on: Vec<String>,
    dump: Arc<dyn Fn(Replier) + Send + Sync>,
}

struct Inner {
    methods: RwLock<BTreeMap<String, Slot>>,
    subsystems: RwLock<Vec<Subsystem>>,
    state: AtomicU32,
    /// Initialization (the startup config included) is complete; until
    /// then `framework_wait_init` callers wait in `init_waiters`.
    init: Mutex<InitState>,
}

struct InitState {
    done: bool,
    waiters: Vec<Replier>,
}

/// The registry of RPC methods, shared (cheap `Clone`) between the server
/// thread and whoever registers methods.
#[derive(Clone)]
pub struct MethodTable {
    inner: Arc<Inner>,
}

impl Default for MethodTable {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MethodTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MethodTable")
            .field("methods", &self.method_names(false, true))
            .field("state", &self.state())
            .finish()
    }
}

impl MethodTable {
    /// A table holding the built-in methods, in the [`RPC_RUNTIME`] state
    /// (a server started with `--wait-for-rpc` sets [`RPC_STARTUP`] first and
    /// its `framework_start_init` sets [`RPC_RUNTIME`]).
    pub fn new() -> Self {
        let t = MethodTable {
            inner: Arc::new(Inner {
                methods: RwLock::new(BTreeMap::new()),
                subsystems: RwLock::new(Vec::new()),
                state: AtomicU32::new(RPC_RUNTIME),
                init: Mutex::new(InitState {
                    done: true,
                    waiters: Vec::new(),
                }),
            }),
        };
        builtins::register(&t);
        t
    }

    /// Register an asynchronous method allowed in the states of `mask`.
    pub fn register(
        &self,
        name: &str,
        mask: u32,
        handler: impl Fn(Value, Replier) + Send + Sync + 'static,
    ) -> Result<(), RegisterError> {
        let mut m = write(&self.inner.methods);
        if m.contains_key(name) {
            return Err(RegisterError::Duplicate(name.to_string()));
        }
        let slot = Slot::Method {
            handler: Arc::new(handler),
            mask,
        };
        m.insert(name.to_string(), slot);
        Ok(())
    }

    /// Register a method that answers at once.
    pub fn register_sync(
        &self,
        name: &str,
        mask: u32,
        f: impl Fn(Value) -> Result<Value, RpcError> + Send + Sync + 'static,
    ) -> Result<(), RegisterError> {
        self.register(name, mask, move |params, reply| reply.send(f(params)))
    }

    /// Register `alias` as another name of `target` (SPDK keeps deprecated
    /// names working; calling one logs a warning once).
    pub fn register_alias(
        &self,
        alias: &str,
        target: &str,
        deprecated: bool,
    ) -> Result<(), RegisterError> {
        let mut m = write(&self.inner.methods);
        if !matches!(m.get(target), Some(Slot::Method { .. })) {
            return Err(RegisterError::UnknownTarget {
                alias: alias.to_string(),
                target: target.to_string(),
            });
        }
        if m.contains_key(alias) {
            return Err(RegisterError::Duplicate(alias.to_string()));
        }
        let slot = Slot::Alias {
            target: target.to_string(),
            deprecated,
            warned: AtomicBool::new(false),
        };
        m.insert(alias.to_string(), slot);
        Ok(())
    }

    /// Register a subsystem for `framework_get_subsystems` /
    /// `framework_get_config`. `dump` answers with the subsystem's config:
    /// an array of `{"method": .., "params": ..}` that recreates it. Register
    /// dependencies first (the order is the init order).
    pub fn add_subsystem(
        &self,
        name: &str,
        depends_on: &[&str],
        dump: impl Fn(Replier) + Send + Sync + 'static,
    ) -> Result<(), RegisterError> {
        let mut subs = write(&self.inner.subsystems);
        if subs.iter().any(|s| s.name == name) {
            return Err(RegisterError::DuplicateSubsystem(name.to_string()));
        }
        if let Some(d) = depends_on
            .iter()
            .find(|d| !subs.iter().any(|s| s.name == **d))
        {
            return Err(RegisterError::UnknownDependency {
                subsystem: name.to_string(),
                depends_on: d.to_string(),
            });
        }
        subs.push(Subsystem {
            name: name.to_string(),
            depends_on: depends_on.iter().map(|s| s.to_string()).collect(),
            dump: Arc::new(dump),
        });
        Ok(())
    }

    /// Set the current state ([`RPC_STARTUP`] or [`RPC_RUNTIME`]).
    pub fn set_state(&self, state: u32) {
        self.inner.state.store(state, Ordering::Release);
    }

    /// Marks initialization as under way: [`MethodTable::wait_init`]
    /// callers wait until [`MethodTable::init_done`].
    pub fn init_begun(&self) {
        lock(&self.inner.init).done = false;
    }

    /// Initialization finished (startup config applied): answers every
    /// waiting `framework_wait_init`.
    pub fn init_done(&self) {
        let waiters = {
            let mut g = lock(&self.inner.init);
            g.done = true;
            std::mem::take(&mut g.waiters)
        };
        for w in waiters {
            w.ok(Value::Bool(true));
        }
    }

    /// Answers `true` through `reply` once initialization is done: at once
    /// if it is, else when [`MethodTable::init_done`] is called (SPDK's
    /// `framework_wait_init`, which returns only after init).
    pub fn wait_init(&self, reply: Replier) {
        let mut g = lock(&self.inner.init);
        if g.done {
            drop(g);
            reply.ok(Value::Bool(true));
        } else {
            g.waiters.push(reply);
        }
    }

    /// The current state.
    pub fn state(&self) -> u32 {
        self.inner.state.load(Ordering::Acquire)
    }

    /// Method names, sorted; `current` keeps only those callable in the
    /// current state, `include_aliases` adds alias names.
    pub fn method_names(&self, current: bool, include_aliases: bool) -> Vec<String> {
        let m = read(&self.inner.methods);
        let state = self.state();
        m.iter()
            .filter(|(_, slot)| {
                let (mask, is_alias) = match slot {
                    Slot::Method { mask, .. } => (*mask, false),
                    Slot::Alias { target, .. } => match m.get(target) {
                        Some(Slot::Method { mask, .. }) => (*mask, true),
                        _ => return false,
                    },
                };
                (!current || mask & state == state) && (include_aliases || !is_alias)
            })
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Resolve a name (following an alias) to its handler, checking the
    /// state. The lock is released before the handler runs, so handlers may
    /// register methods.
    fn resolve(&self, method: &str) -> Result<Handler, RpcError> {
        let m = read(&self.inner.methods);
        let mut slot = m.get(method);
        if let Some(Slot::Alias {
            target,
            deprecated,
            warned,
        }) = slot
        {
            if *deprecated && !warned.swap(true, Ordering::Relaxed) {
                tracing::warn!("RPC method {method} is deprecated. Use {target} instead.");
            }
            slot = m.get(target);
        }
        let Some(Slot::Method { handler, mask }) = slot else {
            return Err(RpcError::method_not_found(method));
        };
        let state = self.state();
        if mask & state != state {
            let msg = if state == RPC_STARTUP {
                MSG_ONLY_AFTER_INIT
            } else {
                MSG_ONLY_BEFORE_INIT
            };
            return Err(RpcError::new(crate::errors::INVALID_STATE, msg));
        }
        Ok(handler.clone())
    }

    /// Dispatch one call; the answer goes to `reply`.
    pub fn call(&self, method: &str, params: Value, reply: Replier) {
        let handler = match self.resolve(method) {
            Ok(h) => h,
            Err(e) => return reply.err(e),
        };
        let params = if params.is_null() { json!({}) } else { params };
        // A panicking handler must not take the control plane down: the
        // replier it owned is dropped while unwinding and answers -32603.
        if catch_unwind(AssertUnwindSafe(|| handler(params, reply))).is_err() {
            tracing::error!("RPC method {method} panicked");
        }
    }

    /// Dispatch one call and wait for its answer (for in-process callers
    /// such as config loading; never call it on a thread that the handler
    /// needs in order to answer).
    pub fn call_blocking(
        &self,
        method: &str,
        params: Value,
        timeout: Duration,
    ) -> Result<Value, RpcError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.call(
            method,
            params,
            Replier::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.recv_timeout(timeout).unwrap_or_else(|_| {
            Err(RpcError::errno_msg(
                libc::ETIMEDOUT,
                format!("method {method} did not answer within {timeout:?}"),
            ))
        })
    }

    /// Handle one decoded message. `done` is called exactly once, when every
    /// request in it has answered, with the reply to send (`None` when every
    /// request was a notification).
    pub fn handle_message(&self, msg: Message, done: Completion) {
        match msg {
            Message::Single(entry) => self.handle_entry(entry, Box::new(move |r| done(r))),
            Message::Batch(entries) => {
                let batch = Arc::new(BatchState {
                    slots: Mutex::new((vec![None; entries.len()], entries.len())),
                    done,
                });
                for (i, entry) in entries.into_iter().enumerate() {
                    let b = batch.clone();
                    self.handle_entry(entry, Box::new(move |r| b.fill(i, r)));
                }
            }
        }
    }

    fn handle_entry(&self, entry: Entry, out: Box<dyn FnOnce(Option<Value>) + Send>) {
        match entry {
            Err((id, e)) => out(Some(encode_response(id, Err(e)))),
            Ok(Request { id, method, params }) => {
                let reply = Replier::new(move |r| match id {
                    Some(id) => out(Some(encode_response(id, r))),
                    None => {
                        if let Err(e) = r {
                            tracing::debug!("notification failed: {e}");
                        }
                        out(None)
                    }
                });
                self.call(&method, params, reply);
            }
        }
    }
}

struct BatchState {
    /// Replies by entry index, and how many entries are still running.
    slots: Mutex<(Vec<Option<Value>>, usize)>,
    done: Completion,
}

impl BatchState {
    fn fill(&self, i: usize, reply: Option<Value>) {
        let finished = {
            let mut g = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(slot) = g.0.get_mut(i) {
                *slot = reply;
            }
            g.1 = g.1.saturating_sub(1);
            (g.1 == 0).then(|| std::mem::take(&mut g.0))
        };
        if let Some(slots) = finished {
            let replies: Vec<Value> = slots.into_iter().flatten().collect();
            (self.done)((!replies.is_empty()).then_some(Value::Array(replies)));
        }
    }
}

// Lock poisoning only means a registering thread panicked; the map itself is
// still consistent (inserts are single operations), so keep serving.
fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}

fn lock<T>(l: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    l.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::decode_message;

    fn run(t: &MethodTable, msg: Value) -> Option<Value> {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        t.handle_message(
            decode_message(msg),
            Arc::new(move |r| {
                let _ = tx.lock().unwrap().send(r);
            }),
        );
        rx.recv_timeout(Duration::from_secs(5)).unwrap()
    }

    #[test]
    fn states_and_aliases() {
        let t = MethodTable::new();
        t.register_sync("start_only", RPC_STARTUP, |_| Ok(json!(1)))
            .unwrap();
        t.register_sync("run_only", RPC_RUNTIME, |_| Ok(json!(2)))
            .unwrap();
        t.register_alias("old_run", "run_only", true).unwrap();
        assert!(t
            .register_sync("run_only", RPC_RUNTIME, |_| Ok(json!(2)))
            .is_err());
        let call = |m: &str| t.call_blocking(m, json!({}), Duration::from_secs(1));
        assert_eq!(call("old_run"), Ok(json!(2)));
        assert_eq!(
            call("start_only").unwrap_err().message,
            MSG_ONLY_BEFORE_INIT
        );
        t.set_state(RPC_STARTUP);
        let e = call("run_only").unwrap_err();
        assert_eq!((e.code, e.message.as_str()), (-1, MSG_ONLY_AFTER_INIT));
        assert_eq!(call("start_only"), Ok(json!(1)));
        let cur = t
            .call_blocking(
                "rpc_get_methods",
                json!({"current": true}),
                Duration::from_secs(1),
            )
            .unwrap();
        assert!(cur.as_array().unwrap().contains(&json!("start_only")));
        assert!(!cur.as_array().unwrap().contains(&json!("run_only")));
        let all = t
            .call_blocking(
                "rpc_get_methods",
                json!({"include_aliases": true}),
                Duration::from_secs(1),
            )
            .unwrap();
        assert!(all.as_array().unwrap().contains(&json!("old_run")));
        assert_eq!(
            call("nope").unwrap_err().code,
            crate::errors::METHOD_NOT_FOUND
        );
    }

    #[test]
    fn dropped_or_panicking_handler_answers_internal_error() {
        let t = MethodTable::new();
        t.register("drop", RPC_ANY_STATE, |_, r| drop(r)).unwrap();
        t.register("panic", RPC_ANY_STATE, |_, _r| panic!("boom"))
            .unwrap();
        for m in ["drop", "panic"] {
            let e = t
                .call_blocking(m, json!({}), Duration::from_secs(1))
                .unwrap_err();
            assert_eq!(e.code, crate::errors::INTERNAL_ERROR);
        }
    }

    #[test]
    fn batches_and_notifications() {
        let t = MethodTable::new();
        t.register_sync("echo", RPC_ANY_STATE, Ok).unwrap();
        let r = run(
            &t,
            json!([
                {"jsonrpc":"2.0","method":"echo","params":[1],"id":"a"},
                {"jsonrpc":"2.0","method":"echo","params":[2]},
                {"jsonrpc":"2.0","method":"nope","id":null},
                7
            ]),
        )
        .unwrap();
        let arr = r.as_array().unwrap();
        assert_eq!(arr.len(), 3);
        assert_eq!(arr[0], json!({"jsonrpc":"2.0","id":"a","result":[1]}));
        assert_eq!(arr[1]["error"]["code"], json!(-32601));
        assert_eq!(arr[2]["error"]["code"], json!(-32600));
        let none = run(&t, json!([{"jsonrpc":"2.0","method":"echo"}]));
        assert_eq!(none, None);
        assert_eq!(run(&t, json!({"jsonrpc":"2.0","method":"echo"})), None);
    }

    #[test]
    fn subsystems() {
        let t = MethodTable::new();
        t.add_subsystem("bdev", &[], |r| r.ok(json!([{"method":"m","params":{}}])))
            .unwrap();
        assert!(t
            .add_subsystem("nbd", &["nope"], |r| r.ok(json!([])))
            .is_err());
        t.add_subsystem("nbd", &["bdev"], |r| r.ok(json!([])))
            .unwrap();
        let d = Duration::from_secs(1);
        let s = t
            .call_blocking("framework_get_subsystems", Value::Null, d)
            .unwrap();
        assert_eq!(s[1], json!({"subsystem":"nbd","depends_on":["bdev"]}));
        let c = t
            .call_blocking("framework_get_config", json!({"name":"bdev"}), d)
            .unwrap();
        assert_eq!(c[0]["method"], json!("m"));
        let e = t
            .call_blocking("framework_get_config", json!({"name":"x"}), d)
            .unwrap_err();
        assert_eq!(e.param(), Some("name"));
    }
}

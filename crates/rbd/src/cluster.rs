//! Registered Ceph clusters: one librados connection each, shared by every
//! image opened through it (`bdev_rbd_register_cluster`), and the placement
//! of that connection's threads.
//!
//! Placement: Linux gives a new thread its creator's CPU affinity, and
//! librados/librbd make their threads from the thread that connects or
//! opens an image, or from threads made that way. So the control thread
//! narrows its own affinity to the cluster's cores around `rados_connect`,
//! `rbd_open` and `rbd_update_watch` (the first watch starts librbd's
//! `tp_librbd` pool), and every thread of the connection lands there. The
//! threads that appeared are counted and checked (and pinned, should one
//! have escaped). Default cores: those without a reactor; when every core
//! runs a reactor, all of them, with a warning in the log.
//!
//! Scheduling policy (`batch_completions`, ustor's own, off by default):
//! the connection's completion thread (librados' `io_context_pool`, which
//! runs every callback) may run `SCHED_BATCH`. librados wakes it while
//! still holding a lock (`C_aio_Complete::finish` defers the callback under
//! the completion's lock); with the thread on the messenger's core a plain
//! wake-up preempts the messenger there, the woken thread blocks on that
//! lock, and the messenger resumes only to wake it a second time. A batch
//! thread never preempts on wake-up: it runs when the messenger goes back
//! to its epoll wait. In per-thread windows at randread QD1, every client
//! thread on one core, that cut the messenger's involuntary switches from
//! 1.2 to 0.02 per I/O but not the client's CPU per I/O (1.00-1.08x), nor
//! did the paired benchmark show a gain at QD1 (0.97x and 1.04x, 0.79x IOPS
//! in one run: a batch thread also waits behind other processes' threads on
//! its core); 0.76x at randread QD32 in one run. So it stays off by default
//! (bench/RESULTS-rbd.md). The
//! messenger stays `SCHED_OTHER` either way. Threads librbd starts from the
//! completion thread (its task finisher and a timer) inherit the policy.
//!
//! `sched_batch` (ustor's own, off by default) makes every thread of the
//! connection `SCHED_BATCH`, the messenger included. With an interrupt-mode
//! reactor alone on the core that cut the client CPU per I/O further, but a
//! batch messenger cannot preempt anything else on its core either: on a
//! loaded machine (load average 11-14 on 2 cores) it cost 0.55-0.69x the
//! IOPS at three of four points, and behind a polling reactor 0.4x.
//!
//! Time limits: Ceph's `rados_osd_op_timeout` arms a timer event in
//! librados for every op, which cost 0.81-0.87x client CPU per I/O at
//! three of four points with every thread on one core (bench/RESULTS-rbd.md;
//! fio runs without it). So ustor bounds the direct path's I/O itself
//! (`op_timeout_s`, a deadline per request checked by the reactor, see
//! [`crate::direct`]) and turns Ceph's timeout on only while something of
//! the connection needs librbd to be bounded: an image being opened, or
//! one on librbd's data path. Set through `config_param`, Ceph's timeout
//! is the user's and left alone.

use std::collections::{BTreeMap, HashSet};
use std::ffi::CString;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::ffi;
use crate::RbdError;

/// `bdev_rbd_register_cluster` parameters (SPDK's).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterOpts {
    pub name: String,
    /// Ceph client id without `client.` (librados' default: `admin`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_id: Option<String>,
    /// Ceph options applied after the config file and ustor's defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_param: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<String>,
    /// Cores for this connection's threads (`0x3`, `[0-1]`, `0,2`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub core_mask: Option<String>,
    /// ustor's own: run the connection's threads `SCHED_BATCH` (default
    /// false; see the module doc).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sched_batch: Option<bool>,
    /// ustor's own: run the connection's completion thread
    /// (`io_context_pool`) `SCHED_BATCH` (default false; see the module
    /// doc).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_completions: Option<bool>,
    /// ustor's own: seconds before an I/O fails with ETIMEDOUT (default
    /// [`OP_TIMEOUT_S`]; 0: never). See the module doc.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op_timeout_s: Option<u64>,
}

/// Default seconds before an I/O the cluster does not answer fails.
pub const OP_TIMEOUT_S: u64 = 30;

/// Ceph options ustor sets before the user's (`config_param` overrides).
/// Few client threads; no client cache, so a write completes when the OSD
/// has it (an honest latency, and nothing lost on a crash); no admin socket
/// per client (several connections of one process would fight over its
/// path); and time limits for connect and monitor calls, so a lost cluster
/// fails instead of hanging (I/O: `op_timeout_s`).
pub const DEFAULTS: &[(&str, &str)] = &[
    ("rbd_cache", "false"),
    ("librados_thread_count", "1"),
    ("ms_async_op_threads", "1"),
    ("admin_socket", ""),
    ("client_mount_timeout", "10"),
    ("rados_mon_op_timeout", "30"),
];

const OSD_TIMEOUT: &str = "rados_osd_op_timeout";

/// One librados connection.
pub struct Cluster {
    pub opts: ClusterOpts,
    handle: ffi::rados_t,
    /// Where its threads run.
    pub cores: Vec<usize>,
    /// Which of its threads run `SCHED_BATCH`.
    pub batch: Batch,
    /// Threads that appeared while connecting and opening images.
    threads: Mutex<usize>,
    /// Seconds before an I/O fails (0: never).
    pub op_timeout_s: u64,
    /// What needs Ceph's op timeout on (images opening or on librbd's
    /// path); `None` when the user set it.
    timeout_holds: Option<Mutex<usize>>,
}

// SAFETY: a connected `rados_t` may be used from any thread (librados
// serialises internally); ustor only creates io contexts through it.
unsafe impl Send for Cluster {}
// SAFETY: as above.
unsafe impl Sync for Cluster {}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: the handle came from rados_create; every io context and
        // image made from it holds an `Arc<Cluster>`, so none is left.
        unsafe { ffi::rados_shutdown(self.handle) };
    }
}

fn cstr(what: &'static str, s: &str) -> Result<CString, RbdError> {
    CString::new(s).map_err(|_| RbdError::Invalid {
        param: what,
        why: "contains a NUL byte".into(),
    })
}

/// Closes a handle that never connected.
struct Unconnected(ffi::rados_t);

impl Drop for Unconnected {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: a handle from rados_create, used by nothing else.
            unsafe { ffi::rados_shutdown(self.0) };
        }
    }
}

impl Cluster {
    /// Connects (blocking: the control thread's business, never a
    /// reactor's). `reactor_cores`: cores the default placement avoids.
    pub fn connect(opts: ClusterOpts, reactor_cores: &[usize]) -> Result<Arc<Cluster>, RbdError> {
        let cores = placement(opts.core_mask.as_deref(), reactor_cores)?;
        let batch = match (opts.sched_batch, opts.batch_completions) {
            (Some(true), _) => Batch::All,
            (_, Some(true)) => Batch::Completions,
            _ => Batch::None,
        };
        // Before any handle exists: a host without librbd gets a clear
        // error and nothing half-created.
        ffi::load().map_err(RbdError::Library)?;
        let id = opts
            .user_id
            .as_deref()
            .map(|u| cstr("user_id", u))
            .transpose()?;
        let mut h = Unconnected(std::ptr::null_mut());
        // SAFETY: rados_create writes a handle to `h.0`; `id` outlives it.
        let r = unsafe {
            ffi::rados_create(
                &mut h.0,
                id.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
            )
        };
        check(r, || "creating the cluster handle".into())?;
        if let Some(f) = &opts.config_file {
            let p = cstr("config_file", f)?;
            // SAFETY: a valid handle and C string.
            check(
                unsafe { ffi::rados_conf_read_file(h.0, p.as_ptr()) },
                || format!("reading config file {f}"),
            )?;
        }
        let set = |k: &str, v: &str| -> Result<(), RbdError> {
            let (kc, vc) = (cstr("config_param", k)?, cstr("config_param", v)?);
            // SAFETY: a valid, unconnected handle and C strings.
            check(
                unsafe { ffi::rados_conf_set(h.0, kc.as_ptr(), vc.as_ptr()) },
                || format!("setting Ceph option {k}={v}"),
            )
        };
        for (k, v) in DEFAULTS {
            set(k, v)?;
        }
        let op_timeout_s = opts.op_timeout_s.unwrap_or(OP_TIMEOUT_S);
        let user_timeout = opts
            .config_param
            .iter()
            .flatten()
            .any(|(k, _)| k == OSD_TIMEOUT);
        // On while connecting; off below once connected (nothing holds it).
        set(OSD_TIMEOUT, &op_timeout_s.to_string())?;
        for (k, v) in opts.config_param.iter().flatten() {
            set(k, v)?;
        }
        if let Some(k) = &opts.key_file {
            set("keyring", k)?;
        }
        let (r, threads) = on_cores(&cores, batch, || {
            // SAFETY: a configured, unconnected handle.
            unsafe { ffi::rados_connect(h.0) }
        });
        check(r, || format!("connecting to cluster `{}`", opts.name))?;
        let handle = std::mem::replace(&mut h.0, std::ptr::null_mut());
        let policy = match batch {
            Batch::All => "SCHED_BATCH",
            Batch::Completions => "SCHED_OTHER, io_context_pool SCHED_BATCH",
            Batch::None => "SCHED_OTHER",
        };
        tracing::info!(
            "rbd cluster {}: connected, {threads} librados threads on cores {cores:?}, {policy}",
            opts.name
        );
        let c = Cluster {
            opts,
            handle,
            cores,
            batch,
            threads: Mutex::new(threads),
            op_timeout_s,
            timeout_holds: (!user_timeout).then(|| Mutex::new(1)),
        };
        c.release_osd_timeout();
        Ok(Arc::new(c))
    }

    /// Something of this connection needs librbd's I/O bounded: Ceph's
    /// op timeout is on until the matching [`Self::release_osd_timeout`].
    pub(crate) fn hold_osd_timeout(&self) {
        self.osd_timeout_holds(1);
    }

    pub(crate) fn release_osd_timeout(&self) {
        self.osd_timeout_holds(-1);
    }

    fn osd_timeout_holds(&self, d: isize) {
        let Some(m) = &self.timeout_holds else { return };
        let mut n = m.lock().unwrap_or_else(|p| p.into_inner());
        let was = *n;
        *n = n.saturating_add_signed(d);
        if (was == 0) == (*n == 0) {
            return;
        }
        let v = if *n == 0 { 0 } else { self.op_timeout_s };
        let k = CString::new(OSD_TIMEOUT).expect("no NUL");
        let vc = CString::new(v.to_string()).expect("digits");
        // SAFETY: a connected handle and C strings. librados applies the
        // change at once (the Objecter observes this option): ops sent from
        // now on get the timer, or not.
        let r = unsafe { ffi::rados_conf_set(self.handle, k.as_ptr(), vc.as_ptr()) };
        if r < 0 {
            tracing::warn!(
                "rbd cluster {}: setting {OSD_TIMEOUT}={v}: errno {}",
                self.opts.name,
                -r
            );
        }
    }

    /// Runs `f` (which makes librados/librbd threads) with the calling
    /// thread on this connection's cores; counts the threads it made.
    pub fn placed<R>(&self, f: impl FnOnce() -> R) -> R {
        let (r, n) = on_cores(&self.cores, self.batch, f);
        *self.threads.lock().unwrap_or_else(|p| p.into_inner()) += n;
        r
    }

    pub fn handle(&self) -> ffi::rados_t {
        self.handle
    }

    /// Threads this connection made (connect and image opens).
    pub fn threads(&self) -> usize {
        *self.threads.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `bdev_rbd_get_clusters_info`'s entry.
    pub fn info_json(&self) -> Value {
        let o = &self.opts;
        json!({
            "cluster_name": o.name,
            "user_id": o.user_id,
            "config_param": o.config_param,
            "config_file": o.config_file,
            "key_file": o.key_file,
            "core_mask": o.core_mask,
            "cores": self.cores,
            "sched_batch": self.batch == Batch::All,
            "batch_completions": self.batch != Batch::None,
            "op_timeout_s": self.op_timeout_s,
            "threads": self.threads(),
        })
    }
}

/// `Err(Rados)` for a negative return.
pub(crate) fn check(r: i32, what: impl FnOnce() -> String) -> Result<(), RbdError> {
    if r < 0 {
        Err(RbdError::Rados {
            what: what(),
            errno: -r,
        })
    } else {
        Ok(())
    }
}

/// The cores a connection's threads use.
fn placement(mask: Option<&str>, reactor_cores: &[usize]) -> Result<Vec<usize>, RbdError> {
    let online = allowed_cores();
    if let Some(m) = mask {
        let spec = m.trim().trim_start_matches('[').trim_end_matches(']');
        let cores = ustor_runtime::parse_cores(spec).map_err(|e| RbdError::Invalid {
            param: "core_mask",
            why: e.to_string(),
        })?;
        if let Some(c) = cores.iter().find(|c| !online.contains(c)) {
            return Err(RbdError::Invalid {
                param: "core_mask",
                why: format!("core {c} is not available to this process"),
            });
        }
        return Ok(cores);
    }
    let free: Vec<usize> = online
        .iter()
        .copied()
        .filter(|c| !reactor_cores.contains(c))
        .collect();
    if free.is_empty() {
        tracing::warn!(
            "rbd: every core runs a reactor; librados threads share them (set core_mask, or run fewer reactors)"
        );
        return Ok(online);
    }
    Ok(free)
}

/// The cores this process may run on.
fn allowed_cores() -> Vec<usize> {
    // SAFETY: sched_getaffinity fills the set we pass for this process.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect();
    }
    // SAFETY: CPU_ISSET reads the set filled above.
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

fn cpu_set(cores: &[usize]) -> libc::cpu_set_t {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes into it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cores {
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    set
}

fn tasks() -> HashSet<i32> {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Runs `f` with the calling thread's affinity narrowed to `cores`, so the
/// threads it creates inherit them; returns `f`'s result and how many
/// threads appeared (each checked, and pinned if it is elsewhere; those
/// `batch` names made `SCHED_BATCH`: the threads they make later inherit
/// it).
fn on_cores<R>(cores: &[usize], batch: Batch, f: impl FnOnce() -> R) -> (R, usize) {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: get/set this thread's affinity with sets of the right size.
    let mut old: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let saved = unsafe { libc::sched_getaffinity(0, size, &mut old) } == 0;
    let want = cpu_set(cores);
    unsafe { libc::sched_setaffinity(0, size, &want) };
    let before = tasks();
    let r = f();
    let new: Vec<i32> = tasks().difference(&before).copied().collect();
    for &tid in &new {
        // SAFETY: as above, for a thread of this process.
        let mut got: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let ok = unsafe { libc::sched_getaffinity(tid, size, &mut got) } == 0;
        if ok && !unsafe { libc::CPU_EQUAL(&got, &want) } {
            tracing::warn!("rbd: thread {tid} escaped its placement; pinning it");
            unsafe { libc::sched_setaffinity(tid, size, &want) };
        }
        if batch.takes(tid) {
            set_batch(tid);
        }
    }
    if saved {
        // SAFETY: restores the set read above.
        unsafe { libc::sched_setaffinity(0, size, &old) };
    }
    (r, new.len())
}

/// Which of a connection's threads run `SCHED_BATCH` (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Batch {
    None,
    /// librados' completion thread (`io_context_pool`).
    Completions,
    /// Every thread (`sched_batch`).
    All,
}

/// librados' completion thread's name (librbd's work runs there too).
const COMPLETION_THREAD: &str = "io_context_pool";

impl Batch {
    /// Whether thread `tid` of this process (just made) is one to batch.
    fn takes(self, tid: i32) -> bool {
        match self {
            Batch::None => false,
            Batch::All => true,
            Batch::Completions => std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"))
                .is_ok_and(|c| c.trim_end() == COMPLETION_THREAD),
        }
    }
}

/// Makes thread `tid` `SCHED_BATCH` (no privilege needed); a thread that
/// already ended is no error.
fn set_batch(tid: i32) {
    let p = libc::sched_param { sched_priority: 0 };
    // SAFETY: plain syscall on a thread of this process with a valid param.
    let r = unsafe { libc::sched_setscheduler(tid, libc::SCHED_BATCH, &p) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ESRCH) {
            tracing::warn!("rbd: thread {tid} stays SCHED_OTHER: {e}");
        }
    }
}

/// The registered clusters of one ustor instance.
#[derive(Default)]
pub struct Clusters {
    map: Mutex<BTreeMap<String, Arc<Cluster>>>,
    /// Cores with reactors (the default placement avoids them).
    pub reactor_cores: Vec<usize>,
}

impl Clusters {
    pub fn new(reactor_cores: Vec<usize>) -> Clusters {
        Clusters {
            map: Mutex::default(),
            reactor_cores,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<Cluster>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `bdev_rbd_register_cluster`: connects, then registers (a failed
    /// connect leaves nothing behind).
    pub fn register(&self, opts: ClusterOpts) -> Result<(), RbdError> {
        if opts.name.is_empty() {
            return Err(RbdError::Invalid {
                param: "name",
                why: "must not be empty".into(),
            });
        }
        if self.lock().contains_key(&opts.name) {
            return Err(RbdError::ClusterExists(opts.name));
        }
        let name = opts.name.clone();
        let c = Cluster::connect(opts, &self.reactor_cores)?;
        let mut m = self.lock();
        if m.contains_key(&name) {
            return Err(RbdError::ClusterExists(name));
        }
        m.insert(name, c);
        Ok(())
    }

    /// `bdev_rbd_unregister_cluster`: refused while a bdev uses it.
    pub fn unregister(&self, name: &str) -> Result<(), RbdError> {
        let mut m = self.lock();
        let c = m
            .get(name)
            .ok_or_else(|| RbdError::NoCluster(name.into()))?;
        let users = Arc::strong_count(c) - 1;
        if users > 0 {
            return Err(RbdError::ClusterBusy {
                name: name.into(),
                users,
            });
        }
        m.remove(name);
        Ok(())
    }

    pub fn get(&self, name: &str) -> Result<Arc<Cluster>, RbdError> {
        self.lock()
            .get(name)
            .cloned()
            .ok_or_else(|| RbdError::NoCluster(name.into()))
    }

    /// `bdev_rbd_get_clusters_info`: one cluster's entry, or all of them.
    pub fn info(&self, name: Option<&str>) -> Result<Value, RbdError> {
        match name {
            Some(n) => Ok(self.get(n)?.info_json()),
            None => Ok(Value::Array(
                self.lock().values().map(|c| c.info_json()).collect(),
            )),
        }
    }

    /// The calls that re-register every cluster (before the bdevs').
    pub fn config_json(&self) -> Vec<Value> {
        self.lock()
            .values()
            .map(|c| json!({"method": "bdev_rbd_register_cluster", "params": c.opts}))
            .collect()
    }
}

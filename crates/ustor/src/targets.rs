//! The protocol targets' lifecycle as [`crate::app::App`] sees it: each
//! target is registered once as a [`Target`], and shutdown (SIGTERM,
//! `App::shutdown`) stops every one, then drains every one against one
//! deadline, before the bdevs are flushed and the reactors stop.
//!
//! Adding a target means implementing [`Target`] for it and registering it
//! in `App::start`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use ustor_nbd::server::NbdServer;
use ustor_nvme::nvmf::rpc::ListenerParams;

/// A network target's lifecycle.
pub trait Target: Send + Sync {
    /// Short name for logs and the shutdown report (`nbd`, `nvmf`).
    fn name(&self) -> &'static str;

    /// Called once when the app starts; targets that listen only when an
    /// RPC asks them to have nothing to do here.
    fn start(&self) -> std::io::Result<()> {
        Ok(())
    }

    /// Stops accepting connections (idempotent).
    fn stop(&self);

    /// Lets established connections finish their work and waits, until
    /// `deadline` at most, for the target to be idle (what idle means is
    /// the target's: no request in flight, no connection open); true when
    /// it is. Called after [`Target::stop`].
    fn drain(&self, deadline: Instant) -> bool;

    /// Connections open now.
    fn connections(&self) -> usize;

    /// The config calls that recreate the target's objects.
    fn config_json(&self) -> Vec<Value>;
}

/// How one target ended at shutdown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stopped {
    pub name: &'static str,
    /// The target was idle by the deadline (see [`Target::drain`]).
    pub drained: bool,
}

/// Stops every target, then drains them all within `budget` (one deadline
/// for all: a shutdown never waits longer than that, however many targets
/// there are).
pub fn stop_all(targets: &[Arc<dyn Target>], budget: Duration) -> Vec<Stopped> {
    for t in targets {
        // What is being torn down, for the log (the calls that would
        // recreate it).
        tracing::info!(
            "{}: stopping ({} config calls, {} connections)",
            t.name(),
            t.config_json().len(),
            t.connections()
        );
        t.stop();
    }
    let deadline = Instant::now() + budget;
    targets
        .iter()
        .map(|t| {
            let drained = t.drain(deadline);
            if !drained {
                tracing::warn!(
                    "{}: still busy at the shutdown deadline ({} connection(s)); closing",
                    t.name(),
                    t.connections()
                );
            }
            Stopped {
                name: t.name(),
                drained,
            }
        })
        .collect()
}

/// The NBD server.
pub struct NbdTarget(pub Arc<NbdServer>);

impl Target for NbdTarget {
    fn name(&self) -> &'static str {
        "nbd"
    }
    fn stop(&self) {
        self.0.stop();
    }
    /// Every request received before the drain is answered; later ones
    /// get `ESHUTDOWN` unexecuted (so the bdev flush that follows covers
    /// every acknowledged write); then every connection is closed.
    fn drain(&self, deadline: Instant) -> bool {
        let left = deadline.saturating_duration_since(Instant::now());
        self.0.drain(left).unwrap_or_else(|e| {
            tracing::warn!("nbd: drain: {e}");
            false
        })
    }
    fn connections(&self) -> usize {
        self.0.connections()
    }
    fn config_json(&self) -> Vec<Value> {
        let mut calls = Vec::new();
        if let Some(a) = self.0.local_addr() {
            calls.push(json!({"method": "nbd_server_start", "params": {
                "listen_address": {"traddr": a.ip().to_string(), "trsvcid": a.port().to_string()},
            }}));
        }
        for e in self.0.get_exports() {
            calls.push(json!({"method": "nbd_export_create", "params": {
                "name": e.name, "bdev_name": e.bdev_name, "read_only": e.read_only, "description": e.description,
            }}));
        }
        calls
    }
}

/// The NVMe-oF/TCP target.
pub struct NvmfTarget(pub ustor_nvme::nvmf::Target);

impl Target for NvmfTarget {
    fn name(&self) -> &'static str {
        "nvmf"
    }
    /// Removes every NVM subsystem's listeners: no new connection, and the
    /// hosts' queues are shut down, as SPDK's target does at exit.
    fn stop(&self) {
        for s in self.0.nvmf_get_subsystems() {
            if !s.subtype.eq_ignore_ascii_case("nvme") {
                continue;
            }
            for a in s.listen_addresses {
                let p = ListenerParams {
                    nqn: s.nqn.clone(),
                    listen_address: a,
                };
                if let Err(e) = self.0.nvmf_subsystem_remove_listener(&p) {
                    tracing::warn!("nvmf: stopping listener of {}: {e}", s.nqn);
                }
            }
        }
    }
    /// Every queue is closed (stop shut their sockets).
    fn drain(&self, deadline: Instant) -> bool {
        self.0
            .wait_idle(deadline.saturating_duration_since(Instant::now()))
    }
    fn connections(&self) -> usize {
        self.0.connections()
    }
    fn config_json(&self) -> Vec<Value> {
        self.0.config_json()
    }
}

/// The iSCSI target.
pub struct IscsiTarget(pub Arc<ustor_iscsi_target::IscsiTarget>);

impl Target for IscsiTarget {
    fn name(&self) -> &'static str {
        "iscsi"
    }
    /// Stops every portal's listener; sessions run on until they log out
    /// or the reactors stop.
    fn stop(&self) {
        self.0.stop();
    }
    /// Idle means no connection open (a command runs to completion within
    /// its connection). Each session's initiator is asked to log out (an
    /// Async Message) a second before the deadline, and cut off then.
    fn drain(&self, deadline: Instant) -> bool {
        let left = deadline.saturating_duration_since(Instant::now());
        self.0
            .request_logout(left.saturating_sub(Duration::from_secs(1)));
        self.0.wait_idle(left)
    }
    fn connections(&self) -> usize {
        self.0.connections()
    }
    fn config_json(&self) -> Vec<Value> {
        self.0.config_json()
    }
}

/// The vhost-user controllers.
pub struct VhostTarget(pub Arc<ustor_vhost::VhostTarget>);

impl Target for VhostTarget {
    fn name(&self) -> &'static str {
        "vhost"
    }
    /// Each controller stops listening and disconnects its frontend once
    /// the requests its rings took have completed (so the bdev flush that
    /// follows covers every write the guest was told is done).
    fn stop(&self) {
        self.0.stop_all();
    }
    fn drain(&self, deadline: Instant) -> bool {
        self.0.wait_idle(deadline)
    }
    fn connections(&self) -> usize {
        self.0.connections()
    }
    fn config_json(&self) -> Vec<Value> {
        crate::methods::vhost::config_calls(&self.0)
    }
}

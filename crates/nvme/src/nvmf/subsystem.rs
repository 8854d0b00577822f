//! Subsystems (NVMe and discovery), their namespaces, allowed hosts and
//! listeners. Control-plane state behind a mutex: touched by Connect, by
//! admin commands and by RPCs, never per I/O. Queue pairs notice namespace
//! changes through `ns_gen` (one atomic load per I/O) and then refresh their
//! own per-reactor namespace table.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use serde::{Deserialize, Serialize};
use ustor_bdev::Desc;

use super::ctrlr::Ctrl;

/// Listen address in SPDK's form.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListenAddress {
    #[serde(default = "tcp")]
    pub trtype: String,
    #[serde(default = "ipv4")]
    pub adrfam: String,
    pub traddr: String,
    pub trsvcid: String,
}

fn tcp() -> String {
    "TCP".into()
}
fn ipv4() -> String {
    "IPv4".into()
}

impl ListenAddress {
    pub fn same(&self, o: &ListenAddress) -> bool {
        self.traddr == o.traddr && self.trsvcid == o.trsvcid
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SubType {
    Discovery,
    Nvme,
}

/// One namespace: an opened, claimed bdev.
pub struct Namespace {
    pub nsid: u32,
    pub bdev_name: String,
    pub desc: Desc,
    pub uuid: [u8; 16],
    pub nguid: [u8; 16],
    pub block_size: u32,
}

impl Drop for Namespace {
    fn drop(&mut self) {
        self.desc.release_claim();
    }
}

pub(crate) struct SubsysState {
    pub allow_any_host: bool,
    pub hosts: Vec<String>,
    pub listeners: Vec<ListenAddress>,
    pub namespaces: BTreeMap<u32, Arc<Namespace>>,
    pub ctrls: BTreeMap<u16, Weak<Ctrl>>,
    pub next_cntlid: u16,
}

/// A subsystem.
pub struct Subsystem {
    pub nqn: String,
    pub subtype: SubType,
    pub serial_number: String,
    pub model_number: String,
    pub max_namespaces: u32,
    pub min_cntlid: u16,
    pub max_cntlid: u16,
    state: Mutex<SubsysState>,
    /// Bumped on every namespace change.
    pub(crate) ns_gen: AtomicU64,
}

impl Subsystem {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        nqn: String,
        subtype: SubType,
        serial_number: String,
        model_number: String,
        allow_any_host: bool,
        max_namespaces: u32,
        min_cntlid: u16,
        max_cntlid: u16,
    ) -> Subsystem {
        Subsystem {
            nqn,
            subtype,
            serial_number,
            model_number,
            max_namespaces,
            min_cntlid,
            max_cntlid,
            state: Mutex::new(SubsysState {
                allow_any_host,
                hosts: Vec::new(),
                listeners: Vec::new(),
                namespaces: BTreeMap::new(),
                ctrls: BTreeMap::new(),
                next_cntlid: min_cntlid,
            }),
            ns_gen: AtomicU64::new(1),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, SubsysState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn host_allowed(&self, hostnqn: &str) -> bool {
        let s = self.lock();
        s.allow_any_host || s.hosts.iter().any(|h| h == hostnqn)
    }

    pub fn listening_on(&self, a: &ListenAddress) -> bool {
        self.subtype == SubType::Discovery || self.lock().listeners.iter().any(|l| l.same(a))
    }

    /// Allocates a controller id not in use (SPDK: min_cntlid..=max_cntlid,
    /// round robin).
    pub(crate) fn alloc_cntlid(&self, s: &mut SubsysState) -> Option<u16> {
        s.ctrls.retain(|_, w| w.strong_count() > 0);
        let span = u32::from(self.max_cntlid - self.min_cntlid) + 1;
        for _ in 0..span {
            let id = s.next_cntlid;
            s.next_cntlid = if id >= self.max_cntlid {
                self.min_cntlid
            } else {
                id + 1
            };
            if !s.ctrls.contains_key(&id) {
                return Some(id);
            }
        }
        None
    }

    pub(crate) fn ctrl(&self, cntlid: u16) -> Option<Arc<Ctrl>> {
        self.lock().ctrls.get(&cntlid).and_then(|w| w.upgrade())
    }

    pub(crate) fn ctrls(&self) -> Vec<Arc<Ctrl>> {
        self.lock()
            .ctrls
            .values()
            .filter_map(|w| w.upgrade())
            .collect()
    }

    pub fn namespaces(&self) -> Vec<Arc<Namespace>> {
        self.lock().namespaces.values().cloned().collect()
    }

    pub fn namespace(&self, nsid: u32) -> Option<Arc<Namespace>> {
        self.lock().namespaces.get(&nsid).cloned()
    }

    pub(crate) fn bump_ns_gen(&self) {
        self.ns_gen.fetch_add(1, Ordering::AcqRel);
    }

    pub fn ns_generation(&self) -> u64 {
        self.ns_gen.load(Ordering::Acquire)
    }
}

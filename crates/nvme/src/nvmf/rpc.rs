//! Control functions with SPDK's method names and parameters, as plain
//! methods of [`Target`] taking and returning serde types. The `ustor`
//! binary registers them in its JSON-RPC table (see docs/nvmf.md).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use ustor_bdev::BdevEvent;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::stats::{self, PollGroupStats};
use super::subsystem::{ListenAddress, Namespace, SubType, Subsystem};
use super::{lock, NvmfError, Target, TransportOpts};
use crate::wire::DISCOVERY_NQN;

/// `nvmf_create_transport`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CreateTransportParams {
    pub trtype: String,
    #[serde(flatten)]
    pub opts: TransportOpts,
}

/// One entry of `nvmf_get_transports`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TransportInfo {
    pub trtype: String,
    #[serde(flatten)]
    pub opts: TransportOpts,
}

/// `nvmf_create_subsystem`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CreateSubsystemParams {
    pub nqn: String,
    #[serde(default = "default_sn")]
    pub serial_number: String,
    #[serde(default = "default_mn")]
    pub model_number: String,
    #[serde(default)]
    pub allow_any_host: bool,
    #[serde(default = "default_max_ns")]
    pub max_namespaces: u32,
    #[serde(default = "one")]
    pub min_cntlid: u16,
    #[serde(default = "max_cntlid")]
    pub max_cntlid: u16,
}

fn default_sn() -> String {
    "00000000000000000000".into()
}
fn default_mn() -> String {
    "ustor NVMe-oF controller".into()
}
fn default_max_ns() -> u32 {
    32
}
fn one() -> u16 {
    1
}
fn max_cntlid() -> u16 {
    0xffef
}

/// `nvmf_delete_subsystem`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NqnParams {
    pub nqn: String,
}

/// The `namespace` object of `nvmf_subsystem_add_ns`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NamespaceParams {
    pub bdev_name: String,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub nsid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nguid: Option<String>,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// `nvmf_subsystem_add_ns`; the result is the NSID.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AddNsParams {
    pub nqn: String,
    pub namespace: NamespaceParams,
}

/// `nvmf_subsystem_remove_ns`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RemoveNsParams {
    pub nqn: String,
    pub nsid: u32,
}

/// `nvmf_subsystem_add_listener` / `nvmf_subsystem_remove_listener`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ListenerParams {
    pub nqn: String,
    pub listen_address: ListenAddress,
}

/// `nvmf_subsystem_add_host` / `nvmf_subsystem_remove_host`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HostParams {
    pub nqn: String,
    pub host: String,
}

/// `nvmf_subsystem_allow_any_host`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AllowAnyHostParams {
    pub nqn: String,
    pub allow_any_host: bool,
}

/// A namespace in `nvmf_get_subsystems`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NamespaceInfo {
    pub nsid: u32,
    pub bdev_name: String,
    pub name: String,
    pub nguid: String,
    pub uuid: String,
}

/// A host in `nvmf_get_subsystems`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HostInfo {
    pub nqn: String,
}

/// One entry of `nvmf_get_subsystems`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SubsystemInfo {
    pub nqn: String,
    pub subtype: String,
    pub listen_addresses: Vec<ListenAddress>,
    pub allow_any_host: bool,
    pub hosts: Vec<HostInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serial_number: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_number: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_namespaces: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_cntlid: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_cntlid: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<Vec<NamespaceInfo>>,
}

/// `nvmf_get_stats`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NvmfStats {
    pub tick_rate: u64,
    pub poll_groups: Vec<PollGroupStats>,
    /// ustor extension: connections admitted, refused at
    /// `max_connections`, closed for a late ICReq, and open now.
    #[serde(default)]
    pub connections: ustor_net::ListenerStats,
}

fn hex(b: &[u8; 16]) -> String {
    b.iter().map(|x| format!("{x:02X}")).collect()
}

fn uuid_text(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

fn parse_hex16(s: &str, param: &'static str) -> Result<[u8; 16], NvmfError> {
    let h: String = s.chars().filter(|c| *c != '-').collect();
    if h.len() != 32 {
        return Err(NvmfError::invalid(param, "needs 32 hex digits"));
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&h[i * 2..i * 2 + 2], 16)
            .map_err(|_| NvmfError::invalid(param, "not hex"))?;
    }
    Ok(out)
}

fn check_nqn(nqn: &str) -> Result<(), NvmfError> {
    if nqn.len() > 223 || !nqn.starts_with("nqn.") || nqn.contains('\0') {
        return Err(NvmfError::invalid(
            "nqn",
            "must start with nqn. and fit 223 bytes",
        ));
    }
    Ok(())
}

impl Target {
    fn subsys(&self, nqn: &str) -> Result<Arc<Subsystem>, NvmfError> {
        self.shared
            .subsystem(nqn)
            .ok_or_else(|| NvmfError::NoSubsystem(nqn.to_string()))
    }

    fn nvme_subsys(&self, nqn: &str) -> Result<Arc<Subsystem>, NvmfError> {
        let s = self.subsys(nqn)?;
        if s.subtype == SubType::Discovery {
            return Err(NvmfError::invalid(
                "nqn",
                "the discovery subsystem is fixed",
            ));
        }
        Ok(s)
    }

    /// `nvmf_create_transport` (TCP only).
    pub fn nvmf_create_transport(&self, p: &CreateTransportParams) -> Result<bool, NvmfError> {
        if !p.trtype.eq_ignore_ascii_case("tcp") {
            return Err(NvmfError::invalid("trtype", "only TCP"));
        }
        let o = &p.opts;
        if o.max_h2c_data < 4096 || o.max_h2c_data % 4 != 0 {
            return Err(NvmfError::invalid("io_unit_size", ">= 4096, multiple of 4"));
        }
        if o.max_io_size < 4096 || !o.max_io_size.is_power_of_two() || o.max_io_size > 1 << 20 {
            return Err(NvmfError::invalid(
                "max_io_size",
                "a power of two in 4 KiB..=1 MiB",
            ));
        }
        if o.in_capsule_data_size > 64 << 10 || o.in_capsule_data_size % 16 != 0 {
            return Err(NvmfError::invalid(
                "in_capsule_data_size",
                "a multiple of 16 up to 64 KiB",
            ));
        }
        if o.max_connections == 0 {
            return Err(NvmfError::invalid("max_connections", ">= 1"));
        }
        if o.icreq_timeout_ms == 0 {
            return Err(NvmfError::invalid("icreq_timeout_ms", ">= 1"));
        }
        let mut t = lock(&self.shared.transport);
        if t.is_some() {
            return Err(NvmfError::TransportExists("TCP".into()));
        }
        *t = Some(*o);
        self.shared.limit.set_max(o.max_connections as usize);
        Ok(true)
    }

    /// `nvmf_get_transports`.
    pub fn nvmf_get_transports(&self) -> Vec<TransportInfo> {
        lock(&self.shared.transport)
            .iter()
            .map(|o| TransportInfo {
                trtype: "TCP".into(),
                opts: *o,
            })
            .collect()
    }

    /// One subsystem open to any host with `bdev` as namespace 1, listening
    /// on 127.0.0.1:`trsvcid` (`"0"`: a free port): the export that tests,
    /// examples and benchmarks set up. The TCP transport must exist.
    /// Returns the port listened on.
    pub fn export_local(
        &self,
        nqn: &str,
        serial: &str,
        model: &str,
        bdev: &str,
        trsvcid: &str,
    ) -> Result<String, NvmfError> {
        self.nvmf_create_subsystem(&CreateSubsystemParams {
            nqn: nqn.into(),
            serial_number: serial.into(),
            model_number: model.into(),
            allow_any_host: true,
            max_namespaces: 8,
            min_cntlid: 1,
            max_cntlid: 0xffef,
        })?;
        self.nvmf_subsystem_add_ns(&AddNsParams {
            nqn: nqn.into(),
            namespace: NamespaceParams {
                bdev_name: bdev.into(),
                nsid: 1,
                uuid: None,
                nguid: None,
            },
        })?;
        let l = self.nvmf_subsystem_add_listener(&ListenerParams {
            nqn: nqn.into(),
            listen_address: ListenAddress {
                trtype: "TCP".into(),
                adrfam: "IPv4".into(),
                traddr: "127.0.0.1".into(),
                trsvcid: trsvcid.into(),
            },
        })?;
        Ok(l.trsvcid)
    }

    /// `nvmf_create_subsystem`.
    pub fn nvmf_create_subsystem(&self, p: &CreateSubsystemParams) -> Result<bool, NvmfError> {
        check_nqn(&p.nqn)?;
        if p.serial_number.len() > 20 || !p.serial_number.is_ascii() {
            return Err(NvmfError::invalid(
                "serial_number",
                "at most 20 ASCII characters",
            ));
        }
        if p.model_number.len() > 40 || !p.model_number.is_ascii() {
            return Err(NvmfError::invalid(
                "model_number",
                "at most 40 ASCII characters",
            ));
        }
        if p.min_cntlid == 0 || p.min_cntlid > p.max_cntlid || p.max_cntlid > 0xffef {
            return Err(NvmfError::invalid(
                "min_cntlid",
                "1 <= min <= max <= 0xffef",
            ));
        }
        if p.max_namespaces == 0 || p.max_namespaces > 1024 {
            return Err(NvmfError::invalid("max_namespaces", "1..=1024"));
        }
        let mut subs = lock(&self.shared.subsystems);
        if subs.contains_key(&p.nqn) {
            return Err(NvmfError::SubsystemExists(p.nqn.clone()));
        }
        let s = Subsystem::new(
            p.nqn.clone(),
            SubType::Nvme,
            p.serial_number.clone(),
            p.model_number.clone(),
            p.allow_any_host,
            p.max_namespaces,
            p.min_cntlid,
            p.max_cntlid,
        );
        subs.insert(p.nqn.clone(), Arc::new(s));
        drop(subs);
        self.shared.changed();
        Ok(true)
    }

    /// `nvmf_delete_subsystem`: fails its controllers (their connections
    /// close), releases its namespaces and listeners.
    pub fn nvmf_delete_subsystem(&self, p: &NqnParams) -> Result<bool, NvmfError> {
        self.nvme_subsys(&p.nqn)?;
        let Some(s) = lock(&self.shared.subsystems).remove(&p.nqn) else {
            return Err(NvmfError::NoSubsystem(p.nqn.clone()));
        };
        for c in s.ctrls() {
            c.fail();
        }
        let (listeners, nss) = {
            let mut st = s.lock();
            (
                std::mem::take(&mut st.listeners),
                std::mem::take(&mut st.namespaces),
            )
        };
        drop(nss);
        s.bump_ns_gen();
        for l in &listeners {
            self.unlisten(l);
        }
        self.shared.changed();
        Ok(true)
    }

    /// `nvmf_subsystem_add_ns`: opens and claims the bdev; returns the NSID.
    /// Connected hosts get a namespace-attribute-changed event.
    pub fn nvmf_subsystem_add_ns(&self, p: &AddNsParams) -> Result<u32, NvmfError> {
        let s = self.nvme_subsys(&p.nqn)?;
        let n = &p.namespace;
        // A resize of the bdev raises the namespace-attribute-changed event
        // on every controller (the NSID is known once inserted below).
        let ns_id = Arc::new(AtomicU32::new(0));
        let (weak, id) = (Arc::downgrade(&s), ns_id.clone());
        let desc = self.shared.registry.open(&n.bdev_name, true, move |ev| {
            let (Some(s), nsid) = (weak.upgrade(), id.load(Ordering::Acquire)) else {
                return;
            };
            if ev == BdevEvent::Resize && nsid != 0 {
                s.ctrls().iter().for_each(|c| c.notify_ns_changed(nsid));
            }
        })?;
        desc.claim(&format!("nvmf:{}", p.nqn))?;
        let info = desc.info().clone();
        let uuid = match &n.uuid {
            Some(u) => parse_hex16(u, "uuid")?,
            None => *info.uuid.as_bytes(),
        };
        let nguid = match &n.nguid {
            Some(g) => parse_hex16(g, "nguid")?,
            None => uuid,
        };
        let nsid = {
            let mut st = s.lock();
            let nsid = if n.nsid != 0 {
                n.nsid
            } else {
                (1..=s.max_namespaces)
                    .find(|id| !st.namespaces.contains_key(id))
                    .unwrap_or(0)
            };
            if nsid == 0 || nsid > s.max_namespaces {
                desc.release_claim();
                return Err(NvmfError::invalid(
                    "nsid",
                    "no free NSID within max_namespaces",
                ));
            }
            if st.namespaces.contains_key(&nsid) {
                desc.release_claim();
                return Err(NvmfError::NsExists(nsid));
            }
            st.namespaces.insert(
                nsid,
                Arc::new(Namespace {
                    nsid,
                    bdev_name: n.bdev_name.clone(),
                    block_size: info.block_size,
                    desc,
                    uuid,
                    nguid,
                }),
            );
            ns_id.store(nsid, Ordering::Release);
            nsid
        };
        s.bump_ns_gen();
        for c in s.ctrls() {
            c.notify_ns_changed(nsid);
        }
        Ok(nsid)
    }

    /// `nvmf_subsystem_remove_ns`.
    pub fn nvmf_subsystem_remove_ns(&self, p: &RemoveNsParams) -> Result<bool, NvmfError> {
        let s = self.nvme_subsys(&p.nqn)?;
        let ns = s.lock().namespaces.remove(&p.nsid);
        if ns.is_none() {
            return Err(NvmfError::NoNamespace(p.nsid));
        }
        drop(ns);
        s.bump_ns_gen();
        for c in s.ctrls() {
            c.notify_ns_changed(p.nsid);
        }
        Ok(true)
    }

    /// `nvmf_subsystem_add_listener`; returns the bound address (trsvcid
    /// "0" picks a free port).
    pub fn nvmf_subsystem_add_listener(
        &self,
        p: &ListenerParams,
    ) -> Result<ListenAddress, NvmfError> {
        let s = self.nvme_subsys(&p.nqn)?;
        if !p.listen_address.trtype.eq_ignore_ascii_case("tcp") {
            return Err(NvmfError::invalid("trtype", "only TCP"));
        }
        if lock(&self.shared.transport).is_none() {
            return Err(NvmfError::NoTransport("TCP".into()));
        }
        if s.lock().listeners.iter().any(|l| l.same(&p.listen_address)) {
            return Err(NvmfError::invalid("listen_address", "already listening"));
        }
        let real = self.listen(&p.listen_address)?;
        s.lock().listeners.push(real.clone());
        self.shared.changed();
        Ok(real)
    }

    /// `nvmf_subsystem_remove_listener`.
    pub fn nvmf_subsystem_remove_listener(&self, p: &ListenerParams) -> Result<bool, NvmfError> {
        let s = self.nvme_subsys(&p.nqn)?;
        let removed = {
            let mut st = s.lock();
            let before = st.listeners.len();
            st.listeners.retain(|l| !l.same(&p.listen_address));
            before != st.listeners.len()
        };
        if !removed {
            return Err(NvmfError::invalid("listen_address", "not listening there"));
        }
        self.unlisten(&p.listen_address);
        // Hosts connected through that listener lose their controllers, as
        // with SPDK: their queues' sockets are shut down.
        for c in s.ctrls() {
            if c.listener.same(&p.listen_address) {
                c.fail();
            }
        }
        self.shared.changed();
        Ok(true)
    }

    /// `nvmf_subsystem_add_host`.
    pub fn nvmf_subsystem_add_host(&self, p: &HostParams) -> Result<bool, NvmfError> {
        check_nqn(&p.host).map_err(|_| NvmfError::invalid("host", "not an NQN"))?;
        let s = self.nvme_subsys(&p.nqn)?;
        let mut st = s.lock();
        if !st.hosts.contains(&p.host) {
            st.hosts.push(p.host.clone());
        }
        drop(st);
        self.shared.changed();
        Ok(true)
    }

    /// `nvmf_subsystem_remove_host`: its controllers are failed too.
    pub fn nvmf_subsystem_remove_host(&self, p: &HostParams) -> Result<bool, NvmfError> {
        let s = self.nvme_subsys(&p.nqn)?;
        s.lock().hosts.retain(|h| h != &p.host);
        if !s.host_allowed(&p.host) {
            for c in s.ctrls().into_iter().filter(|c| c.hostnqn == p.host) {
                c.fail();
            }
        }
        self.shared.changed();
        Ok(true)
    }

    /// `nvmf_subsystem_allow_any_host`.
    pub fn nvmf_subsystem_allow_any_host(&self, p: &AllowAnyHostParams) -> Result<bool, NvmfError> {
        let s = self.nvme_subsys(&p.nqn)?;
        s.lock().allow_any_host = p.allow_any_host;
        self.shared.changed();
        Ok(true)
    }

    /// `nvmf_get_subsystems`.
    pub fn nvmf_get_subsystems(&self) -> Vec<SubsystemInfo> {
        let subs: Vec<Arc<Subsystem>> = lock(&self.shared.subsystems).values().cloned().collect();
        let mut out: Vec<SubsystemInfo> = subs
            .iter()
            .map(|s| {
                let st = s.lock();
                let nvme = s.subtype == SubType::Nvme;
                SubsystemInfo {
                    nqn: s.nqn.clone(),
                    subtype: if nvme { "NVMe" } else { "Discovery" }.into(),
                    listen_addresses: st.listeners.clone(),
                    allow_any_host: st.allow_any_host,
                    hosts: st
                        .hosts
                        .iter()
                        .map(|h| HostInfo { nqn: h.clone() })
                        .collect(),
                    serial_number: nvme.then(|| s.serial_number.clone()),
                    model_number: nvme.then(|| s.model_number.clone()),
                    max_namespaces: nvme.then_some(s.max_namespaces),
                    min_cntlid: nvme.then_some(s.min_cntlid),
                    max_cntlid: nvme.then_some(s.max_cntlid),
                    namespaces: nvme.then(|| {
                        st.namespaces
                            .values()
                            .map(|n| NamespaceInfo {
                                nsid: n.nsid,
                                bdev_name: n.bdev_name.clone(),
                                name: n.bdev_name.clone(),
                                nguid: hex(&n.nguid),
                                uuid: uuid_text(&n.uuid),
                            })
                            .collect()
                    }),
                }
            })
            .collect();
        // Discovery first, as SPDK lists it.
        out.sort_by_key(|s| s.nqn != DISCOVERY_NQN);
        out
    }

    /// `nvmf_get_stats`: one poll group per reactor.
    pub fn nvmf_get_stats(&self) -> Result<NvmfStats, NvmfError> {
        let groups = self.shared.rt.call_all(stats::snapshot)?;
        Ok(NvmfStats {
            tick_rate: ustor_runtime::ticks::hz(),
            poll_groups: groups,
            connections: self.shared.limit.stats(),
        })
    }

    /// The calls that recreate this target's state, in order.
    pub fn config_json(&self) -> Vec<Value> {
        let mut v = Vec::new();
        for t in self.nvmf_get_transports() {
            v.push(json!({"method": "nvmf_create_transport", "params": CreateTransportParams { trtype: t.trtype, opts: t.opts }}));
        }
        let subs: Vec<Arc<Subsystem>> = lock(&self.shared.subsystems).values().cloned().collect();
        for s in subs.iter().filter(|s| s.subtype == SubType::Nvme) {
            let st = s.lock();
            v.push(
                json!({"method": "nvmf_create_subsystem", "params": CreateSubsystemParams {
                    nqn: s.nqn.clone(),
                    serial_number: s.serial_number.clone(),
                    model_number: s.model_number.clone(),
                    allow_any_host: st.allow_any_host,
                    max_namespaces: s.max_namespaces,
                    min_cntlid: s.min_cntlid,
                    max_cntlid: s.max_cntlid,
                }}),
            );
            for h in &st.hosts {
                v.push(json!({"method": "nvmf_subsystem_add_host", "params": {"nqn": s.nqn, "host": h}}));
            }
            for n in st.namespaces.values() {
                v.push(
                    json!({"method": "nvmf_subsystem_add_ns", "params": AddNsParams {
                        nqn: s.nqn.clone(),
                        namespace: NamespaceParams {
                            bdev_name: n.bdev_name.clone(),
                            nsid: n.nsid,
                            uuid: Some(uuid_text(&n.uuid)),
                            nguid: Some(hex(&n.nguid)),
                        },
                    }}),
                );
            }
            for l in &st.listeners {
                v.push(json!({"method": "nvmf_subsystem_add_listener", "params": {"nqn": s.nqn, "listen_address": l}}));
            }
        }
        v
    }
}

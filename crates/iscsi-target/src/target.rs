//! The iSCSI target's control plane: portal groups (each a set of
//! listeners on the connection layer), initiator groups, auth groups and
//! target nodes with their LUNs (open, claimed bdevs), behind one mutex
//! touched by RPCs and by logins, never per command.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ustor_bdev::{ControlError, Desc, Registry};
use ustor_net::listener::{
    Accepted, ConnLimit, Listener, ListenerConfig, Placement, Refused, Service,
};
use ustor_runtime::RuntimeHandle;
use ustor_scsi_target::LuConfig;

use crate::config::*;
use crate::live::{ConnInfo, Live};
use crate::login::{Access, Catalog, ChapPolicy, LoginFail, Secret};
use crate::negotiate::{DigestRule, Offer};
use crate::options::IscsiOptions;
use crate::session::Discovery;

/// Default cap on connections over all portals.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Time a connection has to finish its login.
pub const LOGIN_TIMEOUT: Duration = Duration::from_secs(15);

/// Why a control-plane call failed.
#[derive(Debug, thiserror::Error)]
pub enum IscsiError {
    #[error("{0} {1} already exists")]
    Exists(&'static str, String),
    #[error("no {0} {1}")]
    NotFound(&'static str, String),
    #[error("invalid {0}: {1}")]
    Invalid(&'static str, String),
    #[error("{0} {1} is in use by a target node")]
    InUse(&'static str, u32),
    #[error("cannot listen on {0}: {1}")]
    Listen(String, #[source] std::io::Error),
    #[error("bdev: {0}")]
    Bdev(#[from] ControlError),
}

/// One LUN of a live node.
pub struct LunEntry {
    pub lun_id: u64,
    pub bdev_name: String,
    pub desc: Desc,
    pub cfg: LuConfig,
    /// Reservations and mode parameters, shared by every session's
    /// table of this LUN.
    pub shared: Arc<ustor_scsi_target::LuShared>,
}

impl Drop for LunEntry {
    fn drop(&mut self) {
        self.desc.release_claim();
    }
}

/// A live target node.
pub struct NodeEntry {
    pub params: TargetNodeParams,
    pub full_name: String,
    pub luns: Vec<Arc<LunEntry>>,
}

struct PortalGroup {
    params: PortalGroupParams,
    bound: Vec<SocketAddr>,
    listeners: Vec<Listener>,
}

#[derive(Default)]
struct State {
    portal_groups: BTreeMap<u32, PortalGroup>,
    initiator_groups: BTreeMap<u32, InitiatorGroupParams>,
    auth_groups: BTreeMap<u32, AuthGroupParams>,
    nodes: BTreeMap<String, Arc<NodeEntry>>,
    next_lun_id: u32,
}

pub(crate) struct Shared {
    pub(crate) rt: RuntimeHandle,
    state: Mutex<State>,
    pub(crate) conns: Arc<ConnLimit>,
    tsih: AtomicU16,
    login_timeout: Mutex<Duration>,
    options: Mutex<IscsiOptions>,
    pub(crate) live: Arc<Live>,
    pub(crate) drain: Arc<crate::drain::Drain>,
    pub(crate) sessions: Arc<crate::sessions::Sessions>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn options(&self) -> MutexGuard<'_, IscsiOptions> {
        self.options.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// NOP-In pings of sessions logging in from now on.
    pub(crate) fn pings(&self) -> crate::session::Pings {
        let o = self.options();
        crate::session::Pings {
            interval: o.nop_in_interval,
            timeout: o.nop_timeout,
        }
    }

    /// SPDK's `allow_duplicated_isid`: a new session of an initiator port
    /// that has one leaves the old one running (no reinstatement).
    pub(crate) fn duplicated_isid(&self) -> bool {
        self.options().allow_duplicated_isid
    }

    /// SPDK's `max_sessions`, enforced per target node: the normal
    /// sessions one node may have at once.
    pub(crate) fn max_sessions(&self) -> usize {
        self.options().max_sessions as usize
    }

    /// The physical block size new sessions' LUNs report (0: their own).
    pub(crate) fn physical_block(&self) -> u32 {
        self.options().physical_block_size
    }
}

/// The connections of one portal group.
pub(crate) struct PortalService {
    pub(crate) shared: Arc<Shared>,
    pub(crate) tag: u32,
}

impl Service for PortalService {
    type Fut = std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;

    fn serve(self: Arc<Self>, conn: Accepted) -> Self::Fut {
        Box::pin(crate::conn::serve(conn, self))
    }

    /// Beyond the cap: the Login Request is answered "out of resources".
    fn refuse(self: Arc<Self>, conn: Refused) -> Option<Self::Fut> {
        Some(Box::pin(crate::refuse::answer(conn)))
    }
}

fn initiator_allowed(ig: &InitiatorGroupParams, initiator: &str) -> bool {
    let mut allowed = false;
    for i in &ig.initiators {
        match i.strip_prefix('!') {
            Some(deny) if deny == initiator || deny.eq_ignore_ascii_case("ANY") => return false,
            Some(_) => {}
            None => allowed |= i == initiator || i.eq_ignore_ascii_case("ANY"),
        }
    }
    allowed
}

/// SPDK's CHAP flags as a policy (a group alone makes CHAP optional).
fn chap_policy(disable: bool, require: bool, mutual: bool, group: u32) -> ChapPolicy {
    if disable {
        ChapPolicy::Disabled
    } else if require {
        ChapPolicy::Required { mutual }
    } else if group != 0 {
        ChapPolicy::Optional
    } else {
        ChapPolicy::Disabled
    }
}

fn access(node: &NodeEntry, auth: &BTreeMap<u32, AuthGroupParams>, o: &IscsiOptions) -> Access {
    let p = &node.params;
    let chap = chap_policy(p.disable_chap, p.require_chap, p.mutual_chap, p.chap_group);
    let digest = |on: bool| {
        if on {
            DigestRule::Require
        } else {
            DigestRule::Allow
        }
    };
    Access {
        chap,
        secrets: auth
            .get(&p.chap_group)
            .map(|g| g.secrets.clone())
            .unwrap_or_default(),
        offer: Offer {
            header_digest: digest(p.header_digest),
            data_digest: digest(p.data_digest),
            first_burst: o.first_burst_length,
            immediate_data: o.immediate_data,
            max_connections: o.max_connections_per_session,
            ..Offer::default()
        },
        alias: (!p.alias_name.is_empty()).then(|| p.alias_name.clone()),
    }
}

impl Catalog for PortalService {
    type Node = Arc<NodeEntry>;

    fn node(
        &self,
        target: &str,
        initiator: &str,
        tag: u32,
        peer: Option<std::net::IpAddr>,
    ) -> Result<(Arc<NodeEntry>, Access), LoginFail> {
        let st = self.shared.lock();
        let node = st.nodes.get(target).ok_or(LoginFail::NotFound)?;
        let allowed = node.params.pg_ig_maps.iter().any(|m| {
            m.pg_tag == tag
                && st.initiator_groups.get(&m.ig_tag).is_some_and(|ig| {
                    initiator_allowed(ig, initiator) && crate::netmask::allowed(&ig.netmasks, peer)
                })
        });
        if !allowed {
            return Err(LoginFail::Authorization);
        }
        let opts = self.shared.options();
        Ok((node.clone(), access(node, &st.auth_groups, &opts)))
    }

    /// Discovery sessions follow the target-wide CHAP options (SPDK's
    /// `iscsi_set_options` / `iscsi_set_discovery_auth` fields).
    fn discovery(&self) -> Access {
        let st = self.shared.lock();
        let o = self.shared.options();
        Access {
            chap: chap_policy(o.disable_chap, o.require_chap, o.mutual_chap, o.chap_group),
            secrets: st
                .auth_groups
                .get(&o.chap_group)
                .map(|g| g.secrets.clone())
                .unwrap_or_default(),
            ..Access::default()
        }
    }

    /// A TSIH no running session has (never 0).
    fn new_tsih(&self) -> u16 {
        loop {
            let t = self.shared.tsih.fetch_add(1, Ordering::Relaxed);
            if t != 0 && !self.shared.sessions.has(t) {
                return t;
            }
        }
    }

    fn session(
        &self,
        tsih: u16,
        initiator: &str,
        isid: &[u8; 6],
        target: &str,
        tag: u32,
    ) -> Result<crate::negotiate::Params, LoginFail> {
        let s = &self.shared.sessions;
        Ok(s.joinable(tsih, initiator, isid, target, tag)?.params)
    }
}

impl Discovery for PortalService {
    fn send_targets(&self, which: &str, initiator: &str) -> Vec<(String, String)> {
        let st = self.shared.lock();
        let mut out = Vec::new();
        for (name, node) in &st.nodes {
            if which != "All" && which != name {
                continue;
            }
            let mut addrs = Vec::new();
            for m in &node.params.pg_ig_maps {
                let ok = st
                    .initiator_groups
                    .get(&m.ig_tag)
                    .is_some_and(|ig| initiator_allowed(ig, initiator));
                let Some(pg) = st.portal_groups.get(&m.pg_tag).filter(|_| ok) else {
                    continue;
                };
                if pg.params.private && m.pg_tag != self.tag {
                    continue;
                }
                for a in &pg.bound {
                    addrs.push(format!("{a},{}", m.pg_tag));
                }
            }
            if addrs.is_empty() {
                continue;
            }
            out.push(("TargetName".to_string(), name.clone()));
            out.extend(addrs.into_iter().map(|a| ("TargetAddress".to_string(), a)));
        }
        out
    }
}

/// `iscsi_get_stats`: connections by state, SPDK's fields.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct IscsiStats {
    pub invalid: u64,
    pub running: u64,
    pub exiting: u64,
    pub exited: u64,
}

/// The iSCSI target: control-plane entry points (SPDK's RPCs as methods).
pub struct IscsiTarget {
    shared: Arc<Shared>,
    registry: Arc<Registry>,
    /// The listeners' services by portal group tag: the accept loops hold
    /// them weakly, so they live as long as their group here.
    services: Mutex<BTreeMap<u32, Arc<PortalService>>>,
}

impl IscsiTarget {
    pub fn new(rt: RuntimeHandle, registry: Arc<Registry>) -> IscsiTarget {
        IscsiTarget {
            shared: Arc::new(Shared {
                rt,
                state: Mutex::new(State::default()),
                conns: ConnLimit::new(DEFAULT_MAX_CONNECTIONS),
                tsih: AtomicU16::new(1),
                login_timeout: Mutex::new(LOGIN_TIMEOUT),
                options: Mutex::new(IscsiOptions::default()),
                live: Arc::default(),
                drain: Arc::default(),
                sessions: Arc::default(),
            }),
            registry,
            services: Mutex::new(BTreeMap::new()),
        }
    }

    fn services(&self) -> MutexGuard<'_, BTreeMap<u32, Arc<PortalService>>> {
        self.services.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `iscsi_create_portal_group`: listens on every portal now.
    pub fn create_portal_group(&self, p: &PortalGroupParams) -> Result<(), IscsiError> {
        if self.shared.lock().portal_groups.contains_key(&p.tag) {
            return Err(IscsiError::Exists("portal group", p.tag.to_string()));
        }
        if p.tag == 0 || p.portals.is_empty() {
            return Err(IscsiError::Invalid(
                "portal group",
                "tag 0 or no portals".into(),
            ));
        }
        let svc = Arc::new(PortalService {
            shared: self.shared.clone(),
            tag: p.tag,
        });
        let placement = Arc::new(Placement::default());
        let mut listeners = Vec::new();
        let mut bound = Vec::new();
        for portal in &p.portals {
            let addr = ustor_net::listener::socket_addr(&portal.host, &portal.port)
                .map_err(|text| IscsiError::Invalid("portal", text))?;
            let mut cfg = ListenerConfig::new("iscsi", self.shared.conns.clone());
            cfg.handshake_timeout = *self
                .shared
                .login_timeout
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let l = Listener::bind(&self.shared.rt, addr, cfg, placement.clone(), &svc)
                .map_err(|e| IscsiError::Listen(addr.to_string(), e))?;
            bound.push(l.local_addr());
            listeners.push(l);
        }
        let mut st = self.shared.lock();
        if st.portal_groups.contains_key(&p.tag) {
            return Err(IscsiError::Exists("portal group", p.tag.to_string()));
        }
        self.services().insert(p.tag, svc);
        st.portal_groups.insert(
            p.tag,
            PortalGroup {
                params: p.clone(),
                bound,
                listeners,
            },
        );
        Ok(())
    }

    /// `iscsi_get_portal_groups`: portals show the bound port.
    pub fn get_portal_groups(&self) -> Vec<PortalGroupParams> {
        let st = self.shared.lock();
        st.portal_groups
            .values()
            .map(|pg| PortalGroupParams {
                portals: pg
                    .bound
                    .iter()
                    .map(|a| Portal {
                        host: a.ip().to_string(),
                        port: a.port().to_string(),
                    })
                    .collect(),
                ..pg.params.clone()
            })
            .collect()
    }

    /// `iscsi_delete_portal_group`: stops its listeners.
    pub fn delete_portal_group(&self, tag: u32) -> Result<(), IscsiError> {
        let mut st = self.shared.lock();
        if st
            .nodes
            .values()
            .any(|n| n.params.pg_ig_maps.iter().any(|m| m.pg_tag == tag))
        {
            return Err(IscsiError::InUse("portal group", tag));
        }
        let pg = st
            .portal_groups
            .remove(&tag)
            .ok_or_else(|| IscsiError::NotFound("portal group", tag.to_string()))?;
        drop(st);
        for l in pg.listeners {
            l.stop();
        }
        self.services().remove(&tag);
        Ok(())
    }

    /// `iscsi_create_initiator_group`.
    pub fn create_initiator_group(&self, p: &InitiatorGroupParams) -> Result<(), IscsiError> {
        let mut st = self.shared.lock();
        if st.initiator_groups.contains_key(&p.tag) {
            return Err(IscsiError::Exists("initiator group", p.tag.to_string()));
        }
        if p.tag == 0 || p.initiators.is_empty() {
            return Err(IscsiError::Invalid(
                "initiator group",
                "tag 0 or no initiators".into(),
            ));
        }
        st.initiator_groups.insert(p.tag, p.clone());
        Ok(())
    }

    pub fn get_initiator_groups(&self) -> Vec<InitiatorGroupParams> {
        self.shared
            .lock()
            .initiator_groups
            .values()
            .cloned()
            .collect()
    }

    pub fn delete_initiator_group(&self, tag: u32) -> Result<(), IscsiError> {
        let mut st = self.shared.lock();
        if st
            .nodes
            .values()
            .any(|n| n.params.pg_ig_maps.iter().any(|m| m.ig_tag == tag))
        {
            return Err(IscsiError::InUse("initiator group", tag));
        }
        st.initiator_groups
            .remove(&tag)
            .map(|_| ())
            .ok_or_else(|| IscsiError::NotFound("initiator group", tag.to_string()))
    }

    /// `iscsi_create_auth_group`.
    pub fn create_auth_group(&self, p: &AuthGroupParams) -> Result<(), IscsiError> {
        let mut st = self.shared.lock();
        if st.auth_groups.contains_key(&p.tag) {
            return Err(IscsiError::Exists("auth group", p.tag.to_string()));
        }
        st.auth_groups.insert(p.tag, p.clone());
        Ok(())
    }

    /// `iscsi_auth_group_add_secret`.
    pub fn auth_group_add_secret(&self, tag: u32, s: Secret) -> Result<(), IscsiError> {
        let mut st = self.shared.lock();
        let g = st
            .auth_groups
            .get_mut(&tag)
            .ok_or_else(|| IscsiError::NotFound("auth group", tag.to_string()))?;
        if g.secrets.iter().any(|x| x.user == s.user) {
            return Err(IscsiError::Exists("CHAP user", s.user));
        }
        g.secrets.push(s);
        Ok(())
    }

    pub fn delete_auth_group(&self, tag: u32) -> Result<(), IscsiError> {
        self.shared
            .lock()
            .auth_groups
            .remove(&tag)
            .map(|_| ())
            .ok_or_else(|| IscsiError::NotFound("auth group", tag.to_string()))
    }

    pub fn get_auth_groups(&self) -> Vec<AuthGroupParams> {
        self.shared.lock().auth_groups.values().cloned().collect()
    }

    fn open_lun(&self, node: &str, l: &NodeLun, id: u32) -> Result<Arc<LunEntry>, IscsiError> {
        let desc = self.registry.open(&l.bdev_name, true, |_| {})?;
        desc.claim(&format!("iscsi target node {node}"))?;
        let thin = desc.info().unmap_reads_zero;
        let mut cfg = LuConfig::disk("ustor iSCSI disk", id, thin);
        cfg.serial = format!("{:.16}", l.bdev_name);
        if thin {
            // What one UNMAP may carry (the core's limit), so initiators
            // split longer lists instead of losing descriptors.
            cfg.limits.max_unmap_descriptors = ustor_scsi_target::MAX_UNMAP_DESCRIPTORS as u32;
            cfg.limits.max_unmap_blocks = u32::MAX;
            cfg.limits.unmap_granularity_blocks = 1;
        }
        Ok(Arc::new(LunEntry {
            lun_id: l.lun_id,
            bdev_name: l.bdev_name.clone(),
            desc,
            cfg,
            shared: ustor_scsi_target::LuShared::new(),
        }))
    }

    /// `iscsi_create_target_node`: opens and claims every LUN's bdev.
    pub fn create_target_node(&self, p: &TargetNodeParams) -> Result<(), IscsiError> {
        let full = p.full_name();
        {
            let st = self.shared.lock();
            if st.nodes.contains_key(&full) {
                return Err(IscsiError::Exists("target node", full));
            }
            for m in &p.pg_ig_maps {
                if !st.portal_groups.contains_key(&m.pg_tag) {
                    return Err(IscsiError::NotFound("portal group", m.pg_tag.to_string()));
                }
                if !st.initiator_groups.contains_key(&m.ig_tag) {
                    return Err(IscsiError::NotFound(
                        "initiator group",
                        m.ig_tag.to_string(),
                    ));
                }
            }
            if p.disable_chap && p.require_chap || p.mutual_chap && !p.require_chap {
                return Err(IscsiError::Invalid(
                    "target node",
                    "CHAP flags conflict".into(),
                ));
            }
        }
        if p.luns.is_empty() || p.luns.len() > ustor_scsi_target::MAX_LUNS {
            return Err(IscsiError::Invalid(
                "target node",
                "needs 1 to 256 LUNs".into(),
            ));
        }
        let mut luns = Vec::new();
        for l in &p.luns {
            if luns.iter().any(|x: &Arc<LunEntry>| x.lun_id == l.lun_id) {
                return Err(IscsiError::Exists("LUN", l.lun_id.to_string()));
            }
            let id = {
                let mut st = self.shared.lock();
                st.next_lun_id += 1;
                st.next_lun_id
            };
            luns.push(self.open_lun(&full, l, id)?);
        }
        let mut st = self.shared.lock();
        if st.nodes.contains_key(&full) {
            return Err(IscsiError::Exists("target node", full));
        }
        let node = NodeEntry {
            params: p.clone(),
            full_name: full.clone(),
            luns,
        };
        st.nodes.insert(full, Arc::new(node));
        Ok(())
    }

    /// `iscsi_target_node_add_lun`: new sessions see the LUN.
    pub fn target_node_add_lun(&self, p: &AddLunParams) -> Result<(), IscsiError> {
        let full = full_name(&p.name);
        let old = self
            .shared
            .lock()
            .nodes
            .get(&full)
            .cloned()
            .ok_or_else(|| IscsiError::NotFound("target node", full.clone()))?;
        let lun_id = p.lun_id.unwrap_or_else(|| {
            (0..)
                .find(|i| old.luns.iter().all(|l| l.lun_id != *i))
                .unwrap_or(0)
        });
        if old.luns.iter().any(|l| l.lun_id == lun_id) {
            return Err(IscsiError::Exists("LUN", lun_id.to_string()));
        }
        let id = {
            let mut st = self.shared.lock();
            st.next_lun_id += 1;
            st.next_lun_id
        };
        let nl = NodeLun {
            bdev_name: p.bdev_name.clone(),
            lun_id,
        };
        let lun = self.open_lun(&full, &nl, id)?;
        let mut params = old.params.clone();
        params.luns.push(nl);
        let mut luns = old.luns.clone();
        luns.push(lun);
        let node = NodeEntry {
            params,
            full_name: full.clone(),
            luns,
        };
        self.shared.lock().nodes.insert(full, Arc::new(node));
        Ok(())
    }

    /// `iscsi_delete_target_node`: sessions already open keep their LUNs
    /// until they end.
    pub fn delete_target_node(&self, name: &str) -> Result<(), IscsiError> {
        let full = full_name(name);
        match self.shared.lock().nodes.remove(&full) {
            Some(_) => Ok(()),
            None => Err(IscsiError::NotFound("target node", full)),
        }
    }

    /// `iscsi_get_target_nodes`.
    pub fn get_target_nodes(&self) -> Vec<NodeInfo> {
        self.shared
            .lock()
            .nodes
            .values()
            .map(|n| {
                let p = &n.params;
                NodeInfo {
                    name: n.full_name.clone(),
                    alias_name: p.alias_name.clone(),
                    pg_ig_maps: p.pg_ig_maps.clone(),
                    luns: p.luns.clone(),
                    queue_depth: p.queue_depth,
                    disable_chap: p.disable_chap,
                    require_chap: p.require_chap,
                    mutual_chap: p.mutual_chap,
                    chap_group: p.chap_group,
                    header_digest: p.header_digest,
                    data_digest: p.data_digest,
                }
            })
            .collect()
    }

    /// Stops every listener (connections run on).
    pub fn stop(&self) {
        let mut st = self.shared.lock();
        for pg in st.portal_groups.values_mut() {
            for l in pg.listeners.drain(..) {
                l.stop();
            }
        }
    }

    /// Shutdown: stops every listener, asks each session's initiator to
    /// log out within `grace` (an Async Message), ends the connections
    /// still open after it, and waits for them (at most `grace` and 5 s
    /// more). Whether every connection ended.
    pub fn drain(&self, grace: Duration) -> bool {
        self.stop();
        let secs = self.request_logout(grace);
        self.wait_idle(Duration::from_secs(secs as u64 + 5))
    }

    /// Asks every session's initiator to log out within `grace` (whole
    /// seconds, at least 1, which it returns); sessions still open after
    /// it are ended. Logins are not stopped here ([`IscsiTarget::stop`]).
    pub fn request_logout(&self, grace: Duration) -> u32 {
        let secs = grace.as_secs().clamp(1, u16::MAX as u64) as u32;
        self.shared.drain.start(secs);
        secs
    }

    /// Waits, at most `max`, until no connection is open.
    pub fn wait_idle(&self, max: Duration) -> bool {
        self.shared.conns.wait_idle(max)
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        self.shared.conns.open()
    }

    /// Time a connection has to finish its login, for portal groups
    /// created from now on.
    pub fn set_login_timeout(&self, t: Duration) {
        *self
            .shared
            .login_timeout
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = t;
    }

    /// `iscsi_set_options`: checked, then in force for logins from now on.
    pub fn set_options(&self, o: IscsiOptions) -> Result<(), IscsiError> {
        o.check().map_err(|e| IscsiError::Invalid("options", e))?;
        *self.shared.options() = o;
        Ok(())
    }

    /// `iscsi_get_options`.
    pub fn get_options(&self) -> IscsiOptions {
        self.shared.options().clone()
    }

    /// `iscsi_get_stats`: every open connection is running (there is no
    /// exiting state a caller could see).
    pub fn get_stats(&self) -> IscsiStats {
        IscsiStats {
            running: self.connections() as u64,
            ..IscsiStats::default()
        }
    }

    /// `iscsi_get_connections`: the connections past login.
    /// Each one's counters are read on its reactor.
    pub fn get_connections(&self) -> Vec<ConnInfo> {
        let mut list = self.shared.live.list();
        let key = Arc::as_ptr(&self.shared.live) as usize;
        if let Ok(per) = self
            .shared
            .rt
            .call_all(move |_| crate::live::counters_here(key))
        {
            for (id, ops, r, w) in per.into_iter().flatten() {
                if let Some(c) = list.iter_mut().find(|c| c.id == id) {
                    (c.ops, c.bytes_read, c.bytes_written) = (ops, r, w);
                }
            }
        }
        list
    }

    /// Sets the connection cap.
    pub fn set_max_connections(&self, n: usize) {
        self.shared.conns.set_max(n);
    }

    /// The connection cap's counters (admitted, refused, login timeouts).
    pub fn listener_stats(&self) -> ustor_net::listener::ListenerStats {
        self.shared.conns.stats()
    }

    /// The calls that recreate this target's objects (for save_config),
    /// in dependency order.
    pub fn config_json(&self) -> Vec<serde_json::Value> {
        use serde_json::json;
        let mut calls = Vec::new();
        for g in self.get_auth_groups() {
            calls.push(json!({"method": "iscsi_create_auth_group", "params": g}));
        }
        {
            let st = self.shared.lock();
            for pg in st.portal_groups.values() {
                calls.push(json!({"method": "iscsi_create_portal_group", "params": pg.params}));
            }
        }
        for ig in self.get_initiator_groups() {
            calls.push(json!({"method": "iscsi_create_initiator_group", "params": ig}));
        }
        for n in self.shared.lock().nodes.values() {
            calls.push(json!({"method": "iscsi_create_target_node", "params": n.params}));
        }
        calls
    }
}

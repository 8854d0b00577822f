//! The iSCSI initiator as a SCSI low-level driver: one session (one
//! connection) per host to one target. Login with CHAP (one-way or
//! mutual) and operational negotiation (CRC32C digests, ImmediateData,
//! InitialR2T, burst lengths); SendTargets discovery when no target is
//! named. The data path is the socket-free machine in [`crate::session`]
//! driven by three tasks per connection: a receiver (non-blocking `readv`
//! straight into the command's buffers), a sender (`writev` of headers and
//! the command's buffers) and a keep-alive (NOP-Out pings when idle).
//!
//! Recovery (RFC 7143 §7.8, the simplest allowed): any connection failure
//! — socket error, digest mismatch, malformed PDU, unanswered ping — fails
//! the outstanding commands back to the mid-layer (which retries them) and
//! reinstates the session in the background; host reset does the same
//! with every command dropped.

use std::cell::{Cell, RefCell};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::Duration;

use ustor_runtime::ticks;
use ustor_scsi::lld::{
    Completion, HostLimits, Lld, LocalFuture, Nexus, QueueError, ScsiCmd, Tag, TargetAddr,
    TmfResult, TransportError,
};
use ustor_scsi::lun::encode_lun;

use crate::conn::{readv_nb, set_nonblocking, wait_ready, writev_nb};
use crate::login::{self, LoginError, LoginParams, LoginProtocol, Negotiated};
use crate::session::{Params, State, Stats, ITT_TMF, MAX_TASKS, RX_IOVS, TX_IOVS};
use crate::task::SENSE_MAX;
use crate::wire::{build, tmf, RESERVED_TAG};

mod config;
mod loops;

pub use config::IscsiConfig;
use loops::{keepalive, receiver, recover, rx_poll, sender, EMPTY_IOV};

/// Our MaxRecvDataSegmentLength and the largest command transfer.
const MAX_RECV_SEG: u32 = 262_144;
const TMF_WAIT: Duration = Duration::from_secs(5);
/// Back-off between reinstatement attempts.
const RECONNECT_MIN: Duration = Duration::from_millis(50);
const RECONNECT_MAX: Duration = Duration::from_secs(1);
/// Socket passes a loop makes before yielding the reactor.
const LOOP_BUDGET: u32 = 32;
/// Reads the receive poller makes per reactor pass.
const RX_PASS_BUDGET: usize = 16;

/// The state every task of the host shares (one reactor, so `Rc`).
struct Shared {
    cfg: IscsiConfig,
    isid: [u8; 6],
    st: RefCell<Option<State>>,
    stream: RefCell<Option<TcpStream>>,
    /// The connection's socket (valid while `connected`).
    fd: Cell<RawFd>,
    /// The connection's receive poller.
    rx_poller: Cell<Option<ustor_runtime::PollerId>>,
    connected: Cell<bool>,
    /// Bumped by every connection and teardown: loops of an older one stop.
    generation: Cell<u64>,
    target: RefCell<String>,
    negotiated: Cell<Option<Negotiated>>,
    send_waker: RefCell<Option<Waker>>,
    reinstating: Cell<bool>,
    recovering: Cell<bool>,
    closed: Cell<bool>,
    seq: Cell<u16>,
    /// Counters kept across connections (the session state's are added).
    stats: Cell<Stats>,
    last_error: RefCell<Option<String>>,
}

thread_local! {
    /// The sessions of this reactor, for [`local_sessions`].
    static SESSIONS: RefCell<Vec<std::rc::Weak<Shared>>> = const { RefCell::new(Vec::new()) };
}

/// Live facts (`info()`: negotiated values, counters) of the iSCSI
/// sessions on the calling reactor, oldest first. `scsi_get_hosts` shows
/// the info taken when the host was added; this one is current.
pub fn local_sessions() -> Vec<serde_json::Value> {
    SESSIONS.with(|v| {
        let mut v = v.borrow_mut();
        v.retain(|w| w.strong_count() > 0);
        v.iter()
            .filter_map(|w| w.upgrade())
            .map(|s| s.info())
            .collect()
    })
}

/// The iSCSI LLD.
pub struct IscsiLld {
    s: Rc<Shared>,
}

impl IscsiLld {
    pub fn new(cfg: IscsiConfig) -> IscsiLld {
        // A per-host ISID (random qualifier, RFC 7143 §10.12.5 type 0x80
        // "random"), kept across reinstatements so the target replaces the
        // old session instead of keeping two.
        let mut isid = [0x80, 0, 0, 0, 0, 0];
        if crate::chap::random_bytes(&mut isid[1..]).is_err() {
            isid[1..5].copy_from_slice(&std::process::id().to_be_bytes());
        }
        let lld = IscsiLld {
            s: Rc::new(Shared {
                cfg,
                isid,
                st: RefCell::new(None),
                stream: RefCell::new(None),
                fd: Cell::new(-1),
                rx_poller: Cell::new(None),
                connected: Cell::new(false),
                generation: Cell::new(0),
                target: RefCell::new(String::new()),
                negotiated: Cell::new(None),
                send_waker: RefCell::new(None),
                reinstating: Cell::new(false),
                recovering: Cell::new(false),
                closed: Cell::new(false),
                seq: Cell::new(0),
                stats: Cell::new(Stats::default()),
                last_error: RefCell::new(None),
            }),
        };
        SESSIONS.with(|v| v.borrow_mut().push(Rc::downgrade(&lld.s)));
        lld
    }

    /// Counters of this host (also in `info().stats`).
    pub fn stats(&self) -> Stats {
        self.s.stats()
    }
}

impl Drop for IscsiLld {
    fn drop(&mut self) {
        self.s.closed.set(true);
        self.s.teardown();
    }
}

/// SendTargets discovery with default options: the target names behind a
/// portal.
pub async fn discover(portal: &str, initiator: &str) -> std::io::Result<Vec<String>> {
    let cfg = IscsiConfig::new(portal, None);
    let mut p = login_params(&cfg, [0x80, 0, 0, 0, 0, 1], None);
    p.initiator = initiator;
    login::discover(portal, &p, Duration::from_millis(cfg.login_timeout_ms))
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))
}

fn login_params<'a>(
    cfg: &'a IscsiConfig,
    isid: [u8; 6],
    target: Option<&'a str>,
) -> LoginParams<'a> {
    LoginParams {
        initiator: &cfg.initiator,
        target,
        isid,
        chap: IscsiConfig::secret(&cfg.chap_user, &cfg.chap_secret),
        mutual: IscsiConfig::secret(&cfg.mutual_chap_user, &cfg.mutual_chap_secret),
        header_digest: cfg.header_digest,
        data_digest: cfg.data_digest,
        immediate_data: cfg.immediate_data,
        initial_r2t: cfg.initial_r2t,
        first_burst: cfg.first_burst_length.max(512),
        max_burst: cfg.max_burst_length.max(512),
        max_recv_seg: MAX_RECV_SEG,
    }
}

impl Shared {
    fn info(&self) -> serde_json::Value {
        let s = self;
        let n = s.negotiated.get();
        serde_json::json!({
            "portal": s.cfg.portal,
            "target": *s.target.borrow(),
            "connected": s.connected.get(),
            "isid": crate::chap::encode_hex(&s.isid),
            "negotiated": n.map(|n| serde_json::json!({
                "header_digest": n.header_digest,
                "data_digest": n.data_digest,
                "immediate_data": n.immediate_data,
                "initial_r2t": n.initial_r2t,
                "first_burst_length": n.first_burst,
                "max_burst_length": n.max_burst,
                "max_send_data_segment_length": n.max_send_seg,
                "chap": n.chap,
                "mutual_chap": n.mutual,
            })),
            "last_error": *s.last_error.borrow(),
            "stats": s.stats(),
        })
    }

    fn stats(&self) -> Stats {
        let mut s = self.stats.get();
        if let Some(st) = self.st.borrow().as_ref() {
            add_stats(&mut s, &st.stats);
        }
        s
    }

    fn count(&self, f: impl FnOnce(&mut Stats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }

    fn wake_sender(&self) {
        if let Some(w) = self.send_waker.borrow_mut().take() {
            w.wake();
        }
    }

    fn live(&self, gen: u64) -> bool {
        self.generation.get() == gen && self.connected.get()
    }

    /// Stops the current connection's loops and closes its socket. The
    /// shutdown happens before anything hands a command's buffer back: a
    /// shut-down socket never writes into memory again.
    fn teardown(&self) {
        self.generation.set(self.generation.get() + 1);
        self.connected.set(false);
        if let Some(id) = self.rx_poller.take() {
            ustor_runtime::unregister_poller(id);
        }
        if let Some(st) = self.stream.borrow_mut().take() {
            let _ = st.shutdown(std::net::Shutdown::Both);
        }
        self.wake_sender();
    }

    /// The connection of generation `gen` failed: fail its commands back
    /// to the mid-layer and reinstate the session in the background.
    fn fail_conn(self: &Rc<Self>, gen: u64, why: &str) {
        if !self.live(gen) {
            return;
        }
        tracing::warn!("iscsi {}: connection failed: {why}", self.cfg.portal);
        *self.last_error.borrow_mut() = Some(why.to_string());
        self.teardown();
        if let Some(st) = self.st.borrow_mut().as_mut() {
            st.stats.connection_failures += 1;
            st.fail_all(TransportError::Disconnected);
        }
        if !self.recovering.get() && !self.closed.get() {
            ustor_runtime::spawn(recover(self.clone()));
        }
    }

    /// Logs in anew (session reinstatement: same ISID, TSIH 0) and starts
    /// the connection's loops. One at a time: a second caller waits for
    /// the first.
    async fn reinstate(self: &Rc<Self>) -> Result<(), LoginError> {
        if self.reinstating.get() {
            let deadline = ticks::now()
                + ticks::from_duration(Duration::from_millis(self.cfg.login_timeout_ms * 3));
            while self.reinstating.get() && ticks::now() < deadline {
                ustor_runtime::sleep(Duration::from_millis(1)).await;
            }
            return if self.connected.get() {
                Ok(())
            } else {
                Err(LoginProtocol::ReinstatementFailed.into())
            };
        }
        self.reinstating.set(true);
        let r = self.connect().await;
        self.reinstating.set(false);
        match &r {
            Ok(()) => self.count(|s| s.reinstatements += 1),
            Err(e) => {
                self.count(|s| s.reinstatement_failures += 1);
                *self.last_error.borrow_mut() = Some(e.to_string());
            }
        }
        r
    }

    async fn connect(self: &Rc<Self>) -> Result<(), LoginError> {
        self.teardown();
        let cfg = &self.cfg;
        let timeout = Duration::from_millis(cfg.login_timeout_ms);
        let known = self.target.borrow().clone();
        let target = match (&cfg.target, known.is_empty()) {
            (Some(t), _) => t.clone(),
            (None, false) => known,
            (None, true) => {
                let p = login_params(cfg, self.isid, None);
                login::discover(&cfg.portal, &p, timeout)
                    .await?
                    .into_iter()
                    .next()
                    .ok_or(LoginProtocol::NoTarget)?
            }
        };
        let stream = crate::conn::connect(&cfg.portal, timeout).await?;
        let fd = stream.as_raw_fd();
        let p = login_params(cfg, self.isid, Some(&target));
        let n = login::login(fd, &p, timeout).await?;
        let _ = ustor_runtime::net::set_nodelay(fd);
        set_nonblocking(fd)?;
        let params = Params {
            header_digest: n.header_digest,
            data_digest: n.data_digest,
            immediate_data: n.immediate_data,
            initial_r2t: n.initial_r2t,
            first_burst: n.first_burst,
            max_burst: n.max_burst,
            max_send_seg: n.max_send_seg.min(MAX_RECV_SEG),
            max_recv_seg: MAX_RECV_SEG,
        };
        tracing::info!("iscsi {}: logged in to {target}: {n:?}", self.cfg.portal);
        let expstatsn = n.statsn.wrapping_add(1);
        {
            let mut g = self.st.borrow_mut();
            match g.as_mut() {
                Some(st) => {
                    // Fold the old connection's counters into the host's.
                    let old = std::mem::take(&mut st.stats);
                    self.count(|s| add_stats(s, &old));
                    st.reset_conn(params, n.cmdsn, expstatsn, n.maxcmdsn);
                }
                None => {
                    let ntasks = self.cfg.queue_depth.clamp(1, MAX_TASKS as u32) as usize;
                    *g = Some(State::new(params, ntasks, n.cmdsn, expstatsn, n.maxcmdsn));
                }
            }
        }
        *self.stream.borrow_mut() = Some(stream);
        *self.target.borrow_mut() = target;
        self.negotiated.set(Some(n));
        let gen = self.generation.get() + 1;
        self.generation.set(gen);
        self.fd.set(fd);
        self.connected.set(true);
        let me = self.clone();
        let mut iov = Box::new([EMPTY_IOV; RX_IOVS]);
        // While commands are outstanding, every reactor pass tries the
        // socket (no io_uring poll round trip on the latency path); idle
        // connections wait in the receiver task's poll.
        self.rx_poller.set(Some(ustor_runtime::register_poller(
            "iscsi-rx",
            move || rx_poll(&me, gen, fd, &mut iov),
        )));
        ustor_runtime::spawn(receiver(self.clone(), fd, gen));
        ustor_runtime::spawn(sender(self.clone(), fd, gen));
        if cfg.nop_interval_ms > 0 {
            ustor_runtime::spawn(keepalive(self.clone(), gen));
        }
        Ok(())
    }

    /// Sends what is staged right away (a command from `queuecommand`):
    /// the sender task only takes what the socket would not.
    fn flush_tx(&self) {
        if !self.connected.get() {
            return;
        }
        let fd = self.fd.get();
        let mut iov = [EMPTY_IOV; TX_IOVS];
        let more = {
            let mut g = self.st.borrow_mut();
            let Some(st) = g.as_mut() else { return };
            let n = st.tx_iovecs(&mut iov);
            if n > 0 {
                // SAFETY: as in `sender`: staged headers, the spill buffer or
                // active commands' buffers, valid for this synchronous call.
                if let Ok(Some(k)) = unsafe { writev_nb(fd, &iov[..n]) } {
                    st.tx_advance(k);
                }
            }
            st.tx_pending()
        };
        // Errors and leftovers: the sender task handles both.
        if more {
            self.wake_sender();
        }
    }

    fn next_seq(&self) -> u16 {
        let v = self.seq.get().wrapping_add(1);
        self.seq.set(v);
        v
    }

    /// Sends a TMF and waits (bounded) for its response code.
    async fn send_tmf(
        &self,
        function: u8,
        lun: [u8; 8],
        ref_itt: u32,
        refcmdsn: u32,
    ) -> Option<u8> {
        let itt = (self.next_seq() as u32) << 16 | ITT_TMF;
        {
            let mut g = self.st.borrow_mut();
            let st = g.as_mut()?;
            if !self.connected.get() {
                return None;
            }
            st.tmf_resp = None;
            let b = build::tmf(
                function,
                lun,
                itt,
                ref_itt,
                st.cmdsn,
                st.expstatsn,
                refcmdsn,
            );
            st.send_ctl(b);
        }
        self.wake_sender();
        let deadline = ticks::now() + ticks::from_duration(TMF_WAIT);
        loop {
            {
                let mut g = self.st.borrow_mut();
                let st = g.as_mut()?;
                if let Some((i, r)) = st.tmf_resp {
                    if i == itt {
                        st.tmf_resp = None;
                        return Some(r);
                    }
                }
            }
            if ticks::now() >= deadline || !self.connected.get() {
                return None;
            }
            ustor_runtime::sleep(Duration::from_millis(1)).await;
        }
    }
}

fn add_stats(a: &mut Stats, b: &Stats) {
    a.pdus_rx += b.pdus_rx;
    a.pdus_tx += b.pdus_tx;
    a.data_in_bytes += b.data_in_bytes;
    a.data_out_bytes += b.data_out_bytes;
    a.immediate_bytes += b.immediate_bytes;
    a.r2ts += b.r2ts;
    a.pings_sent += b.pings_sent;
    a.pings_answered += b.pings_answered;
    a.target_nops_answered += b.target_nops_answered;
    a.keepalive_timeouts += b.keepalive_timeouts;
    a.header_digest_errors += b.header_digest_errors;
    a.data_digest_errors += b.data_digest_errors;
    a.protocol_errors += b.protocol_errors;
    a.connection_failures += b.connection_failures;
    a.reinstatements += b.reinstatements;
    a.reinstatement_failures += b.reinstatement_failures;
    a.spills += b.spills;
}

impl Lld for IscsiLld {
    fn name(&self) -> &str {
        "iscsi"
    }

    fn limits(&self) -> HostLimits {
        let q = self.s.cfg.queue_depth.clamp(1, MAX_TASKS as u32);
        HostLimits {
            can_queue: q,
            cmd_per_lun: q,
            max_transfer_bytes: MAX_RECV_SEG,
            max_sg_entries: crate::MAX_SEGS as u32,
            dma_alignment: 1,
        }
    }

    fn queuecommand(&self, cmd: &ScsiCmd) -> Result<(), QueueError> {
        let s = &self.s;
        if !s.connected.get() {
            return Err(QueueError::NotConnected);
        }
        {
            let mut g = s.st.borrow_mut();
            let st = g.as_mut().ok_or(QueueError::NotConnected)?;
            // The target's command window (MaxCmdSN) is closed: wait.
            if !st.window_open() {
                return Err(QueueError::HostBusy);
            }
            st.start(cmd).ok_or(QueueError::HostBusy)?;
        }
        s.flush_tx();
        Ok(())
    }

    fn poll(&self, budget: usize, done: &mut dyn FnMut(Completion<'_>)) -> usize {
        let mut sense = [0u8; SENSE_MAX];
        let mut n = 0;
        while n < budget {
            // Taken out before the callback: it may queue the next command.
            let d = match self.s.st.borrow_mut().as_mut() {
                Some(st) => st.take_done(&mut sense),
                None => None,
            };
            let Some((tag, status, resid, slen)) = d else {
                break;
            };
            done(Completion {
                tag,
                status,
                sense: &sense[..slen],
                resid,
            });
            n += 1;
        }
        n
    }

    fn scan(&self) -> LocalFuture<'_, Result<Vec<TargetAddr>, TransportError>> {
        Box::pin(async move {
            if !self.s.connected.get() {
                if let Err(e) = self.s.reinstate().await {
                    tracing::error!("iscsi {}: {e}", self.s.cfg.portal);
                    return Err(e.transport());
                }
            }
            Ok(vec![TargetAddr {
                channel: 0,
                target: 0,
                name: self.s.target.borrow().clone(),
                luns: Vec::new(),
            }])
        })
    }

    fn abort(&self, tag: Tag, nexus: Nexus) -> LocalFuture<'_, TmfResult> {
        Box::pin(async move {
            let s = &self.s;
            let slot = (tag & 0xffff) as u16;
            let refcmdsn = {
                let g = s.st.borrow();
                match g.as_ref().and_then(|st| st.tasks.get(slot as usize)) {
                    Some(t) if t.tag == tag && t.state != crate::task::TaskState::Free => t.cmdsn,
                    // Not ours any more: counts as aborted.
                    _ => return TmfResult::Success,
                }
            };
            match s
                .send_tmf(tmf::ABORT_TASK, encode_lun(nexus.lun), tag, refcmdsn)
                .await
            {
                // Function complete, or the task is not there (any more).
                Some(0) | Some(1) => {
                    if let Some(st) = s.st.borrow_mut().as_mut() {
                        let t = &st.tasks[slot as usize];
                        if t.tag == tag && t.state != crate::task::TaskState::Free {
                            st.drop_task(slot);
                        }
                    }
                    TmfResult::Success
                }
                _ => TmfResult::Failed,
            }
        })
    }

    fn device_reset(&self, nexus: Nexus) -> LocalFuture<'_, TmfResult> {
        Box::pin(async move {
            let s = &self.s;
            match s
                .send_tmf(tmf::LUN_RESET, encode_lun(nexus.lun), RESERVED_TAG, 0)
                .await
            {
                Some(0) => {
                    if let Some(st) = s.st.borrow_mut().as_mut() {
                        for i in 0..st.tasks.len() {
                            let t = &st.tasks[i];
                            if t.state != crate::task::TaskState::Free && t.lun_no == nexus.lun {
                                st.drop_task(i as u16);
                            }
                        }
                    }
                    TmfResult::Success
                }
                _ => TmfResult::Failed,
            }
        })
    }

    fn host_reset(&self) -> LocalFuture<'_, TmfResult> {
        Box::pin(async move {
            // Session reinstatement; every outstanding command is dropped
            // with the old session (the socket is shut down first).
            let s = &self.s;
            s.teardown();
            if let Some(st) = s.st.borrow_mut().as_mut() {
                st.drop_all();
            }
            match s.reinstate().await {
                Ok(()) => TmfResult::Success,
                Err(e) => {
                    tracing::warn!("iscsi {}: session reinstatement failed: {e}", s.cfg.portal);
                    TmfResult::Failed
                }
            }
        })
    }

    fn info(&self) -> serde_json::Value {
        self.s.info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of `scsi_iscsi_attach_host`'s params (crates/ustor): the
    /// config flattened next to the host's own fields.
    #[derive(serde::Deserialize, serde::Serialize)]
    #[serde(deny_unknown_fields)]
    struct Attach {
        #[serde(flatten)]
        iscsi: IscsiConfig,
        #[serde(default)]
        reactor: usize,
    }

    #[test]
    fn rpc_params_carry_chap_digests_and_keepalive() {
        let v = serde_json::json!({
            "portal": "127.0.0.1:3260", "target": "iqn.x", "reactor": 0,
            "chap_user": "u", "chap_secret": "s", "mutual_chap_user": "t",
            "mutual_chap_secret": "ts", "header_digest": true, "data_digest": true,
            "immediate_data": false, "initial_r2t": true, "first_burst_length": 8192,
            "max_burst_length": 65536, "nop_interval_ms": 1000, "nop_timeout_ms": 2000,
            "login_timeout_ms": 3000
        });
        let a: Attach = serde_json::from_value(v).unwrap();
        let c = &a.iscsi;
        assert_eq!(
            (c.chap_user.as_deref(), c.mutual_chap_secret.as_deref()),
            (Some("u"), Some("ts"))
        );
        assert!(c.header_digest && c.data_digest && !c.immediate_data && c.initial_r2t);
        assert_eq!((c.nop_interval_ms, c.nop_timeout_ms), (1000, 2000));
        // Defaults when left out.
        let d: Attach = serde_json::from_value(serde_json::json!({"portal": "p"})).unwrap();
        assert!(d.iscsi.immediate_data && !d.iscsi.initial_r2t && !d.iscsi.header_digest);
        assert_eq!(d.iscsi.nop_interval_ms, 5000);
        assert!(d.iscsi.chap_user.is_none());
        // What save_config would write reads back the same.
        let again: Attach = serde_json::from_value(serde_json::to_value(&a).unwrap()).unwrap();
        assert_eq!(again.iscsi.chap_secret.as_deref(), Some("s"));
        let p = login_params(&again.iscsi, [0x80, 0, 0, 0, 0, 1], Some("iqn.x"));
        assert_eq!(p.chap.unwrap().user, "u");
        assert_eq!(p.mutual.unwrap().secret, "ts");
    }
}

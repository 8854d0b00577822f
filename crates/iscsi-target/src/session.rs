//! Full feature phase of one connection of a session: the receive loop.
//! It admits requests by the session's command window (ExpCmdSN/MaxCmdSN,
//! shared by the session's connections on every reactor, [`crate::sess`]:
//! a command that arrives ahead of one sent earlier on another connection
//! waits for it)
//! and serves each request PDU in turn: a SCSI Command becomes a task of its
//! own ([`crate::exec`]) so every command the window admits runs at once,
//! its status sent when it finishes; Data-Out goes to its task's mailbox;
//! NOP-Out, Text (SendTargets), Task Management (which aborts real tasks,
//! [`crate::tasks`]; resets reach the node's other sessions too,
//! [`crate::sessions`]) and Logout (close the session or a connection)
//! are answered here; anything else is
//! rejected. The receive races the NOP-In timer: an idle connection is
//! pinged every `nop_in_interval` seconds, and ends when a ping stays
//! unanswered for `nop_timeout`. When the target drains, the session asks
//! its initiator to log out (Async Message) and ends the connection once
//! the grace time is over. Sends that stall end the connection too
//! ([`crate::tx`]).

use std::future::Future;
use std::pin::{pin, Pin};
use std::rc::Rc;
use std::task::Poll;
use std::time::{Duration, Instant};

use ustor_iscsi::wire::{opcode, Bhs, BHS_LEN, RESERVED_TAG};
use ustor_runtime::timer::Sleep;
use ustor_runtime::RuntimeHandle;
use ustor_scsi_proto::lun::decode_lun;

use crate::exec::{self, Core};
use crate::io::{ConnError, Received, Wire};
use crate::live::ConnCounters;
use crate::pdu::{self, reject, tmf_response};
use crate::sess::Leave;
use crate::sessions::Sessions;

/// Sent in answer to SendTargets: the text of what an initiator may see.
pub trait Discovery {
    /// `TargetName=`/`TargetAddress=` pairs for `which` ("All", a name, or
    /// "" for the session's own target).
    fn send_targets(&self, which: &str, initiator: &str) -> Vec<(String, String)>;
}

/// NOP-In pings on an idle connection (SPDK's `nop_in_interval` and
/// `nop_timeout`, in seconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pings {
    pub interval: u32,
    pub timeout: u32,
}

/// How long a send may stall when pings are off.
pub(crate) const SEND_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a command that came ahead of its turn (MC/S) waits for the
/// commands before it: at ERL 0 a CmdSN that never comes ends the session.
const ORDER_TIMEOUT: Duration = Duration::from_secs(30);

/// COMMANDS CLEARED BY ANOTHER INITIATOR (SAM-5 §7.3, TAS 0).
const CLEARED_BY_ANOTHER: (u8, u8) = (0x2f, 0x00);

/// Pings and the drain: what a wait for the next PDU watches.
#[derive(Default)]
struct Idle {
    pings: Option<Pings>,
    /// The Target Transfer Tag of the ping not answered yet.
    ping_out: Option<u32>,
    drain: Option<crate::drain::Watch>,
    /// When the initiator, asked to log out, is cut off.
    logout_by: Option<Instant>,
    /// The one armed timer and when it fires. It is kept across waits
    /// (and armed again only when it fired early): a timer per wait would
    /// leave an entry per PDU in the reactor's timer heap until its
    /// deadline, a heap of millions at full speed, each firing a wake-up.
    timer: Option<(Instant, Sleep)>,
}

/// The session state one connection runs.
pub struct Session<'a, D: Discovery> {
    pub wire: Wire,
    core: Rc<Core>,
    /// A normal session (SCSI commands and TMFs served), not discovery.
    normal: bool,
    pub discovery: &'a D,
    pub initiator: String,
    /// The target's sessions, for resets that reach other sessions.
    peers: Option<(std::sync::Arc<Sessions>, RuntimeHandle)>,
    /// Text left to send after a Continue (SendTargets beyond one PDU).
    text_left: Vec<u8>,
    /// The data segment of the request being served (reused: NOP and
    /// Text payloads are copied here once).
    scratch: Vec<u8>,
    idle: Idle,
    /// The gate place `admit` took for the SCSI command it admitted.
    gate_seq: Option<u64>,
}

/// What ended a wait for the next PDU.
enum Woken {
    Pdu(Result<Received, ConnError>),
    Timer,
    Drain(u32),
}

/// How the loop ended.
#[derive(Debug, PartialEq, Eq)]
pub enum End {
    Logout,
    Closed,
}

impl<'a, D: Discovery> Session<'a, D> {
    /// The receive loop of connection `core` (of a normal session when
    /// `normal`, otherwise discovery).
    pub(crate) fn new(
        wire: Wire,
        core: Rc<Core>,
        normal: bool,
        discovery: &'a D,
        initiator: String,
    ) -> Session<'a, D> {
        Session {
            wire,
            core,
            normal,
            discovery,
            initiator,
            peers: None,
            text_left: Vec::new(),
            scratch: Vec::new(),
            idle: Idle::default(),
            gate_seq: None,
        }
    }

    /// Lets resets reach the node's other sessions.
    pub(crate) fn set_peers(&mut self, sessions: std::sync::Arc<Sessions>, rt: RuntimeHandle) {
        self.peers = Some((sessions, rt));
    }

    /// Counts the commands answered into `counters`.
    pub(crate) fn count_into(&mut self, counters: Rc<ConnCounters>) {
        *self.core.counters.borrow_mut() = counters;
    }

    /// Pings an idle initiator; a send stalled for the ping timeout (when
    /// there is one) ends the connection.
    pub fn set_pings(&mut self, p: Pings) {
        self.idle.pings = Some(p);
        if p.timeout > 0 {
            self.core
                .tx
                .set_timeout(Duration::from_secs(p.timeout as u64));
        }
    }

    /// Ends the session when the target drains.
    pub fn set_drain(&mut self, w: crate::drain::Watch) {
        self.idle.drain = Some(w);
    }

    /// The next PDU off the wire. The receive races the ping timer and
    /// the drain: an unanswered ping ends the connection, as does the end
    /// of a drain's grace time.
    async fn next_pdu(&mut self) -> Result<Received, ConnError> {
        let (idle, core) = (&mut self.idle, &self.core);
        let mut r = pin!(self.wire.recv());
        // Budget: each round sends a ping or a logout request, or returns.
        loop {
            if idle.logout_by.is_none() {
                if let Some(g) = idle.drain.as_ref().and_then(|d| d.started()) {
                    idle.ask_logout(core, g).await?;
                }
            }
            if idle.logout_by.is_some_and(|t| Instant::now() >= t) {
                return Err(ConnError::Drained);
            }
            match idle.wait(r.as_mut()).await {
                Woken::Pdu(p) => {
                    return p;
                }
                Woken::Drain(g) => idle.ask_logout(core, g).await?,
                Woken::Timer if idle.logout_by.is_some_and(|t| Instant::now() >= t) => {
                    return Err(ConnError::Drained)
                }
                Woken::Timer => match (idle.ping_out, idle.pings) {
                    (Some(_), Some(p)) if p.timeout > 0 => {
                        return Err(ConnError::NopTimeout(p.timeout))
                    }
                    (_, Some(p)) if p.interval > 0 => idle.ping(core).await?,
                    _ => {}
                },
            }
        }
    }

    /// Serves requests until Logout or the connection ends; the tasks
    /// still running then are aborted (unless the initiator logged out:
    /// they finished before its Logout Response) and waited for.
    pub async fn run(&mut self) -> Result<End, ConnError> {
        let r = self.serve().await;
        let core = &self.core;
        let serial = core.serial;
        if !matches!(r, Ok(End::Logout)) {
            core.tx.close();
            core.sess.tasks.abort(|t| t.conn == serial);
            if core.leave.get() == Leave::Failed {
                // ERL 0: the connection failed, the session ends with it,
                // on every reactor.
                self.end_session();
            }
        }
        core.sess.tasks.ended(|t| t.conn == serial).await;
        crate::workers::close(core);
        core.sess.leave(core);
        r
    }

    async fn serve(&mut self) -> Result<End, ConnError> {
        loop {
            let b = match self.next_pdu().await {
                Ok(Received::Pdu(b)) => b,
                Ok(Received::BadDataDigest(b)) => {
                    self.reject(&b, reject::DIGEST).await?;
                    continue;
                }
                Err(ConnError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    return Ok(End::Closed)
                }
                Err(e) => return Err(e),
            };
            if b.opcode() == opcode::DATA_OUT {
                // A Data-Out nobody waits for: its task is gone (ERL 0
                // drops it).
                let core = &self.core;
                let data = core.copy_buf(self.wire.data());
                if let Err((_, data)) = core.sess.tasks.deliver(b.itt(), core.serial, (b, data)) {
                    core.give_buf(data);
                }
                continue;
            }
            if !self.admit(&b).await? {
                continue;
            }
            if b.opcode() == opcode::SCSI_CMD && self.normal {
                // The initiator's depth when it sent this command: the
                // responses it had not seen (its ExpStatSN) and this one.
                // A deep initiator lets the reactor sleep between batches
                // instead of spinning for each command (runtime `depth`).
                ustor_runtime::note_depth(self.core.tx.unseen(b.u32_at(28)) + 1);
                self.scsi(&b).await?;
                if !self.wire.more_staged() {
                    // Nothing else has come: the command's task runs before
                    // this loop arms the next receive, so its response
                    // leaves first (the receive is not on its way).
                    ustor_runtime::yield_now().await;
                }
                continue;
            }
            let mut buf = std::mem::take(&mut self.scratch);
            buf.clear();
            buf.extend_from_slice(self.wire.data());
            let end = self.dispatch(&b, &buf).await;
            self.scratch = buf;
            if let Some(end) = end? {
                return Ok(end);
            }
        }
    }

    /// CmdSN rules: a non-immediate request advances ExpCmdSN; one outside
    /// the window is dropped (RFC 7143 §4.2.2.1), except that in a session
    /// of several connections one ahead of ExpCmdSN waits for the requests
    /// before it, sent on the others (on any reactor). A SCSI command of a
    /// session with a gate takes its place there first. A SCSI command
    /// keeps its slot of the window until it ends; other requests are
    /// answered at once and give theirs back.
    async fn admit(&mut self, b: &Bhs) -> Result<bool, ConnError> {
        let op = b.opcode();
        let immediate = b.0[0] & 0x40 != 0;
        if op == opcode::DATA_OUT || op == 0x10 || immediate {
            return Ok(true);
        }
        let cmdsn = b.u32_at(24);
        let sess = self.core.sess.clone();
        let w = &sess.window;
        let ahead = (cmdsn.wrapping_sub(w.exp.get()) as i32) > 0;
        let beyond = |max: u32| (cmdsn.wrapping_sub(max) as i32) > 0;
        if ahead && !beyond(w.max.get()) && sess.connections() > 1 {
            match ustor_net::time::timeout(ORDER_TIMEOUT, w.turn(cmdsn)).await {
                Some(true) => {}
                Some(false) => return Err(ConnError::Protocol("session ended")),
                None => return Err(ConnError::Protocol("CmdSN gap across connections")),
            }
        }
        let scsi = op == opcode::SCSI_CMD && self.normal;
        let over = beyond(w.max.get());
        // A task enters the gate before ExpCmdSN moves past it: the next
        // command, perhaps on another reactor, enters after it.
        let seq = match &w.gate {
            Some(g) if scsi && !over && cmdsn == w.exp.get() => {
                Some(g.enter(task_attr(b) == crate::tasks::attr::ORDERED))
            }
            _ => None,
        };
        if over || !w.advance(cmdsn) {
            if let (Some(g), Some(seq)) = (&w.gate, seq) {
                g.leave(seq);
            }
            tracing::debug!(
                "iscsi: CmdSN {cmdsn} outside the window [{}, {}]",
                w.exp.get(),
                w.max.get()
            );
            return Ok(false);
        }
        if !scsi {
            w.credit();
        }
        self.gate_seq = seq;
        Ok(true)
    }

    async fn dispatch(&mut self, b: &Bhs, data: &[u8]) -> Result<Option<End>, ConnError> {
        match b.opcode() {
            opcode::NOP_OUT => self.nop_out(b, data).await?,
            opcode::TEXT_REQ => self.text(b, data).await?,
            opcode::TMF_REQ if self.normal => self.tmf(b).await?,
            opcode::LOGOUT_REQ => {
                if self.logout(b).await? {
                    return Ok(Some(End::Logout));
                }
            }
            _ => self.reject(b, reject::NOT_SUPPORTED).await?,
        }
        Ok(None)
    }

    /// Starts the command as a task of its own.
    async fn scsi(&mut self, b: &Bhs) -> Result<(), ConnError> {
        let seq = self.gate_seq.take();
        let Some(cmd) = exec::Command::parse(b, self.wire.data()) else {
            if let (Some(g), Some(seq)) = (&self.core.sess.window.gate, seq) {
                g.leave(seq);
            }
            // Bidirectional commands are not offered.
            return self.reject(b, reject::NOT_SUPPORTED).await;
        };
        let attr = task_attr(b);
        let lun = decode_lun(cmd.info.lun);
        let windowed = b.0[0] & 0x40 == 0;
        let core = &self.core;
        // An immediate command takes its place in the gate now.
        let ordered = attr == crate::tasks::attr::ORDERED;
        let seq = (core.sess.window.gate.as_ref()).map(|g| seq.unwrap_or_else(|| g.enter(ordered)));
        let task = core
            .sess
            .tasks
            .add(cmd.info.itt, lun, core.serial, attr, windowed, seq);
        crate::workers::push(&self.core, task, cmd);
        Ok(())
    }

    async fn reject(&mut self, b: &Bhs, reason: u8) -> Result<(), ConnError> {
        let tx = &self.core.tx;
        let r = pdu::reject(reason, &tx.bump());
        tx.send(&r, &b.0[..BHS_LEN]).await
    }

    async fn nop_out(&mut self, b: &Bhs, data: &[u8]) -> Result<(), ConnError> {
        if b.itt() == RESERVED_TAG {
            // The answer to our ping: nothing to send.
            if self.idle.ping_out == Some(b.u32_at(20)) {
                self.idle.ping_out = None;
            }
            return Ok(());
        }
        let tx = &self.core.tx;
        let n = data.len().min(self.core.params.max_send_data as usize);
        let r = pdu::nop_in(b.lun(), b.itt(), RESERVED_TAG, n, &tx.bump());
        tx.send(&r, &data[..n]).await
    }

    async fn text(&mut self, b: &Bhs, data: &[u8]) -> Result<(), ConnError> {
        if b.u32_at(20) == RESERVED_TAG {
            let pairs = ustor_iscsi::wire::parse_text(data);
            let mut out: Vec<(String, String)> = Vec::new();
            for (k, v) in &pairs {
                if k == "SendTargets" {
                    out.extend(self.discovery.send_targets(v, &self.initiator));
                } else {
                    out.push((k.clone(), "NotUnderstood".into()));
                }
            }
            let refs: Vec<(&str, &str)> =
                out.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            self.text_left = ustor_iscsi::wire::encode_text(&refs);
        }
        let max = self.core.params.max_send_data as usize;
        let n = self.text_left.len().min(max);
        let chunk: Vec<u8> = self.text_left.drain(..n).collect();
        let more = !self.text_left.is_empty();
        let ttt = if more { self.core.ttt() } else { RESERVED_TAG };
        let tx = &self.core.tx;
        let r = pdu::text(b.itt(), more, ttt, chunk.len(), &tx.bump());
        tx.send(&r, &chunk).await
    }

    /// Task management on the session's running tasks; the answer leaves
    /// once the tasks it aborts have ended (RFC 7143 §11.5.1). The LUN's
    /// task set is shared by every I_T nexus (TST 0): CLEAR TASK SET and
    /// LUN RESET abort other sessions' tasks on the LUN too, the target
    /// resets every task of the node (SAM-5 §7).
    async fn tmf(&mut self, b: &Bhs) -> Result<(), ConnError> {
        let function = b.flags() & 0x7f;
        let lun = decode_lun(b.lun());
        let core = self.core.clone();
        let response = match function {
            1 => {
                let rtt = b.u32_at(20);
                // The task may be on any connection of the session.
                let found = self
                    .each_part(move |s| async move {
                        let tasks = &s.tasks;
                        match tasks.find(rtt) {
                            Some(t) if t.lun == lun => {
                                tasks.abort(|x| x.itt == rtt);
                                tasks.ended(|x| x.itt == rtt).await;
                                Some(tmf_response::COMPLETE)
                            }
                            Some(_) => Some(tmf_response::NO_TASK),
                            None => None,
                        }
                    })
                    .await;
                match found.into_iter().flatten().min() {
                    Some(r) => r,
                    None => self.gone(b.u32_at(32)),
                }
            }
            2 | 3 => {
                self.each_part(move |s| async move {
                    s.tasks.abort(|t| t.lun == lun);
                    s.tasks.ended(|t| t.lun == lun).await;
                })
                .await;
                if function == 3 {
                    self.others(Some(lun), false).await;
                }
                tmf_response::COMPLETE
            }
            4 => tmf_response::COMPLETE,
            5 if core.sess.table.get(lun).is_some() => {
                self.each_part(move |s| async move {
                    s.tasks.abort(|t| t.lun == lun);
                    s.tasks.ended(|t| t.lun == lun).await;
                })
                .await;
                self.others(Some(lun), true).await;
                // Once, on this part: the unit owes every I_T nexus (this
                // one too) one POWER ON, RESET, whichever reactors its
                // connections run on.
                core.sess.table.reset_lun(lun);
                tmf_response::COMPLETE
            }
            5 => tmf_response::NO_LUN,
            6 | 7 => {
                self.each_part(|s| async move {
                    s.tasks.abort(|_| true);
                    s.tasks.ended(|_| true).await;
                })
                .await;
                self.others(None, true).await;
                core.sess.table.reset_all();
                tmf_response::COMPLETE
            }
            8 => tmf_response::NO_REASSIGN,
            _ => tmf_response::NOT_SUPPORTED,
        };
        let r = pdu::tmf(b.itt(), response, &core.tx.bump());
        core.tx.send(&r, &[]).await?;
        if function == 7 {
            // TARGET COLD RESET: then every session of the target ends
            // (RFC 7143 §11.5.1), this one too.
            self.end_others().await;
            self.end_session();
        }
        Ok(())
    }

    /// Runs `f` with every part of this session (each on its reactor), or
    /// with this one when the session cannot have others; their results.
    async fn each_part<F, Fut, R>(&self, f: F) -> Vec<R>
    where
        F: Fn(Rc<crate::sess::Sess>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = R> + 'static,
        R: Send + 'static,
    {
        match (&self.peers, &self.core.sess.ctl) {
            (Some((sessions, rt)), Some(ctl)) if ctl.several() => {
                sessions.on_parts(rt, ctl.tsih, f).await
            }
            _ => vec![f(self.core.sess.clone()).await],
        }
    }

    /// Ends this session: this part now, the others on their reactors.
    fn end_session(&self) {
        self.core.sess.end();
        if let (Some((sessions, rt)), Some(ctl)) = (&self.peers, &self.core.sess.ctl) {
            if ctl.several() {
                sessions.end_now(rt, ctl.tsih);
            }
        }
    }

    /// Ends every other session of the node (connections closed).
    async fn end_others(&self) {
        let (Some((sessions, rt)), Some(me)) = (&self.peers, &self.core.sess.ctl) else {
            return;
        };
        for ctl in sessions.of_node(&me.node) {
            if ctl.tsih != me.tsih {
                sessions.end(rt, &ctl).await;
            }
        }
    }

    /// Aborts the tasks of the node's other sessions on `lun` (every LUN:
    /// `None`) and waits until they have ended. They end silently (TAS 0).
    /// A reset's POWER ON, RESET comes from the unit (the caller resets
    /// it); a clear owes COMMANDS CLEARED BY ANOTHER INITIATOR to each
    /// session where it aborted something, once per session (its I_T
    /// nexus), not once per reactor its connections run on.
    async fn others(&self, lun: Option<u64>, reset: bool) {
        let (Some((sessions, rt)), Some(me)) = (&self.peers, &self.core.sess.ctl) else {
            return;
        };
        let on = move |l: u64| lun.is_none() || lun == Some(l);
        for ctl in sessions.of_node(&me.node) {
            if ctl.tsih == me.tsih {
                continue;
            }
            let aborted: usize = sessions
                .on_parts(rt, ctl.tsih, move |s| async move {
                    let n = s.tasks.abort(|t| on(t.lun));
                    s.tasks.ended(|t| on(t.lun)).await;
                    n
                })
                .await
                .into_iter()
                .sum();
            if !reset && aborted > 0 {
                let nexus = crate::conn::nexus_name(&ctl.initiator, &ctl.isid);
                self.core.sess.table.tell(&nexus, CLEARED_BY_ANOTHER, on);
            }
        }
    }

    /// ABORT TASK for a task not running: RFC 7143 §11.5.1 answers
    /// "complete" when its RefCmdSN is still in the window (not received
    /// yet), "task does not exist" when it is behind (it completed).
    fn gone(&self, ref_cmdsn: u32) -> u8 {
        let seq = self.core.tx.seq();
        // Serial arithmetic: a window full of running commands has MaxCmdSN
        // one below ExpCmdSN (RFC 7143 §4.2.2.1).
        let ahead = ref_cmdsn.wrapping_sub(seq.exp_cmdsn) as i32;
        let window = seq.max_cmdsn.wrapping_sub(seq.exp_cmdsn) as i32;
        if (0..=window).contains(&ahead) {
            tmf_response::COMPLETE
        } else {
            tmf_response::NO_TASK
        }
    }

    /// Logout (RFC 7143 §11.14): close the session (every connection) or
    /// one connection (this one or another, by CID), answered once their
    /// running tasks have answered; removing a connection for recovery
    /// needs ERL 2 and is refused. Whether this connection ends.
    async fn logout(&mut self, b: &Bhs) -> Result<bool, ConnError> {
        let core = self.core.clone();
        let (tasks, serial) = (&core.sess.tasks, core.serial);
        let cid = b.u16_at(20);
        let (response, ends) = match b.flags() & 0x7f {
            logout_reason::SESSION => {
                self.each_part(|s| async move { s.tasks.ended(|_| true).await })
                    .await;
                core.sess.set_leave(&core, Leave::LoggedOut);
                (logout_response::CLOSED, true)
            }
            logout_reason::CONNECTION if cid == core.cid => {
                tasks.ended(|t| t.conn == serial).await;
                core.sess.set_leave(&core, Leave::LoggedOut);
                (logout_response::CLOSED, true)
            }
            logout_reason::CONNECTION => {
                // Another connection, on whichever reactor it runs.
                let closed = self
                    .each_part(move |s| async move {
                        let gone = s.close_cid(cid, Leave::LoggedOut);
                        s.tasks.ended(|t| gone.contains(&t.conn)).await;
                        !gone.is_empty()
                    })
                    .await;
                if !closed.contains(&true) {
                    (logout_response::NO_CID, false)
                } else {
                    (logout_response::CLOSED, false)
                }
            }
            logout_reason::RECOVERY => (logout_response::NO_RECOVERY, false),
            _ => {
                self.reject(b, reject::INVALID_FIELD).await?;
                return Ok(false);
            }
        };
        let tx = &core.tx;
        let wait = core.params.time2wait as u16;
        let r = pdu::logout(b.itt(), response, wait, 0, &tx.bump());
        tx.send(&r, &[]).await?;
        if b.flags() & 0x7f == logout_reason::SESSION {
            // The session's other connections end with it.
            self.end_session();
        }
        Ok(ends)
    }
}

/// A SCSI Command's task attribute. COMPARE AND WRITE and ORWRITE read
/// before they write: they run alone in the session (as ORDERED) so none
/// of its own writes interleave (crates/scsi-target's rmw relies on it).
fn task_attr(b: &Bhs) -> u8 {
    match b.0[32] {
        0x89 | 0x8b => crate::tasks::attr::ORDERED,
        _ => b.flags() & 0x07,
    }
}

/// Logout Request reason codes (RFC 7143 §11.14.1).
mod logout_reason {
    pub const SESSION: u8 = 0;
    pub const CONNECTION: u8 = 1;
    pub const RECOVERY: u8 = 2;
}

/// Logout Response codes (RFC 7143 §11.15.1).
mod logout_response {
    pub const CLOSED: u8 = 0;
    pub const NO_CID: u8 = 1;
    pub const NO_RECOVERY: u8 = 2;
}

impl Idle {
    /// When the wait that starts now ends with [`Woken::Timer`]: the ping
    /// (or the ping's timeout) after a quiet stretch, or the end of the
    /// logout grace time.
    fn due(&self, now: Instant) -> Option<Instant> {
        let ping = match (self.pings, self.ping_out) {
            (Some(p), Some(_)) if p.timeout > 0 => p.timeout,
            (Some(p), _) => p.interval,
            (None, _) => 0,
        };
        let ping = (ping > 0).then(|| now + Duration::from_secs(ping as u64));
        match (ping, self.logout_by) {
            (Some(p), Some(l)) => Some(p.min(l)),
            (p, l) => p.or(l),
        }
    }

    /// Waits for the PDU `r` receives, the ping or logout timer, or the
    /// start of a drain.
    async fn wait<F>(&mut self, mut r: Pin<&mut F>) -> Woken
    where
        F: Future<Output = Result<Received, ConnError>>,
    {
        let now = Instant::now();
        let due = self.due(now);
        if let Some(due) = due {
            // A timer armed for later than this wait's end is replaced; one
            // armed earlier is armed again when it fires.
            if !matches!(&self.timer, Some((at, _)) if *at <= due) {
                self.timer = Some((
                    due,
                    ustor_runtime::sleep(due.saturating_duration_since(now)),
                ));
            }
        }
        let watch = self.drain.as_ref().filter(|_| self.logout_by.is_none());
        let timer = &mut self.timer;
        std::future::poll_fn(|cx| {
            if let Poll::Ready(v) = r.as_mut().poll(cx) {
                return Poll::Ready(Woken::Pdu(v));
            }
            if let Some(Poll::Ready(g)) = watch.map(|w| w.poll_started(cx)) {
                return Poll::Ready(Woken::Drain(g));
            }
            let Some(due) = due else {
                return Poll::Pending;
            };
            // Budget: at most two rounds (an early timer is armed again
            // for `due`, which has not passed, so it stays pending).
            while let Some((_, t)) = timer.as_mut() {
                if Pin::new(t).poll(cx).is_pending() {
                    break;
                }
                let now = Instant::now();
                if now >= due {
                    *timer = None;
                    return Poll::Ready(Woken::Timer);
                }
                *timer = Some((
                    due,
                    ustor_runtime::sleep(due.saturating_duration_since(now)),
                ));
            }
            Poll::Pending
        })
        .await
    }

    /// The Async Message asking for a logout within `secs` (once).
    async fn ask_logout(&mut self, core: &Core, secs: u32) -> Result<(), ConnError> {
        self.logout_by = Some(Instant::now() + Duration::from_secs(secs as u64));
        let r = pdu::logout_request(secs.min(u16::MAX as u32) as u16, &core.tx.bump());
        core.tx.send(&r, &[]).await
    }

    /// A NOP-In asking for an answer: StatSN is the next one, not
    /// advanced (RFC 7143 §11.19).
    async fn ping(&mut self, core: &Core) -> Result<(), ConnError> {
        let ttt = core.ttt();
        self.ping_out = Some(ttt);
        let r = pdu::nop_in([0; 8], RESERVED_TAG, ttt, 0, &core.tx.seq());
        core.tx.send(&r, &[]).await
    }
}

//! Full feature phase of one connection (one connection per session):
//! the receive loop. It keeps the command window (ExpCmdSN/MaxCmdSN) and
//! serves each request PDU in turn: a SCSI Command becomes a task of its
//! own ([`crate::exec`]) so every command the window admits runs at once,
//! its status sent when it finishes; Data-Out goes to its task's mailbox;
//! NOP-Out, Text (SendTargets), Task Management (which aborts real tasks,
//! [`crate::tasks`]) and Logout are answered here; anything else is
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
use ustor_scsi_proto::lun::decode_lun;
use ustor_scsi_target::LunTable;

use crate::exec::{self, Core};
use crate::io::{ConnError, Received, Wire};
use crate::live::ConnCounters;
use crate::negotiate::Params;
use crate::pdu::{self, reject, tmf_response, Seq};
use crate::tx::Tx;

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
const SEND_TIMEOUT: Duration = Duration::from_secs(60);

/// Pings and the drain: what a wait for the next PDU watches.
#[derive(Default)]
struct Idle {
    pings: Option<Pings>,
    /// The Target Transfer Tag of the ping not answered yet.
    ping_out: Option<u32>,
    drain: Option<crate::drain::Watch>,
    /// When the initiator, asked to log out, is cut off.
    logout_by: Option<Instant>,
}

/// The session state one connection runs.
pub struct Session<'a, D: Discovery> {
    pub wire: Wire,
    core: Rc<Core>,
    /// A normal session (SCSI commands and TMFs served), not discovery.
    normal: bool,
    pub discovery: &'a D,
    pub initiator: String,
    pub queue_depth: u32,
    /// Text left to send after a Continue (SendTargets beyond one PDU).
    text_left: Vec<u8>,
    /// The data segment of the request being served (reused: NOP and
    /// Text payloads are copied here once).
    scratch: Vec<u8>,
    idle: Idle,
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
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        wire: Wire,
        params: Params,
        table: Option<LunTable>,
        discovery: &'a D,
        initiator: String,
        statsn: u32,
        exp_cmdsn: u32,
        queue_depth: u32,
    ) -> Session<'a, D> {
        let queue_depth = queue_depth.max(1);
        let seq = Seq {
            statsn,
            exp_cmdsn,
            max_cmdsn: exp_cmdsn.wrapping_add(queue_depth - 1),
        };
        let tx = Tx::new(
            wire.fd(),
            (wire.header_digest, wire.data_digest),
            SEND_TIMEOUT,
            seq,
        );
        let normal = table.is_some();
        Session {
            wire,
            core: Rc::new(Core::new(tx, params, table.unwrap_or_default())),
            normal,
            discovery,
            initiator,
            queue_depth,
            text_left: Vec::new(),
            scratch: Vec::new(),
            idle: Idle::default(),
        }
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
        if !matches!(r, Ok(End::Logout)) {
            self.core.tx.close();
            self.core.tasks.abort(|_| true);
        }
        self.core.tasks.ended(|_| true).await;
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
                let data = self.wire.data().to_vec();
                self.core.tasks.deliver(b.itt(), (b, data));
                continue;
            }
            if !self.admit(&b) {
                continue;
            }
            if b.opcode() == opcode::SCSI_CMD && self.normal {
                self.scsi(&b).await?;
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
    /// the window is dropped (RFC 7143 §4.2.2.1). A SCSI command keeps its
    /// slot of the window until it ends; other requests are answered at
    /// once and give theirs back.
    fn admit(&mut self, b: &Bhs) -> bool {
        let op = b.opcode();
        if op == opcode::DATA_OUT || op == 0x10 {
            return true;
        }
        let immediate = b.0[0] & 0x40 != 0;
        let cmdsn = b.u32_at(24);
        if immediate {
            return true;
        }
        let mut seq = self.core.tx.seq.get();
        let beyond = (cmdsn.wrapping_sub(seq.max_cmdsn) as i32) > 0;
        if cmdsn != seq.exp_cmdsn || beyond {
            tracing::debug!(
                "iscsi: CmdSN {cmdsn} outside the window [{}, {}]",
                seq.exp_cmdsn,
                seq.max_cmdsn
            );
            return false;
        }
        seq.exp_cmdsn = cmdsn.wrapping_add(1);
        if op != opcode::SCSI_CMD || !self.normal {
            seq.max_cmdsn = seq.max_cmdsn.wrapping_add(1);
        }
        self.core.tx.seq.set(seq);
        true
    }

    async fn dispatch(&mut self, b: &Bhs, data: &[u8]) -> Result<Option<End>, ConnError> {
        match b.opcode() {
            opcode::NOP_OUT => self.nop_out(b, data).await?,
            opcode::TEXT_REQ => self.text(b, data).await?,
            opcode::TMF_REQ if self.normal => self.tmf(b).await?,
            opcode::LOGOUT_REQ => {
                self.logout(b).await?;
                return Ok(Some(End::Logout));
            }
            _ => self.reject(b, reject::NOT_SUPPORTED).await?,
        }
        Ok(None)
    }

    /// Starts the command as a task of its own.
    async fn scsi(&mut self, b: &Bhs) -> Result<(), ConnError> {
        let Some(cmd) = exec::Command::parse(b, self.wire.data()) else {
            // Bidirectional commands are not offered.
            return self.reject(b, reject::NOT_SUPPORTED).await;
        };
        // COMPARE AND WRITE and ORWRITE read before they write: they run
        // alone in the session (as ORDERED) so none of its own writes
        // interleave (crates/scsi-target's rmw relies on it).
        let attr = match b.0[32] {
            0x89 | 0x8b => crate::tasks::attr::ORDERED,
            _ => b.flags() & 0x07,
        };
        let lun = decode_lun(cmd.info.lun);
        let windowed = b.0[0] & 0x40 == 0;
        let task = self.core.tasks.add(cmd.info.itt, lun, attr, windowed);
        ustor_runtime::spawn(exec::run(self.core.clone(), task, cmd));
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

    /// Task management on the running tasks; the answer leaves once the
    /// tasks it aborts have ended (RFC 7143 §11.5.1).
    async fn tmf(&mut self, b: &Bhs) -> Result<(), ConnError> {
        let function = b.flags() & 0x7f;
        let lun = decode_lun(b.lun());
        let core = self.core.clone();
        let tasks = &core.tasks;
        let response = match function {
            1 => {
                let rtt = b.u32_at(20);
                match tasks.find(rtt) {
                    Some(t) if t.lun == lun => {
                        tasks.abort(|x| x.itt == rtt);
                        tasks.ended(|x| x.itt == rtt).await;
                        tmf_response::COMPLETE
                    }
                    Some(_) => tmf_response::NO_TASK,
                    None => self.gone(b.u32_at(32)),
                }
            }
            2 | 3 => {
                tasks.abort(|t| t.lun == lun);
                tasks.ended(|t| t.lun == lun).await;
                tmf_response::COMPLETE
            }
            4 => tmf_response::COMPLETE,
            5 if core.table.get(lun).is_some() => {
                tasks.abort(|t| t.lun == lun);
                tasks.ended(|t| t.lun == lun).await;
                core.table.reset_lun(lun);
                tmf_response::COMPLETE
            }
            5 => tmf_response::NO_LUN,
            6 | 7 => {
                tasks.abort(|_| true);
                tasks.ended(|_| true).await;
                core.table.reset_all();
                tmf_response::COMPLETE
            }
            8 => tmf_response::NO_REASSIGN,
            _ => tmf_response::NOT_SUPPORTED,
        };
        let r = pdu::tmf(b.itt(), response, &core.tx.bump());
        core.tx.send(&r, &[]).await
    }

    /// ABORT TASK for a task not running: RFC 7143 §11.5.1 answers
    /// "complete" when its RefCmdSN is still in the window (not received
    /// yet), "task does not exist" when it is behind (it completed).
    fn gone(&self, ref_cmdsn: u32) -> u8 {
        let seq = self.core.tx.seq.get();
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

    /// The Logout Response, once every running task has answered.
    async fn logout(&mut self, b: &Bhs) -> Result<(), ConnError> {
        self.core.tasks.ended(|_| true).await;
        let tx = &self.core.tx;
        let r = pdu::logout(b.itt(), 0, self.core.params.time2wait as u16, 0, &tx.bump());
        tx.send(&r, &[]).await
    }
}

impl Idle {
    /// Waits for the PDU `r` receives, the ping or logout timer, or the
    /// start of a drain.
    async fn wait<F>(&self, mut r: Pin<&mut F>) -> Woken
    where
        F: Future<Output = Result<Received, ConnError>>,
    {
        let ping = match (self.pings, self.ping_out) {
            (Some(p), Some(_)) if p.timeout > 0 => p.timeout,
            (Some(p), _) => p.interval,
            (None, _) => 0,
        };
        let mut d = match ping {
            0 => Duration::from_secs(24 * 3600),
            s => Duration::from_secs(s as u64),
        };
        if let Some(t) = self.logout_by {
            d = d.min(t.saturating_duration_since(Instant::now()));
        }
        let watch = self.drain.as_ref().filter(|_| self.logout_by.is_none());
        let mut t = pin!(ustor_runtime::sleep(d));
        std::future::poll_fn(|cx| {
            if let Poll::Ready(v) = r.as_mut().poll(cx) {
                return Poll::Ready(Woken::Pdu(v));
            }
            if let Some(Poll::Ready(g)) = watch.map(|w| w.poll_started(cx)) {
                return Poll::Ready(Woken::Drain(g));
            }
            if t.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Woken::Timer);
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
        let r = pdu::nop_in([0; 8], RESERVED_TAG, ttt, 0, &core.tx.seq.get());
        core.tx.send(&r, &[]).await
    }
}

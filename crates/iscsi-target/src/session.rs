//! Full feature phase of one connection (one connection per session):
//! the command window (ExpCmdSN/MaxCmdSN), StatSN, and each request PDU
//! in turn — SCSI Command (executed by the SCSI target core on this
//! reactor's LUN table, data moved by [`crate::command`]), NOP-Out, Text
//! (SendTargets), Task Management, Logout. Anything else is rejected.
//! Commands run one at a time in CmdSN order, each to completion. An
//! idle connection is pinged with a NOP-In every `nop_in_interval`
//! seconds, and ends when a ping stays unanswered for `nop_timeout`. When
//! the target drains, the session asks its initiator to log out (Async
//! Message) and ends the connection once the grace time is over.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::pin;
use std::rc::Rc;
use std::task::Poll;
use std::time::{Duration, Instant};

use ustor_iscsi::wire::{opcode, Bhs, BHS_LEN, RESERVED_TAG};
use ustor_scsi_proto::lun::decode_lun;
use ustor_scsi_target::{Direction, LunTable, Outcome};

use crate::command::{last_is_data_in, CmdInfo, WireData};
use crate::io::{ConnError, Received, Wire};
use crate::live::ConnCounters;
use crate::negotiate::Params;
use crate::pdu::{self, reject, tmf_response, Seq};

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

/// The session state one connection runs.
pub struct Session<'a, D: Discovery> {
    pub wire: Wire,
    pub params: Params,
    pub table: Option<LunTable>,
    pub discovery: &'a D,
    pub initiator: String,
    pub queue_depth: u32,
    seq: Seq,
    deferred: VecDeque<(Bhs, Vec<u8>)>,
    next_ttt: u32,
    /// Text left to send after a Continue (SendTargets beyond one PDU).
    text_left: Vec<u8>,
    /// The data segment of the request being served (reused: immediate
    /// data and NOP/Text payloads are copied here once).
    scratch: Vec<u8>,
    /// This connection's command counters (`iscsi_get_connections`).
    counters: Rc<ConnCounters>,
    /// Pings on idle (none: never).
    pub pings: Option<Pings>,
    /// The Target Transfer Tag of the ping not answered yet.
    ping_out: Option<u32>,
    /// The target's shutdown signal (none: never drained).
    pub drain: Option<crate::drain::Watch>,
    /// When the initiator, asked to log out, is cut off.
    logout_by: Option<Instant>,
}

/// What ended a wait for the next PDU.
enum Woken {
    Readable(std::io::Result<()>),
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
        Session {
            wire,
            params,
            table,
            discovery,
            initiator,
            queue_depth,
            seq: Seq {
                statsn,
                exp_cmdsn,
                max_cmdsn: exp_cmdsn.wrapping_add(queue_depth - 1),
            },
            deferred: VecDeque::new(),
            next_ttt: 1,
            text_left: Vec::new(),
            scratch: Vec::new(),
            counters: Rc::default(),
            pings: None,
            ping_out: None,
            drain: None,
            logout_by: None,
        }
    }

    /// Counts the commands answered into `counters`.
    pub(crate) fn count_into(&mut self, counters: Rc<ConnCounters>) {
        self.counters = counters;
    }

    /// Returns when a PDU can be received. While the connection is idle
    /// the initiator is pinged; a ping unanswered for the timeout ends it,
    /// as does the end of a drain's grace time.
    async fn idle(&mut self) -> Result<(), ConnError> {
        let fd = self.wire.fd();
        // Budget: each round sends a ping or a logout request, or returns.
        loop {
            if self.logout_by.is_none() {
                if let Some(g) = self.drain.as_ref().and_then(|d| d.started()) {
                    self.ask_logout(g).await?;
                }
            }
            if self.logout_by.is_some_and(|t| Instant::now() >= t) {
                return Err(ConnError::Drained);
            }
            if ustor_net::recv::queued(fd) {
                return Ok(());
            }
            match self.wait(fd).await {
                Woken::Readable(r) => return r.map_err(ConnError::Io),
                Woken::Drain(g) => self.ask_logout(g).await?,
                Woken::Timer if self.logout_by.is_some_and(|t| Instant::now() >= t) => {
                    return Err(ConnError::Drained)
                }
                Woken::Timer => match (self.ping_out, self.pings) {
                    (Some(_), Some(p)) if p.timeout > 0 => {
                        return Err(ConnError::NopTimeout(p.timeout))
                    }
                    (_, Some(p)) if p.interval > 0 => self.ping().await?,
                    _ => {}
                },
            }
        }
    }

    /// Waits until the socket is readable, the ping or logout timer runs
    /// out, or the target starts draining.
    async fn wait(&self, fd: std::os::fd::RawFd) -> Woken {
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
        let mut r = pin!(ustor_net::recv::readable(fd));
        let mut t = pin!(ustor_runtime::sleep(d));
        std::future::poll_fn(|cx| {
            if let Poll::Ready(v) = r.as_mut().poll(cx) {
                return Poll::Ready(Woken::Readable(v));
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
    async fn ask_logout(&mut self, secs: u32) -> Result<(), ConnError> {
        self.logout_by = Some(Instant::now() + Duration::from_secs(secs as u64));
        let seq = self.bump();
        let r = pdu::logout_request(secs.min(u16::MAX as u32) as u16, &seq);
        self.wire.send(&r, &[]).await
    }

    /// The next PDU off the wire, pinging the initiator while it is idle.
    async fn next_pdu(&mut self) -> Result<Received, ConnError> {
        self.idle().await?;
        self.wire.recv().await
    }

    /// A NOP-In asking for an answer: StatSN is the next one, not
    /// advanced (RFC 7143 §11.19).
    async fn ping(&mut self) -> Result<(), ConnError> {
        let ttt = self.next_ttt;
        self.next_ttt = crate::command::next_tag(ttt);
        self.ping_out = Some(ttt);
        let r = pdu::nop_in([0; 8], RESERVED_TAG, ttt, 0, &self.seq);
        self.wire.send(&r, &[]).await
    }

    /// Serves requests until Logout or the connection ends.
    pub async fn run(&mut self) -> Result<End, ConnError> {
        loop {
            let (b, data) = match self.deferred.pop_front() {
                Some(p) => p,
                None => match self.next_pdu().await {
                    Ok(Received::Pdu(b)) => (b, Vec::new()),
                    Ok(Received::BadDataDigest(b)) => {
                        self.reject(&b, reject::DIGEST).await?;
                        continue;
                    }
                    Err(ConnError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        return Ok(End::Closed)
                    }
                    Err(e) => return Err(e),
                },
            };
            // A deferred PDU brought its data; otherwise it is in the wire's
            // buffer, copied into the reused scratch vector.
            let mut buf = std::mem::take(&mut self.scratch);
            buf.clear();
            buf.extend_from_slice(if data.is_empty() {
                self.wire.data()
            } else {
                &data
            });
            if !self.admit(&b) {
                self.scratch = buf;
                continue;
            }
            let end = self.dispatch(&b, &buf).await;
            self.scratch = buf;
            if let Some(end) = end? {
                return Ok(end);
            }
        }
    }

    /// CmdSN rules: a non-immediate request advances ExpCmdSN; one outside
    /// the window is dropped (RFC 7143 §4.2.2.1).
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
        if cmdsn != self.seq.exp_cmdsn {
            tracing::debug!(
                "iscsi: CmdSN {cmdsn} outside the window (expected {})",
                self.seq.exp_cmdsn
            );
            return false;
        }
        self.seq.exp_cmdsn = cmdsn.wrapping_add(1);
        self.seq.max_cmdsn = self.seq.exp_cmdsn.wrapping_add(self.queue_depth - 1);
        true
    }

    async fn dispatch(&mut self, b: &Bhs, data: &[u8]) -> Result<Option<End>, ConnError> {
        match b.opcode() {
            opcode::NOP_OUT => self.nop_out(b, data).await?,
            opcode::SCSI_CMD if self.table.is_some() => self.scsi(b, data).await?,
            opcode::TEXT_REQ => self.text(b, data).await?,
            opcode::TMF_REQ if self.table.is_some() => self.tmf(b).await?,
            opcode::LOGOUT_REQ => {
                self.logout(b).await?;
                return Ok(Some(End::Logout));
            }
            // A Data-Out nobody waits for: its task is gone (ERL 0 drops it).
            opcode::DATA_OUT => {}
            _ => self.reject(b, reject::NOT_SUPPORTED).await?,
        }
        Ok(None)
    }

    fn bump(&mut self) -> Seq {
        let s = self.seq;
        self.seq.statsn = self.seq.statsn.wrapping_add(1);
        s
    }

    async fn reject(&mut self, b: &Bhs, reason: u8) -> Result<(), ConnError> {
        let seq = self.bump();
        let r = pdu::reject(reason, &seq);
        self.wire.send(&r, &b.0[..BHS_LEN]).await
    }

    async fn nop_out(&mut self, b: &Bhs, data: &[u8]) -> Result<(), ConnError> {
        if b.itt() == RESERVED_TAG {
            // The answer to our ping: nothing to send.
            if self.ping_out == Some(b.u32_at(20)) {
                self.ping_out = None;
            }
            return Ok(());
        }
        let seq = self.bump();
        let n = data.len().min(self.params.max_send_data as usize);
        let r = pdu::nop_in(b.lun(), b.itt(), RESERVED_TAG, n, &seq);
        self.wire.send(&r, &data[..n]).await
    }

    async fn scsi(&mut self, b: &Bhs, data: &[u8]) -> Result<(), ConnError> {
        let f = b.flags();
        let (read, write) = (f & 0x40 != 0, f & 0x20 != 0);
        let edtl = b.u32_at(20);
        let info = CmdInfo {
            lun: b.lun(),
            itt: b.itt(),
            edtl: if read || write { edtl } else { 0 },
            dir: match (read, write) {
                (true, false) => Direction::FromDevice,
                (false, true) => Direction::ToDevice,
                _ => Direction::None,
            },
            immediate: if write {
                data.len().min(edtl as usize) as u32
            } else {
                0
            },
            unsolicited: write && f & 0x80 == 0,
        };
        if read && write {
            // Bidirectional commands are not offered.
            return self.reject(b, reject::NOT_SUPPORTED).await;
        }
        let mut cdb = [0u8; 16];
        cdb.copy_from_slice(&b.0[32..48]);
        let lun = decode_lun(b.lun());
        let table = self.table.take().expect("normal session");
        let (res, sent, seq_error) = {
            let mut wd = WireData::new(
                &mut self.wire,
                &mut self.deferred,
                &mut self.seq,
                &self.params,
                &mut self.next_ttt,
                info,
                data,
            );
            let mut res = table.execute(lun, &cdb, &mut wd).await;
            if res.is_ok() && info.dir == Direction::ToDevice {
                if let Err(e) = wd.drain().await {
                    res = Err(e);
                }
            }
            (res, wd.sent(), wd.sequence_error())
        };
        let want = wanted_len(&table, lun, &cdb);
        self.table = Some(table);
        let mut outcome = res.map_err(|_| ConnError::Protocol("data phase failed"))?;
        let written = match info.dir {
            Direction::ToDevice if !seq_error => info.edtl,
            _ => 0,
        };
        self.counters.note(u64::from(sent), u64::from(written));
        if seq_error {
            // A Data-Out out of DataSN order: the command ends ABORTED
            // COMMAND (nothing of its data written), the session goes on.
            outcome = Outcome::check(
                ustor_scsi_proto::SenseKey::AbortedCommand,
                DATA_PHASE_ERROR,
                info.edtl,
            );
        }
        self.respond(&info, outcome, sent, want).await
    }

    /// Status: in the last Data-In when there is one and no sense to send,
    /// otherwise a SCSI Response (with the sense as its data).
    async fn respond(
        &mut self,
        info: &CmdInfo,
        o: Outcome,
        sent: u32,
        want: Option<u64>,
    ) -> Result<(), ConnError> {
        let edtl = info.edtl as u64;
        let resid = match want {
            // The command wanted more than the initiator expected: overflow.
            Some(w) if o.status.is_good() && w > edtl => {
                Some((true, (w - edtl).min(u32::MAX as u64) as u32))
            }
            // A write that wanted less: underflow.
            Some(w) if o.status.is_good() && w < edtl && info.dir == Direction::ToDevice => {
                Some((false, (edtl - w) as u32))
            }
            _ => residual(info, &o, sent),
        };
        let status = o.status.as_u8();
        if let (Some(mut last), None) = (last_is_data_in(&self.wire, info.itt), o.sense) {
            let seq = self.bump();
            let n = last.data_len();
            let patched = pdu::data_in(
                info.lun,
                info.itt,
                true,
                Some((status, resid)),
                last.u32_at(36),
                last.u32_at(40),
                n,
                &seq,
            );
            last = patched;
            self.wire.patch_last(&last);
            return self.wire.flush().await;
        }
        if let Some(mut last) = last_is_data_in(&self.wire, info.itt) {
            last.0[1] |= 0x80;
            self.wire.patch_last(&last);
        }
        let seq = self.bump();
        let mut sense = [0u8; 2 + ustor_scsi_proto::sense::DESCRIPTOR_SENSE_MAX];
        let n = match o.sense {
            Some(s) if s.descriptor => {
                let mut d = [0u8; ustor_scsi_proto::sense::DESCRIPTOR_SENSE_MAX];
                let len = s.encode_descriptor(o.field, &mut d);
                sense[..2].copy_from_slice(&(len as u16).to_be_bytes());
                sense[2..2 + len].copy_from_slice(&d[..len]);
                2 + len
            }
            Some(s) => {
                let mut fixed = [0u8; 18];
                let len = s.encode_fixed(&mut fixed);
                if let Some(f) = o.field {
                    f.encode(&mut fixed);
                }
                sense[..2].copy_from_slice(&(len as u16).to_be_bytes());
                sense[2..2 + len].copy_from_slice(&fixed[..len]);
                2 + len
            }
            None => 0,
        };
        let mut r = pdu::scsi_response(info.itt, status, resid, &seq);
        r.set_data_len(n);
        self.wire.send(&r, &sense[..n]).await
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
        let max = self.params.max_send_data as usize;
        let n = self.text_left.len().min(max);
        let chunk: Vec<u8> = self.text_left.drain(..n).collect();
        let more = !self.text_left.is_empty();
        let ttt = if more { self.next_ttt } else { RESERVED_TAG };
        let seq = self.bump();
        let r = pdu::text(b.itt(), more, ttt, chunk.len(), &seq);
        self.wire.send(&r, &chunk).await
    }

    async fn tmf(&mut self, b: &Bhs) -> Result<(), ConnError> {
        let function = b.flags() & 0x7f;
        let lun = decode_lun(b.lun());
        let table = self.table.as_ref().expect("normal session");
        let response = match function {
            // Commands run to completion one at a time, so the referenced
            // task is never running: RFC 7143 §11.5.1 answers "complete"
            // when its RefCmdSN is still in the window (not received yet),
            // "task does not exist" when it is behind (it completed).
            1 => {
                let ref_cmdsn = b.u32_at(32);
                let ahead = ref_cmdsn.wrapping_sub(self.seq.exp_cmdsn);
                let window = self.seq.max_cmdsn.wrapping_sub(self.seq.exp_cmdsn);
                if ahead <= window {
                    tmf_response::COMPLETE
                } else {
                    tmf_response::NO_TASK
                }
            }
            2..=4 => tmf_response::COMPLETE,
            5 if table.reset_lun(lun) => tmf_response::COMPLETE,
            5 => tmf_response::NO_LUN,
            6 | 7 => {
                table.reset_all();
                tmf_response::COMPLETE
            }
            8 => tmf_response::NO_REASSIGN,
            _ => tmf_response::NOT_SUPPORTED,
        };
        let seq = self.bump();
        let r = pdu::tmf(b.itt(), response, &seq);
        self.wire.send(&r, &[]).await
    }

    async fn logout(&mut self, b: &Bhs) -> Result<(), ConnError> {
        let seq = self.bump();
        let r = pdu::logout(b.itt(), 0, self.params.time2wait as u16, 0, &seq);
        self.wire.send(&r, &[]).await
    }
}

/// DATA PHASE ERROR (ASC, ASCQ).
const DATA_PHASE_ERROR: (u8, u8) = (0x4b, 0x00);

/// Bytes a READ or WRITE moves by its CDB (for its residual); `None` for
/// other commands.
fn wanted_len(table: &LunTable, lun: u64, cdb: &[u8; 16]) -> Option<u64> {
    use ustor_scsi_proto::cdb::Command;
    let lu = table.get(lun)?;
    match Command::parse(cdb).ok()? {
        c @ (Command::Read { .. } | Command::Write { .. } | Command::WriteAndVerify { .. }) => {
            Some(c.transfer_len(lu.channel().block_size()))
        }
        _ => None,
    }
}

/// The residual to report: what the command moved against what the
/// initiator expected.
fn residual(info: &CmdInfo, o: &Outcome, sent: u32) -> Option<(bool, u32)> {
    if info.edtl == 0 {
        return None;
    }
    let moved = match info.dir {
        Direction::FromDevice => sent,
        _ => info.edtl.saturating_sub(o.resid),
    };
    let r = info.edtl.saturating_sub(moved).max(o.resid);
    (r > 0).then_some((false, r))
}

//! The session's state machine, without sockets (select apart from apply):
//! the task table, the receive machine that tells the socket loop where the
//! next bytes go (a header buffer, or the command's own buffer for Data-In)
//! and acts on each complete PDU, and the send machine that lays the next
//! PDUs out as iovecs (header + the command's buffer). The socket loops in
//! `initiator` and the fuzz target drive the same code.
//!
//! Everything is preallocated at login: tasks, queues, the header buffer
//! and a scratch buffer for the data of non-Data-In PDUs (sense, NOP-In
//! pings, reject). A malformed or unexpected PDU is an [`RxError`]: the
//! caller fails the connection and reinstates the session (RFC 7143 §7.8,
//! the simplest allowed recovery).

use std::collections::VecDeque;

use ustor_scsi::lld::{Tag, TransportError};
use ustor_scsi::ScsiStatus;

use crate::task::{Burst, Task, TaskState, SENSE_MAX};
use crate::wire::{build, opcode, pad4, Bhs, TargetPdu, WireError, BHS_LEN, RESERVED_TAG};

/// Largest header: BHS, 255 words of AHS, header digest.
const HDR_MAX: usize = BHS_LEN + 255 * 4 + 4;
/// PDUs the sender lays out per `writev`.
pub const TX_BATCH: usize = 8;
/// iovecs one receive uses: the task's segments, pad/digest, next header.
pub const RX_IOVS: usize = crate::MAX_SEGS + 2;
/// iovecs one send uses: per PDU header, data segments, pad/digest.
pub const TX_IOVS: usize = TX_BATCH * (crate::MAX_SEGS + 2);
/// Low 16 bits of our own ITTs (pings, TMFs): above any mid-layer slot.
pub const ITT_PING: u32 = 0xfffe;
pub const ITT_TMF: u32 = 0xfffd;
/// Most tasks (the low 16 bits of an ITT are the slot; 0xfffx are ours).
pub const MAX_TASKS: usize = 4096;

/// Why the receive side gives up on the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RxError {
    #[error("{0}")]
    Wire(#[from] WireError),
    #[error("PDU for unknown or finished task {0:#x}")]
    UnknownTask(u32),
    #[error("data beyond the task's buffer (offset {offset}, length {len}, buffer {size})")]
    Overrun { offset: u32, len: u32, size: u32 },
    #[error("R2T the task cannot take")]
    BadR2t,
    #[error("data segment of {0} bytes on a PDU that carries none")]
    UnexpectedData(usize),
    #[error("peer closed the connection")]
    Eof,
}

/// Values in force for the connection.
#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub header_digest: bool,
    pub data_digest: bool,
    pub immediate_data: bool,
    pub initial_r2t: bool,
    pub first_burst: u32,
    pub max_burst: u32,
    /// Largest data segment we send (the target's MaxRecvDataSegmentLength).
    pub max_send_seg: u32,
    /// Largest data segment we accept (ours).
    pub max_recv_seg: u32,
}

/// Counters shown by `scsi_get_hosts` (`info.stats`).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Stats {
    pub pdus_rx: u64,
    pub pdus_tx: u64,
    pub data_in_bytes: u64,
    pub data_out_bytes: u64,
    pub immediate_bytes: u64,
    pub r2ts: u64,
    pub pings_sent: u64,
    pub pings_answered: u64,
    pub target_nops_answered: u64,
    pub keepalive_timeouts: u64,
    pub header_digest_errors: u64,
    pub data_digest_errors: u64,
    pub protocol_errors: u64,
    pub connection_failures: u64,
    pub reinstatements: u64,
    pub reinstatement_failures: u64,
    /// Half-sent PDUs whose command went away (their rest was copied).
    pub spills: u64,
}

/// Where the receive machine is in the current PDU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RxPhase {
    /// BHS, AHS and header digest into `hdr`.
    Header,
    /// The data segment, into a task's buffer or `scratch`.
    Data,
    /// Padding and data digest into `tail`.
    Tail,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dest {
    Task(u16),
    Scratch,
}

/// One PDU laid out for sending.
#[derive(Clone, Copy)]
struct TxPdu {
    hdr: [u8; BHS_LEN + 4],
    hlen: usize,
    /// Data from a task's buffer (slot, offset, length), or from `spill`.
    slot: Option<u16>,
    off: u32,
    len: u32,
    spilled: bool,
    tail: [u8; 8],
    tlen: usize,
    sent: usize,
}

impl TxPdu {
    fn total(&self) -> usize {
        self.hlen + self.len as usize + self.tlen
    }
}

/// The session state of one connection.
pub struct State {
    pub p: Params,
    pub tasks: Vec<Task>,
    pub cmdsn: u32,
    pub expstatsn: u32,
    pub maxcmdsn: u32,
    /// Tasks with output for the sender (each at most once).
    ready: VecDeque<u16>,
    /// Immediate control PDUs (NOP-Out, TMF), sent before task PDUs.
    ctl: VecDeque<Bhs>,
    staged: [Option<TxPdu>; TX_BATCH],
    nstaged: usize,
    spill: Vec<u8>,
    /// Finished tasks to report: (slot, tag).
    pub done: VecDeque<(u16, Tag)>,
    // Receive machine.
    hdr: Box<[u8; HDR_MAX]>,
    hgot: usize,
    hwant: usize,
    phase: RxPhase,
    cur: Bhs,
    dest: Dest,
    doff: usize,
    dlen: usize,
    dgot: usize,
    tail: [u8; 8],
    tgot: usize,
    twant: usize,
    crc: u32,
    scratch: Vec<u8>,
    /// Our outstanding ping (ITT), answered when its NOP-In comes.
    pub ping_itt: Option<u32>,
    /// TMF responses: (ITT, response).
    pub tmf_resp: Option<(u32, u8)>,
    /// Received bytes since the keep-alive last looked.
    pub rx_seen: bool,
    /// Tasks in the Active state.
    nactive: usize,
    pub stats: Stats,
}

fn push_iov(out: &mut [libc::iovec; RX_IOVS], n: &mut usize, p: *mut u8, len: usize) {
    if len > 0 && *n < RX_IOVS {
        out[*n] = libc::iovec {
            iov_base: p.cast(),
            iov_len: len,
        };
        *n += 1;
    }
}

fn ahs_and_digest(b: &Bhs, hd: bool) -> usize {
    BHS_LEN + b.ahs_len() + if hd { 4 } else { 0 }
}

impl State {
    /// Preallocates everything for `ntasks` tasks.
    pub fn new(p: Params, ntasks: usize, cmdsn: u32, expstatsn: u32, maxcmdsn: u32) -> State {
        let ntasks = ntasks.clamp(1, MAX_TASKS);
        State {
            p,
            tasks: (0..ntasks).map(|_| Task::default()).collect(),
            cmdsn,
            expstatsn,
            maxcmdsn,
            ready: VecDeque::with_capacity(ntasks),
            ctl: VecDeque::with_capacity(16),
            staged: [None; TX_BATCH],
            nstaged: 0,
            spill: Vec::with_capacity(p.max_send_seg as usize + 8),
            done: VecDeque::with_capacity(ntasks),
            hdr: Box::new([0; HDR_MAX]),
            hgot: 0,
            hwant: BHS_LEN + if p.header_digest { 4 } else { 0 },
            phase: RxPhase::Header,
            cur: Bhs::default(),
            dest: Dest::Scratch,
            doff: 0,
            dlen: 0,
            dgot: 0,
            tail: [0; 8],
            tgot: 0,
            twant: 0,
            crc: 0,
            scratch: vec![0; p.max_recv_seg as usize],
            ping_itt: None,
            tmf_resp: None,
            rx_seen: false,
            nactive: 0,
            stats: Stats::default(),
        }
    }

    /// A new connection (session reinstatement): new values and sequence
    /// numbers, receive and send machines at rest; tasks must already be
    /// failed or dropped.
    pub fn reset_conn(&mut self, p: Params, cmdsn: u32, expstatsn: u32, maxcmdsn: u32) {
        debug_assert!(self.tasks.iter().all(|t| t.state != TaskState::Active));
        self.reset_tx();
        if p.max_recv_seg != self.p.max_recv_seg {
            self.scratch = vec![0; p.max_recv_seg as usize];
        }
        if p.max_send_seg > self.p.max_send_seg {
            self.spill = Vec::with_capacity(p.max_send_seg as usize + 8);
        }
        self.p = p;
        (self.cmdsn, self.expstatsn, self.maxcmdsn) = (cmdsn, expstatsn, maxcmdsn);
        self.phase = RxPhase::Header;
        self.hgot = 0;
        self.hwant = BHS_LEN + if p.header_digest { 4 } else { 0 };
        self.ping_itt = None;
        self.tmf_resp = None;
    }

    fn update_sn(&mut self, statsn: Option<u32>, maxcmdsn: u32) {
        if let Some(s) = statsn {
            self.expstatsn = s.wrapping_add(1);
        }
        if (maxcmdsn.wrapping_sub(self.maxcmdsn) as i32) > 0 {
            self.maxcmdsn = maxcmdsn;
        }
    }

    /// Commands sent (or queued) and not answered yet.
    pub fn outstanding(&self) -> usize {
        self.nactive
    }

    /// Whether the target's command window (MaxCmdSN) is open.
    pub fn window_open(&self) -> bool {
        (self.cmdsn.wrapping_sub(self.maxcmdsn) as i32) <= 0
    }

    // ---- commands -------------------------------------------------------

    /// Starts a command in its slot; the sender will carry it (with
    /// immediate and unsolicited data as negotiated). `None` if the slot is
    /// out of range or busy.
    pub fn start(&mut self, cmd: &ustor_scsi::lld::ScsiCmd) -> Option<()> {
        let slot = (cmd.tag & 0xffff) as usize;
        let (p, cmdsn, expstatsn) = (self.p, self.cmdsn, self.expstatsn);
        let t = self.tasks.get_mut(slot)?;
        if t.state != TaskState::Free {
            return None;
        }
        let read = cmd.dir == ustor_scsi::lld::DataDir::FromDevice;
        let write = cmd.dir == ustor_scsi::lld::DataDir::ToDevice;
        let lun = ustor_scsi::lun::encode_lun(cmd.nexus.lun);
        t.bhs = build::scsi_cmd(
            lun,
            cmd.tag,
            cmd.cdb.as_bytes(),
            read,
            write,
            cmd.data_len,
            cmdsn,
            expstatsn,
        );
        t.tag = cmd.tag;
        t.state = TaskState::Active;
        t.lun = lun;
        t.lun_no = cmd.nexus.lun;
        t.cmdsn = cmdsn;
        t.iov = cmd.iov;
        t.iovcnt = cmd.iovcnt.min(crate::MAX_SEGS);
        // Never trust a length the iovecs do not cover.
        let covered: usize = t.iovecs().iter().map(|v| v.iov_len).sum();
        t.data_len = cmd.data_len.min(covered.min(u32::MAX as usize) as u32);
        t.read = read;
        t.write = write;
        t.received = 0;
        t.resid = 0;
        t.sense_len = 0;
        t.out = None;
        t.next_r2t = None;
        t.imm = 0;
        if write && cmd.data_len > 0 {
            let unsol = if p.initial_r2t {
                0
            } else {
                cmd.data_len.min(p.first_burst)
            };
            if p.immediate_data {
                t.imm = cmd.data_len.min(p.first_burst).min(p.max_send_seg);
            }
            if unsol > t.imm {
                t.out = Some(Burst {
                    ttt: RESERVED_TAG,
                    off: t.imm,
                    end: unsol,
                    datasn: 0,
                });
                // F clear: unsolicited Data-Out PDUs follow.
                t.bhs.0[1] &= !0x80;
            }
            t.bhs.set_data_len(t.imm as usize);
        }
        t.cmd_pending = true;
        self.nactive += 1;
        self.cmdsn = cmdsn.wrapping_add(1);
        self.enqueue(slot as u16);
        Some(())
    }

    fn enqueue(&mut self, slot: u16) {
        let t = &mut self.tasks[slot as usize];
        if !t.queued {
            t.queued = true;
            self.ready.push_back(slot);
        }
    }

    /// Finishes a task: it waits in `done` for `poll`.
    fn finish(&mut self, slot: u16, status: Result<ScsiStatus, TransportError>, resid: u32) {
        self.release_tx(slot);
        let t = &mut self.tasks[slot as usize];
        debug_assert_eq!(t.state, TaskState::Active);
        self.nactive -= 1;
        t.state = TaskState::Done;
        t.status = status;
        t.resid = resid;
        t.out = None;
        t.next_r2t = None;
        t.cmd_pending = false;
        self.done.push_back((slot, t.tag));
    }

    /// Drops a task without reporting it (successful abort / reset).
    pub fn drop_task(&mut self, slot: u16) {
        self.release_tx(slot);
        if self.tasks[slot as usize].state == TaskState::Active {
            self.nactive -= 1;
        }
        self.tasks[slot as usize].clear();
    }

    /// The slot of an active task with this tag.
    pub fn active_slot(&self, tag: Tag) -> Option<u16> {
        let slot = (tag & 0xffff) as usize;
        let t = self.tasks.get(slot)?;
        (t.state == TaskState::Active && t.tag == tag).then_some(slot as u16)
    }

    /// Fails every active task with `why` (connection lost): the mid-layer
    /// decides about retries. Output state is dropped with the connection.
    pub fn fail_all(&mut self, why: TransportError) {
        self.reset_tx();
        for i in 0..self.tasks.len() {
            if self.tasks[i].state == TaskState::Active {
                self.finish(i as u16, Err(why), 0);
            }
        }
    }

    /// Drops everything, reported or not (host reset).
    pub fn drop_all(&mut self) {
        self.reset_tx();
        for t in &mut self.tasks {
            t.clear();
        }
        self.nactive = 0;
        self.done.clear();
    }

    /// Takes the next finished task: (tag, status, resid), its sense copied
    /// into `sense`; the slot is free again.
    pub fn take_done(
        &mut self,
        sense: &mut [u8; SENSE_MAX],
    ) -> Option<(Tag, Result<ScsiStatus, TransportError>, u32, usize)> {
        while let Some((slot, tag)) = self.done.pop_front() {
            let t = &mut self.tasks[slot as usize];
            // Dropped by an abort or reset after it finished: not reported.
            if t.state != TaskState::Done || t.tag != tag {
                continue;
            }
            let n = t.sense_len.min(SENSE_MAX);
            sense[..n].copy_from_slice(&t.sense[..n]);
            let r = (tag, t.status, t.resid, n);
            t.clear();
            return Some(r);
        }
        None
    }

    // ---- control PDUs ---------------------------------------------------

    /// Queues an immediate control PDU (ping, NOP answer, TMF).
    pub fn send_ctl(&mut self, b: Bhs) {
        self.ctl.push_back(b);
    }

    /// A NOP-Out ping; returns its ITT.
    pub fn ping(&mut self, seq: u16) -> u32 {
        let itt = (seq as u32) << 16 | ITT_PING;
        let b = build::nop_out([0; 8], itt, RESERVED_TAG, self.cmdsn, self.expstatsn);
        self.send_ctl(b);
        self.ping_itt = Some(itt);
        self.stats.pings_sent += 1;
        itt
    }

    // ---- receive --------------------------------------------------------

    /// Where the next received bytes go: fills `out`, returns the count
    /// (at least one, never zero-length).
    pub fn rx_iovecs(&mut self, out: &mut [libc::iovec; RX_IOVS]) -> usize {
        let mut n = 0;
        match self.phase {
            RxPhase::Header => {
                let p = self.hdr[self.hgot..].as_mut_ptr();
                push_iov(out, &mut n, p, self.hwant - self.hgot);
                return n;
            }
            RxPhase::Data => {
                let (a, b) = (self.doff + self.dgot, self.doff + self.dlen);
                match self.dest {
                    Dest::Task(slot) => {
                        let t = &self.tasks[slot as usize];
                        n = t.slices(a..b, &mut out[..crate::MAX_SEGS]).0;
                    }
                    Dest::Scratch => {
                        let p = self.scratch[a..].as_mut_ptr();
                        push_iov(out, &mut n, p, b - a);
                    }
                }
                let p = self.tail.as_mut_ptr();
                push_iov(out, &mut n, p, self.twant);
            }
            RxPhase::Tail => {
                let p = self.tail[self.tgot..].as_mut_ptr();
                push_iov(out, &mut n, p, self.twant - self.tgot);
            }
        }
        // Look ahead: the next PDU's BHS (+ header digest) lands in place.
        let p = self.hdr.as_mut_ptr();
        let hd = if self.p.header_digest { 4 } else { 0 };
        push_iov(out, &mut n, p, BHS_LEN + hd);
        n
    }

    /// Takes `n` bytes that arrived where [`State::rx_iovecs`] said.
    pub fn rx_advance(&mut self, mut n: usize) -> Result<(), RxError> {
        if n == 0 {
            return Err(RxError::Eof);
        }
        self.rx_seen = true;
        while n > 0 || self.rx_step_ready() {
            match self.phase {
                RxPhase::Header => {
                    // Look-ahead bytes already sit at hdr[0..]: only count.
                    let k = n.min(self.hwant - self.hgot);
                    self.hgot += k;
                    n -= k;
                    if self.hgot < self.hwant {
                        debug_assert_eq!(n, 0);
                        return Ok(());
                    }
                    if self.header_done()? {
                        continue;
                    }
                }
                RxPhase::Data => {
                    let k = n.min(self.dlen - self.dgot);
                    if self.p.data_digest && k > 0 {
                        let r = self.doff + self.dgot..self.doff + self.dgot + k;
                        self.crc = match self.dest {
                            Dest::Task(s) => self.tasks[s as usize].crc(self.crc, r),
                            Dest::Scratch => crc32c::crc32c_append(self.crc, &self.scratch[r]),
                        };
                    }
                    self.dgot += k;
                    n -= k;
                    if self.dgot < self.dlen {
                        // A short read ends inside the data: the tail and
                        // look-ahead iovecs got nothing.
                        return Ok(());
                    }
                    self.phase = RxPhase::Tail;
                    // Data and tail were read together: tail bytes start at
                    // tail[0] already.
                }
                RxPhase::Tail => {
                    let k = n.min(self.twant - self.tgot);
                    self.tgot += k;
                    n -= k;
                    if self.tgot < self.twant {
                        return Ok(());
                    }
                    // Whatever is left was read into hdr[0..] (look-ahead).
                    self.pdu_done()?;
                }
            }
            if n == 0 && !self.rx_step_ready() {
                break;
            }
        }
        Ok(())
    }

    /// A phase with nothing left to read (empty data or tail) can advance
    /// without bytes.
    fn rx_step_ready(&self) -> bool {
        match self.phase {
            RxPhase::Header => false,
            RxPhase::Data => self.dgot == self.dlen,
            RxPhase::Tail => self.tgot == self.twant,
        }
    }

    /// The header is complete (or needs its AHS): returns true when the
    /// machine moved on.
    fn header_done(&mut self) -> Result<bool, RxError> {
        let hd = self.p.header_digest;
        let b = Bhs::from_slice(&self.hdr[..BHS_LEN])?;
        let want = ahs_and_digest(&b, hd);
        if self.hwant < want {
            // The AHS is longer than the first read: read the rest.
            self.hwant = want;
            return Ok(false);
        }
        if hd {
            let at = BHS_LEN + b.ahs_len();
            let got = u32::from_le_bytes([
                self.hdr[at],
                self.hdr[at + 1],
                self.hdr[at + 2],
                self.hdr[at + 3],
            ]);
            if crc32c::crc32c(&self.hdr[..at]) != got {
                self.stats.header_digest_errors += 1;
                return Err(WireError::HeaderDigest.into());
            }
        }
        self.stats.pdus_rx += 1;
        self.cur = b;
        self.hgot = 0;
        self.hwant = BHS_LEN + if hd { 4 } else { 0 };
        let dlen = b.data_len();
        if dlen > self.p.max_recv_seg as usize {
            return Err(WireError::TooLarge(dlen).into());
        }
        self.dest = Dest::Scratch;
        self.doff = 0;
        if b.opcode() == opcode::DATA_IN && dlen > 0 {
            let itt = b.itt();
            let slot = self.active_slot(itt).ok_or(RxError::UnknownTask(itt))?;
            let t = &self.tasks[slot as usize];
            let offset = b.u32_at(40);
            if !t.read || offset as u64 + dlen as u64 > t.data_len as u64 {
                return Err(RxError::Overrun {
                    offset,
                    len: dlen as u32,
                    size: if t.read { t.data_len } else { 0 },
                });
            }
            self.dest = Dest::Task(slot);
            self.doff = offset as usize;
        }
        self.dlen = dlen;
        self.dgot = 0;
        self.tgot = 0;
        self.twant = pad4(dlen) - dlen + if self.p.data_digest && dlen > 0 { 4 } else { 0 };
        self.crc = 0;
        self.phase = RxPhase::Data;
        Ok(true)
    }

    /// The whole PDU is in: check the data digest, act on it.
    fn pdu_done(&mut self) -> Result<(), RxError> {
        let pad = pad4(self.dlen) - self.dlen;
        if self.p.data_digest && self.dlen > 0 {
            let crc = crc32c::crc32c_append(self.crc, &self.tail[..pad]);
            let got = u32::from_le_bytes([
                self.tail[pad],
                self.tail[pad + 1],
                self.tail[pad + 2],
                self.tail[pad + 3],
            ]);
            if crc != got {
                self.stats.data_digest_errors += 1;
                return Err(WireError::DataDigest.into());
            }
        }
        self.phase = RxPhase::Header;
        let b = self.cur;
        self.on_pdu(&b)
    }

    /// Acts on one complete target PDU (its data is in the task's buffer or
    /// in `scratch[..dlen]`).
    fn on_pdu(&mut self, b: &Bhs) -> Result<(), RxError> {
        let pdu = TargetPdu::decode(b)?;
        let dlen = self.dlen;
        match pdu {
            TargetPdu::DataIn {
                itt,
                status,
                statsn,
                maxcmdsn,
                residual,
                underflow,
                ..
            } => {
                let slot = self.active_slot(itt).ok_or(RxError::UnknownTask(itt))?;
                let t = &mut self.tasks[slot as usize];
                if dlen > 0 && !t.read {
                    return Err(RxError::UnexpectedData(dlen));
                }
                t.received = t.received.saturating_add(dlen as u32);
                self.stats.data_in_bytes += dlen as u64;
                if let Some(st) = status {
                    self.update_sn(Some(statsn), maxcmdsn);
                    let resid = if underflow { residual } else { 0 };
                    self.finish(slot, Ok(ScsiStatus::from_u8(st)), resid);
                } else {
                    self.update_sn(None, maxcmdsn);
                }
            }
            TargetPdu::ScsiResponse {
                itt,
                response,
                status,
                statsn,
                maxcmdsn,
                residual,
                underflow,
            } => {
                self.update_sn(Some(statsn), maxcmdsn);
                let slot = self.active_slot(itt).ok_or(RxError::UnknownTask(itt))?;
                let data = &self.scratch[..dlen];
                let t = &mut self.tasks[slot as usize];
                if data.len() >= 2 {
                    let n = (u16::from_be_bytes([data[0], data[1]]) as usize)
                        .min(data.len() - 2)
                        .min(SENSE_MAX);
                    t.sense[..n].copy_from_slice(&data[2..2 + n]);
                    t.sense_len = n;
                }
                let status = if response == 0 {
                    Ok(ScsiStatus::from_u8(status))
                } else {
                    Err(TransportError::Protocol("target failure response"))
                };
                self.finish(slot, status, if underflow { residual } else { 0 });
            }
            TargetPdu::R2t {
                itt,
                ttt,
                maxcmdsn,
                offset,
                len,
                ..
            } => {
                self.update_sn(None, maxcmdsn);
                self.on_r2t(itt, ttt, offset, len)?;
            }
            TargetPdu::NopIn {
                itt,
                ttt,
                statsn,
                maxcmdsn,
            } => {
                // StatSN advances only on the answer to our ping; an
                // unsolicited NOP-In (ITT reserved) carries the next one
                // without using it (RFC 7143 §11.19.3).
                if itt != RESERVED_TAG {
                    self.update_sn(Some(statsn), maxcmdsn);
                    if self.ping_itt == Some(itt) {
                        self.ping_itt = None;
                        self.stats.pings_answered += 1;
                    }
                } else if ttt != RESERVED_TAG {
                    self.update_sn(None, maxcmdsn);
                    // The target pings us: echo its TTT.
                    let nop =
                        build::nop_out(b.lun(), RESERVED_TAG, ttt, self.cmdsn, self.expstatsn);
                    self.send_ctl(nop);
                    self.stats.target_nops_answered += 1;
                } else {
                    self.update_sn(None, maxcmdsn);
                }
            }
            TargetPdu::TmfResponse {
                itt,
                response,
                statsn,
                maxcmdsn,
            } => {
                self.update_sn(Some(statsn), maxcmdsn);
                self.tmf_resp = Some((itt, response));
            }
            TargetPdu::Async {
                statsn,
                maxcmdsn,
                event,
            } => {
                self.update_sn(Some(statsn), maxcmdsn);
                tracing::info!("iscsi: async event {event}");
            }
            TargetPdu::Reject { reason, statsn } => {
                self.update_sn(Some(statsn), self.maxcmdsn);
                tracing::warn!("iscsi: reject reason {reason:#x}");
            }
            TargetPdu::LogoutResponse { statsn, .. } => {
                self.update_sn(Some(statsn), self.maxcmdsn);
            }
            // Login and text responses have no place in full feature phase.
            TargetPdu::LoginResponse { .. } | TargetPdu::TextResponse { .. } => {
                return Err(WireError::Opcode(b.opcode()).into())
            }
        }
        Ok(())
    }

    fn on_r2t(&mut self, itt: u32, ttt: u32, offset: u32, len: u32) -> Result<(), RxError> {
        let slot = self.active_slot(itt).ok_or(RxError::UnknownTask(itt))?;
        let max_burst = self.p.max_burst;
        let t = &mut self.tasks[slot as usize];
        let end = offset as u64 + len as u64;
        if !t.write || len == 0 || len > max_burst || end > t.data_len as u64 || ttt == RESERVED_TAG
        {
            return Err(RxError::BadR2t);
        }
        let b = Burst {
            ttt,
            off: offset,
            end: end as u32,
            datasn: 0,
        };
        match (t.out, t.next_r2t) {
            (None, _) => t.out = Some(b),
            (Some(_), None) => t.next_r2t = Some(b),
            _ => return Err(RxError::BadR2t),
        }
        self.stats.r2ts += 1;
        self.enqueue(slot);
        Ok(())
    }

    // ---- send -----------------------------------------------------------

    /// Whether the sender has anything to do.
    pub fn tx_pending(&self) -> bool {
        self.nstaged > 0 || !self.ctl.is_empty() || !self.ready.is_empty()
    }

    /// Stages PDUs (up to a batch) and lays them out in `out`; returns the
    /// iovec count (0 = nothing to send).
    pub fn tx_iovecs(&mut self, out: &mut [libc::iovec; TX_IOVS]) -> usize {
        while self.nstaged < TX_BATCH {
            let Some(p) = self.next_pdu() else { break };
            self.staged[self.nstaged] = Some(p);
            self.nstaged += 1;
        }
        let mut n = 0;
        for i in 0..self.nstaged {
            let Some(p) = self.staged[i].as_ref() else {
                continue;
            };
            let mut skip = p.sent;
            let mut add = |base: *const u8, len: usize, n: &mut usize, skip: &mut usize| {
                if *skip >= len {
                    *skip -= len;
                    return;
                }
                out[*n] = libc::iovec {
                    // SAFETY: skip < len, inside the piece.
                    iov_base: unsafe { base.add(*skip) } as *mut libc::c_void,
                    iov_len: len - *skip,
                };
                *skip = 0;
                *n += 1;
            };
            add(p.hdr.as_ptr(), p.hlen, &mut n, &mut skip);
            if p.len > 0 {
                if p.spilled {
                    add(self.spill.as_ptr(), p.len as usize, &mut n, &mut skip);
                } else if let Some(slot) = p.slot {
                    let mut segs = [libc::iovec {
                        iov_base: std::ptr::null_mut(),
                        iov_len: 0,
                    }; crate::MAX_SEGS];
                    let r = p.off as usize..(p.off + p.len) as usize;
                    let (k, _) = self.tasks[slot as usize].slices(r, &mut segs);
                    for s in &segs[..k] {
                        add(s.iov_base as *const u8, s.iov_len, &mut n, &mut skip);
                    }
                }
            }
            add(p.tail.as_ptr(), p.tlen, &mut n, &mut skip);
        }
        n
    }

    /// `n` bytes of the laid-out PDUs went out.
    pub fn tx_advance(&mut self, mut n: usize) {
        let mut done = 0;
        for i in 0..self.nstaged {
            let Some(p) = self.staged[i].as_mut() else {
                done += 1;
                continue;
            };
            let k = n.min(p.total() - p.sent);
            p.sent += k;
            n -= k;
            if p.sent < p.total() {
                break;
            }
            if p.spilled {
                self.spill.clear();
            }
            self.stats.pdus_tx += 1;
            done += 1;
        }
        if done > 0 {
            self.staged.copy_within(done..self.nstaged, 0);
            for s in &mut self.staged[self.nstaged - done..self.nstaged] {
                *s = None;
            }
            self.nstaged -= done;
        }
    }

    /// The next PDU: control first, then task output round-robin.
    fn next_pdu(&mut self) -> Option<TxPdu> {
        if let Some(mut b) = self.ctl.pop_front() {
            b.set_u32(28, self.expstatsn);
            return Some(self.header_pdu(&b));
        }
        while let Some(slot) = self.ready.pop_front() {
            let expstatsn = self.expstatsn;
            let t = &mut self.tasks[slot as usize];
            t.queued = false;
            if t.state != TaskState::Active {
                continue;
            }
            if t.cmd_pending {
                t.cmd_pending = false;
                let mut b = t.bhs;
                b.set_u32(28, expstatsn);
                let imm = t.imm;
                let more = t.out.is_some();
                let p = self.data_pdu(&b, slot, 0, imm);
                self.stats.immediate_bytes += imm as u64;
                if more {
                    self.enqueue(slot);
                }
                return Some(p);
            }
            let Some(mut o) = t.out else { continue };
            let seg = self.p.max_send_seg.max(512);
            let len = seg.min(o.end - o.off);
            let last = o.off + len == o.end;
            let b = build::data_out(
                t.lun,
                t.tag,
                o.ttt,
                expstatsn,
                o.datasn,
                o.off,
                len as usize,
                last,
            );
            let off = o.off;
            o.off += len;
            o.datasn += 1;
            t.out = if last { t.next_r2t.take() } else { Some(o) };
            let more = t.out.is_some();
            let p = self.data_pdu(&b, slot, off, len);
            self.stats.data_out_bytes += len as u64;
            if more {
                self.enqueue(slot);
            }
            return Some(p);
        }
        None
    }

    fn header_pdu(&self, b: &Bhs) -> TxPdu {
        let mut hdr = [0u8; BHS_LEN + 4];
        hdr[..BHS_LEN].copy_from_slice(&b.0);
        let mut hlen = BHS_LEN;
        if self.p.header_digest {
            hdr[BHS_LEN..].copy_from_slice(&crc32c::crc32c(&b.0).to_le_bytes());
            hlen += 4;
        }
        TxPdu {
            hdr,
            hlen,
            slot: None,
            off: 0,
            len: 0,
            spilled: false,
            tail: [0; 8],
            tlen: 0,
            sent: 0,
        }
    }

    fn data_pdu(&self, b: &Bhs, slot: u16, off: u32, len: u32) -> TxPdu {
        let mut p = self.header_pdu(b);
        if len == 0 {
            return p;
        }
        p.slot = Some(slot);
        p.off = off;
        p.len = len;
        let pad = pad4(len as usize) - len as usize;
        p.tlen = pad;
        if self.p.data_digest {
            let r = off as usize..(off + len) as usize;
            let crc = self.tasks[slot as usize].crc(0, r);
            let crc = crc32c::crc32c_append(crc, &[0u8; 3][..pad]);
            p.tail[pad..pad + 4].copy_from_slice(&crc.to_le_bytes());
            p.tlen += 4;
        }
        p
    }

    /// A task goes away: staged PDUs that still point into its buffer are
    /// dropped if none of their bytes went out, or (the one half-sent PDU)
    /// have their rest copied aside, so the stream stays whole.
    fn release_tx(&mut self, slot: u16) {
        let mut keep = 0;
        for i in 0..self.nstaged {
            let Some(mut p) = self.staged[i] else {
                continue;
            };
            if p.slot == Some(slot) && !p.spilled && p.len > 0 {
                if p.sent == 0 {
                    continue;
                }
                self.spill.clear();
                // The spill holds the whole data part; the sent prefix is
                // skipped by `sent` as before.
                let r = p.off as usize..(p.off + p.len) as usize;
                self.tasks[slot as usize].copy_out(r, &mut self.spill);
                p.spilled = true;
                self.stats.spills += 1;
            }
            self.staged[keep] = Some(p);
            keep += 1;
        }
        for s in &mut self.staged[keep..] {
            *s = None;
        }
        self.nstaged = keep;
    }

    fn reset_tx(&mut self) {
        self.staged = [None; TX_BATCH];
        self.nstaged = 0;
        self.ready.clear();
        self.ctl.clear();
        self.spill.clear();
        for t in &mut self.tasks {
            t.queued = false;
        }
    }
}

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

mod rx;
mod tx;

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
}

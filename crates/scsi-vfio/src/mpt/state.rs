//! The driver state of one MPT IOC: request frames, sense buffers and
//! reply frames in one DMA area (the SAS1068 takes one 4 GiB window for
//! all three), chain segments per slot for SGLs longer than a frame, a
//! bounce buffer per slot plus one shared large one for transfers beyond
//! it, command slots whose index is the request's MsgContext,
//! submission by the request post FIFO, and reaping of the reply post FIFO
//! (context-only "turbo" replies for plain success, address replies for
//! errors, residuals, sense, task management and events).

use std::collections::VecDeque;

use ustor_scsi::lld::{DataDir, Nexus, QueueError, ScsiCmd, Tag, TransportError};
use ustor_scsi::ScsiStatus;
use ustor_vfio::{DmaMem, Vfio};

use super::event::{self, Effect, Event};
use super::ioc::Ioc;
use super::wire::{self, Facts, IoReply, Sge};
use super::MptError;
use crate::sg::{gather, scatter};
use crate::wake::Wake;

/// Command slots at most (the IOC's credits may lower it).
pub const MAX_SLOTS: usize = 64;
/// Request frame bytes we lay out (the IOC may read fewer: SGEs are
/// limited to its RequestFrameSize).
const FRAME: usize = 512;
pub const SENSE: usize = 96;
/// Reply frame bytes given to IOCInit.
pub const REPLY: usize = 128;
pub const BOUNCE: usize = 128 << 10;
/// The largest transfer: zero-copy up to the SGL's reach, bounced through
/// the one shared large buffer beyond [`BOUNCE`].
pub const MAX_XFER: usize = 1 << 20;
/// Chain segments per slot (each one request frame long).
const CHAIN_SEGS: usize = 8;
/// The task-management frame follows the command slots; its context.
const TMF_SLOT: usize = MAX_SLOTS;
/// The EventNotification frame (the IOC keeps it while events are on)
/// and the EventAck frame.
const EVENT_SLOT: usize = MAX_SLOTS + 1;
const ACK_SLOT: usize = MAX_SLOTS + 2;
/// Event acks waiting for the ack frame, at most.
const MAX_ACKS: usize = 32;
const SENSE_OFF: usize = (MAX_SLOTS + 3) * FRAME;
const REPLY_OFF: usize = SENSE_OFF + MAX_SLOTS * SENSE;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    Free,
    Mid,
    Internal,
    Forgotten,
}

/// Where a slot's command stands once the IOC answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Context-only reply: success, everything moved.
    Turbo,
    Reply(IoReply),
}

#[derive(Clone, Copy, Debug)]
pub struct Slot {
    pub state: SlotState,
    pub tag: Tag,
    pub nexus: Nexus,
    dir: DataDir,
    iov: *const libc::iovec,
    iovcnt: usize,
    pub data_len: u32,
    bounced: bool,
    /// Bounced through the shared large buffer.
    big: bool,
    pub done: Option<Answer>,
}

const FREE_SLOT: Slot = Slot {
    state: SlotState::Free,
    tag: 0,
    nexus: Nexus {
        channel: 0,
        target: 0,
        lun: 0,
    },
    dir: DataDir::None,
    iov: std::ptr::null(),
    iovcnt: 0,
    data_len: 0,
    bounced: false,
    big: false,
    done: None,
};

/// A completion copied out of DMA memory.
pub struct Finished {
    pub tag: Tag,
    pub status: Result<ScsiStatus, TransportError>,
    pub sense: [u8; SENSE],
    pub sense_len: usize,
    pub resid: u32,
}

/// A byte view of DMA memory we own.
///
/// # Safety
/// `off + len` within `mem`; the IOC must not be writing those bytes.
unsafe fn bytes<'a>(mem: &DmaMem, off: usize, len: usize) -> &'a mut [u8] {
    debug_assert!(off + len <= mem.len);
    std::slice::from_raw_parts_mut(mem.ptr.add(off), len)
}

pub struct State {
    pub vfio: Vfio,
    pub ioc: Ioc,
    pub facts: Facts,
    pub slots_n: usize,
    pub max_sg: usize,
    replies_n: usize,
    area: DmaMem,
    bounce: DmaMem,
    chains: DmaMem,
    big: DmaMem,
    /// The slot whose bounced data is in `big`.
    big_owner: Option<u16>,
    /// Chain segment bytes: the IOC's request frame.
    seg_bytes: usize,
    /// Reused for every command's SGEs (no allocation per I/O).
    sges: Vec<Sge>,
    pub slots: Vec<Slot>,
    free: Vec<u16>,
    ready: VecDeque<u16>,
    failed: VecDeque<(Tag, TransportError)>,
    /// The task-management request in flight has answered: (IOCStatus,
    /// response code).
    pub tmf_done: Option<(u16, u8)>,
    pub tmf_busy: bool,
    pub zero_copy: u64,
    /// Zero-copy commands whose data is in another reactor's pool.
    pub zero_copy_foreign: u64,
    pub bounced: u64,
    pub address_replies: u64,
    /// Event replies seen, and whether the IOC said events are on.
    pub events: u64,
    pub events_on: bool,
    /// An event said targets may have come or gone (`Lld::take_rescan`).
    pub rescan: bool,
    ack_busy: bool,
    acks: VecDeque<Event>,
    pub pool_mapped: usize,
    /// The owning reactor's buffer pool (address, length).
    pub own_pool: (usize, usize),
    /// The MSI that wakes a sleeping reactor, if any.
    pub wake: Option<Wake>,
}

impl State {
    pub fn open(vfio: Vfio) -> Result<State, MptError> {
        vfio.enable_bus_master()?;
        let ioc = Ioc { bar: vfio.bar(1)? };
        if ioc.bar.len() < 0x100 {
            return Err(MptError::Ioc(
                "BAR 1 is too small for the MPT registers".into(),
            ));
        }
        let area = vfio.alloc_dma(REPLY_OFF + (MAX_SLOTS * 2 + 2) * REPLY)?;
        let bounce = vfio.alloc_dma(MAX_SLOTS * BOUNCE)?;
        let chains = vfio.alloc_dma(MAX_SLOTS * CHAIN_SEGS * FRAME)?;
        let big = vfio.alloc_dma(MAX_XFER)?;
        let wake = Wake::start(&vfio);
        let mut s = State {
            vfio,
            ioc,
            facts: Facts::default(),
            slots_n: 0,
            max_sg: 1,
            replies_n: 0,
            area,
            bounce,
            chains,
            big,
            big_owner: None,
            seg_bytes: FRAME,
            sges: Vec::with_capacity(MAX_SLOTS * 4),
            slots: vec![FREE_SLOT; MAX_SLOTS],
            free: Vec::new(),
            ready: VecDeque::new(),
            failed: VecDeque::new(),
            tmf_done: None,
            tmf_busy: false,
            zero_copy: 0,
            zero_copy_foreign: 0,
            bounced: 0,
            address_replies: 0,
            events: 0,
            events_on: false,
            rescan: false,
            ack_busy: false,
            acks: VecDeque::new(),
            pool_mapped: 0,
            own_pool: (0, 0),
            wake,
        };
        s.bring_up()?;
        Ok(s)
    }

    /// Reset, handshake, reply frames posted, port enabled. Every slot is
    /// free afterwards (the reset dropped whatever the IOC held).
    pub fn bring_up(&mut self) -> Result<(), MptError> {
        self.ioc.reset()?;
        let facts = self.ioc.init(REPLY as u16)?;
        // One credit each stays for the task-management, event and ack frames.
        self.slots_n = (facts.global_credits as usize)
            .saturating_sub(3)
            .min(MAX_SLOTS);
        // Reply frames: one per request that may need one, within the
        // reply queue's depth.
        self.replies_n = (facts.reply_queue_depth as usize).min(MAX_SLOTS * 2 + 2);
        if self.slots_n == 0 || self.replies_n < 2 {
            return Err(MptError::Ioc(format!("IOC offers no queue: {facts:?}")));
        }
        self.slots_n = self.slots_n.min(self.replies_n - 1);
        let frame = facts.request_frame_bytes.min(FRAME);
        self.seg_bytes = frame;
        let depth = CHAIN_SEGS.min(facts.max_chain_depth as usize);
        self.max_sg = wire::sgl_capacity(frame, frame, depth);
        self.facts = facts;
        for i in 0..self.replies_n {
            let iova = self.area.iova_at(REPLY_OFF + i * REPLY);
            self.ioc.bar.write32(wire::REG_REPLY_FIFO, iova as u32);
        }
        self.ioc.port_enable()?;
        if self.wake.is_some() {
            // Replies interrupt (the reset masked everything).
            self.ioc.bar.write32(wire::REG_INT_MASK, wire::HIM_DOORBELL);
        }
        self.slots.fill(FREE_SLOT);
        self.free = (0..self.slots_n as u16).rev().collect();
        self.ready.clear();
        self.failed.clear();
        self.big_owner = None;
        self.tmf_busy = false;
        self.tmf_done = None;
        self.events_on = false;
        self.ack_busy = false;
        self.acks.clear();
        // SAFETY: the event frame: the reset took back whatever the IOC held.
        let f = unsafe { bytes(&self.area, EVENT_SLOT * FRAME, FRAME) };
        event::encode_notify(f, EVENT_SLOT as u32, true);
        let frame = self.area.iova_at(EVENT_SLOT * FRAME) as u32;
        self.ioc.bar.write32(wire::REG_REQUEST_POST, frame);
        Ok(())
    }

    /// An event reply: counted, a rescan asked for where targets may have
    /// come or gone, acknowledged where the IOC asks.
    fn on_event(&mut self, r: &[u8]) {
        let ev = event::decode(r);
        self.events += 1;
        match event::effect(&ev) {
            Effect::Enabled(on) => self.events_on = on,
            Effect::Rescan => {
                tracing::info!(
                    event = ev.event,
                    tid = ev.target,
                    reason = ev.reason,
                    "MPT event: rescan"
                );
                self.rescan = true;
            }
            Effect::None => tracing::debug!(event = ev.event, "MPT event ignored"),
        }
        if ev.ack_required {
            if self.acks.len() >= MAX_ACKS {
                tracing::warn!(
                    event = ev.event,
                    "MPT event acks piling up: dropping the oldest"
                );
                self.acks.pop_front();
            }
            self.acks.push_back(ev);
            self.send_ack();
        }
    }

    /// Sends the next queued EventAck once the ack frame is free.
    fn send_ack(&mut self) {
        if self.ack_busy {
            return;
        }
        let Some(ev) = self.acks.pop_front() else {
            return;
        };
        // SAFETY: the ack frame: the IOC holds no ack of ours.
        let f = unsafe { bytes(&self.area, ACK_SLOT * FRAME, FRAME) };
        event::encode_ack(f, ACK_SLOT as u32, &ev);
        self.ack_busy = true;
        let frame = self.area.iova_at(ACK_SLOT * FRAME) as u32;
        self.ioc.bar.write32(wire::REG_REQUEST_POST, frame);
    }

    /// Whether `cmd`'s data starts outside the owning reactor's pool.
    fn foreign_data(&self, cmd: &ScsiCmd) -> bool {
        // SAFETY: the mid-layer keeps the iovecs alive until completion.
        let iovs = unsafe { cmd.iovecs() };
        iovs.first()
            .is_some_and(|v| crate::foreign(self.own_pool, v.iov_base as usize))
    }

    /// Data segments of `cmd`, zero-copy when every iovec is DMA-mapped and
    /// they fit one frame; `None`: bounce.
    fn data_sges(&self, cmd: &ScsiCmd, out: &mut Vec<Sge>) -> bool {
        // SAFETY: the mid-layer keeps the iovecs alive until completion.
        let iovs = unsafe { cmd.iovecs() };
        for v in iovs.iter().filter(|v| v.iov_len > 0) {
            match self.vfio.iova_of(v.iov_base as *const u8, v.iov_len) {
                Some(iova) if out.len() < self.max_sg && v.iov_len <= wire::SGE_MAX_LEN => out
                    .push(Sge {
                        iova,
                        len: v.iov_len as u32,
                    }),
                _ => return false,
            }
        }
        !out.is_empty()
    }

    /// Where slot `si` bounces: its own buffer, or the shared large one.
    fn bounce_at(&self, si: u16, big: bool) -> (&DmaMem, usize) {
        if big {
            (&self.big, 0)
        } else {
            (&self.bounce, si as usize * BOUNCE)
        }
    }

    /// Bounces `cmd`'s data for slot `si`: its SGE, and whether it took
    /// the large buffer; `Err` when that is busy (the mid-layer retries).
    fn bounce(&mut self, si: u16, cmd: &ScsiCmd) -> Result<(Sge, bool), QueueError> {
        let big = cmd.data_len as usize > BOUNCE;
        if big {
            if self.big_owner.is_some() {
                return Err(QueueError::HostBusy);
            }
            self.big_owner = Some(si);
        }
        let (mem, off) = self.bounce_at(si, big);
        if cmd.dir == DataDir::ToDevice {
            // SAFETY: this slot's bounce bytes, not in flight; the iovecs
            // live until completion.
            let (b, iovs) = unsafe { (bytes(mem, off, cmd.data_len as usize), cmd.iovecs()) };
            gather(iovs, b);
        }
        let sge = Sge {
            iova: mem.iova_at(off),
            len: cmd.data_len,
        };
        Ok((sge, big))
    }

    fn start(&mut self, si: u16, cmd: &ScsiCmd, state: SlotState) -> Result<(), QueueError> {
        let s = si as usize;
        let mut sges = std::mem::take(&mut self.sges);
        sges.clear();
        let (mut bounced, mut big) = (false, false);
        let control = match cmd.dir {
            _ if cmd.data_len == 0 => 0,
            DataDir::None => 0,
            DataDir::ToDevice => wire::CONTROL_WRITE,
            DataDir::FromDevice => wire::CONTROL_READ,
        };
        if control != 0 && !self.data_sges(cmd, &mut sges) {
            sges.clear();
            if cmd.data_len as usize > MAX_XFER {
                self.sges = sges;
                self.failed
                    .push_back((cmd.tag, TransportError::Protocol("transfer too long")));
                return Ok(());
            }
            match self.bounce(si, cmd) {
                Ok((sge, b)) => {
                    sges.push(sge);
                    (bounced, big) = (true, b);
                }
                Err(e) => {
                    self.sges = sges;
                    return Err(e);
                }
            }
        }
        let io = wire::ScsiIo {
            nexus: cmd.nexus,
            context: si as u32,
            cdb: cmd.cdb.as_bytes(),
            control,
            data_len: if control == 0 { 0 } else { cmd.data_len },
            sense_iova: self.area.iova_at(SENSE_OFF + s * SENSE) as u32,
            sense_len: SENSE as u8,
        };
        let seg = CHAIN_SEGS * FRAME;
        // SAFETY: slot `si`'s frame and chain segments: the IOC holds no
        // request of it.
        let (frame, chain) = unsafe {
            (
                bytes(&self.area, s * FRAME, self.seg_bytes),
                bytes(&self.chains, s * seg, seg),
            )
        };
        let chain = wire::ChainArea {
            buf: chain,
            iova: self.chains.iova_at(s * seg),
            seg_bytes: self.seg_bytes,
        };
        wire::encode_scsi_io(frame, &io, &sges, chain);
        self.sges = sges;
        self.slots[s] = Slot {
            state,
            tag: cmd.tag,
            nexus: cmd.nexus,
            dir: cmd.dir,
            iov: cmd.iov,
            iovcnt: cmd.iovcnt,
            data_len: io.data_len,
            bounced,
            big,
            done: None,
        };
        if bounced {
            self.bounced += 1;
        } else if control != 0 {
            self.zero_copy += 1;
            if self.foreign_data(cmd) {
                self.zero_copy_foreign += 1;
            }
        }
        let frame = self.area.iova_at(s * FRAME) as u32;
        self.ioc.bar.write32(wire::REG_REQUEST_POST, frame);
        Ok(())
    }

    pub fn submit(&mut self, cmd: &ScsiCmd, state: SlotState) -> Result<u16, QueueError> {
        let si = self.free.pop().ok_or(QueueError::HostBusy)?;
        match self.start(si, cmd, state) {
            Ok(()) if self.slots[si as usize].state == SlotState::Free => {
                self.free.push(si);
                Ok(si)
            }
            Ok(()) => Ok(si),
            Err(e) => {
                self.free.push(si);
                Err(e)
            }
        }
    }

    fn release(&mut self, si: u16) {
        if self.big_owner == Some(si) {
            self.big_owner = None;
        }
        self.slots[si as usize] = FREE_SLOT;
        self.free.push(si);
    }

    fn answered(&mut self, ctx: u32, a: Answer) {
        let Some(slot) = self.slots.get(ctx as usize).copied() else {
            tracing::warn!(ctx, "MPT reply for an unknown context");
            return;
        };
        let si = ctx as u16;
        match slot.state {
            // A second answer for one command (a device reading back
            // garbage, say) must not queue the slot twice.
            SlotState::Mid if slot.done.is_some() => {
                tracing::warn!(ctx, "MPT reply for a command already answered")
            }
            SlotState::Mid => {
                self.slots[ctx as usize].done = Some(a);
                self.ready.push_back(si);
            }
            SlotState::Internal => self.slots[ctx as usize].done = Some(a),
            SlotState::Forgotten => self.release(si),
            SlotState::Free => {}
        }
    }

    /// Drains the reply post FIFO: at most as many entries as it can hold
    /// (every command slot's turbo reply and every reply frame), so a
    /// controller that stopped answering reads (reads as zeroes, never
    /// "empty") cannot keep the poller here.
    pub fn reap(&mut self) {
        for _ in 0..self.slots_n + self.replies_n + 2 {
            let v = self.ioc.bar.read32(wire::REG_REPLY_FIFO);
            if v == wire::FIFO_EMPTY {
                return;
            }
            if v & wire::ADDRESS_REPLY == 0 {
                self.answered(v, Answer::Turbo);
                continue;
            }
            self.address_replies += 1;
            let addr = (v << 1) as u64;
            let off = addr.wrapping_sub(self.area.iova) as usize;
            if off < REPLY_OFF || off >= REPLY_OFF + self.replies_n * REPLY {
                tracing::error!(addr, "MPT reply frame address outside our frames");
                continue;
            }
            // SAFETY: a reply frame the IOC handed back to us; it is ours
            // until we post it to the free FIFO below.
            let r = unsafe { bytes(&self.area, off, REPLY) };
            let (_, function, ctx) = wire::reply_header(r);
            match function {
                wire::F_SCSI_IO => self.answered(ctx, Answer::Reply(wire::decode_io_reply(r))),
                wire::F_TASK_MGMT => self.tmf_done = Some(wire::decode_tm_reply(r)),
                event::F_EVENT_NOTIFICATION => self.on_event(r),
                event::F_EVENT_ACK => {
                    self.ack_busy = false;
                    self.send_ack();
                }
                f => tracing::debug!(function = f, "MPT reply ignored"),
            }
            self.ioc.bar.write32(wire::REG_REPLY_FIFO, addr as u32);
        }
    }

    /// Status, residual and sense of an answered slot.
    fn finish(&self, si: u16) -> Finished {
        let s = si as usize;
        let slot = self.slots[s];
        let mut f = Finished {
            tag: slot.tag,
            status: Ok(ScsiStatus::Good),
            sense: [0; SENSE],
            sense_len: 0,
            resid: 0,
        };
        if let Some(Answer::Reply(r)) = slot.done {
            let (status, resid, sense) = wire::outcome(&r, slot.data_len);
            f.status = status;
            f.resid = resid;
            f.sense_len = sense.min(SENSE);
            // SAFETY: the IOC wrote the sense before replying.
            let b = unsafe { bytes(&self.area, SENSE_OFF + s * SENSE, SENSE) };
            f.sense[..f.sense_len].copy_from_slice(&b[..f.sense_len]);
        }
        f
    }

    pub fn take_ready(&mut self) -> Option<Finished> {
        if let Some((tag, e)) = self.failed.pop_front() {
            return Some(Finished {
                tag,
                status: Err(e),
                sense: [0; SENSE],
                sense_len: 0,
                resid: 0,
            });
        }
        let si = self.ready.pop_front()?;
        let f = self.finish(si);
        let slot = self.slots[si as usize];
        if slot.bounced && slot.dir == DataDir::FromDevice && f.status.is_ok() {
            let n = (slot.data_len - f.resid.min(slot.data_len)) as usize;
            // SAFETY: returned by the IOC; the iovecs are alive until the
            // mid-layer hears of this completion, which is after this.
            let (mem, off) = self.bounce_at(si, slot.big);
            let (b, iovs) = unsafe {
                (
                    bytes(mem, off, n),
                    std::slice::from_raw_parts(slot.iov, slot.iovcnt),
                )
            };
            scatter(b, iovs);
        }
        self.release(si);
        Some(f)
    }

    /// An internal command's result and data-in; frees the slot.
    pub fn take_internal(&mut self, si: u16, len: usize) -> Option<(Finished, Vec<u8>)> {
        self.slots[si as usize].done?;
        let f = self.finish(si);
        let n = len.saturating_sub(f.resid as usize).min(BOUNCE);
        // SAFETY: returned by the IOC; internal data is always bounced.
        let v = unsafe { bytes(&self.bounce, si as usize * BOUNCE, n) }.to_vec();
        self.release(si);
        Some((f, v))
    }

    pub fn forget(&mut self, si: u16) {
        if let Some(p) = self.ready.iter().position(|&x| x == si) {
            self.ready.remove(p);
            self.release(si);
        } else if self.slots[si as usize].state != SlotState::Free {
            self.slots[si as usize].state = SlotState::Forgotten;
        }
    }

    /// Posts one task-management request; `false` if one is in flight.
    pub fn send_tmf(&mut self, task: u8, nexus: Nexus, task_ctx: u32) -> bool {
        if self.tmf_busy {
            return false;
        }
        // SAFETY: the TMF frame is ours while no TMF is in flight.
        let f = unsafe { bytes(&self.area, TMF_SLOT * FRAME, FRAME) };
        wire::encode_tmf(f, nexus, task, TMF_SLOT as u32, task_ctx);
        self.tmf_busy = true;
        self.tmf_done = None;
        let frame = self.area.iova_at(TMF_SLOT * FRAME) as u32;
        self.ioc.bar.write32(wire::REG_REQUEST_POST, frame);
        true
    }
}

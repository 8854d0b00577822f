//! The queue pair's command slots (SPDK's `nvmf_tcp_req`): one per command
//! the host may have outstanding; a slot's index is its R2T transfer tag.
//! A slot moves through [`SlotState`] by [`Slot::set_state`] only, which
//! checks the transition against [`ALLOWED`] and counts each state entered
//! (`nvmf_get_stats` `slot_state_transitions`).

use ustor_runtime::IoBuf;

use super::super::ctrlr::{MAX_AERS, MAX_IO_QUEUE_DEPTH};
use super::super::stats::{self, inc};
use super::{Conn, Out};
use crate::wire::*;
use ustor_net::COPY_MAX;

/// Command slots per connection; the R2T transfer tag is the slot index.
pub(super) const SLOTS: usize = MAX_IO_QUEUE_DEPTH as usize + MAX_AERS + 1;

/// Where a command is (SPDK's `nvmf_tcp_req_state`, folded to the steps
/// that differ here).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotState {
    /// Not in use (SPDK: FREE).
    Free = 0,
    /// The receiver holds it: waiting for a pool buffer or receiving data
    /// (SPDK: NEW, NEED_BUFFER, TRANSFERRING_HOST_TO_CONTROLLER); an Abort
    /// only marks it.
    Receiving = 1,
    /// R2T sent; H2CData PDUs are filling the buffer (SPDK:
    /// AWAITING_R2T_ACK and the wait for the host's data).
    AwaitH2C = 2,
    /// Waiting for a worker (SPDK: READY_TO_EXECUTE).
    Queued = 3,
    /// Executing: submitted to the bdev, or an admin command / parked AER
    /// (SPDK: EXECUTING through TRANSFERRING_CONTROLLER_TO_HOST).
    Running = 4,
}

use SlotState::*;

/// The transitions a slot may make, (from, to).
const ALLOWED: [(SlotState, SlotState); 10] = [
    // A capsule the receiver takes on.
    (Free, Receiving),
    // A capsule refused before its command started gives its slot back.
    (Free, Free),
    // Write data not in the capsule: R2T sent.
    (Receiving, AwaitH2C),
    // All data in (or none needed): to a worker.
    (Receiving, Queued),
    // Failed in transport (bad digest at capsule) or aborted while received.
    (Receiving, Free),
    // An H2CData PDU for it arrived: the receiver fills its buffer.
    (AwaitH2C, Receiving),
    // Aborted while its data was due.
    (AwaitH2C, Free),
    // A worker took it.
    (Queued, Running),
    // Aborted before a worker took it.
    (Queued, Free),
    // Answered.
    (Running, Free),
];

fn allowed(from: SlotState, to: SlotState) -> bool {
    ALLOWED.iter().any(|&(f, t)| f == from && t == to)
}

pub(super) struct Slot {
    state: SlotState,
    pub(super) sqe: Sqe,
    pub(super) sgl: DataSgl,
    pub(super) buf: Option<IoBuf>,
    /// Data bytes expected and received so far (R2T transfers).
    pub(super) len: u32,
    pub(super) got: u32,
    /// Set when the command already failed in transport (bad data digest).
    pub(super) failed: Option<Status>,
    /// An Abort arrived while the receiver held the slot.
    pub(super) aborted: bool,
    /// The fused operation this command is a half of.
    pub(super) fused: Option<std::rc::Rc<super::fused::Pair>>,
}

impl Slot {
    pub(super) fn new() -> Slot {
        Slot {
            state: Free,
            sqe: Sqe::default(),
            sgl: DataSgl::None,
            buf: None,
            len: 0,
            got: 0,
            failed: None,
            aborted: false,
            fused: None,
        }
    }

    pub(super) fn state(&self) -> SlotState {
        self.state
    }

    /// The one place a slot changes state: checked (debug builds) and
    /// counted (a thread-local cell, as the receive states are).
    #[inline]
    pub(super) fn set_state(&mut self, to: SlotState) {
        debug_assert!(
            allowed(self.state, to),
            "nvmf slot: {:?} -> {to:?} is not a transition",
            self.state
        );
        self.state = to;
        stats::with(|c| inc(&c.slot_states[to as usize], 1));
    }
}

impl Conn {
    pub(super) fn alloc_slot(&self) -> Option<u16> {
        self.free.borrow_mut().pop()
    }

    /// Frees slot `i`. A receiver parked for a slot rechecks when the
    /// driver has sent the slot's answer (`Protocol::may_resume`).
    pub(super) fn free_slot(&self, i: u16) {
        let mut s = self.slots.borrow_mut();
        let slot = &mut s[i as usize];
        slot.set_state(Free);
        slot.buf = None;
        slot.failed = None;
        slot.aborted = false;
        let pair = slot.fused.take();
        drop(s);
        // A half that ends here without reaching its pair (refused,
        // aborted) fails its partner; after the pair ran this changes
        // nothing.
        if let Some(p) = pair {
            p.abandon();
        }
        self.free.borrow_mut().push(i);
    }

    /// Slot `i`'s command goes to a worker (the job the driver queues).
    pub(super) fn queue_job(&self, i: u16) -> u16 {
        self.slots.borrow_mut()[i as usize].set_state(Queued);
        self.executing.set(self.executing.get() + 1);
        i
    }

    /// Slot `i`'s answer when it was refused before it ran: `s`, and the
    /// slot is free.
    pub(super) fn fail_out(&self, i: u16, cid: u16, s: Status) -> Out {
        let c = self.cqe(cid, s);
        self.free_slot(i);
        stats::with(|c| inc(&c.errors, 1));
        Out::Resp(c)
    }

    /// Slot `i`'s answer when it was aborted: Command Abort Requested, and
    /// the slot is free (its buffer goes back to the pool).
    pub(super) fn aborted_out(&self, i: u16) -> Out {
        let cid = {
            let mut s = self.slots.borrow_mut();
            s[i as usize].buf = None;
            s[i as usize].sqe.cid()
        };
        let c = self.cqe(cid, Status::ABORT_REQUESTED);
        self.free_slot(i);
        stats::with(|c| inc(&c.aborted, 1));
        Out::Resp(c)
    }

    /// Whether slot `i`'s command was aborted while it was being received.
    pub(super) fn slot_aborted(&self, i: u16) -> bool {
        self.slots.borrow()[i as usize].aborted
    }

    /// A queued job's answer when an Abort marked it before a worker took
    /// it (`Protocol::aborted`).
    #[inline]
    pub(super) fn take_aborted(&self, i: u16) -> Option<Out> {
        {
            let s = self.slots.borrow();
            let slot = &s[i as usize];
            if !slot.aborted || slot.state != Queued {
                return None;
            }
        }
        self.executing.set(self.executing.get() - 1);
        Some(self.aborted_out(i))
    }

    /// An R2T of `len` bytes is due: counted until [`Conn::r2t_settled`].
    pub(super) fn r2t_due(&self, len: u32) {
        self.r2t_out.set(self.r2t_out.get() + 1);
        if len as usize > COPY_MAX {
            self.r2t_big_out.set(self.r2t_big_out.get() + 1);
        }
    }

    /// An R2T of `len` bytes needs no more data (all in, or aborted).
    pub(super) fn r2t_settled(&self, len: u32) {
        self.r2t_out.set(self.r2t_out.get() - 1);
        if len as usize > COPY_MAX {
            self.r2t_big_out.set(self.r2t_big_out.get() - 1);
        }
    }

    /// Abort of command `cid`: true if it had not reached the bdev (it is
    /// completed with Command Abort Requested now, by the receiver as soon
    /// as it has consumed the command's data, or by the worker that takes
    /// it off the queue).
    pub(super) fn abort(&self, cid: u16) -> bool {
        if self.slot_wait.get() == Some(cid) {
            self.slot_wait_aborted.set(true);
            return true;
        }
        let mut s = self.slots.borrow_mut();
        let Some(i) = s.iter().position(|x| x.state != Free && x.sqe.cid() == cid) else {
            return false;
        };
        match s[i].state {
            Receiving | Queued => {
                s[i].aborted = true;
                true
            }
            AwaitH2C => {
                let len = s[i].len;
                drop(s);
                self.r2t_settled(len);
                let o = self.aborted_out(i as u16);
                self.push_out(o);
                true
            }
            Running | Free => false,
        }
    }
}

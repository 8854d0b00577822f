//! Per-reactor target counters (thread-local `Cell`s: no atomics per I/O),
//! summed by `nvmf_get_stats` through `call_all`, plus each live queue's
//! own LANoT counters and setting (`qpairs`), read from the queue itself.

use std::cell::{Cell, RefCell};
use std::rc::Weak;

use serde::{Deserialize, Serialize};

use ustor_net::coalesce::CoalesceStats;

/// One live queue pair in `nvmf_get_stats` (`poll_groups[].qpairs[]`): who
/// it belongs to and its coalescer's counters and current setting, so the
/// adaptive policy's state can be watched queue by queue.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct QpairStats {
    /// Empty until the queue's Connect succeeded.
    pub subnqn: String,
    pub hostnqn: String,
    pub cntlid: u16,
    /// 0 for the admin queue.
    pub qid: u16,
    /// Commands queued or executing now.
    pub outstanding: u64,
    /// PDUs sent (`coalesce.pdus`) in `coalesce.groups` groups (one
    /// `sendmsg` each), and why each group left.
    pub coalesce: CoalesceStats,
}

/// A queue the poll group can ask for its `QpairStats` (the connection).
pub(crate) trait LiveQueue {
    fn qpair_stats(&self) -> QpairStats;
}

/// Receive states, for the per-state transition counters.
pub const RECV_STATES: [&str; 4] = ["await_ch", "await_psh", "await_payload", "quiesced"];

/// Command slot states, for the per-state transition counters.
pub const SLOT_STATES: [&str; 5] = ["free", "receiving", "await_h2c", "queued", "running"];

/// One poll group's (reactor's) counters.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PollGroupStats {
    pub name: String,
    pub current_io_qpairs: u64,
    pub current_admin_qpairs: u64,
    pub admin_qpairs: u64,
    pub io_qpairs: u64,
    pub pending_bdev_io: u64,
    pub commands: u64,
    pub reads: u64,
    pub writes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub r2ts: u64,
    pub h2c_pdus: u64,
    pub c2h_pdus: u64,
    pub errors: u64,
    /// Commands completed with Command Abort Requested by an Abort.
    #[serde(default)]
    pub aborted: u64,
    pub term_reqs_sent: u64,
    pub term_reqs_received: u64,
    pub digest_errors: u64,
    /// Queue pairs with both header and data digests on.
    pub digest_qpairs: u64,
    pub recv_calls: u64,
    pub sendmsg_calls: u64,
    /// Payload bytes that were staged and copied once (not zero-copy).
    pub payload_copies: u64,
    pub payload_copied_bytes: u64,
    pub recv_state_transitions: Vec<(String, u64)>,
    /// Command slot states entered (`free`, `receiving`, `await_h2c`,
    /// `queued`, `running`).
    #[serde(default)]
    pub slot_state_transitions: Vec<(String, u64)>,
    /// Sum over this group's queues, closed ones included (degree and
    /// timer: the largest of the live queues').
    pub coalesce: CoalesceStats,
    /// The live queues, each with its own counters.
    #[serde(default)]
    pub qpairs: Vec<QpairStats>,
}

pub(crate) struct Counters {
    pub admin_qpairs: Cell<u64>,
    pub io_qpairs: Cell<u64>,
    pub cur_admin: Cell<u64>,
    pub cur_io: Cell<u64>,
    pub commands: Cell<u64>,
    pub reads: Cell<u64>,
    pub writes: Cell<u64>,
    pub bytes_read: Cell<u64>,
    pub bytes_written: Cell<u64>,
    pub r2ts: Cell<u64>,
    pub h2c: Cell<u64>,
    pub c2h: Cell<u64>,
    pub errors: Cell<u64>,
    pub aborted: Cell<u64>,
    pub term_sent: Cell<u64>,
    pub term_recv: Cell<u64>,
    pub digest_errors: Cell<u64>,
    pub digest_qpairs: Cell<u64>,
    pub recv_calls: Cell<u64>,
    pub sendmsg_calls: Cell<u64>,
    pub payload_copies: Cell<u64>,
    pub payload_copied_bytes: Cell<u64>,
    pub recv_states: [Cell<u64>; 4],
    pub slot_states: [Cell<u64>; 5],
    pub pending_io: Cell<u64>,
    /// Closed queues' coalescer counters.
    pub coalesce_closed: Cell<CoalesceStats>,
    pub live: RefCell<Vec<Weak<dyn LiveQueue>>>,
}

impl Counters {
    const fn new() -> Counters {
        Counters {
            admin_qpairs: Cell::new(0),
            io_qpairs: Cell::new(0),
            cur_admin: Cell::new(0),
            cur_io: Cell::new(0),
            commands: Cell::new(0),
            reads: Cell::new(0),
            writes: Cell::new(0),
            bytes_read: Cell::new(0),
            bytes_written: Cell::new(0),
            r2ts: Cell::new(0),
            h2c: Cell::new(0),
            c2h: Cell::new(0),
            errors: Cell::new(0),
            aborted: Cell::new(0),
            term_sent: Cell::new(0),
            term_recv: Cell::new(0),
            digest_errors: Cell::new(0),
            digest_qpairs: Cell::new(0),
            recv_calls: Cell::new(0),
            sendmsg_calls: Cell::new(0),
            payload_copies: Cell::new(0),
            payload_copied_bytes: Cell::new(0),
            recv_states: [const { Cell::new(0) }; 4],
            slot_states: [const { Cell::new(0) }; 5],
            pending_io: Cell::new(0),
            coalesce_closed: Cell::new(CoalesceStats::ZERO),
            live: RefCell::new(Vec::new()),
        }
    }
}

thread_local! {
    // `const`: several bumps per I/O, each otherwise a lazy-init check.
    static COUNTERS: Counters = const { Counters::new() };
}

pub(crate) fn with<R>(f: impl FnOnce(&Counters) -> R) -> R {
    COUNTERS.with(f)
}

#[inline]
pub(crate) fn inc(c: &Cell<u64>, n: u64) {
    c.set(c.get() + n);
}

pub(crate) fn snapshot(reactor: usize) -> PollGroupStats {
    with(|c| {
        let mut co = c.coalesce_closed.get();
        c.live.borrow_mut().retain(|w| w.strong_count() > 0);
        let qpairs: Vec<QpairStats> = c
            .live
            .borrow()
            .iter()
            .filter_map(|w| w.upgrade())
            .map(|q| q.qpair_stats())
            .collect();
        for q in &qpairs {
            co.add(&q.coalesce);
        }
        PollGroupStats {
            name: format!("nvmf_tgt_poll_group_{reactor}"),
            current_io_qpairs: c.cur_io.get(),
            current_admin_qpairs: c.cur_admin.get(),
            admin_qpairs: c.admin_qpairs.get(),
            io_qpairs: c.io_qpairs.get(),
            pending_bdev_io: c.pending_io.get(),
            commands: c.commands.get(),
            reads: c.reads.get(),
            writes: c.writes.get(),
            bytes_read: c.bytes_read.get(),
            bytes_written: c.bytes_written.get(),
            r2ts: c.r2ts.get(),
            h2c_pdus: c.h2c.get(),
            c2h_pdus: c.c2h.get(),
            errors: c.errors.get(),
            aborted: c.aborted.get(),
            term_reqs_sent: c.term_sent.get(),
            term_reqs_received: c.term_recv.get(),
            digest_errors: c.digest_errors.get(),
            digest_qpairs: c.digest_qpairs.get(),
            recv_calls: c.recv_calls.get(),
            sendmsg_calls: c.sendmsg_calls.get(),
            payload_copies: c.payload_copies.get(),
            payload_copied_bytes: c.payload_copied_bytes.get(),
            recv_state_transitions: RECV_STATES
                .iter()
                .zip(&c.recv_states)
                .map(|(n, v)| (n.to_string(), v.get()))
                .collect(),
            slot_state_transitions: SLOT_STATES
                .iter()
                .zip(&c.slot_states)
                .map(|(n, v)| (n.to_string(), v.get()))
                .collect(),
            coalesce: co,
            qpairs,
        }
    })
}

//! The queue pair as a [`Protocol`] of the connection driver
//! (`ustor_net::driver`): the driver owns the socket, the staging buffer,
//! the workers and the sender; this says where the next bytes go
//! ([`Protocol::apply`]: the receive state machine, [`Rx`]), what a
//! command does ([`Protocol::execute`]: `exec`), how an answer is encoded
//! ([`Protocol::encode`]: `send`), and what LANoT sees of the queue
//! ([`Protocol::backlog`], its own [`Coalescer`] for the per-queue
//! statistics).

use std::cell::RefCell;
use std::rc::Rc;

use ustor_net::coalesce::{Coalescer, BACKLOG_UNKNOWN};
use ustor_net::driver::{self, Backlog, DriverConfig, IoEvent, Protocol, Recv, RecvEvent};
use ustor_net::{PduGroup, RecvMode, Rewind, Staging};
use ustor_runtime::IoBuf;

use super::super::stats::{self, inc};
use super::slots::SLOTS;
use super::{capsule, exec, recv, send, Conn, Out};
use crate::wire::*;

/// The staging buffer of a queue pair.
pub(super) const STAGING_LEN: usize = 128 << 10;

/// PDUs the receiver handles before it yields to other tasks.
const RECV_BUDGET: u32 = 32;

/// Where the receive state machine stands between two driver instructions.
pub(super) enum Rx {
    /// Between PDUs.
    Idle,
    /// The common header is being staged.
    Ch,
    /// The rest of the header (and its digest) is being staged.
    Psh(PduLayout),
    /// A capsule waits for a free slot (the receiver is parked).
    SlotWait(PduLayout, Sqe),
    /// A refused capsule's data is skipped, then it is answered.
    SkipFail { i: u16, cid: u16, status: Status },
    /// The padding before a PDU's data is skipped.
    Pad(Data),
    /// A PDU's data is being received.
    Payload(Data),
    /// The data is in; its digest is being staged.
    Digest(Data, IoBuf),
    /// Waiting for a pool buffer for an R2T's data.
    R2tBuf { i: u16, cid: u16, len: u32 },
    /// A fatal error was answered; nothing more is read.
    Quiesced,
}

/// Whose data a PDU carries.
#[derive(Clone, Copy)]
pub(super) enum Into {
    /// A command capsule's own (in-capsule) data.
    Capsule { i: u16, sgl: DataSgl },
    /// H2CData for slot `i`'s R2T of `total` bytes.
    H2C { i: u16, total: u32 },
}

/// A PDU's data on its way in.
pub(super) struct Data {
    pub(super) l: PduLayout,
    pub(super) to: Into,
    /// The buffer it lands in (`None`: a pool buffer of the data's size).
    pub(super) buf: Option<IoBuf>,
    pub(super) off: usize,
}

/// The driver's view of one queue pair.
pub(super) struct Qp(pub(super) Rc<Conn>);

/// The driver's shape for a queue pair: a worker per slot, started with
/// the driver so a burst never spawns; the slots bound what is in flight.
pub(super) fn driver_config() -> DriverConfig {
    DriverConfig {
        max_outstanding: SLOTS * 2,
        max_outstanding_bytes: u64::MAX,
        max_workers: SLOTS,
        prespawn_workers: SLOTS,
        staging_len: STAGING_LEN,
        rewind: Rewind::Lazy,
        recv_mode: RecvMode::Adaptive,
        recv_budget: Some(RECV_BUDGET),
        max_replies: u32::MAX,
        // The queue pair's group as before the port (`PduGroup::new`): 64
        // segments, so a group of 4 KiB reads (3 segments each) is full at
        // 21 and leaves before LANoT's degree (up to 32) is reached. With
        // the driver's default 128 a QD32 read load waited for all 32
        // answers in one group (sendmsg per I/O 0.031 against 0.062) and
        // the host sat idle meanwhile: 4K randread QD128 ran at ~0.6x.
        group_iov: ustor_runtime::ops::MAX_IOV,
        ..DriverConfig::default()
    }
}

impl Protocol for Qp {
    type Job = u16;
    type Reply = Out;

    #[inline]
    fn apply(&self, ev: RecvEvent, st: &mut Staging) -> Recv<Self> {
        let c = &*self.0;
        let rx = c.rx.replace(Rx::Idle);
        match (rx, ev) {
            (Rx::Quiesced, _) => {
                *c.rx.borrow_mut() = Rx::Quiesced;
                Recv::Close
            }
            (_, RecvEvent::Next) => recv::next_pdu(c, st, true),
            (Rx::Ch, RecvEvent::Staged) => recv::common_header(c, st),
            (Rx::Psh(l), RecvEvent::Staged) => recv::pdu_header(c, st, l),
            (Rx::SlotWait(l, sqe), RecvEvent::Resumed) => {
                let r = capsule::slot_wait(c, l, sqe);
                recv::settle(c, r, l.hlen)
            }
            (Rx::SkipFail { i, cid, status }, RecvEvent::Skipped) => {
                Recv::Reply(c.fail_out(i, cid, status))
            }
            (Rx::Pad(d), RecvEvent::Skipped) => recv::payload(c, d),
            (Rx::Payload(d), RecvEvent::Payload(buf)) => recv::payload_in(c, st, d, buf),
            (Rx::Digest(d, buf), RecvEvent::Staged) => recv::digest_in(c, st, d, buf),
            (Rx::R2tBuf { i, cid, len }, RecvEvent::Payload(buf)) => {
                capsule::r2t(c, i, cid, len, buf)
            }
            _ => {
                debug_assert!(false, "nvmf: receive event out of order");
                Recv::Close
            }
        }
    }

    #[inline]
    fn may_resume(&self) -> bool {
        self.0.closing.get() || !self.0.free.borrow().is_empty()
    }

    fn execute(&self, job: u16) -> impl std::future::Future<Output = Out> {
        exec::run(self.0.clone(), job)
    }

    #[inline]
    fn encode(&self, reply: Out, g: &mut PduGroup) -> Result<(), Out> {
        let c = &self.0;
        let term = matches!(reply, Out::Term { .. });
        send::encode(g, reply, c.dg.get(), c.hpda.get())?;
        if term {
            c.term_sent.set(true);
        }
        Ok(())
    }

    #[inline]
    fn urgent(&self, reply: &Out) -> bool {
        matches!(reply, Out::Term { .. })
    }

    #[inline]
    fn aborted(&self, job: &u16) -> Option<Out> {
        self.0.take_aborted(*job)
    }

    /// Commands still executing, or awaiting the data of an R2T already
    /// sent, may join the group; how many the host has in flight beyond
    /// them is not visible here. Parked AERs are not counted.
    #[inline]
    fn backlog(&self, queued: usize, interim: u32) -> Option<Backlog> {
        let c = &self.0;
        let (exec, r2ts) = (c.executing.get(), c.r2t_out.get());
        let others = if exec > 0 || queued > 0 || r2ts > interim {
            BACKLOG_UNKNOWN
        } else {
            0
        };
        // What the adaptive policy may know of the queue's depth: commands
        // executing, awaiting data, or answered but not yet in a group.
        let depth = exec + r2ts.saturating_sub(interim) as usize + queued;
        Some(Backlog {
            others,
            depth: u32::try_from(depth).unwrap_or(u32::MAX),
        })
    }

    fn coalescer(&self) -> Option<&RefCell<Coalescer>> {
        Some(&self.0.coal)
    }

    /// The receiver stopped: parked AERs answer now, so the driver can end.
    fn on_close(&self) {
        let c = &self.0;
        c.closing.set(true);
        // A fused half waiting for a partner that will not come now fails.
        if let Some(p) = c.fused_open.borrow_mut().take() {
            p.missing();
        }
        for s in c.slots.borrow().iter() {
            if let Some(p) = &s.fused {
                p.abandon();
            }
        }
        if let Some(ctrl) = c.ctrl.borrow().as_ref() {
            let waiters =
                std::mem::take(&mut ctrl.aer.lock().unwrap_or_else(|p| p.into_inner()).waiters);
            for w in waiters {
                w.wake();
            }
        }
    }

    #[inline]
    fn on_io(&self, ev: IoEvent) {
        match ev {
            IoEvent::Received { calls, .. } => stats::with(|c| inc(&c.recv_calls, calls)),
            IoEvent::Copied { bytes } if bytes > 0 => stats::with(|c| {
                inc(&c.payload_copies, 1);
                inc(&c.payload_copied_bytes, bytes as u64);
            }),
            IoEvent::Copied { .. } => {}
            IoEvent::Sent { calls, .. } => {
                stats::with(|c| inc(&c.sendmsg_calls, calls));
                self.sent();
            }
        }
    }

    fn attach(&self, conn: &Rc<driver::Conn<Self>>) {
        *self.0.driver.borrow_mut() = Rc::downgrade(conn);
    }
}

impl Qp {
    /// A group left. After a termination request, or once a Disconnect is
    /// answered and nothing else runs, the socket ends here rather than
    /// when the host closes it: the receive pending ends and the queue id
    /// is free at once.
    #[inline]
    fn sent(&self) {
        let c = &self.0;
        let end = c.term_sent.get() || (c.closing.get() && c.executing.get() == 0);
        if end {
            c.closing.set(true);
            ustor_net::recv::shutdown(c.fd);
        }
    }
}

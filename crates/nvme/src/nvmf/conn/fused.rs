//! Fused Compare + Write (NVMe base spec, "Fused Operations"): the first
//! command (FUSE = 01b, Compare) and the second (FUSE = 10b, Write) arrive
//! as adjacent capsules on one queue and run as one atomic
//! [`IoChannel::compare_and_write`] of the namespace's bdev.
//!
//! The receiver pairs them at arrival ([`arrive`]): a first opens a
//! [`Pair`] that the next capsule joins (a second) or leaves missing
//! (anything else). Each half then goes to a worker like any command; its
//! worker deposits its half, and the worker that completes the pair runs
//! it while the other waits for the statuses. The first command's
//! completion is queued before the second's (hosts rely on it: SPDK's
//! bdev_nvme takes the first completion of a pair for the Compare's). A
//! half that ends without reaching the pair (refused, aborted, transport
//! error, queue closed) fails its partner.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::task::{Poll, Waker};

use ustor_bdev::{BdevError, IoFlags};
use ustor_runtime::IoBuf;

use super::super::io as nvm;
use super::{Conn, Out};
use crate::wire::*;

/// A half's command and its data, as its worker deposits it.
type Half = (Sqe, Option<IoBuf>);

const FIRST: u8 = 1;
const SECOND: u8 = 2;

/// One fused operation: the halves its workers deposited and, once
/// decided, the statuses of (first, second).
#[derive(Default)]
pub(super) struct Pair {
    halves: RefCell<[Option<Half>; 2]>,
    done: Cell<Option<(Status, Status)>>,
    waker: RefCell<Option<Waker>>,
    /// Both halves reached their workers and the pair ran: the second's
    /// answer then waits for the first's.
    ran: Cell<bool>,
    /// The first half's answer is out (queued for the sender).
    first_out: Cell<bool>,
    second_waker: RefCell<Option<Waker>>,
}

impl Pair {
    /// Decides the statuses (the first decision stands) and wakes a
    /// waiting half.
    fn decide(&self, first: Status, second: Status) {
        if self.done.get().is_none() {
            self.done.set(Some((first, second)));
            self.halves.borrow_mut().iter_mut().for_each(|h| *h = None);
            if let Some(w) = self.waker.borrow_mut().take() {
                w.wake();
            }
        }
    }

    /// The first half's partner did not follow it.
    pub(super) fn missing(&self) {
        self.decide(Status::ABORTED_MISSING_FUSED, Status::ABORTED_MISSING_FUSED);
    }

    /// A half ended without running (refused, aborted, failed in
    /// transport, queue closed): its partner fails with it.
    pub(super) fn abandon(&self) {
        self.decide(Status::ABORTED_FAILED_FUSED, Status::ABORTED_FAILED_FUSED);
    }
}

/// Pairs capsule `sqe` at arrival: `Ok(Some)` for a half of a fused
/// operation, `Ok(None)` for an ordinary command, `Err` for a capsule
/// refused with that status. Any capsule but a second leaves an open
/// first without its partner.
pub(super) fn arrive(conn: &Conn, sqe: &Sqe) -> Result<Option<Rc<Pair>>, Status> {
    let open = conn.fused_open.borrow_mut().take();
    let fuse = sqe.fuse();
    if fuse != SECOND {
        if let Some(p) = &open {
            p.missing();
        }
    }
    let io_queue = matches!(conn.qid.get(), Some(q) if q != 0);
    match fuse {
        0 => Ok(None),
        FIRST if io_queue && sqe.opcode() == io::COMPARE => {
            let p = Rc::new(Pair::default());
            *conn.fused_open.borrow_mut() = Some(p.clone());
            Ok(Some(p))
        }
        SECOND => match open {
            Some(p) if sqe.opcode() == io::WRITE => Ok(Some(p)),
            Some(p) => {
                p.abandon();
                Err(Status::INVALID_FIELD)
            }
            None => Err(Status::ABORTED_MISSING_FUSED),
        },
        // Only Compare + Write may be fused; 11b is reserved.
        _ => Err(Status::INVALID_FIELD),
    }
}

/// A fused half's worker: deposits it; the worker that completes the pair
/// runs it. Answers with this half's status.
pub(super) async fn execute(conn: &Conn, p: Rc<Pair>, sqe: &Sqe, buf: Option<IoBuf>) -> Out {
    let first = sqe.fuse() == FIRST;
    if p.done.get().is_none() {
        let both = {
            let mut h = p.halves.borrow_mut();
            h[usize::from(!first)] = Some((*sqe, buf));
            h.iter().all(Option::is_some)
        };
        if both {
            let [a, b] = std::mem::take(&mut *p.halves.borrow_mut());
            let (s1, s2) = match (a, b) {
                (Some(a), Some(b)) => run(conn, a, b).await,
                _ => (Status::INTERNAL, Status::ABORTED_FAILED_FUSED),
            };
            p.ran.set(true);
            p.decide(s1, s2);
        }
    }
    let (s1, s2) = std::future::poll_fn(|cx| match p.done.get() {
        Some(d) => Poll::Ready(d),
        None => {
            *p.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        }
    })
    .await;
    if first {
        // Queued when this worker returns, before the second is polled.
        p.first_out.set(true);
        if let Some(w) = p.second_waker.borrow_mut().take() {
            w.wake();
        }
    } else if p.ran.get() {
        // Both workers run until the first answers (the pair ran), so
        // this wait ends.
        std::future::poll_fn(|cx| {
            if p.first_out.get() {
                Poll::Ready(())
            } else {
                *p.second_waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await;
    }
    Out::Resp(conn.cqe(sqe.cid(), if first { s1 } else { s2 }))
}

/// Runs Compare `c` + Write `w` as one compare-and-write: statuses of
/// (compare, write).
async fn run(conn: &Conn, c: Half, w: Half) -> (Status, Status) {
    let failed = |s: Status| (s, Status::ABORTED_FAILED_FUSED);
    let ((cs, cbuf), (ws, wbuf)) = (c, w);
    // Both commands name the same blocks of one namespace.
    if cs.nsid() != ws.nsid() || cs.slba() != ws.slba() || cs.nlb() != ws.nlb() {
        return failed(Status::INVALID_FIELD);
    }
    let Some(ch) = conn.channel(cs.nsid()) else {
        return failed(Status::INVALID_NAMESPACE);
    };
    let (slba, nlb) = (cs.slba(), u64::from(cs.nlb()));
    // Atomic only where the bdev does it natively, within its limit.
    if nlb > ch.max_compare_and_write_blocks() {
        return failed(Status::INVALID_FIELD);
    }
    if slba.checked_add(nlb).map_or(true, |e| e > ch.num_blocks()) {
        return failed(Status::LBA_OUT_OF_RANGE);
    }
    let len = (nlb * u64::from(ch.block_size())) as usize;
    let (Some(cbuf), Some(wbuf)) = (
        cbuf.filter(|b| b.len() == len),
        wbuf.filter(|b| b.len() == len),
    ) else {
        return failed(Status::DATA_SGL_LENGTH_INVALID);
    };
    let fua = IoFlags::fua_if(ws.cdw(12) & (1 << 30) != 0);
    let (r, _, _) = ch.compare_and_write(slba, nlb, cbuf, wbuf, fua).await;
    match r {
        Ok(()) => {
            conn.host_io.read(len as u64);
            conn.host_io.write(len as u64);
            (Status::SUCCESS, Status::SUCCESS)
        }
        Err(BdevError::Miscompare { .. }) => failed(Status::COMPARE_FAILURE),
        Err(e) => failed(nvm::status_of(e, true)),
    }
}

//! The driver's sender: encodes queued replies into one [`PduGroup`] and
//! sends it with one `sendmsg`. Without a coalescer every reply queued
//! since the last send leaves at once (at QD1 a reply is sent in the pass
//! that completed it; under load every reply of a pass shares a syscall);
//! with one, LANoT decides when the group leaves.

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::rc::Rc;
use std::task::Poll;

use ustor_runtime::timer::Sleep;

use super::{Backlog, Conn, IoEvent, Protocol, Queued};
use crate::coalesce::Coalescer;
use crate::group::PduGroup;

/// Why the sender woke.
#[derive(PartialEq, Eq)]
enum Woke {
    Replies,
    Timer,
    /// Closing and every unit answered.
    Done,
}

/// Sends queued replies until the connection closes and all are answered.
pub(super) async fn run<P: Protocol>(conn: Rc<Conn<P>>) {
    let cfg = &conn.cfg;
    let mut g = PduGroup::with_capacity(cfg.group_iov, cfg.group_arena);
    // The protocol's own coalescer (its counters are its to report) or
    // one made from the config.
    let shared = conn.proto.coalescer();
    let own = match shared {
        Some(_) => None,
        None => cfg.coalesce.map(|c| RefCell::new(Coalescer::new(c))),
    };
    let coal = shared.or(own.as_ref());
    // Groups that ask for it leave zero-copy (crate::zc) when the
    // protocol takes their reports.
    let zc = conn
        .proto
        .zero_copy_done()
        .map(|sink| crate::zc::ZcSender::new(sink, cfg.group_iov, cfg.group_arena));
    let mut deadline: Option<u64> = None;
    let mut t = Tally::default();
    // Budget: each round sends a group, waits, or returns.
    loop {
        let woke = wait(&conn, deadline).await;
        let full = fill(&conn, &mut g, &mut t);
        if g.is_empty() {
            if woke == Woke::Done {
                return;
            }
            continue;
        }
        if let Some(c) = coal {
            let mut c = c.borrow_mut();
            let b = backlog(&conn, &t);
            let fired = woke == Woke::Timer;
            let why = if woke == Woke::Done {
                Some(crate::coalesce::Flush::Small)
            } else {
                c.flush_reason(&g, full, fired, b.others, t.urgent, &mut deadline)
            };
            let Some(why) = why else { continue };
            deadline = None;
            c.on_flush(why, g.pdus(), b.depth);
        }
        let mut calls = 0;
        if conn.dead.get() {
            if let Some(zc) = &zc {
                zc.discard(&g);
            }
            g.clear();
        } else {
            let (r, back) = match &zc {
                Some(zc) if g.holds() > 0 => zc.send(conn.raw_fd(), g, &mut calls).await,
                _ => crate::sender::send_all(conn.raw_fd(), g, &mut calls).await,
            };
            g = back;
            if r.is_err() {
                conn.dead.set(true);
            }
        }
        conn.proto.on_io(IoEvent::Sent {
            replies: t.units as u32 + t.interim,
            calls,
        });
        conn.finished(t.units, t.charge);
        t = Tally::default();
    }
}

/// What the group being filled holds.
#[derive(Default)]
struct Tally {
    /// Replies that answer a unit, and the payload budget they free.
    units: usize,
    charge: u64,
    /// [`super::Recv::Interim`] replies.
    interim: u32,
    urgent: bool,
}

/// Moves queued replies into the group; true when it can take no more.
fn fill<P: Protocol>(conn: &Conn<P>, g: &mut PduGroup, t: &mut Tally) -> bool {
    let mut q = conn.replies.borrow_mut();
    // Budget: at most `max_replies` rounds.
    while (t.units as u32 + t.interim) < conn.cfg.max_replies {
        let Some(Queued {
            reply,
            charge: c,
            unit,
        }) = q.pop_front()
        else {
            return false;
        };
        t.urgent |= conn.proto.urgent(&reply);
        match conn.proto.encode(reply, g) {
            Ok(()) if unit => {
                t.units += 1;
                t.charge += c;
            }
            Ok(()) => t.interim += 1,
            Err(reply) => {
                assert!(!g.is_empty(), "a reply larger than an empty group");
                q.push_front(Queued {
                    reply,
                    charge: c,
                    unit,
                });
                return true;
            }
        }
    }
    true
}

/// LANoT's inputs: the protocol's own count when it keeps one, else the
/// units received and not answered beyond those in the group.
#[inline]
fn backlog<P: Protocol>(conn: &Conn<P>, t: &Tally) -> Backlog {
    let queued = conn.replies.borrow().len();
    conn.proto.backlog(queued, t.interim).unwrap_or_else(|| {
        let others = (conn.outstanding.get() - t.units) as u32;
        Backlog {
            others,
            depth: others,
        }
    })
}

/// Waits for replies, the group's deadline, or the end.
async fn wait<P: Protocol>(conn: &Conn<P>, deadline: Option<u64>) -> Woke {
    let mut timer: Option<Sleep> = deadline.map(ustor_runtime::sleep_until);
    poll_fn(|cx| {
        if !conn.replies.borrow().is_empty() {
            return Poll::Ready(Woke::Replies);
        }
        if conn.closing.get() && conn.outstanding.get() == 0 {
            return Poll::Ready(Woke::Done);
        }
        if let Some(t) = timer.as_mut() {
            // `Sleep` is plain data (Unpin): pinning it in place is free.
            if Pin::new(t).poll(cx).is_ready() {
                return Poll::Ready(Woke::Timer);
            }
        }
        *conn.sender.borrow_mut() = Some(cx.waker().clone());
        Poll::Pending
    })
    .await
}

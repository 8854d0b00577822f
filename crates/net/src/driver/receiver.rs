//! The driver's receiver: performs what [`Protocol::apply`] asks, one
//! instruction at a time, until the protocol closes or the socket ends.

use std::future::poll_fn;
use std::rc::Rc;
use std::task::Poll;

use ustor_runtime::IoBuf;

use super::{Conn, IoEvent, Protocol, Recv, RecvEvent, Via};
use crate::recv::Seg;
use crate::staging::Staging;

/// Reads units until the protocol closes, EOF or a fatal error.
pub(super) async fn run<P: Protocol>(conn: &Rc<Conn<P>>, st: &mut Staging) {
    let mut ev = RecvEvent::Next;
    let mut budget = conn.cfg.recv_budget.unwrap_or(0);
    // Budget: each round performs one instruction; every instruction
    // either consumes bytes, waits, or ends the loop (a protocol that
    // answers `Next` with `Next`-only instructions forever is a bug that
    // the unit budget below still keeps from starving the reactor).
    loop {
        if matches!(ev, RecvEvent::Next) {
            // Checked here first: under load the budget is almost always
            // there, and the wait's future is then never built.
            if (conn.dead.get() || !conn.has_budget()) && !wait_budget(conn).await {
                return;
            }
            if conn.cfg.recv_budget.is_some() {
                budget = budget.saturating_sub(1);
                if budget == 0 {
                    budget = conn.cfg.recv_budget.unwrap_or(1);
                    ustor_runtime::yield_now().await;
                }
            }
            st.note_unit();
        }
        let next = conn.proto.apply(ev, st);
        ev = match next {
            Recv::Stage { need, max } => {
                let mode = conn.cfg.recv_mode;
                // `ASK`: the protocol's bound, asked before each receive.
                let max = || {
                    if max == super::ASK {
                        conn.proto.stage_max()
                    } else {
                        max
                    }
                };
                match st.fill(conn.raw_fd(), need, max, mode).await {
                    Ok(f) => {
                        report_fill(conn, f);
                        RecvEvent::Staged
                    }
                    Err(_) => return,
                }
            }
            Recv::Payload { buf, off, len, via } => {
                match payload(conn, st, buf, off, len, via).await {
                    Some(b) => RecvEvent::Payload(b),
                    None => return,
                }
            }
            Recv::Skip(n) => match st.skip(conn.raw_fd(), n, conn.cfg.recv_mode).await {
                Ok(f) => {
                    report_fill(conn, f);
                    RecvEvent::Skipped
                }
                Err(_) => return,
            },
            Recv::Dispatch(job) => {
                let charge = conn.proto.charge(&job);
                conn.outstanding.set(conn.outstanding.get() + 1);
                conn.outstanding_bytes
                    .set(conn.outstanding_bytes.get() + charge);
                super::workers::queue_job(conn, job, charge);
                RecvEvent::Next
            }
            Recv::Reply(r) => {
                conn.outstanding.set(conn.outstanding.get() + 1);
                conn.queue_reply(r, 0, true);
                RecvEvent::Next
            }
            Recv::Interim(r) => {
                conn.queue_reply(r, 0, false);
                RecvEvent::Next
            }
            Recv::Park => {
                if !park(conn).await {
                    return;
                }
                RecvEvent::Resumed
            }
            Recv::Close => return,
            Recv::Place { tail } => {
                if !place(conn, st, tail).await {
                    return;
                }
                RecvEvent::Next
            }
        };
    }
}

fn report_fill<P: Protocol>(conn: &Conn<P>, f: crate::staging::Filled) {
    if f.calls > 0 || f.moved > 0 {
        conn.proto.on_io(IoEvent::Received {
            calls: f.calls,
            moved: f.moved,
        });
    }
}

/// Backpressure: waits while the budgets are spent; false when the socket
/// died meanwhile.
async fn wait_budget<P: Protocol>(conn: &Conn<P>) -> bool {
    poll_fn(|cx| {
        if conn.dead.get() || conn.has_budget() {
            Poll::Ready(())
        } else {
            *conn.receiver.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        }
    })
    .await;
    !conn.dead.get()
}

/// Waits until the protocol lets a parked receiver go on; false when the
/// socket died meanwhile.
async fn park<P: Protocol>(conn: &Conn<P>) -> bool {
    poll_fn(|cx| {
        if conn.dead.get() || conn.proto.may_resume() {
            Poll::Ready(())
        } else {
            *conn.receiver.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        }
    })
    .await;
    !conn.dead.get()
}

/// Receives one payload into `buf[off..off + len]`; `None` when the socket
/// ended (nothing was executed).
async fn payload<P: Protocol>(
    conn: &Conn<P>,
    st: &mut Staging,
    buf: Option<IoBuf>,
    off: usize,
    len: usize,
    via: Via,
) -> Option<IoBuf> {
    let mut buf = match buf {
        Some(b) => b,
        None => {
            let mut b = IoBuf::alloc(off + len).await;
            b.set_len(off + len);
            b
        }
    };
    assert!(off + len <= buf.capacity(), "payload beyond its buffer");
    let fd = conn.raw_fd();
    match via {
        Via::Staging => {
            let f = st
                .fill(fd, len, || usize::MAX, conn.cfg.recv_mode)
                .await
                .ok()?;
            report_fill(conn, f);
            let n = st.take_into(&mut buf.spare_mut()[off..off + len]);
            debug_assert_eq!(n, len);
            conn.proto.on_io(IoEvent::Copied { bytes: n });
        }
        Via::Direct { tail } => {
            let seg = Seg {
                // SAFETY: off + len <= capacity (asserted above).
                ptr: unsafe { buf.as_mut_ptr().add(off) },
                len,
            };
            // SAFETY: `buf` is owned by this frame for the whole call and
            // the receive is synchronous.
            let p = unsafe { st.recv_payload(fd, &[seg], tail) }.await.ok()?;
            if p.copied > 0 {
                conn.proto.on_io(IoEvent::Copied { bytes: p.copied });
            }
            if p.calls > 0 {
                conn.proto.on_io(IoEvent::Received {
                    calls: p.calls,
                    moved: 0,
                });
            }
        }
    }
    Some(buf)
}

/// Receives into the segments the protocol names ([`Protocol::place`]);
/// false when the socket ended.
async fn place<P: Protocol>(conn: &Conn<P>, st: &mut Staging, tail: usize) -> bool {
    let mut segs = [Seg {
        ptr: std::ptr::null_mut(),
        len: 0,
    }; crate::recv::MAX_RECV_IOV - 1];
    // SAFETY: the protocol keeps the segments valid and unshared until
    // the next `apply`, which follows this receive.
    let n = unsafe { conn.proto.place(&mut segs) };
    // SAFETY: as above; the receive is done when it returns.
    let Ok(p) = (unsafe { st.recv_payload(conn.raw_fd(), &segs[..n], tail) }).await else {
        return false;
    };
    if p.copied > 0 {
        conn.proto.on_io(IoEvent::Copied { bytes: p.copied });
    }
    if p.calls > 0 {
        conn.proto.on_io(IoEvent::Received {
            calls: p.calls,
            moved: 0,
        });
    }
    true
}

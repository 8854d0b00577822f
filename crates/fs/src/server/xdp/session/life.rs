//! The engine's waiting and its clean-up.
//!
//! - The volume's lock: taken with `try_lock` on the reactor (only where
//!   the region's pages never leave memory, so a commit's msync does not
//!   sleep); when it is busy, or the region may fault, the request runs
//!   on the offload pool and its outcome comes back through the
//!   [`Inbox`], which wakes the export's task.
//! - A placement's deadline: when its slots are not all filled within
//!   [`GRANT_DEADLINE`] (the client vanished), the socket is closed and a
//!   new one bound over the same UMEM. Only that takes the slots back out
//!   of the kernel's fill ring; the write fails with EIO. The bind waits
//!   (a timer, not a sleep) until the kernel has released the queue.
//! - Idle sessions expire after [`SESSION_IDLE`]; a pending write's blocks
//!   go back.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ustor_net::xdp::XskSocket;

use super::place::GRANT_DEADLINE;
use super::{bump, Engine, Key};
use crate::fs::WritePlan;
use crate::proto::Header;
use crate::server::xdp::{Counters, Notify};
use crate::server::Inner;

/// A session with no frame for this long is dropped.
pub(crate) const SESSION_IDLE: Duration = Duration::from_secs(60);
/// How often idle sessions are looked for.
const SWEEP: Duration = Duration::from_secs(5);
/// How soon a rebuilt socket tries to bind again.
const REBIND: Duration = Duration::from_millis(1);

/// What a request under the volume's lock came to.
pub(crate) enum Outcome {
    /// A final reply.
    Reply(Vec<u8>),
    /// A write's plan (or errno): its grant goes out next.
    Planned {
        h: Header,
        plan: Result<Box<WritePlan>, i32>,
        crc: u32,
    },
    /// Nothing to send.
    Quiet,
}

pub(crate) type Work = Box<dyn FnOnce(&mut Inner, &Counters) -> Outcome + Send>;

/// Outcomes of requests that ran on the pool, for the export's task.
pub(crate) struct Inbox {
    done: Mutex<Vec<(Key, u64, Outcome)>>,
    notify: Arc<Notify>,
}

impl Inbox {
    pub(crate) fn new(notify: Arc<Notify>) -> Inbox {
        Inbox {
            done: Mutex::new(Vec::new()),
            notify,
        }
    }

    fn push(&self, key: Key, rid: u64, o: Outcome) {
        self.done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((key, rid, o));
        self.notify.wake();
    }
}

impl Engine {
    /// Runs `w` under the volume's lock: here when the lock is free and
    /// the region cannot fault, else on the offload pool.
    pub(super) fn with_vol(&mut self, key: Key, rid: u64, w: Work) {
        let svc = self.svc.clone();
        if !svc.vol.may_fault {
            if let Some(mut g) = svc.vol.try_lock() {
                let o = w(&mut g, &self.c);
                drop(g);
                return self.on_outcome(key, rid, o);
            }
        }
        self.jobs += 1;
        bump(&self.svc.offloaded, 1);
        let (svc, c, inbox) = (self.svc.clone(), self.c.clone(), self.inbox.clone());
        // The outcome comes back through the inbox, not this future.
        drop(crate::server::offload::offload(move || {
            let o = w(&mut svc.vol.lock(), &c);
            inbox.push(key, rid, o);
        }));
    }

    /// Finishes requests that ran on the pool.
    pub(super) fn drain_inbox(&mut self) -> bool {
        let done = std::mem::take(&mut *self.inbox.done.lock().unwrap_or_else(|e| e.into_inner()));
        let any = !done.is_empty();
        for (key, rid, o) in done {
            self.jobs -= 1;
            self.on_outcome(key, rid, o);
        }
        any
    }

    fn on_outcome(&mut self, key: Key, rid: u64, o: Outcome) {
        match o {
            Outcome::Reply(rep) => self.finish(key, rid, rep),
            Outcome::Planned { h, plan, crc } => match plan {
                Ok(plan) => self.planned(key, rid, h, *plan, crc),
                Err(errno) => self.reply_err(key, rid, h.op, h.tag, errno),
            },
            Outcome::Quiet => {}
        }
    }

    /// When the task must look again although no frame comes: a
    /// placement's deadline, a bind to retry, the next sweep of idle
    /// sessions. `None`: only a frame or the inbox wakes it.
    pub(crate) fn next_wake(&self) -> Option<Instant> {
        let mut t = self.placing.as_ref().map(|p| p.until);
        if self.down {
            t = Some(self.now + REBIND);
        }
        if !self.sessions.is_empty() {
            t = Some(t.map_or(self.next_sweep, |t| t.min(self.next_sweep)));
        }
        t
    }

    /// Acts on deadlines that passed; returns whether any did.
    pub(super) fn deadlines(&mut self) -> bool {
        let mut any = false;
        if self.placing.as_ref().is_some_and(|p| p.until <= self.now) {
            self.rebuild();
            any = true;
        }
        if self.now >= self.next_sweep {
            self.next_sweep = self.now + SWEEP;
            any |= self.sweep();
        }
        any
    }

    /// Drops sessions idle for [`SESSION_IDLE`] (not one placing or with
    /// requests waiting).
    fn sweep(&mut self) -> bool {
        let now = self.now;
        let placing = self.placing.as_ref().map(|p| p.key);
        let old: Vec<Key> = self
            .sessions
            .iter()
            .filter(|(k, s)| {
                now.duration_since(s.seen) >= SESSION_IDLE
                    && placing != Some(**k)
                    && !self.held.iter().any(|e| e.0 == **k)
            })
            .map(|(k, _)| *k)
            .collect();
        for k in &old {
            if let Some(p) = self.sessions.remove(k).and_then(|s| s.write) {
                self.drop_write(p);
            }
            bump(&self.c.sessions_expired, 1);
        }
        !old.is_empty()
    }

    /// Takes the slots of an expired placement back out of the kernel:
    /// closes the socket and opens a new one over the same UMEM.
    fn rebuild(&mut self) {
        let cfg = *self.xsk.config();
        let (ptr, len) = (self.umem.ptr, self.umem.len);
        // SAFETY: the engine's own UMEM mapping, as for the first socket;
        // it outlives the socket (the engine's field order).
        let new = match unsafe { XskSocket::with_area_unbound(cfg, ptr, len) } {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("fs xdp: a new socket for an expired grant: {e}");
                if let Some(p) = self.placing.as_mut() {
                    p.until = self.now + GRANT_DEADLINE;
                }
                return;
            }
        };
        bump(&self.c.grants_expired, 1);
        // Frames already received are lost with the old socket; their
        // senders resend. Once it is closed the kernel writes no more
        // frames into the UMEM (the release waits for the receive path).
        // Nothing else holds it: the task's io_uring poll is on the epoll
        // set, and the socket leaves the set as it closes.
        drop(std::mem::replace(&mut self.xsk, new));
        if let Err(e) = super::watch(&self.ep, std::os::fd::AsRawFd::as_raw_fd(&self.xsk)) {
            tracing::warn!("fs xdp: watching the new socket: {e}");
        }
        self.down = true;
        self.tx.clear();
        self.reset_buffers();
        let pl = self.placing.take().expect("placing");
        self.restore(&pl.saved);
        self.fail_write(pl.key, libc::EIO);
        // Grants of writes going on in fragments point at buffers of the
        // old socket: those clients resend and get new ones.
        self.regrant.clear();
        self.try_up();
    }

    /// Binds a rebuilt socket and steers frames to it again.
    pub(super) fn try_up(&mut self) -> bool {
        match self.xsk.try_bind() {
            Ok(true) => {}
            Ok(false) => return false,
            Err(e) => {
                tracing::warn!("fs xdp: binding a new socket: {e}");
                return false;
            }
        }
        let q = self.xsk.config().queue;
        if let Err(e) = self
            .prog
            .register(q, std::os::fd::AsRawFd::as_raw_fd(&self.xsk))
        {
            tracing::warn!("fs xdp: steering to the new socket: {e}");
        }
        self.down = false;
        self.refill();
        true
    }
}

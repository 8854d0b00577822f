//! The target's sessions as logins and task management see them, across
//! reactors: a registry of every normal session in full feature phase
//! ([`Sessions`], one [`SessionCtl`] each: its TSIH, I_T nexus, node,
//! negotiated parameters, connection IDs and command window) and the
//! reactor-local parts of each session ([`crate::sess::Sess`], found by
//! TSIH on their reactor). A session's connections run where the
//! listener placed them: a reactor with connections of a session has a
//! part of it. A session stays registered while a part of it or a
//! connection on its way to one ([`Ticket`]) is left. Work on a session
//! (end it for session reinstatement, abort its tasks for a reset) is
//! sent to every reactor and waited for here with a [`Signal`], never by
//! blocking a reactor.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::future::{poll_fn, Future};
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};
use std::time::Duration;

use ustor_runtime::RuntimeHandle;

use crate::login::LoginFail;
use crate::negotiate::Params;
use crate::sess::{Sess, Window};

/// How long a login waits for the session it reinstates to end, and a
/// reset for other sessions' tasks to end.
pub(crate) const OTHERS_TIMEOUT: Duration = Duration::from_secs(10);

/// A one-shot event another thread can wait for without blocking.
#[derive(Default)]
pub struct Signal {
    st: Mutex<(bool, Vec<Waker>)>,
}

impl Signal {
    fn lock(&self) -> MutexGuard<'_, (bool, Vec<Waker>)> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set(&self) {
        let w = {
            let mut g = self.lock();
            g.0 = true;
            std::mem::take(&mut g.1)
        };
        w.into_iter().for_each(Waker::wake);
    }

    pub(crate) async fn wait(&self) {
        poll_fn(|cx| {
            let mut g = self.lock();
            if g.0 {
                return Poll::Ready(());
            }
            g.1.push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}

/// One normal session, as every reactor sees it.
pub struct SessionCtl {
    pub tsih: u16,
    pub initiator: String,
    pub isid: [u8; 6],
    /// The target node's full name.
    pub node: String,
    /// The portal group it logged in through.
    pub tag: u32,
    /// The session-wide parameters its leading login negotiated.
    pub params: Params,
    /// Its command window, shared by every part.
    pub window: Arc<Window>,
    /// The CIDs of its connections (reserved at login).
    cids: Mutex<Vec<u16>>,
    /// Its parts and the connections on their way to one; 0: ended.
    users: AtomicUsize,
    /// Set when its last part has ended.
    pub ended: Signal,
}

impl SessionCtl {
    fn cids(&self) -> MutexGuard<'_, Vec<u16>> {
        self.cids.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a place for connection `cid`: a CID in use is a connection
    /// reinstatement (the old one is to be replaced: `true`), a new one
    /// must fit under MaxConnections.
    pub(crate) fn reserve(&self, cid: u16) -> Result<bool, LoginFail> {
        let mut c = self.cids();
        if c.contains(&cid) {
            return Ok(true);
        }
        if c.len() >= self.params.max_connections.max(1) as usize {
            return Err(LoginFail::TooManyConnections);
        }
        c.push(cid);
        Ok(false)
    }

    /// The connection `cid` has gone (not replaced by another).
    pub(crate) fn release(&self, cid: u16) {
        self.cids().retain(|c| *c != cid);
    }

    /// Its connections, on every reactor.
    pub(crate) fn connections(&self) -> usize {
        self.cids().len()
    }

    /// Whether its connections may be on several reactors (it may have
    /// more than one).
    pub(crate) fn several(&self) -> bool {
        self.params.max_connections > 1
    }

    /// Keeps the session registered for a connection on its way to it;
    /// `NoSession` once it has ended.
    pub(crate) fn ticket(self: &Arc<Self>, sessions: &Arc<Sessions>) -> Result<Ticket, LoginFail> {
        self.users
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                (u > 0).then_some(u + 1)
            })
            .map_err(|_| LoginFail::NoSession)?;
        Ok(Ticket {
            sessions: sessions.clone(),
            ctl: self.clone(),
        })
    }
}

/// Keeps a session registered: held by each of its parts and by each
/// connection between its login and its part. The last one to go ends
/// the session (its TSIH is free, its end signalled).
pub struct Ticket {
    sessions: Arc<Sessions>,
    ctl: Arc<SessionCtl>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.ctl.users.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let tsih = self.ctl.tsih;
        let mut m = self.sessions.lock();
        if m.get(&tsih).is_some_and(|c| Arc::ptr_eq(c, &self.ctl)) {
            m.remove(&tsih);
        }
        drop(m);
        self.ctl.ended.set();
    }
}

/// Every normal session of one target, by TSIH.
#[derive(Default)]
pub struct Sessions {
    map: Mutex<BTreeMap<u16, Arc<SessionCtl>>>,
}

thread_local! {
    /// This reactor's session parts: (registry address, TSIH, part).
    static LOCAL: RefCell<Vec<(usize, u16, Weak<Sess>)>> = const { RefCell::new(Vec::new()) };
}

/// Lists a part on its reactor and keeps its session registered; it
/// drops with the part.
pub struct LocalGuard {
    _ticket: Ticket,
}

impl Drop for LocalGuard {
    fn drop(&mut self) {
        // The part is being dropped (no strong reference left): its entry
        // and any other dead one go. try_with: a part may drop while its
        // reactor's thread ends.
        let _ = LOCAL.try_with(|l| l.borrow_mut().retain(|e| e.2.strong_count() > 0));
    }
}

impl Sessions {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<u16, Arc<SessionCtl>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a session has this TSIH.
    pub(crate) fn has(&self, tsih: u16) -> bool {
        self.lock().contains_key(&tsih)
    }

    /// Whether `node` has room for one more session of this initiator
    /// port: fewer than `max` sessions besides the ones a new session of
    /// the port reinstates (checked before they are ended, so a login
    /// over the cap disturbs nothing).
    pub(crate) fn room(
        &self,
        node: &str,
        initiator: &str,
        isid: &[u8; 6],
        max: usize,
    ) -> Result<(), LoginFail> {
        let m = self.lock();
        let others = m
            .values()
            .filter(|c| c.node == node)
            .filter(|c| c.initiator != initiator || c.isid != *isid)
            .count();
        if others >= max {
            return Err(LoginFail::Resources);
        }
        Ok(())
    }

    /// A new session's entry (its connection `cid` counted, the ticket
    /// its first part takes over), if `node` has fewer than `max`
    /// sessions (checked and entered at once, so logins racing for the
    /// last place cannot both take it). `window` is its command window.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add(
        self: &Arc<Self>,
        tsih: u16,
        initiator: &str,
        isid: [u8; 6],
        node: &str,
        tag: u32,
        params: Params,
        cid: u16,
        max: usize,
        window: Arc<Window>,
    ) -> Result<(Arc<SessionCtl>, Ticket), LoginFail> {
        let mut m = self.lock();
        if m.values().filter(|c| c.node == node).count() >= max {
            return Err(LoginFail::Resources);
        }
        let ctl = Arc::new(SessionCtl {
            tsih,
            initiator: initiator.to_string(),
            isid,
            node: node.to_string(),
            tag,
            params,
            window,
            cids: Mutex::new(vec![cid]),
            users: AtomicUsize::new(1),
            ended: Signal::default(),
        });
        m.insert(tsih, ctl.clone());
        let t = Ticket {
            sessions: self.clone(),
            ctl: ctl.clone(),
        };
        Ok((ctl, t))
    }

    /// The session a connection with a non-zero TSIH wants to join; it
    /// must be the same initiator port (name and ISID), node and portal
    /// group (RFC 7143 §6.3.1, §11.13.5).
    pub(crate) fn joinable(
        &self,
        tsih: u16,
        initiator: &str,
        isid: &[u8; 6],
        node: &str,
        tag: u32,
    ) -> Result<Arc<SessionCtl>, LoginFail> {
        let m = self.lock();
        let c = m.get(&tsih).ok_or(LoginFail::NoSession)?;
        if c.initiator != initiator || c.isid != *isid || c.node != node {
            return Err(LoginFail::NoSession);
        }
        if c.tag != tag {
            return Err(LoginFail::CantInclude);
        }
        Ok(c.clone())
    }

    /// The sessions of this initiator port on this node (what a leading
    /// login with TSIH 0 reinstates).
    pub(crate) fn same_nexus(
        &self,
        initiator: &str,
        isid: &[u8; 6],
        node: &str,
    ) -> Vec<Arc<SessionCtl>> {
        let m = self.lock();
        m.values()
            .filter(|c| c.initiator == initiator && c.isid == *isid && c.node == node)
            .cloned()
            .collect()
    }

    /// Every session of `node`.
    pub(crate) fn of_node(&self, node: &str) -> Vec<Arc<SessionCtl>> {
        self.lock()
            .values()
            .filter(|c| c.node == node)
            .cloned()
            .collect()
    }

    /// Lists part `sess` on this reactor until the guard drops; the
    /// guard holds `ticket`.
    pub(crate) fn register_local(
        self: &Arc<Self>,
        ctl: &Arc<SessionCtl>,
        sess: &Rc<Sess>,
        ticket: Ticket,
    ) -> LocalGuard {
        let key = Arc::as_ptr(self) as usize;
        LOCAL.with(|l| l.borrow_mut().push((key, ctl.tsih, Rc::downgrade(sess))));
        LocalGuard { _ticket: ticket }
    }

    /// The parts of session `tsih` on this reactor (an ending one may be
    /// there beside a new one).
    pub(crate) fn locals(self: &Arc<Self>, tsih: u16) -> Vec<Rc<Sess>> {
        let key = Arc::as_ptr(self) as usize;
        LOCAL.with(|l| {
            l.borrow()
                .iter()
                .filter(|e| (e.0, e.1) == (key, tsih))
                .filter_map(|e| e.2.upgrade())
                .collect()
        })
    }

    /// Runs `f` with every part of session `tsih`, each on its reactor,
    /// and waits for all of them; their results.
    pub(crate) async fn on_parts<F, Fut, R>(
        self: &Arc<Self>,
        rt: &RuntimeHandle,
        tsih: u16,
        f: F,
    ) -> Vec<R>
    where
        F: Fn(Rc<Sess>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = R> + 'static,
        R: Send + 'static,
    {
        let n = rt.num_reactors();
        let out = Arc::new(Mutex::new(Vec::new()));
        let left = Arc::new(AtomicUsize::new(n));
        let done = Arc::new(Signal::default());
        let f = Arc::new(f);
        let one_less = |left: &AtomicUsize, done: &Signal| {
            if left.fetch_sub(1, Ordering::AcqRel) == 1 {
                done.set();
            }
        };
        for r in 0..n {
            let (me, f, out) = (self.clone(), f.clone(), out.clone());
            let (l, d) = (left.clone(), done.clone());
            let sent = rt.spawn_on(r, move || async move {
                for s in me.locals(tsih) {
                    let v = f(s).await;
                    out.lock().unwrap_or_else(|p| p.into_inner()).push(v);
                }
                one_less(&l, &d);
            });
            if sent.is_err() {
                one_less(&left, &done);
            }
        }
        if ustor_net::time::timeout(OTHERS_TIMEOUT, done.wait())
            .await
            .is_none()
        {
            tracing::warn!("iscsi: session {tsih:#x} did not answer in time");
        }
        let mut g = out.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut *g)
    }

    /// Tells every part of session `tsih` to end, without waiting (a
    /// connection that failed: ERL 0 ends the session).
    pub(crate) fn end_now(self: &Arc<Self>, rt: &RuntimeHandle, tsih: u16) {
        for r in 0..rt.num_reactors() {
            let me = self.clone();
            let _ = rt.spawn_on(r, move || async move {
                me.locals(tsih).iter().for_each(|s| s.end());
            });
        }
    }

    /// Ends the session of `ctl` (every connection closed, its tasks
    /// aborted) and waits until it has ended: session reinstatement, a
    /// cold reset.
    pub(crate) async fn end(self: &Arc<Self>, rt: &RuntimeHandle, ctl: &Arc<SessionCtl>) {
        tracing::info!("iscsi: session {:#x} of {} ends", ctl.tsih, ctl.initiator);
        self.on_parts(rt, ctl.tsih, |s| async move { s.end() })
            .await;
        if ustor_net::time::timeout(OTHERS_TIMEOUT, ctl.ended.wait())
            .await
            .is_none()
        {
            tracing::warn!("iscsi: reinstated session {:#x} still running", ctl.tsih);
        }
    }
}

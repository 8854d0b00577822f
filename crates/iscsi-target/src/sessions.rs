//! The target's sessions as logins and task management see them, across
//! reactors: a registry of every normal session in full feature phase
//! ([`Sessions`], one [`SessionCtl`] each: its TSIH, I_T nexus, node,
//! reactor, negotiated parameters and connection IDs) and the reactor-local
//! side of each session ([`crate::sess::Sess`], found by TSIH on its own
//! reactor). A session runs on one reactor: a connection that joins it
//! (MC/S, connection reinstatement) is moved there after its login.
//! Work on another session (end it for session reinstatement, abort its
//! tasks for a reset) is sent to its reactor and waited for here with a
//! [`Signal`], never by blocking a reactor.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::future::poll_fn;
use std::rc::{Rc, Weak};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};
use std::time::Duration;

use ustor_runtime::RuntimeHandle;

use crate::login::LoginFail;
use crate::negotiate::Params;
use crate::sess::Sess;

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
    /// The reactor its connections run on.
    pub reactor: usize,
    /// The session-wide parameters its leading login negotiated.
    pub params: Params,
    /// The CIDs of its connections (reserved at login, before the move).
    cids: Mutex<Vec<u16>>,
    /// Set when its last connection has ended.
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
}

/// Every normal session of one target, by TSIH.
#[derive(Default)]
pub struct Sessions {
    map: Mutex<BTreeMap<u16, Arc<SessionCtl>>>,
}

thread_local! {
    /// This reactor's sessions: (registry address, TSIH, session).
    static LOCAL: RefCell<Vec<(usize, u16, Weak<Sess>)>> = const { RefCell::new(Vec::new()) };
}

/// Takes the session off its reactor's list and the registry when the
/// session ends, and signals its end.
pub struct LocalGuard {
    sessions: Arc<Sessions>,
    ctl: Arc<SessionCtl>,
}

impl Drop for LocalGuard {
    fn drop(&mut self) {
        let key = Arc::as_ptr(&self.sessions) as usize;
        let tsih = self.ctl.tsih;
        // try_with: a session may drop while its reactor's thread ends.
        let _ = LOCAL.try_with(|l| l.borrow_mut().retain(|e| (e.0, e.1) != (key, tsih)));
        let mut m = self.sessions.lock();
        if m.get(&tsih).is_some_and(|c| Arc::ptr_eq(c, &self.ctl)) {
            m.remove(&tsih);
        }
        drop(m);
        self.ctl.ended.set();
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

    /// A new session's entry (its connection `cid` counted), if `node`
    /// has fewer than `max` sessions (checked and entered at once, so
    /// logins racing for the last place cannot both take it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add(
        &self,
        tsih: u16,
        initiator: &str,
        isid: [u8; 6],
        node: &str,
        tag: u32,
        params: Params,
        cid: u16,
        max: usize,
    ) -> Result<Arc<SessionCtl>, LoginFail> {
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
            reactor: ustor_runtime::reactor_id(),
            params,
            cids: Mutex::new(vec![cid]),
            ended: Signal::default(),
        });
        m.insert(tsih, ctl.clone());
        Ok(ctl)
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

    /// Drops a session that never started on its reactor.
    pub(crate) fn forget(&self, ctl: &Arc<SessionCtl>) {
        let mut m = self.lock();
        if m.get(&ctl.tsih).is_some_and(|c| Arc::ptr_eq(c, ctl)) {
            m.remove(&ctl.tsih);
        }
        drop(m);
        ctl.ended.set();
    }

    /// Every session of `node`.
    pub(crate) fn of_node(&self, node: &str) -> Vec<Arc<SessionCtl>> {
        self.lock()
            .values()
            .filter(|c| c.node == node)
            .cloned()
            .collect()
    }

    /// Lists `sess` on this (its) reactor until the guard drops.
    pub(crate) fn register_local(
        self: &Arc<Self>,
        ctl: &Arc<SessionCtl>,
        sess: &Rc<Sess>,
    ) -> LocalGuard {
        let key = Arc::as_ptr(self) as usize;
        LOCAL.with(|l| l.borrow_mut().push((key, ctl.tsih, Rc::downgrade(sess))));
        LocalGuard {
            sessions: self.clone(),
            ctl: ctl.clone(),
        }
    }

    /// The session `tsih` if it runs on this reactor.
    pub(crate) fn local(self: &Arc<Self>, tsih: u16) -> Option<Rc<Sess>> {
        let key = Arc::as_ptr(self) as usize;
        LOCAL.with(|l| {
            l.borrow()
                .iter()
                .find(|e| (e.0, e.1) == (key, tsih))
                .and_then(|e| e.2.upgrade())
        })
    }

    /// Runs `f` on the reactor of `ctl`'s session with that session (if it
    /// still runs) and waits for the future it returns to finish.
    pub(crate) async fn on_session<F, Fut>(
        self: &Arc<Self>,
        rt: &RuntimeHandle,
        ctl: &SessionCtl,
        f: F,
    ) where
        F: FnOnce(Rc<Sess>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + 'static,
    {
        let done = Arc::new(Signal::default());
        let (me, tsih, d) = (self.clone(), ctl.tsih, done.clone());
        let sent = rt.spawn_on(ctl.reactor, move || async move {
            if let Some(s) = me.local(tsih) {
                f(s).await;
            }
            d.set();
        });
        if sent.is_ok()
            && ustor_net::time::timeout(OTHERS_TIMEOUT, done.wait())
                .await
                .is_none()
        {
            tracing::warn!("iscsi: session {tsih:#x} did not answer in time");
        }
    }

    /// Ends the session of `ctl` (every connection closed, its tasks
    /// aborted) and waits until it has ended: session reinstatement, a
    /// cold reset.
    pub(crate) async fn end(self: &Arc<Self>, rt: &RuntimeHandle, ctl: &Arc<SessionCtl>) {
        tracing::info!("iscsi: session {:#x} of {} ends", ctl.tsih, ctl.initiator);
        self.on_session(rt, ctl, |s| async move { s.end() }).await;
        if ustor_net::time::timeout(OTHERS_TIMEOUT, ctl.ended.wait())
            .await
            .is_none()
        {
            tracing::warn!("iscsi: reinstated session {:#x} still running", ctl.tsih);
        }
    }
}

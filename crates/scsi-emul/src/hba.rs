//! The emulated HBA's LLD half, owned by the host's reactor: faults are
//! applied first, then each command runs through the target core in a task
//! of its own and its completion is queued for [`Lld::poll`].

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use ustor_scsi::lld::{
    Completion, DataDir, HostLimits, Lld, LocalFuture, Nexus, QueueError, ScsiCmd, Tag, TargetAddr,
    TmfResult, TransportError,
};
use ustor_scsi::sense::{asc, Sense, SenseKey};
use ustor_scsi::status::ScsiStatus;
use ustor_scsi_target::{Direction, IovecData, LunTable};

use crate::{build_tables, lock, EmulShared, Fault};

struct Done {
    tag: Tag,
    status: Result<ScsiStatus, TransportError>,
    sense: [u8; 18],
    sense_len: usize,
    resid: u32,
}

/// Commands of this HBA: finished, lost on purpose, and running.
#[derive(Default)]
struct Queues {
    done: RefCell<VecDeque<Done>>,
    /// Commands that will never complete by themselves (timeouts, drops).
    hung: RefCell<Vec<(Tag, Nexus)>>,
    /// Commands whose task is running: their buffers are in use until it
    /// ends, so task management waits for them.
    running: RefCell<Vec<(Tag, Nexus)>>,
}

impl Queues {
    fn push(
        &self,
        tag: Tag,
        status: Result<ScsiStatus, TransportError>,
        sense: Option<Sense>,
        resid: u32,
    ) {
        let mut d = Done {
            tag,
            status,
            sense: [0; 18],
            sense_len: 0,
            resid,
        };
        if let Some(s) = sense {
            d.sense_len = s.encode_fixed(&mut d.sense);
        }
        self.done.borrow_mut().push_back(d);
    }

    fn len(&self) -> usize {
        self.done.borrow().len() + self.hung.borrow().len() + self.running.borrow().len()
    }

    /// Waits until no running command matches `f`.
    async fn quiesce(&self, f: impl Fn(&(Tag, Nexus)) -> bool) {
        while self.running.borrow().iter().any(&f) {
            ustor_runtime::yield_now().await;
        }
    }
}

pub(crate) struct EmulHba {
    st: Arc<EmulShared>,
    q: Rc<Queues>,
    tables: RefCell<Vec<(u32, Rc<LunTable>)>>,
    version: Cell<u64>,
}

impl EmulHba {
    pub(crate) fn new(st: Arc<EmulShared>) -> EmulHba {
        let limit = st.limits.can_queue as usize;
        let q = Queues {
            done: RefCell::new(VecDeque::with_capacity(limit)),
            ..Queues::default()
        };
        let hba = EmulHba {
            st,
            q: Rc::new(q),
            tables: RefCell::new(Vec::new()),
            version: Cell::new(u64::MAX),
        };
        hba.sync();
        hba
    }

    /// Catches up with the handle: LUNs added or removed, unit attentions.
    fn sync(&self) {
        let v = self.st.version.load(Ordering::Acquire);
        if v != self.version.get() {
            let luns = lock(&self.st.luns);
            let t = build_tables(&self.st.targets, &luns, &self.tables.borrow());
            *self.tables.borrow_mut() = t;
            self.version.set(v);
        }
        let ua: Vec<_> = std::mem::take(&mut *lock(&self.st.ua));
        for (t, l, s) in ua {
            if let Some(lu) = self.table(t).as_ref().and_then(|tb| tb.get(l)) {
                lu.set_ua(Some(s));
            }
        }
    }

    fn table(&self, target: u32) -> Option<Rc<LunTable>> {
        let t = self.tables.borrow();
        t.iter()
            .find(|(x, _)| *x == target)
            .map(|(_, tb)| tb.clone())
    }

    fn fault_for(&self, cmd: &ScsiCmd) -> Option<Fault> {
        let mut f = lock(&self.st.faults);
        f.iter_mut()
            .find_map(|r| r.hit(cmd.nexus.lun, cmd.cdb.opcode()))
    }

    /// Runs `cmd` through the target core in a task; `drop_completion`
    /// executes it but loses the completion (it joins the hung commands).
    fn start(&self, cmd: &ScsiCmd, drop_completion: bool) {
        let table = self.table(cmd.nexus.target).unwrap_or_default();
        let q = self.q.clone();
        let (tag, nexus, cdb) = (cmd.tag, cmd.nexus, cmd.cdb);
        let dir = match cmd.dir {
            DataDir::None => Direction::None,
            DataDir::ToDevice => Direction::ToDevice,
            DataDir::FromDevice => Direction::FromDevice,
        };
        let (iov, iovcnt) = (cmd.iov, cmd.iovcnt);
        q.running.borrow_mut().push((tag, nexus));
        ustor_runtime::spawn(async move {
            let iovs = if iovcnt == 0 || iov.is_null() {
                &[][..]
            } else {
                // SAFETY: the mid-layer keeps the iovecs and their buffers
                // valid until the command completes, is aborted or reset;
                // abort and resets wait for this task (`running`) first.
                unsafe { std::slice::from_raw_parts(iov, iovcnt) }
            };
            // SAFETY: as above; nothing else touches the buffers meanwhile.
            let mut data = unsafe { IovecData::new(dir, iovs) };
            let r = table.execute(nexus.lun, cdb.as_bytes(), &mut data).await;
            q.running.borrow_mut().retain(|(t, _)| *t != tag);
            if drop_completion {
                q.hung.borrow_mut().push((tag, nexus));
                return;
            }
            match r {
                Ok(o) => q.push(tag, Ok(o.status), o.sense, o.resid),
                Err(_) => q.push(tag, Err(TransportError::Disconnected), None, 0),
            }
        });
    }
}

impl Lld for EmulHba {
    fn name(&self) -> &str {
        "emul"
    }

    fn limits(&self) -> HostLimits {
        self.st.limits
    }

    fn queuecommand(&self, cmd: &ScsiCmd) -> Result<(), QueueError> {
        if self.q.len() >= self.st.limits.can_queue as usize {
            return Err(QueueError::HostBusy);
        }
        self.sync();
        self.st.ops[cmd.cdb.opcode() as usize].fetch_add(1, Ordering::Relaxed);
        let q = &self.q;
        match self.fault_for(cmd) {
            Some(Fault::Timeout) => q.hung.borrow_mut().push((cmd.tag, cmd.nexus)),
            Some(Fault::DropCompletion) => self.start(cmd, true),
            Some(Fault::Check(s)) => q.push(
                cmd.tag,
                Ok(ScsiStatus::CheckCondition),
                Some(s),
                cmd.data_len,
            ),
            Some(Fault::Busy) => q.push(cmd.tag, Ok(ScsiStatus::Busy), None, cmd.data_len),
            Some(Fault::TaskSetFull) => {
                q.push(cmd.tag, Ok(ScsiStatus::TaskSetFull), None, cmd.data_len)
            }
            None => self.start(cmd, false),
        }
        Ok(())
    }

    fn poll(&self, budget: usize, done: &mut dyn FnMut(Completion<'_>)) -> usize {
        let mut n = 0;
        while n < budget {
            let Some(d) = self.q.done.borrow_mut().pop_front() else {
                break;
            };
            done(Completion {
                tag: d.tag,
                status: d.status,
                sense: &d.sense[..d.sense_len],
                resid: d.resid,
            });
            n += 1;
        }
        n
    }

    fn scan(&self) -> LocalFuture<'_, Result<Vec<TargetAddr>, TransportError>> {
        let t = self
            .st
            .targets
            .iter()
            .map(|&t| TargetAddr {
                channel: 0,
                target: t,
                name: format!("emul-target{t}"),
                luns: Vec::new(),
            })
            .collect();
        Box::pin(async move { Ok(t) })
    }

    fn abort(&self, tag: Tag, _nexus: Nexus) -> LocalFuture<'_, TmfResult> {
        self.st.aborts.fetch_add(1, Ordering::Relaxed);
        let fails = lock(&self.st.tmf).abort_fails;
        Box::pin(async move {
            if fails {
                return TmfResult::Failed;
            }
            self.q.quiesce(|(t, _)| *t == tag).await;
            self.q.hung.borrow_mut().retain(|(t, _)| *t != tag);
            self.q.done.borrow_mut().retain(|d| d.tag != tag);
            TmfResult::Success
        })
    }

    fn device_reset(&self, nexus: Nexus) -> LocalFuture<'_, TmfResult> {
        self.st.lun_resets.fetch_add(1, Ordering::Relaxed);
        let fails = lock(&self.st.tmf).device_reset_fails;
        Box::pin(async move {
            if fails {
                return TmfResult::Failed;
            }
            self.q.quiesce(|(_, n)| *n == nexus).await;
            self.q.hung.borrow_mut().retain(|(_, n)| *n != nexus);
            self.sync();
            if let Some(lu) = self
                .table(nexus.target)
                .as_ref()
                .and_then(|t| t.get(nexus.lun))
            {
                lu.set_ua(Some(Sense::new(
                    SenseKey::UnitAttention,
                    asc::POWER_ON_RESET,
                )));
            }
            TmfResult::Success
        })
    }

    fn host_reset(&self) -> LocalFuture<'_, TmfResult> {
        self.st.host_resets.fetch_add(1, Ordering::Relaxed);
        let fails = lock(&self.st.tmf).host_reset_fails;
        Box::pin(async move {
            if fails {
                return TmfResult::Failed;
            }
            self.q.quiesce(|_| true).await;
            self.q.hung.borrow_mut().clear();
            self.q.done.borrow_mut().clear();
            self.sync();
            for (_, t) in self.tables.borrow().iter() {
                t.reset_all();
            }
            TmfResult::Success
        })
    }

    fn info(&self) -> serde_json::Value {
        serde_json::json!({"targets": self.st.targets.len()})
    }
}

//! The SG_IO passthrough LLD: real SCSI devices behind any kernel HBA
//! driver, reached through their /dev/sgN nodes with the asynchronous sg
//! v3 interface. One sg node is one target (LUN 0) of the host.
//!
//! Data path (no allocation, no blocking):
//! - `queuecommand` fills the slot's preallocated `sg_io_hdr` (CDB, sense
//!   buffer, the command's iovecs, pack_id = tag, usr_ptr = slot) and
//!   queues an `IORING_OP_WRITE` of it on the reactor's ring, so the
//!   submission rides the loop pass's one `io_uring_enter`. sg has no
//!   non-blocking write hook, so the kernel runs the write in an io-wq
//!   worker; it only copies the header, CDB and data-out and queues the
//!   request, so it returns at once.
//! - Completions are announced by a multishot `IORING_OP_POLL_ADD`
//!   (POLLIN) on each sg fd; `Lld::poll` then `read()`s replies with the fd
//!   in O_NONBLOCK mode until EAGAIN. The read is where the kernel copies
//!   data-in and sense into our buffers, and it never blocks. (A ring READ
//!   would be punted to io-wq as well and add a thread hop per command.)
//!
//! Error handling: sg cannot abort one command, so `abort` fails for a
//! command still in flight and the mid-layer escalates to
//! `SG_SCSI_RESET_DEVICE` (then `_BUS`, `_HOST`). A successful reset also
//! closes and reopens the node: the kernel then drops the old commands'
//! replies without ever copying into our (released) buffers.

pub mod dev;
pub mod hdr;
mod slots;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use io_uring::{opcode, types};
use serde::{Deserialize, Serialize};
use serde_json::json;
use ustor_runtime::{CqeHandler, HandlerId};

use crate::lld::{
    Completion, HostLimits, Lld, LocalFuture, Nexus, QueueError, ScsiCmd, Tag, TargetAddr,
    TmfResult, TransportError,
};
use crate::status::ScsiStatus;
use dev::SgFacts;
use hdr::{Reply, SgIoHdr, SG_IO_HDR_LEN, SG_MAX_QUEUE};
use slots::{Slot, SENSE_LEN};

/// Largest transfer when sysfs does not say (no block device bound).
const DEFAULT_MAX_TRANSFER: u32 = 512 << 10;
/// Upper bound on one command's data (the sg reserve is sized to it).
const MAX_TRANSFER_CAP: u32 = 4 << 20;
/// Host command slots at most (mid-layer tags are 16-bit slot indices).
const MAX_SLOTS: u32 = 4096;
/// io_uring ops of this LLD, in the token's top bits.
const OP_WRITE: u64 = 1;
const OP_POLL: u64 = 2;
const OP_POLL_REMOVE: u64 = 3;
/// How long a reset waits for the io-wq writes of the node to finish.
const WRITE_DRAIN: Duration = Duration::from_secs(5);

/// `SgLld` configuration.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SgConfig {
    /// The sg nodes, one target each (`/dev/sg0`, ...).
    pub devices: Vec<PathBuf>,
    /// Kernel-side timeout per command (the mid-layer's own timeout and
    /// error handling normally act first).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u32,
}

fn default_timeout_ms() -> u32 {
    60_000
}

impl SgConfig {
    /// Every /dev/sgN of the machine.
    pub fn all() -> SgConfig {
        SgConfig {
            devices: dev::scan_all(),
            timeout_ms: default_timeout_ms(),
        }
    }
}

/// One sg node as the LLD drives it.
struct Node {
    facts: SgFacts,
    fd: RefCell<Option<OwnedFd>>,
    /// Bumped on every reopen: stale poll completions are ignored.
    gen: Cell<u16>,
    /// POLLIN seen and not yet read down to EAGAIN.
    ready: Cell<bool>,
    poll_armed: Cell<bool>,
    /// Commands with the kernel (at most `SG_MAX_QUEUE`).
    outstanding: Cell<u32>,
    /// Ring writes not yet completed: the kernel may still read the header.
    writes_pending: Cell<u32>,
}

impl Node {
    fn raw_fd(&self) -> Option<RawFd> {
        self.fd.borrow().as_ref().map(|f| f.as_raw_fd())
    }
}

#[derive(Default)]
struct Counters {
    commands: Cell<u64>,
    replies: Cell<u64>,
    write_errors: Cell<u64>,
    stale_replies: Cell<u64>,
    read_errors: Cell<u64>,
}

fn inc(c: &Cell<u64>) {
    c.set(c.get() + 1);
}

struct Inner {
    nodes: Box<[Node]>,
    slots: Box<[Slot]>,
    /// Slots whose write failed: reported by the next `poll`.
    failed: RefCell<VecDeque<u16>>,
    /// The header `read()` fills (one reply at a time).
    reply: RefCell<SgIoHdr>,
    handler: Cell<Option<HandlerId>>,
    limits: HostLimits,
    timeout_ms: u32,
    stats: Counters,
}

/// The SG_IO passthrough LLD.
pub struct SgLld {
    inner: Rc<Inner>,
}

fn token(op: u64, node: usize, gen: u16, slot: u16) -> u64 {
    op << 44 | (node as u64 & 0xfff) << 32 | (gen as u64) << 16 | slot as u64
}

impl SgLld {
    /// Opens every node (on the host's reactor: `ScsiStack::add_host`'s
    /// closure) and registers the completion handler with its ring.
    pub fn new(cfg: SgConfig) -> Result<SgLld, TransportError> {
        if cfg.devices.is_empty() || cfg.devices.len() > 0xfff {
            return Err(TransportError::NoDevice);
        }
        let mut nodes = Vec::with_capacity(cfg.devices.len());
        let mut max_xfer = MAX_TRANSFER_CAP;
        for p in &cfg.devices {
            let (fd, facts) = dev::open(p).map_err(|e| {
                tracing::warn!("sg: cannot open {}: errno {e}", p.display());
                TransportError::Io(e)
            })?;
            let node_max = match facts.max_sectors_kb {
                0 => DEFAULT_MAX_TRANSFER,
                kb => kb.saturating_mul(1024),
            };
            max_xfer = max_xfer.min(node_max);
            nodes.push(Node {
                facts,
                fd: RefCell::new(Some(fd)),
                gen: Cell::new(0),
                ready: Cell::new(false),
                poll_armed: Cell::new(false),
                outstanding: Cell::new(0),
                writes_pending: Cell::new(0),
            });
        }
        let max_xfer = max_xfer.max(4096);
        for n in &nodes {
            if let Some(fd) = n.raw_fd() {
                // Lets one command of the largest size use the reserve
                // buffer instead of allocating its own (best effort).
                dev::set_reserved(fd, max_xfer as i32);
            }
        }
        let can_queue = (SG_MAX_QUEUE * nodes.len() as u32).min(MAX_SLOTS);
        let limits = HostLimits {
            can_queue,
            cmd_per_lun: SG_MAX_QUEUE,
            max_transfer_bytes: max_xfer,
            // Indirect I/O: the kernel copies between its own buffers and
            // any number of user segments, whatever its HBA's table size.
            max_sg_entries: ustor_bdev::io::MAX_SEGMENTS as u32,
            dma_alignment: 1,
        };
        let inner = Rc::new(Inner {
            nodes: nodes.into_boxed_slice(),
            slots: (0..can_queue).map(|_| Slot::new()).collect(),
            failed: RefCell::new(VecDeque::with_capacity(can_queue as usize)),
            reply: RefCell::new(SgIoHdr::zeroed()),
            handler: Cell::new(None),
            limits,
            timeout_ms: cfg.timeout_ms,
            stats: Counters::default(),
        });
        let h = ustor_runtime::register_cqe_handler(inner.clone());
        inner.handler.set(Some(h));
        for i in 0..inner.nodes.len() {
            inner.arm_poll(i);
        }
        Ok(SgLld { inner })
    }
}

impl Inner {
    /// Multishot POLLIN on node `i`: one CQE per batch of finished commands.
    fn arm_poll(&self, i: usize) {
        let n = &self.nodes[i];
        let (Some(fd), Some(h)) = (n.raw_fd(), self.handler.get()) else {
            return;
        };
        let sqe = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
            .multi(true)
            .build();
        // SAFETY: the SQE names only the fd, which stays open until the
        // poll is removed (`drop_node_commands`, `Drop`).
        let ok = unsafe { ustor_runtime::submit_sqe(sqe, h, token(OP_POLL, i, n.gen.get(), 0)) };
        n.poll_armed.set(ok.is_ok());
        // Replies that finished while no poll was armed.
        n.ready.set(true);
    }

    fn remove_poll(&self, i: usize) {
        let n = &self.nodes[i];
        let Some(h) = self.handler.get() else {
            return;
        };
        if !n.poll_armed.replace(false) {
            return;
        }
        let target = (h.0 as u64) << 48 | token(OP_POLL, i, n.gen.get(), 0);
        let sqe = opcode::PollRemove::new(target).build();
        // SAFETY: a poll removal names no memory.
        let _ = unsafe { ustor_runtime::submit_sqe(sqe, h, token(OP_POLL_REMOVE, i, 0, 0)) };
    }

    fn on_write(&self, node: usize, gen: u16, slot: u16, res: i32) {
        if let Some(n) = self.nodes.get(node) {
            n.writes_pending
                .set(n.writes_pending.get().saturating_sub(1));
        }
        if res == SG_IO_HDR_LEN as i32 {
            return;
        }
        let Some(s) = self.slots.get(slot as usize) else {
            return;
        };
        if !s.busy.get() || s.seq.get() != gen {
            return;
        }
        // The kernel did not take the command: no reply will come.
        inc(&self.stats.write_errors);
        s.early.set(match -res {
            libc::EDOM | libc::EAGAIN | libc::EBUSY | libc::ENOMEM => Ok(ScsiStatus::Busy),
            libc::ENODEV | libc::ENXIO => Err(TransportError::NoDevice),
            e if e > 0 => Err(TransportError::Io(e)),
            _ => Err(TransportError::Protocol("short sg header write")),
        });
        self.failed.borrow_mut().push_back(slot);
    }

    fn on_poll(&self, node: usize, gen: u16, res: i32, flags: u32) {
        let Some(n) = self.nodes.get(node) else {
            return;
        };
        if n.gen.get() != gen {
            return;
        }
        if !io_uring::cqueue::more(flags) {
            // Multishot ended (error or overflow): `poll` re-arms it.
            n.poll_armed.set(false);
        }
        if res > 0 || res == -libc::ECANCELED {
            n.ready.set(true);
        } else if res < 0 {
            tracing::warn!(
                "sg: poll on {} failed: errno {}",
                n.facts.path.display(),
                -res
            );
        }
    }

    /// Frees a slot after its command was reported or dropped.
    fn release(&self, i: usize) {
        let s = &self.slots[i];
        if !s.busy.replace(false) {
            return;
        }
        let n = &self.nodes[s.node.get() as usize];
        n.outstanding.set(n.outstanding.get().saturating_sub(1));
    }

    /// Reads replies of node `ni` while they are ready and budget lasts.
    fn reap_node(&self, ni: usize, budget: usize, done: &mut dyn FnMut(Completion<'_>)) -> usize {
        let n = &self.nodes[ni];
        let Some(fd) = n.raw_fd() else {
            return 0;
        };
        let mut count = 0;
        while count < budget && n.ready.get() {
            let r = {
                let mut h = self.reply.borrow_mut();
                match dev::read_reply(fd, &mut h) {
                    Ok(true) => Some(Reply::of(&h)),
                    Ok(false) => None,
                    Err(e) => {
                        inc(&self.stats.read_errors);
                        tracing::warn!("sg: read on {}: errno {e}", n.facts.path.display());
                        None
                    }
                }
            };
            let Some(r) = r else {
                n.ready.set(false);
                break;
            };
            let idx = r.slot as usize;
            let valid = self.slots.get(idx).is_some_and(|s| {
                s.busy.get() && s.tag.get() == r.pack_id as u32 && s.node.get() as usize == ni
            });
            if !valid {
                inc(&self.stats.stale_replies);
                continue;
            }
            inc(&self.stats.replies);
            let s = &self.slots[idx];
            let sense_len = r.sense_len(SENSE_LEN);
            done(Completion {
                tag: s.tag.get(),
                status: r.status(),
                sense: &s.sense_bytes()[..sense_len],
                resid: r.resid(s.data_len.get()),
            });
            self.release(idx);
            count += 1;
        }
        count
    }

    /// Drops every command of node `ni` (after a reset): poll removed,
    /// ring writes finished, fd closed and reopened. The closed file's
    /// replies are discarded by the kernel, never copied to our buffers.
    async fn drop_node_commands(&self, ni: usize) -> TmfResult {
        let n = &self.nodes[ni];
        self.remove_poll(ni);
        let start = Instant::now();
        while n.writes_pending.get() > 0 {
            if start.elapsed() > WRITE_DRAIN {
                tracing::warn!("sg: {}: ring writes did not finish", n.facts.path.display());
                return TmfResult::Failed;
            }
            ustor_runtime::sleep(Duration::from_millis(1)).await;
        }
        drop(n.fd.borrow_mut().take());
        for (i, s) in self.slots.iter().enumerate() {
            if s.busy.get() && s.node.get() as usize == ni {
                self.release(i);
            }
        }
        self.failed
            .borrow_mut()
            .retain(|&i| self.slots[i as usize].busy.get());
        n.gen.set(n.gen.get().wrapping_add(1));
        match dev::open(&n.facts.path) {
            Ok((fd, _)) => {
                dev::set_reserved(fd.as_raw_fd(), self.limits.max_transfer_bytes as i32);
                *n.fd.borrow_mut() = Some(fd);
                self.arm_poll(ni);
                TmfResult::Success
            }
            Err(e) => {
                tracing::warn!("sg: reopening {}: errno {e}", n.facts.path.display());
                TmfResult::Failed
            }
        }
    }

    /// SG_SCSI_RESET on node `ni`, run on a helper thread (the ioctl waits
    /// for the kernel's error handler; the reactor must not).
    async fn reset_node(&self, ni: usize, what: &[i32]) -> bool {
        let Some(fd) = self.nodes[ni]
            .fd
            .borrow()
            .as_ref()
            .and_then(|f| f.try_clone().ok())
        else {
            return false;
        };
        let what = what.to_vec();
        off_reactor(move || what.iter().any(|w| dev::reset(fd.as_raw_fd(), *w).is_ok())).await
    }
}

/// Runs `f` on a helper thread and waits for it without blocking the
/// reactor (control path: resets).
async fn off_reactor<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    let out: Arc<Mutex<Option<R>>> = Arc::default();
    let o = out.clone();
    let t = std::thread::spawn(move || {
        let r = f();
        *o.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
    });
    loop {
        if let Some(r) = out.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
            return r;
        }
        ustor_runtime::sleep(Duration::from_millis(1)).await;
    }
}

impl CqeHandler for Inner {
    fn complete(&self, token: u64, res: i32, flags: u32) {
        let node = ((token >> 32) & 0xfff) as usize;
        let gen = (token >> 16) as u16;
        match token >> 44 {
            OP_WRITE => self.on_write(node, gen, token as u16, res),
            OP_POLL => self.on_poll(node, gen, res, flags),
            _ => {}
        }
    }
}

impl Lld for SgLld {
    fn name(&self) -> &str {
        "sg"
    }

    fn limits(&self) -> HostLimits {
        self.inner.limits
    }

    fn queuecommand(&self, cmd: &ScsiCmd) -> Result<(), QueueError> {
        let inner = &*self.inner;
        let idx = (cmd.tag & 0xffff) as usize;
        let Some(s) = inner.slots.get(idx) else {
            return Err(QueueError::HostBusy);
        };
        if s.busy.get() {
            return Err(QueueError::HostBusy);
        }
        let ni = cmd.nexus.target as usize;
        let node = match inner.nodes.get(ni) {
            Some(n) if cmd.nexus.channel == 0 && cmd.nexus.lun == 0 => n,
            _ => {
                // No such target: report it like the transport would.
                s.begin(cmd, ni as u16);
                s.early.set(Err(TransportError::NoDevice));
                inner.failed.borrow_mut().push_back(idx as u16);
                return Ok(());
            }
        };
        let (Some(fd), Some(h)) = (node.raw_fd(), inner.handler.get()) else {
            return Err(QueueError::NotConnected);
        };
        if node.outstanding.get() >= SG_MAX_QUEUE {
            return Err(QueueError::DeviceBusy);
        }
        let hdr = s.fill(cmd, ni as u16, idx, inner.timeout_ms);
        let sqe = opcode::Write::new(types::Fd(fd), hdr.cast(), SG_IO_HDR_LEN as u32).build();
        let t = token(OP_WRITE, ni, s.seq.get(), idx as u16);
        // SAFETY: the header, CDB, sense buffer and iovec array it names
        // belong to this slot (or to the mid-layer's command, alive until
        // it is reported or dropped); the slot is not reused before the
        // reply is read, and a reset waits for `writes_pending` to reach 0
        // before it gives the command's buffers back.
        if unsafe { ustor_runtime::submit_sqe(sqe, h, t) }.is_err() {
            s.busy.set(false);
            return Err(QueueError::HostBusy);
        }
        node.outstanding.set(node.outstanding.get() + 1);
        node.writes_pending.set(node.writes_pending.get() + 1);
        inc(&inner.stats.commands);
        Ok(())
    }

    fn poll(&self, budget: usize, done: &mut dyn FnMut(Completion<'_>)) -> usize {
        let inner = &*self.inner;
        let mut count = 0;
        while count < budget {
            let Some(i) = inner.failed.borrow_mut().pop_front() else {
                break;
            };
            let s = &inner.slots[i as usize];
            if !s.busy.get() {
                continue;
            }
            done(Completion {
                tag: s.tag.get(),
                status: s.early.get(),
                sense: &[],
                resid: s.data_len.get(),
            });
            inner.release(i as usize);
            count += 1;
        }
        for ni in 0..inner.nodes.len() {
            let n = &inner.nodes[ni];
            if !n.poll_armed.get() && n.raw_fd().is_some() {
                inner.arm_poll(ni);
            }
            if count < budget && n.ready.get() {
                count += inner.reap_node(ni, budget - count, done);
            }
        }
        count
    }

    fn scan(&self) -> LocalFuture<'_, Result<Vec<TargetAddr>, TransportError>> {
        Box::pin(async move {
            Ok(self
                .inner
                .nodes
                .iter()
                .enumerate()
                .filter(|(_, n)| n.raw_fd().is_some())
                .map(|(i, n)| TargetAddr {
                    channel: 0,
                    target: i as u32,
                    name: n.facts.path.display().to_string(),
                    luns: vec![0],
                })
                .collect())
        })
    }

    fn abort(&self, tag: Tag, _nexus: Nexus) -> LocalFuture<'_, TmfResult> {
        let idx = (tag & 0xffff) as usize;
        let live = self
            .inner
            .slots
            .get(idx)
            .is_some_and(|s| s.busy.get() && s.tag.get() == tag);
        // sg has no per-command abort: a command still with the kernel is
        // left to the device reset the mid-layer escalates to.
        Box::pin(async move {
            if live {
                TmfResult::Failed
            } else {
                TmfResult::Success
            }
        })
    }

    fn device_reset(&self, nexus: Nexus) -> LocalFuture<'_, TmfResult> {
        Box::pin(async move {
            let ni = nexus.target as usize;
            if ni >= self.inner.nodes.len() {
                return TmfResult::Failed;
            }
            if !self
                .inner
                .reset_node(ni, &[hdr::SG_SCSI_RESET_DEVICE])
                .await
            {
                return TmfResult::Failed;
            }
            self.inner.drop_node_commands(ni).await
        })
    }

    fn host_reset(&self) -> LocalFuture<'_, TmfResult> {
        Box::pin(async move {
            let inner = &*self.inner;
            let mut ok = true;
            for ni in 0..inner.nodes.len() {
                // Not every kernel HBA driver resets buses or hosts
                // (virtio_scsi resets LUNs only): the node's own LUN reset
                // is the last resort, and what our host reset needs anyway.
                let what = [
                    hdr::SG_SCSI_RESET_BUS,
                    hdr::SG_SCSI_RESET_HOST,
                    hdr::SG_SCSI_RESET_DEVICE,
                ];
                ok &= inner.reset_node(ni, &what).await;
                ok &= inner.drop_node_commands(ni).await == TmfResult::Success;
            }
            if ok {
                TmfResult::Success
            } else {
                TmfResult::Failed
            }
        })
    }

    fn info(&self) -> serde_json::Value {
        let s = &self.inner.stats;
        json!({
            "nodes": self.inner.nodes.iter().map(|n| &n.facts).collect::<Vec<_>>(),
            "timeout_ms": self.inner.timeout_ms,
            "submission": "io_uring write + multishot poll, non-blocking read",
            "commands": s.commands.get(),
            "replies": s.replies.get(),
            "write_errors": s.write_errors.get(),
            "stale_replies": s.stale_replies.get(),
            "read_errors": s.read_errors.get(),
        })
    }
}

impl Drop for SgLld {
    fn drop(&mut self) {
        let inner = &*self.inner;
        for i in 0..inner.nodes.len() {
            inner.remove_poll(i);
        }
        let pending: u32 = inner.nodes.iter().map(|n| n.writes_pending.get()).sum();
        // With ring writes still in flight the kernel may read our headers:
        // the handler (and with it the slots) stays registered, and alive,
        // until the reactor exits.
        if pending == 0 {
            if let Some(h) = inner.handler.take() {
                ustor_runtime::unregister_cqe_handler(h);
            }
        }
    }
}

//! The request queues of a vhost-user-scsi controller: each command runs
//! on the SCSI target core (`ustor-scsi-target`, the same core the iSCSI
//! target uses), its data moved between guest memory and the bdev through
//! a [`DataPath`] over the chain's pieces, and it ends with a
//! `virtio_scsi_cmd_resp` (status, sense, residual).
//!
//! Each queue keeps one LUN table per target on its reactor (the unit's
//! channel for this reactor, its reservations shared with the other
//! queues) and rebuilds it only when the device's configuration changes.
//! Commands are handed to reused worker tasks ([`crate::workers`]), and
//! chains, tables and memory maps are reused or reference-counted without
//! locking: once warm a command allocates nothing of ours.

use std::cell::{Cell, RefCell};
use std::future::{poll_fn, Future};
use std::pin::pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Poll, Waker};

use ustor_runtime::{IoBuf, WorkQueue};
use ustor_scsi_proto::sense::DESCRIPTOR_SENSE_MAX;
use ustor_scsi_target::{
    DataNow, DataPath, Direction, Lun, LunTable, Outcome, RwPending, RwStart, XferError,
};

use super::device::{ScsiDevice, TargetSlot};
use super::ring::Ring;
use super::tasks::TaskTable;
use super::wire::{self, resp, Chain, CmdResp, CDB_SIZE, CMD_REQ_LEN, CMD_RESP_LEN, MAX_TARGETS};
use crate::guest::GuestMem;
use crate::start::VringStart;
use crate::workers::WorkerMem;

/// Serves ring `s.index`: 0 the control queue, 1 the event queue, then
/// request queues.
pub async fn run(s: VringStart<ScsiDevice>) {
    match s.index {
        0 => super::ctrl::run_control(s).await,
        1 => super::ctrl::run_events(s).await,
        _ => run_requests(s).await,
    }
}

/// A command taken from the ring, waiting for a worker.
struct Job {
    chain: Chain,
    table: Rc<LunTable>,
    lun: u64,
    cdb: [u8; CDB_SIZE],
    /// A READ or WRITE the fast path started that waits at the bdev.
    started: Option<RwPending>,
}

/// Pieces a new chain has room for in each stream: chains are reused, and
/// one that has served a longer command keeps that room, but a chain
/// meeting a longer command than before grows while the queue runs; this
/// covers a header, a response and 15 data segments without growing.
const PIECES: usize = 16;

/// Per target: the attachment id a queue's table was built for, and it.
type Tables = [Option<(u64, Rc<LunTable>)>; MAX_TARGETS];

struct ReqQueue {
    ring: Rc<Ring>,
    tables: RefCell<Tables>,
    seen_gen: Cell<u64>,
    resets_seen: [Cell<u64>; MAX_TARGETS],
    chains: RefCell<Vec<Chain>>,
    jobs: WorkQueue<Job>,
    /// The commands running, by head (for ABORT TASK and QUERY TASK).
    tasks: Arc<TaskTable>,
    /// Chains taken per pass at most (a ring's worth).
    budget: usize,
    /// Per worker: the waker of a read it runs that an abort may stop
    /// ([`run_abortable`]).
    abort_wakers: RefCell<Vec<Option<Waker>>>,
    /// The fast path's read buffer, kept between commands.
    spare: RefCell<Option<IoBuf>>,
    /// Buffer lists lent for scattered data-out, kept between commands.
    lists: Lists,
}

type Lists = RefCell<Vec<Vec<IoBuf>>>;

async fn run_requests(s: VringStart<ScsiDevice>) {
    let depth = s.size as usize;
    let Some(ring) = Ring::open(s).await else {
        return;
    };
    let q = Rc::new(ReqQueue {
        ring,
        tables: RefCell::default(),
        seen_gen: Cell::new(0),
        resets_seen: Default::default(),
        // A chain for every descriptor the ring can hold, and one for the
        // pass that finds the ring empty with all of them in flight: the
        // pool never runs dry, so no command allocates one, however many
        // arrive at once (filled on demand, it grew the first time a
        // deeper burst than any before came in: 512 bytes a chain).
        chains: RefCell::new((0..=depth).map(|_| Chain::with_capacity(PIECES)).collect()),
        jobs: WorkQueue::new(depth),
        tasks: Arc::new(TaskTable::new(depth as u16)),
        budget: depth,
        abort_wakers: RefCell::new(vec![None; depth]),
        spare: RefCell::new(None),
        lists: RefCell::default(),
    });
    let ring = q.ring.clone();
    ring.dev
        .set_tasks(ring.index, Some((q.tasks.clone(), ring.kick.clone())));
    ring.serve(ring.dev.poll_window, true, || {
        sync_tables(&q);
        wake_aborted(&q);
        take_available(&q)
    })
    .await;
    ring.finish().await;
    q.jobs.close();
    q.ring.dev.set_tasks(q.ring.index, None);
    q.ring.dev.applied(q.ring.index, u64::MAX);
}

/// Rebuilds the tables of targets that changed, and raises the unit
/// attention of LUN resets asked on the control queue.
fn sync_tables(q: &ReqQueue) {
    let dev = &q.ring.dev;
    for (t, seen) in q.resets_seen.iter().enumerate() {
        let r = dev.resets[t].load(Ordering::Acquire);
        if seen.replace(r) != r {
            if let Some((_, table)) = &q.tables.borrow()[t] {
                table.reset_lun(0);
            }
        }
    }
    let gen = dev.generation();
    if gen == q.seen_gen.get() {
        return;
    }
    let targets = dev.targets();
    let mut tables = q.tables.borrow_mut();
    for (t, slot) in targets.iter().enumerate() {
        let same = matches!((&tables[t], slot), (Some((id, _)), Some(s)) if *id == s.id);
        if !same {
            tables[t] = slot.as_ref().and_then(|s| open_table(s, &dev.nexus));
        }
    }
    q.seen_gen.set(gen);
    dev.applied(q.ring.index, gen);
}

fn open_table(s: &TargetSlot, nexus: &str) -> Option<(u64, Rc<LunTable>)> {
    match Lun::open(s.cfg.clone(), &s.desc) {
        Ok(lu) => {
            let lu = lu.with_provisioning_page().with_shared(s.shared.clone());
            let mut t = LunTable::from_luns([(0, lu)]);
            t.set_nexus(nexus);
            Some((s.id, Rc::new(t)))
        }
        Err(e) => {
            tracing::warn!("vhost-scsi: target over {} has no channel: {e}", s.bdev);
            None
        }
    }
}

/// After an abort was asked (the control queue kicks the ring): wakes the
/// reads that may stop early, so each looks at its own abort flag.
fn wake_aborted(q: &ReqQueue) {
    if !q.tasks.take_pending() {
        return;
    }
    for w in q.abort_wakers.borrow_mut().iter_mut() {
        if let Some(w) = w.take() {
            w.wake();
        }
    }
}

/// Takes the chains available when the pass first looks (the index is
/// read once a pass, [`crate::virtq::Virtq::pop_in_pass`]; a ring's worth
/// at most).
fn take_available(q: &Rc<ReqQueue>) -> usize {
    let ring = &q.ring;
    let mut n = 0;
    let budget = q.budget;
    let mut looked = false;
    while n < budget {
        let pooled = q.chains.borrow_mut().pop();
        let mut chain = pooled.unwrap_or_else(|| Chain::with_capacity(PIECES));
        let Some(ok) = ring.pop_in_pass(&mut chain, &mut looked) else {
            q.chains.borrow_mut().push(chain);
            break;
        };
        n += 1;
        ring.inflight.set(ring.inflight.get() + 1);
        start(q, chain, ok.is_ok());
    }
    n
}

/// Routes one chain to its target's table and a worker, or answers it.
fn start(q: &Rc<ReqQueue>, chain: Chain, well_formed: bool) {
    let mem = q.ring.mem.borrow();
    let hdr = well_formed
        .then(|| wire::cmd_header(&chain, &**mem))
        .flatten();
    let Some(hdr) = hdr else {
        // A short header or a buffer outside guest memory: answered
        // S_FAILURE when the response area is whole, else returned empty.
        tracing::debug!("vhost-scsi: malformed command chain {}", chain.head);
        let len = if chain.wr_len >= CMD_RESP_LEN {
            chain.write(&**mem, 0, &CmdResp::transport(resp::FAILURE).encode());
            CMD_RESP_LEN as u32
        } else {
            0
        };
        return finish(q, &mem, chain, len);
    };
    let addr = wire::decode_lun(&hdr.lun);
    let table = addr.and_then(|a| {
        let tables = q.tables.borrow();
        tables[a.target as usize].as_ref().map(|(_, t)| t.clone())
    });
    let (Some(a), Some(table)) = (addr, table) else {
        let b = CmdResp::transport(resp::BAD_TARGET).encode();
        chain.write(&**mem, 0, &b);
        return finish(q, &mem, chain, CMD_RESP_LEN as u32);
    };
    // In the task set (what TMFs, drains and target removal look at).
    q.tasks.start(chain.head, a.target, hdr.tag);
    // A plain READ or WRITE runs here, and is answered here when the bdev
    // answers at once.
    let mut started = None;
    if let Some(mut data) = GuestData::of(&mem, &chain, &q.lists) {
        let spare = &mut q.spare.borrow_mut();
        match table.rw_now(a.lun, &hdr.cdb, &mut data, spare) {
            RwStart::Done(o) => {
                let len = answer(&data, &o);
                return finish(q, &mem, chain, len);
            }
            RwStart::Waiting(p) => started = Some(p),
            RwStart::Declined => {}
        }
    }
    let job = Job {
        chain,
        table,
        lun: a.lun,
        cdb: hdr.cdb,
        started,
    };
    q.jobs.push(job, |id| spawn_worker(q, id));
}

/// Returns a chain used and keeps it for reuse.
fn finish(q: &ReqQueue, mem: &GuestMem, chain: Chain, len: u32) {
    q.ring.complete(mem, chain.head, len);
    // After the used ring: a TMF waiting for this command answers only
    // once the driver can see the command's own answer.
    q.tasks.finish(chain.head);
    q.ring.inflight.set(q.ring.inflight.get() - 1);
    q.chains.borrow_mut().push(chain);
}

fn spawn_worker(q: &Rc<ReqQueue>, id: usize) {
    ustor_runtime::spawn(worker(q.clone(), id));
}

/// One worker: takes commands until the queue stops.
async fn worker(q: Rc<ReqQueue>, id: usize) {
    let mut mem = WorkerMem::default();
    // Budget: one round per command; ends when the queue is closed.
    while let Some(job) = mem.next(&q.jobs, id, || q.ring.mem_gen.get()).await {
        let m = mem.get(q.ring.mem_gen.get(), &q.ring.mem);
        let run = pin!(serve(&q, id, m, job));
        q.jobs.run(id, run, |i| spawn_worker(&q, i)).await;
    }
}

/// Runs one command and returns it used.
async fn serve(q: &ReqQueue, id: usize, m: &GuestMem, mut job: Job) {
    let started = job.started.take();
    // A command an ABORT TASK reached before it started is not run; a
    // write the fast path started is at the bdev already: it runs out.
    let len = if started.as_ref().is_some_and(|p| p.is_write()) {
        execute(q, m, &job, started).await
    } else if q.tasks.abort_asked(job.chain.head) {
        respond(m, &job.chain, &CmdResp::transport(resp::ABORTED), 0)
    } else if reads_only(&job.chain) {
        run_abortable(q, id, m, &job, started).await
    } else {
        execute(q, m, &job, started).await
    };
    // Out of the task set after the used ring (`finish`): the task-set
    // TMFs then answer after the commands they waited for.
    finish(q, m, job.chain, len);
}

/// A command that moves data only to the driver: it changes nothing on
/// the medium, so an abort may end it while the bdev still reads.
fn reads_only(c: &Chain) -> bool {
    c.rd_len <= CMD_REQ_LEN && c.wr_len > CMD_RESP_LEN
}

/// [`execute`], ended early with ABORTED when an abort is asked while it
/// waits. Dropping it is safe: the bdev keeps an abandoned I/O's buffer
/// until the device is done with it, and guest memory is written only by
/// copies the dropped future no longer makes.
async fn run_abortable(
    q: &ReqQueue,
    id: usize,
    mem: &GuestMem,
    job: &Job,
    started: Option<RwPending>,
) -> u32 {
    let head = job.chain.head;
    let mut run = std::pin::pin!(execute(q, mem, job, started));
    let done = poll_fn(|cx| {
        if let Poll::Ready(n) = run.as_mut().poll(cx) {
            return Poll::Ready(Some(n));
        }
        if q.tasks.abort_asked(head) {
            return Poll::Ready(None);
        }
        let mut w = q.abort_wakers.borrow_mut();
        if let Some(slot) = w.get_mut(id) {
            match slot {
                Some(old) if old.will_wake(cx.waker()) => {}
                _ => *slot = Some(cx.waker().clone()),
            }
        }
        Poll::Pending
    })
    .await;
    match done {
        Some(n) => n,
        None => respond(mem, &job.chain, &CmdResp::transport(resp::ABORTED), 0),
    }
}

/// Runs one command on the target core (or waits for the one the fast
/// path started) and writes its response; the bytes written into the
/// chain.
async fn execute(q: &ReqQueue, mem: &GuestMem, job: &Job, started: Option<RwPending>) -> u32 {
    let c = &job.chain;
    // Bidirectional commands need VIRTIO_SCSI_F_INOUT (not offered).
    let Some(mut data) = GuestData::of(mem, c, &q.lists) else {
        return respond(mem, c, &CmdResp::transport(resp::FAILURE), 0);
    };
    let o = match started {
        Some(p) => p.finish(&mut data).await,
        None => match job.table.execute(job.lun, &job.cdb, &mut data).await {
            Ok(o) => o,
            Err(_) => return respond(mem, c, &CmdResp::transport(resp::FAILURE), 0),
        },
    };
    answer(&data, &o)
}

/// Writes the response of a command the target core answered; the bytes
/// written into the chain.
fn answer(data: &GuestData<'_>, o: &Outcome) -> u32 {
    let (mem, c, dir) = (data.mem, data.chain, data.dir);
    let mut sense = [0u8; DESCRIPTOR_SENSE_MAX];
    let n = encode_sense(o, &mut sense);
    let r = CmdResp {
        response: resp::OK,
        status: o.status.as_u8(),
        resid: o.resid,
        sense: &sense[..n],
    };
    let moved = match dir {
        Direction::FromDevice => data.len.saturating_sub(o.resid),
        _ => 0,
    };
    respond(mem, c, &r, moved)
}

/// Writes `r` into the chain's response area: its fixed fields and sense
/// bytes only, as SPDK does (the driver reads `sense_len` sense bytes; the
/// rest of the 96 would be 1.5 cache lines written per command for
/// nothing). The used length counts the whole response, as SPDK's.
fn respond(mem: &GuestMem, c: &Chain, r: &CmdResp, data_in: u32) -> u32 {
    c.write(mem, 0, &r.encode()[..r.used_bytes()]);
    CMD_RESP_LEN as u32 + data_in
}

/// Sense bytes (fixed, or descriptor when the unit's D_SENSE is set).
fn encode_sense(o: &Outcome, out: &mut [u8; DESCRIPTOR_SENSE_MAX]) -> usize {
    match o.sense {
        Some(s) if s.descriptor => s.encode_descriptor(o.field, out),
        Some(s) => {
            let mut fixed = [0u8; 18];
            let n = s.encode_fixed(&mut fixed);
            if let Some(f) = o.field {
                f.encode(&mut fixed);
            }
            out[..n].copy_from_slice(&fixed[..n]);
            n
        }
        None => 0,
    }
}

/// A command's data in guest memory: data-out after the request header in
/// the readable stream, data-in after the response in the writable one.
struct GuestData<'a> {
    mem: &'a GuestMem,
    chain: &'a Chain,
    dir: Direction,
    len: u32,
    /// The queue's spare buffer lists (scattered data-out).
    lists: &'a Lists,
}

impl<'a> GuestData<'a> {
    /// The chain's data: data-out after the request header, or data-in
    /// after the response; `None` for a chain with both (bidirectional).
    fn of(mem: &'a GuestMem, c: &'a Chain, lists: &'a Lists) -> Option<GuestData<'a>> {
        let (out, inn) = (c.rd_len - CMD_REQ_LEN, c.wr_len - CMD_RESP_LEN);
        let (dir, len) = match (out > 0, inn > 0) {
            (false, false) => (Direction::None, 0),
            (true, false) => (Direction::ToDevice, out),
            (false, true) => (Direction::FromDevice, inn),
            (true, true) => return None,
        };
        Some(GuestData {
            mem,
            chain: c,
            dir,
            len: len.min(u32::MAX as u64) as u32,
            lists,
        })
    }

    /// Where the data bytes `[offset, offset + len)` start in their
    /// stream (after the request header for data-out, the response for
    /// data-in), when the command moves data `want`'s way and they lie
    /// within its data.
    fn data_at(&self, want: Direction, offset: u32, len: usize) -> Option<u64> {
        if self.dir != want || offset as u64 + len as u64 > self.len as u64 {
            return None;
        }
        let head = match want {
            Direction::ToDevice => CMD_REQ_LEN,
            _ => CMD_RESP_LEN,
        };
        Some(head + offset as u64)
    }
}

impl DataNow for GuestData<'_> {
    fn data_in_now(&mut self, offset: u32, src: &[u8]) -> usize {
        if self.dir != Direction::FromDevice {
            return 0;
        }
        let room = (self.len as usize).saturating_sub(offset as usize);
        let n = src.len().min(room);
        let at = CMD_RESP_LEN + offset as u64;
        self.chain.write(self.mem, at, &src[..n])
    }

    /// Data-in that lies in one piece of guest memory, for the bdev to
    /// read into (the core lends it only to a bdev that completes in its
    /// submit: no guest memory is written after an abort).
    fn data_in_place(&mut self, offset: u32, len: usize) -> Option<IoBuf> {
        let at = self.data_at(Direction::FromDevice, offset, len)?;
        let at = self.chain.span(true, at, len)?;
        self.mem.io_buf(at, u32::try_from(len).ok()?)
    }
}

impl DataPath for GuestData<'_> {
    fn direction(&self) -> Direction {
        self.dir
    }

    fn expected_len(&self) -> u32 {
        self.len
    }

    async fn data_out(&mut self, offset: u32, dst: &mut [u8]) -> Result<usize, XferError> {
        if self.dir != Direction::ToDevice {
            return Ok(0);
        }
        let room = (self.len as usize).saturating_sub(offset as usize);
        let n = dst.len().min(room);
        let at = CMD_REQ_LEN + offset as u64;
        Ok(self.chain.read(self.mem, at, &mut dst[..n]))
    }

    /// Data-out that lies in one piece of guest memory goes to the bdev
    /// as it is, not copied (the worker holds the memory map until the
    /// command is done; a write is never abandoned at the bdev).
    fn data_out_buf(&mut self, offset: u32, len: usize) -> Option<IoBuf> {
        let at = self.data_at(Direction::ToDevice, offset, len)?;
        let at = self.chain.span(false, at, len)?;
        self.mem.io_buf(at, u32::try_from(len).ok()?)
    }

    /// Data-out in several pieces of guest memory (a guest's pages) goes
    /// to the bdev as a list of borrowed buffers, as blk's does.
    fn data_out_bufs(&mut self, offset: u32, len: usize, max: usize) -> Option<Vec<IoBuf>> {
        let at = self.data_at(Direction::ToDevice, offset, len)?;
        let mut v = self.lists.borrow_mut().pop().unwrap_or_default();
        let mem = self.mem;
        let took = self.chain.each_piece(false, at, len, |a, n| {
            if v.len() == max {
                return false;
            }
            let b = u32::try_from(n).ok().and_then(|n| mem.io_buf(a, n));
            b.map(|b| v.push(b)).is_some()
        });
        if took != len || v.len() < 2 {
            self.bufs_back(v);
            return None;
        }
        Some(v)
    }

    fn bufs_back(&mut self, mut bufs: Vec<IoBuf>) {
        bufs.clear();
        self.lists.borrow_mut().push(bufs);
    }

    async fn data_in(&mut self, offset: u32, src: &[u8]) -> Result<usize, XferError> {
        Ok(self.data_in_now(offset, src))
    }

    /// virtio-scsi reports residuals (`resid` in the response).
    fn residuals(&self) -> bool {
        true
    }
}

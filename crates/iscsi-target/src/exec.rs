//! One SCSI command as a task of its own: what the session's tasks share
//! ([`Core`]: the send queue, the task set, the LUN table), and the task
//! body — wait for the task attribute's turn, execute on the SCSI target
//! core with [`crate::command::WireData`] as the data path, answer with
//! status (in the last Data-In when possible, phase collapse) as soon as
//! the command finishes, whatever the order the commands were sent in.
//! An aborted task sends nothing; a data phase that breaks the protocol
//! ends the connection. Commands run on the connection's workers
//! ([`crate::workers`]); immediate data lands in a pool buffer that the
//! core writes to the device as it is (no second copy), Data-Out buffers
//! come from the connection's free list, so a command allocates nothing
//! once the connection has warmed up.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use ustor_iscsi::wire::Bhs;
use ustor_runtime::IoBuf;
use ustor_scsi_proto::lun::decode_lun;
use ustor_scsi_target::{Direction, LunTable, Outcome};

use crate::command::{next_tag, CmdInfo, LastIn, WireData};
use crate::live::ConnCounters;
use crate::negotiate::Params;
use crate::pdu;
use crate::sess::{Leave, Sess};
use crate::tasks::Task;
use crate::tx::Tx;
use crate::workers::{Flusher, Job};

/// Data buffers a connection keeps for reuse (more are freed).
const KEPT_BUFS: usize = 256;
/// Smallest data buffer made (the RFC's default data segment).
const MIN_BUF: usize = 8192;

/// One connection of a session, what the tasks that came on it share
/// (on the session's reactor): its send queue and parameters, and the
/// session ([`Sess`]: window, task set, LUN table).
pub struct Core {
    pub tx: Tx,
    pub sess: Rc<Sess>,
    pub params: Params,
    pub cid: u16,
    /// Unique within the session (a reinstated CID gets a new one).
    pub serial: u64,
    pub(crate) leave: Cell<Leave>,
    next_ttt: Cell<u32>,
    pub(crate) counters: RefCell<Rc<ConnCounters>>,
    pub(crate) workers: ustor_runtime::WorkQueue<Job>,
    pub(crate) flusher: Flusher,
    /// Data buffers for reuse (emptied).
    bufs: RefCell<Vec<Vec<u8>>>,
}

impl Core {
    pub fn new(tx: Tx, params: Params, sess: Rc<Sess>, cid: u16) -> Core {
        Core {
            tx,
            serial: sess.conn_serial(),
            sess,
            params,
            cid,
            leave: Cell::new(Leave::Failed),
            next_ttt: Cell::new(1),
            counters: RefCell::default(),
            workers: crate::workers::queue(),
            flusher: Flusher::default(),
            bufs: RefCell::default(),
        }
    }

    /// An empty data buffer of at least `len` bytes: a kept one that is
    /// large enough when there is one (a kept one grown, or a new one,
    /// sized to a power of two, otherwise).
    pub fn take_buf(&self, len: usize) -> Vec<u8> {
        let mut bufs = self.bufs.borrow_mut();
        let fit = bufs.iter().rposition(|v| v.capacity() >= len);
        let mut v = match fit {
            Some(i) => bufs.swap_remove(i),
            None => bufs.pop().unwrap_or_default(),
        };
        if v.capacity() < len {
            v.reserve_exact(len.next_power_of_two().max(MIN_BUF));
        }
        v
    }

    /// A copy of `data` in a reused buffer.
    pub fn copy_buf(&self, data: &[u8]) -> Vec<u8> {
        let mut v = self.take_buf(data.len());
        v.extend_from_slice(data);
        v
    }

    /// Gives a data buffer back for reuse.
    pub fn give_buf(&self, mut v: Vec<u8>) {
        let mut bufs = self.bufs.borrow_mut();
        if bufs.len() < KEPT_BUFS && v.capacity() > 0 {
            v.clear();
            bufs.push(v);
        }
    }

    /// A fresh Target Transfer Tag (R2T, NOP-In ping, Text Continue).
    pub fn ttt(&self) -> u32 {
        let t = self.next_ttt.get();
        self.next_ttt.set(next_tag(t));
        t
    }
}

/// A SCSI Command PDU's fields (its CDB and immediate data copied).
pub struct Command {
    pub info: CmdInfo,
    pub cdb: [u8; 16],
    /// Immediate data (a pool buffer: the device may take it as it is).
    pub data: Option<IoBuf>,
}

impl Command {
    /// The command of `b` with its data segment (copied into a pool
    /// buffer); `None` for a bidirectional command (not offered).
    pub fn parse(b: &Bhs, data: &[u8]) -> Option<Command> {
        let f = b.flags();
        let (read, write) = (f & 0x40 != 0, f & 0x20 != 0);
        if read && write {
            return None;
        }
        let edtl = b.u32_at(20);
        let info = CmdInfo {
            lun: b.lun(),
            itt: b.itt(),
            edtl: if read || write { edtl } else { 0 },
            dir: match (read, write) {
                (true, false) => Direction::FromDevice,
                (false, true) => Direction::ToDevice,
                _ => Direction::None,
            },
            immediate: if write {
                data.len().min(edtl as usize) as u32
            } else {
                0
            },
            unsolicited: write && f & 0x80 == 0,
        };
        let mut cdb = [0u8; 16];
        cdb.copy_from_slice(&b.0[32..48]);
        let n = info.immediate as usize;
        let data = (n > 0).then(|| {
            // An exhausted pool costs an allocation, not a wait.
            let mut buf = IoBuf::try_alloc(n).unwrap_or_else(|| IoBuf::heap(n));
            buf.copy_from_slice(&data[..n]);
            buf
        });
        Some(Command { info, cdb, data })
    }
}

/// The body of one command's task: runs it and answers it, then leaves
/// the task set (the task and the command's buffer kept for reuse).
pub async fn run(core: &Core, task: Rc<Task>, mut cmd: Command) {
    let (tasks, window) = (&core.sess.tasks, &core.sess.window);
    tasks.may_start(&task, window.gate.as_ref()).await;
    if !task.aborted() {
        execute(core, &task, &mut cmd).await;
    }
    tasks.remove(&task);
    if let (Some(g), Some(seq)) = (&window.gate, task.gate_seq) {
        g.leave(seq);
    }
    if task.windowed {
        // Its slot of the window is free again.
        window.credit();
    }
    tasks.recycle(task);
}

async fn execute(core: &Core, task: &Task, cmd: &mut Command) {
    let info = cmd.info;
    let lun = decode_lun(info.lun);
    let mut wd = WireData::new(core, task, info, cmd.data.take());
    let mut res = core.sess.table.execute(lun, &cmd.cdb, &mut wd).await;
    if res.is_ok() && info.dir == Direction::ToDevice {
        if let Err(e) = wd.drain().await {
            res = Err(e);
        }
    }
    let (sent, seq_error, held) = (wd.sent(), wd.sequence_error(), wd.take_last());
    let Ok(mut outcome) = res else {
        if !task.aborted() {
            // The data phase broke (or the connection did): ERL 0 ends
            // the connection.
            tracing::debug!("iscsi: data phase of ITT {:#x} failed", info.itt);
            core.tx.close();
        }
        return;
    };
    if task.aborted() {
        return;
    }
    task.answer();
    let written = match info.dir {
        Direction::ToDevice if !seq_error => info.edtl,
        _ => 0,
    };
    core.counters
        .borrow()
        .note(u64::from(sent), u64::from(written));
    if seq_error {
        // A Data-Out out of DataSN order: the command ends ABORTED
        // COMMAND (nothing of its data written), the session goes on.
        outcome = Outcome::check(
            ustor_scsi_proto::SenseKey::AbortedCommand,
            DATA_PHASE_ERROR,
            info.edtl,
        );
    }
    let want = wanted_len(&core.sess.table, lun, &cmd.cdb);
    respond(core, &info, outcome, sent, want, held).await;
}

/// Status: in the last Data-In when there is one and no sense to send,
/// otherwise a SCSI Response (with the sense as its data).
async fn respond(
    core: &Core,
    info: &CmdInfo,
    o: Outcome,
    sent: u32,
    want: Option<u64>,
    held: Option<LastIn>,
) {
    let edtl = info.edtl as u64;
    let resid = match want {
        // The command wanted more than the initiator expected: overflow.
        Some(w) if o.status.is_good() && w > edtl => {
            Some((true, (w - edtl).min(u32::MAX as u64) as u32))
        }
        // A write that wanted less: underflow.
        Some(w) if o.status.is_good() && w < edtl && info.dir == Direction::ToDevice => {
            Some((false, (edtl - w) as u32))
        }
        _ => residual(info, &o, sent),
    };
    let status = o.status.as_u8();
    let tx = &core.tx;
    if let Some(l) = held {
        // Phase collapse: the status goes into the last Data-In's header
        // while that is still the last PDU queued and unsent, so its
        // StatSN leaves after every smaller one. Otherwise (a sense to
        // send, other responses queued behind it, or already taken by a
        // flush) a SCSI Response follows; the Data-In still gets its F.
        let data_in = |status, seq: &pdu::Seq| {
            let (off, n) = (l.offset, l.len);
            pdu::data_in(info.lun, info.itt, true, status, l.datasn, off, n, seq)
        };
        if o.sense.is_none() && tx.rewrite(l.mark, &data_in(Some((status, resid)), &tx.seq()), true)
        {
            tx.bump();
            return finish(core, info).await;
        }
        tx.rewrite(l.mark, &data_in(None, &tx.seq()), false);
    }
    let mut sense = [0u8; 2 + ustor_scsi_proto::sense::DESCRIPTOR_SENSE_MAX];
    let n = encode_sense(&o, &mut sense);
    let mut r = pdu::scsi_response(info.itt, status, resid, &tx.bump());
    r.set_data_len(n);
    tx.queue(&r, &sense[..n]);
    finish(core, info).await
}

/// Sends what the command queued, at once when it is the session's only
/// command; otherwise the connection's flusher sends it once the other
/// commands ready in this reactor pass have queued theirs (one send per
/// pass, as a poll loop flushes each socket once per iteration).
async fn finish(core: &Core, info: &CmdInfo) {
    if core.sess.tasks.len() > 1 {
        return crate::workers::flush_later(core);
    }
    // The receive loop arms its next receive after this (it yielded to
    // let the response go first): both go in with one enter.
    if let Err(e) = core.tx.flush_before_recv().await {
        tracing::debug!("iscsi: response to ITT {:#x} not sent: {e}", info.itt);
    }
}

/// The sense data segment (SenseLength, then the sense); its length.
fn encode_sense(o: &Outcome, out: &mut [u8]) -> usize {
    let len = match o.sense {
        Some(s) if s.descriptor => {
            let mut d = [0u8; ustor_scsi_proto::sense::DESCRIPTOR_SENSE_MAX];
            let len = s.encode_descriptor(o.field, &mut d);
            out[2..2 + len].copy_from_slice(&d[..len]);
            len
        }
        Some(s) => {
            let mut fixed = [0u8; 18];
            let len = s.encode_fixed(&mut fixed);
            if let Some(f) = o.field {
                f.encode(&mut fixed);
            }
            out[2..2 + len].copy_from_slice(&fixed[..len]);
            len
        }
        None => return 0,
    };
    out[..2].copy_from_slice(&(len as u16).to_be_bytes());
    2 + len
}

/// DATA PHASE ERROR (ASC, ASCQ).
const DATA_PHASE_ERROR: (u8, u8) = (0x4b, 0x00);

/// Bytes a READ or WRITE moves by its CDB (for its residual); `None` for
/// other commands.
fn wanted_len(table: &LunTable, lun: u64, cdb: &[u8; 16]) -> Option<u64> {
    use ustor_scsi_proto::cdb::Command;
    let lu = table.get(lun)?;
    match Command::parse(cdb).ok()? {
        c @ (Command::Read { .. } | Command::Write { .. } | Command::WriteAndVerify { .. }) => {
            Some(c.transfer_len(lu.channel().block_size()))
        }
        _ => None,
    }
}

/// The residual to report: what the command moved against what the
/// initiator expected.
fn residual(info: &CmdInfo, o: &Outcome, sent: u32) -> Option<(bool, u32)> {
    if info.edtl == 0 {
        return None;
    }
    let moved = match info.dir {
        Direction::FromDevice => sent,
        _ => info.edtl.saturating_sub(o.resid),
    };
    let r = info.edtl.saturating_sub(moved).max(o.resid);
    (r > 0).then_some((false, r))
}

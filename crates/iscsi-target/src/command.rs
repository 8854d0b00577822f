//! One SCSI command's data phase on the wire, as the SCSI target core's
//! [`DataPath`]: data to the device comes from the command's immediate
//! data, then unsolicited Data-Out (FirstBurstLength), then Data-Out
//! answering our R2Ts (MaxBurstLength each), handed to the task by the
//! session's receive loop; data from the device leaves as Data-In PDUs
//! (MaxRecvDataSegmentLength each, F at every MaxBurstLength) on the
//! connection's shared send queue, queued at once with the last one's
//! place kept (a READ's data is sent from the buffer the device read into,
//! not copied; other commands' data is copied into the queue), so the status can be written into its header while it is still
//! unsent (phase collapse). Many commands of a session run this at once,
//! each on its own task.

use ustor_iscsi::wire::{Bhs, RESERVED_TAG};
use ustor_runtime::IoBuf;
use ustor_scsi_target::{DataPath, Direction, XferError};

use crate::exec::Core;
use crate::pdu;
use crate::tasks::Task;
use crate::tx::Mark;

/// The SCSI Command fields the data phase needs.
#[derive(Clone, Copy, Debug)]
pub struct CmdInfo {
    pub lun: [u8; 8],
    pub itt: u32,
    pub edtl: u32,
    pub dir: Direction,
    /// Immediate data bytes that came with the command.
    pub immediate: u32,
    /// Unsolicited Data-Out follows (F clear on a write command).
    pub unsolicited: bool,
}

/// Where the data of a write stands.
#[derive(Default)]
struct OutState {
    /// Bytes received so far, in order.
    have: u32,
    /// Unsolicited data still owed by the initiator (up to this offset).
    unsolicited_end: u32,
    /// The burst being received ends at this offset (its F closes it).
    burst_end: u32,
    /// The burst is open (its last Data-Out not yet seen).
    burst_open: bool,
    ttt: u32,
    r2tsn: u32,
    /// DataSN the next Data-Out of the burst must carry (0 at each burst).
    datasn: u32,
    /// Data of the current Data-Out not yet copied out: [from, to).
    carry: Option<(usize, usize)>,
}

/// The last Data-In PDU queued for a command, still in the send queue.
#[derive(Clone, Copy, Debug)]
pub struct LastIn {
    pub mark: Mark,
    pub datasn: u32,
    pub offset: u32,
    pub len: usize,
}

/// The data phase of one command, on its task.
pub struct WireData<'a> {
    core: &'a Core,
    task: &'a Task,
    pub info: CmdInfo,
    /// Immediate data, and how much of it has been taken.
    imm: Option<IoBuf>,
    imm_at: usize,
    out: OutState,
    /// The data segment of the Data-Out being taken.
    cur: Vec<u8>,
    datasn: u32,
    sent: u32,
    /// A Data-Out came with the wrong DataSN: the data phase stops short.
    seq_error: bool,
    /// The last Data-In PDU queued, whose header the status may rewrite.
    last: Option<LastIn>,
    /// DataSN, offset and length of the last Data-In header made.
    piece: (u32, u32, usize),
}

impl<'a> WireData<'a> {
    pub fn new(core: &'a Core, task: &'a Task, info: CmdInfo, imm: Option<IoBuf>) -> WireData<'a> {
        let params = &core.params;
        let unsolicited_end = if info.unsolicited {
            params.first_burst.min(info.edtl)
        } else {
            info.immediate
        };
        let out = OutState {
            unsolicited_end,
            burst_end: unsolicited_end,
            burst_open: info.unsolicited && unsolicited_end > info.immediate,
            ttt: RESERVED_TAG,
            ..OutState::default()
        };
        WireData {
            core,
            task,
            info,
            imm,
            imm_at: 0,
            out,
            cur: Vec::new(),
            datasn: 0,
            sent: 0,
            seq_error: false,
            last: None,
            piece: (0, 0, 0),
        }
    }

    /// The last Data-In queued, for the status to ride in it.
    pub fn take_last(&mut self) -> Option<LastIn> {
        self.last.take()
    }

    /// Whether a Data-Out broke the DataSN order.
    pub fn sequence_error(&self) -> bool {
        self.seq_error
    }

    /// Bytes sent as Data-In.
    pub fn sent(&self) -> u32 {
        self.sent
    }

    /// Copies what the current Data-Out (or immediate data) still holds.
    fn take_carry(&mut self, dst: &mut [u8]) -> usize {
        if let Some(imm) = self.imm.as_ref().filter(|b| b.len() > self.imm_at) {
            let n = (imm.len() - self.imm_at).min(dst.len());
            dst[..n].copy_from_slice(&imm[self.imm_at..self.imm_at + n]);
            self.imm_at += n;
            self.out.have += n as u32;
            return n;
        }
        let Some((from, to)) = self.out.carry else {
            return 0;
        };
        let n = (to - from).min(dst.len());
        dst[..n].copy_from_slice(&self.cur[from..from + n]);
        self.out.carry = (from + n < to).then_some((from + n, to));
        self.out.have += n as u32;
        n
    }

    /// Takes the next Data-Out of this command from its mailbox. One that
    /// does not fit the burst ends the connection (ERL 0).
    async fn next_data_out(&mut self) -> Result<(), XferError> {
        let Some((b, data)) = self.task.next_data_out().await else {
            return Err(XferError::Disconnected);
        };
        let old = std::mem::replace(&mut self.cur, data);
        self.core.give_buf(old);
        let (itt, ttt, off) = (b.itt(), b.u32_at(20), b.u32_at(40));
        let len = b.data_len() as u32;
        if itt != self.info.itt
            || ttt != self.out.ttt
            || off != self.out.have
            || off + len > self.out.burst_end
        {
            // ERL 0: a PDU that does not fit the burst ends the
            // connection.
            self.core.tx.close();
            return Err(XferError::Io(libc::EPROTO));
        }
        // A wrong DataSN on a PDU that otherwise fits: the command
        // fails, the rest of its burst is still read (and dropped).
        self.seq_error |= b.u32_at(36) != self.out.datasn;
        self.out.datasn += 1;
        if b.final_bit() {
            self.out.burst_open = false;
        }
        self.out.carry = (len > 0).then_some((0, len as usize));
        Ok(())
    }

    /// Opens the next solicited burst with an R2T.
    async fn send_r2t(&mut self) -> Result<(), XferError> {
        if self.task.aborted() {
            return Err(XferError::Disconnected);
        }
        let len = self
            .core
            .params
            .max_burst
            .min(self.info.edtl - self.out.have);
        let ttt = self.core.ttt();
        let b = pdu::r2t(
            self.info.lun,
            self.info.itt,
            ttt,
            self.out.r2tsn,
            self.out.have,
            len,
            &self.core.tx.seq(),
        );
        self.out.r2tsn += 1;
        self.out.datasn = 0;
        self.out.ttt = ttt;
        self.out.burst_end = self.out.have + len;
        self.out.burst_open = true;
        self.core
            .tx
            .send(&b, &[])
            .await
            .map_err(|_| XferError::Disconnected)
    }

    /// After the command: reads and drops the Data-Out the initiator still
    /// owes for bursts it was told (or allowed) to send.
    pub async fn drain(&mut self) -> Result<(), XferError> {
        self.out.carry = None;
        self.imm = None;
        while self.out.burst_open {
            self.next_data_out().await?;
            self.out.have += self.out.carry.map_or(0, |(a, b)| (b - a) as u32);
            self.out.carry = None;
        }
        Ok(())
    }

    /// The header of the Data-In carrying `n` bytes at `off` (DataSN
    /// advanced). F marks each burst's end and the end of the expected data.
    fn data_in_header(&mut self, off: u32, n: usize) -> Bhs {
        let burst = self.core.params.max_burst.max(512);
        let end = off + n as u32;
        let b = pdu::data_in(
            self.info.lun,
            self.info.itt,
            end % burst == 0 || end == self.info.edtl,
            None,
            self.datasn,
            off,
            n,
            &self.core.tx.seq(),
        );
        self.piece = (self.datasn, off, n);
        self.datasn += 1;
        b
    }

    /// Bytes of data in one Data-In PDU.
    fn max_piece(&self) -> usize {
        self.core.params.max_send_data.max(512) as usize
    }

    /// Queues the Data-In PDUs for `src` at `offset` (copied into the
    /// queue); the last one's place is kept.
    fn queue_data_in(&mut self, offset: u32, src: &[u8]) {
        let max = self.max_piece();
        let mut at = 0;
        while at < src.len() {
            let n = (src.len() - at).min(max);
            let b = self.data_in_header(offset + at as u32, n);
            let mark = self.core.tx.queue_marked(&b, &src[at..at + n]);
            self.set_mark(Some(mark));
            at += n;
        }
        self.sent = self.sent.max(offset + src.len() as u32);
    }

    /// Queues the Data-In PDUs for the first `n` bytes of `buf` at
    /// `offset`, sent from `buf` itself; the last one's place is kept.
    fn queue_data_in_held(&mut self, offset: u32, buf: IoBuf, n: usize) {
        let (core, max) = (self.core, self.max_piece());
        let mark = core.tx.queue_held(buf, n, max, |at, len| {
            self.data_in_header(offset + at as u32, len)
        });
        self.set_mark(mark);
        self.sent = self.sent.max(offset + n as u32);
    }

    /// Keeps the place of the last PDU queued (its header made last).
    fn set_mark(&mut self, mark: Option<Mark>) {
        let (datasn, offset, len) = self.piece;
        self.last = mark.map(|mark| LastIn {
            mark,
            datasn,
            offset,
            len,
        });
    }

    /// Before more Data-In: this command's earlier chunks leave now (a
    /// long read is sent as it is read, not queued whole). The first
    /// chunk flushes nothing: other commands' responses queued meanwhile
    /// leave with its, not one send each.
    async fn before_data_in(&mut self) -> Result<(), XferError> {
        if self.task.aborted() {
            return Err(XferError::Disconnected);
        }
        if self.last.take().is_some() {
            self.core
                .tx
                .flush()
                .await
                .map_err(|_| XferError::Disconnected)?;
        }
        Ok(())
    }
}

impl Drop for WireData<'_> {
    fn drop(&mut self) {
        // The buffers go back to the connection for the next commands.
        self.core.give_buf(std::mem::take(&mut self.cur));
    }
}

pub(crate) fn next_tag(t: u32) -> u32 {
    match t.wrapping_add(1) {
        RESERVED_TAG => 0,
        n => n,
    }
}

impl DataPath for WireData<'_> {
    fn direction(&self) -> Direction {
        self.info.dir
    }

    fn expected_len(&self) -> u32 {
        self.info.edtl
    }

    fn residuals(&self) -> bool {
        true
    }

    async fn data_out(&mut self, offset: u32, dst: &mut [u8]) -> Result<usize, XferError> {
        if offset != self.out.have {
            return Err(XferError::Io(libc::EPROTO));
        }
        let want = dst.len().min((self.info.edtl - offset) as usize);
        let mut got = self.take_carry(&mut dst[..want]);
        while got < want {
            if self.out.have >= self.out.burst_end || !self.out.burst_open {
                if self.out.have < self.out.unsolicited_end {
                    // The initiator ended its unsolicited burst early.
                    return Err(XferError::Io(libc::EPROTO));
                }
                self.send_r2t().await?;
            }
            self.next_data_out().await?;
            if self.seq_error {
                // Nothing of this chunk counts: the core stops short.
                return Ok(0);
            }
            got += self.take_carry(&mut dst[got..want]);
        }
        Ok(got)
    }

    fn data_out_buf(&mut self, offset: u32, len: usize) -> Option<IoBuf> {
        let whole = self.imm_at == 0 && self.imm.as_ref().is_some_and(|b| b.len() == len);
        if !whole || offset != self.out.have {
            return None;
        }
        self.out.have += len as u32;
        self.imm.take()
    }

    async fn data_in(&mut self, offset: u32, src: &[u8]) -> Result<usize, XferError> {
        let n = src
            .len()
            .min(self.info.edtl.saturating_sub(offset) as usize);
        self.before_data_in().await?;
        self.queue_data_in(offset, &src[..n]);
        Ok(n)
    }

    async fn data_in_buf(
        &mut self,
        offset: u32,
        buf: IoBuf,
    ) -> (Result<usize, XferError>, Option<IoBuf>) {
        let n = buf
            .len()
            .min(self.info.edtl.saturating_sub(offset) as usize);
        if let Err(e) = self.before_data_in().await {
            return (Err(e), Some(buf));
        }
        if n == 0 {
            return (Ok(0), Some(buf));
        }
        self.queue_data_in_held(offset, buf, n);
        if offset + (n as u32) < self.info.edtl {
            // More data may follow: this chunk leaves now, so its buffer
            // is not held while the core waits for the next one (a
            // command holds at most one buffer, and only until the send
            // of its status).
            self.last = None;
            if self.core.tx.flush().await.is_err() {
                return (Err(XferError::Disconnected), None);
            }
        }
        (Ok(n), None)
    }
}

//! One SCSI command's data phase on the wire, as the SCSI target core's
//! [`DataPath`]: data to the device comes from the command's immediate
//! data, then unsolicited Data-Out (FirstBurstLength), then Data-Out
//! answering our R2Ts (MaxBurstLength each), handed to the task by the
//! session's receive loop; data from the device leaves as Data-In PDUs
//! (MaxRecvDataSegmentLength each, F at every MaxBurstLength) on the
//! connection's shared send queue, queued at once (the data copied once,
//! from the device's buffer into the queue) with the last one's place
//! kept, so the status can be written into its header while it is still
//! unsent (phase collapse). Many commands of a session run this at once,
//! each on its own task.

use ustor_iscsi::wire::RESERVED_TAG;
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
    /// Immediate data not yet taken.
    imm: &'a [u8],
    out: OutState,
    /// The data segment of the Data-Out being taken.
    cur: Vec<u8>,
    datasn: u32,
    sent: u32,
    /// A Data-Out came with the wrong DataSN: the data phase stops short.
    seq_error: bool,
    /// The last Data-In PDU queued, whose header the status may rewrite.
    last: Option<LastIn>,
}

impl<'a> WireData<'a> {
    pub fn new(core: &'a Core, task: &'a Task, info: CmdInfo, imm: &'a [u8]) -> WireData<'a> {
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
            imm: &imm[..(info.immediate as usize).min(imm.len())],
            out,
            cur: Vec::new(),
            datasn: 0,
            sent: 0,
            seq_error: false,
            last: None,
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
        if !self.imm.is_empty() {
            let n = self.imm.len().min(dst.len());
            dst[..n].copy_from_slice(&self.imm[..n]);
            self.imm = &self.imm[n..];
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
        self.imm = &[];
        while self.out.burst_open {
            self.next_data_out().await?;
            self.out.have += self.out.carry.map_or(0, |(a, b)| (b - a) as u32);
            self.out.carry = None;
        }
        Ok(())
    }

    /// Queues the Data-In PDUs for `src` at `offset`; the last one's place
    /// is kept. F marks each burst's end and the end of the expected data.
    fn queue_data_in(&mut self, offset: u32, src: &[u8]) {
        let max = self.core.params.max_send_data.max(512) as usize;
        let burst = self.core.params.max_burst.max(512);
        let mut at = 0;
        while at < src.len() {
            let n = (src.len() - at).min(max);
            let off = offset + at as u32;
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
            let mark = self.core.tx.queue_marked(&b, &src[at..at + n]);
            self.last = Some(LastIn {
                mark,
                datasn: self.datasn,
                offset: off,
                len: n,
            });
            self.datasn += 1;
            at += n;
        }
        self.sent = self.sent.max(offset + src.len() as u32);
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

    async fn data_in(&mut self, offset: u32, src: &[u8]) -> Result<usize, XferError> {
        let n = src
            .len()
            .min(self.info.edtl.saturating_sub(offset) as usize);
        if self.task.aborted() {
            return Err(XferError::Disconnected);
        }
        // This command's earlier chunks leave now (a long read is sent as
        // it is read, not queued whole); this chunk's last PDU may carry
        // status. The first chunk flushes nothing: other commands'
        // responses queued meanwhile leave with theirs, not one send each.
        if self.last.take().is_some() {
            self.core
                .tx
                .flush()
                .await
                .map_err(|_| XferError::Disconnected)?;
        }
        self.queue_data_in(offset, &src[..n]);
        Ok(n)
    }
}

//! One SCSI command's data phase on the wire, as the SCSI target core's
//! [`DataPath`]: data to the device comes from the command's immediate
//! data, then unsolicited Data-Out (FirstBurstLength), then Data-Out
//! answering our R2Ts (MaxBurstLength each); data from the device leaves
//! as Data-In PDUs (MaxRecvDataSegmentLength each, F at every
//! MaxBurstLength), the last one held back so the status can ride in it
//! (phase collapse). PDUs of other tasks that arrive while a command waits
//! for its data are kept for the session loop, in order.

use ustor_iscsi::wire::{opcode, Bhs, RESERVED_TAG};
use ustor_scsi_target::{DataPath, Direction, XferError};

use crate::io::{Received, Wire};
use crate::negotiate::Params;
use crate::pdu::{self, Seq};

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

/// The data phase of one command; borrows the connection while it runs.
pub struct WireData<'a> {
    pub wire: &'a mut Wire,
    pub deferred: &'a mut std::collections::VecDeque<(Bhs, Vec<u8>)>,
    pub seq: &'a mut Seq,
    pub params: &'a Params,
    pub info: CmdInfo,
    pub next_ttt: &'a mut u32,
    /// Immediate data not yet taken.
    imm: &'a [u8],
    out: OutState,
    datasn: u32,
    sent: u32,
    /// A Data-Out came with the wrong DataSN: the data phase stops short.
    seq_error: bool,
}

impl<'a> WireData<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        wire: &'a mut Wire,
        deferred: &'a mut std::collections::VecDeque<(Bhs, Vec<u8>)>,
        seq: &'a mut Seq,
        params: &'a Params,
        next_ttt: &'a mut u32,
        info: CmdInfo,
        imm: &'a [u8],
    ) -> WireData<'a> {
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
            wire,
            deferred,
            seq,
            params,
            info,
            next_ttt,
            imm: &imm[..(info.immediate as usize).min(imm.len())],
            out,
            datasn: 0,
            sent: 0,
            seq_error: false,
        }
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
        dst[..n].copy_from_slice(&self.wire.data()[from..from + n]);
        self.out.carry = (from + n < to).then_some((from + n, to));
        self.out.have += n as u32;
        n
    }

    /// Receives the next Data-Out of this command, keeping other PDUs.
    async fn next_data_out(&mut self) -> Result<(), XferError> {
        loop {
            let b = match self.wire.recv().await {
                Ok(Received::Pdu(b)) => b,
                Ok(Received::BadDataDigest(_)) | Err(_) => return Err(XferError::Disconnected),
            };
            if b.opcode() != opcode::DATA_OUT {
                let data = self.wire.data().to_vec();
                self.deferred.push_back((b, data));
                continue;
            }
            let (itt, ttt, off) = (b.itt(), b.u32_at(20), b.u32_at(40));
            let len = b.data_len() as u32;
            if itt != self.info.itt
                || ttt != self.out.ttt
                || off != self.out.have
                || off + len > self.out.burst_end
            {
                // ERL 0: a PDU that does not fit the burst ends the
                // connection.
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
            return Ok(());
        }
    }

    /// Opens the next solicited burst with an R2T.
    async fn send_r2t(&mut self) -> Result<(), XferError> {
        let len = self.params.max_burst.min(self.info.edtl - self.out.have);
        let ttt = *self.next_ttt;
        *self.next_ttt = next_tag(ttt);
        let b = pdu::r2t(
            self.info.lun,
            self.info.itt,
            ttt,
            self.out.r2tsn,
            self.out.have,
            len,
            self.seq,
        );
        self.out.r2tsn += 1;
        self.out.datasn = 0;
        self.out.ttt = ttt;
        self.out.burst_end = self.out.have + len;
        self.out.burst_open = true;
        self.wire
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

    /// Queues the Data-In PDUs for `src` at `offset`; the last stays queued.
    fn queue_data_in(&mut self, offset: u32, src: &[u8]) {
        let max = self.params.max_send_data.max(512) as usize;
        let burst = self.params.max_burst.max(512);
        let mut at = 0;
        while at < src.len() {
            let n = (src.len() - at).min(max);
            let off = offset + at as u32;
            let end = off + n as u32;
            let b = pdu::data_in(
                self.info.lun,
                self.info.itt,
                end % burst == 0,
                None,
                self.datasn,
                off,
                n,
                self.seq,
            );
            self.datasn += 1;
            self.wire.queue(&b, &src[at..at + n]);
            at += n;
        }
        self.sent = self.sent.max(offset + src.len() as u32);
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
        // Earlier chunks leave now; this chunk's last PDU may carry status.
        self.wire
            .flush()
            .await
            .map_err(|_| XferError::Disconnected)?;
        self.queue_data_in(offset, &src[..n]);
        Ok(n)
    }
}

/// Whether the last queued PDU is this command's Data-In (phase collapse
/// possible).
pub fn last_is_data_in(wire: &Wire, itt: u32) -> Option<Bhs> {
    wire.last_header()
        .filter(|b| b.opcode() == opcode::DATA_IN && b.itt() == itt)
}

//! The receive machine: where the next bytes go (a header buffer, or a
//! command's own buffer for Data-In) and what each complete PDU does to the
//! task table.

use ustor_scsi::lld::TransportError;
use ustor_scsi::ScsiStatus;

use super::*;

impl State {
    /// Where the next received bytes go: fills `out`, returns the count
    /// (at least one, never zero-length).
    pub fn rx_iovecs(&mut self, out: &mut [libc::iovec; RX_IOVS]) -> usize {
        let mut n = 0;
        match self.phase {
            RxPhase::Header => {
                let p = self.hdr[self.hgot..].as_mut_ptr();
                push_iov(out, &mut n, p, self.hwant - self.hgot);
                return n;
            }
            RxPhase::Data => {
                let (a, b) = (self.doff + self.dgot, self.doff + self.dlen);
                match self.dest {
                    Dest::Task(slot) => {
                        let t = &self.tasks[slot as usize];
                        n = t.slices(a..b, &mut out[..crate::MAX_SEGS]).0;
                    }
                    Dest::Scratch => {
                        let p = self.scratch[a..].as_mut_ptr();
                        push_iov(out, &mut n, p, b - a);
                    }
                }
                let p = self.tail.as_mut_ptr();
                push_iov(out, &mut n, p, self.twant);
            }
            RxPhase::Tail => {
                let p = self.tail[self.tgot..].as_mut_ptr();
                push_iov(out, &mut n, p, self.twant - self.tgot);
            }
        }
        // Look ahead: the next PDU's BHS (+ header digest) lands in place.
        let p = self.hdr.as_mut_ptr();
        let hd = if self.p.header_digest { 4 } else { 0 };
        push_iov(out, &mut n, p, BHS_LEN + hd);
        n
    }

    /// Takes `n` bytes that arrived where [`State::rx_iovecs`] said.
    pub fn rx_advance(&mut self, mut n: usize) -> Result<(), RxError> {
        if n == 0 {
            return Err(RxError::Eof);
        }
        self.rx_seen = true;
        while n > 0 || self.rx_step_ready() {
            match self.phase {
                RxPhase::Header => {
                    // Look-ahead bytes already sit at hdr[0..]: only count.
                    let k = n.min(self.hwant - self.hgot);
                    self.hgot += k;
                    n -= k;
                    if self.hgot < self.hwant {
                        debug_assert_eq!(n, 0);
                        return Ok(());
                    }
                    if self.header_done()? {
                        continue;
                    }
                }
                RxPhase::Data => {
                    let k = n.min(self.dlen - self.dgot);
                    if self.p.data_digest && k > 0 {
                        let r = self.doff + self.dgot..self.doff + self.dgot + k;
                        self.crc = match self.dest {
                            Dest::Task(s) => self.tasks[s as usize].crc(self.crc, r),
                            Dest::Scratch => crc32c::crc32c_append(self.crc, &self.scratch[r]),
                        };
                    }
                    self.dgot += k;
                    n -= k;
                    if self.dgot < self.dlen {
                        // A short read ends inside the data: the tail and
                        // look-ahead iovecs got nothing.
                        return Ok(());
                    }
                    self.phase = RxPhase::Tail;
                    // Data and tail were read together: tail bytes start at
                    // tail[0] already.
                }
                RxPhase::Tail => {
                    let k = n.min(self.twant - self.tgot);
                    self.tgot += k;
                    n -= k;
                    if self.tgot < self.twant {
                        return Ok(());
                    }
                    // Whatever is left was read into hdr[0..] (look-ahead).
                    self.pdu_done()?;
                }
            }
            if n == 0 && !self.rx_step_ready() {
                break;
            }
        }
        Ok(())
    }

    /// A phase with nothing left to read (empty data or tail) can advance
    /// without bytes.
    fn rx_step_ready(&self) -> bool {
        match self.phase {
            RxPhase::Header => false,
            RxPhase::Data => self.dgot == self.dlen,
            RxPhase::Tail => self.tgot == self.twant,
        }
    }

    /// The header is complete (or needs its AHS): returns true when the
    /// machine moved on.
    fn header_done(&mut self) -> Result<bool, RxError> {
        let hd = self.p.header_digest;
        let b = Bhs::from_slice(&self.hdr[..BHS_LEN])?;
        let want = ahs_and_digest(&b, hd);
        if self.hwant < want {
            // The AHS is longer than the first read: read the rest.
            self.hwant = want;
            return Ok(false);
        }
        if hd {
            let at = BHS_LEN + b.ahs_len();
            let got = u32::from_le_bytes([
                self.hdr[at],
                self.hdr[at + 1],
                self.hdr[at + 2],
                self.hdr[at + 3],
            ]);
            if crc32c::crc32c(&self.hdr[..at]) != got {
                self.stats.header_digest_errors += 1;
                return Err(WireError::HeaderDigest.into());
            }
        }
        self.stats.pdus_rx += 1;
        self.cur = b;
        self.hgot = 0;
        self.hwant = BHS_LEN + if hd { 4 } else { 0 };
        let dlen = b.data_len();
        if dlen > self.p.max_recv_seg as usize {
            return Err(WireError::TooLarge(dlen).into());
        }
        self.dest = Dest::Scratch;
        self.doff = 0;
        if b.opcode() == opcode::DATA_IN && dlen > 0 {
            let itt = b.itt();
            let slot = self.active_slot(itt).ok_or(RxError::UnknownTask(itt))?;
            let t = &self.tasks[slot as usize];
            let offset = b.u32_at(40);
            if !t.read || offset as u64 + dlen as u64 > t.data_len as u64 {
                return Err(RxError::Overrun {
                    offset,
                    len: dlen as u32,
                    size: if t.read { t.data_len } else { 0 },
                });
            }
            self.dest = Dest::Task(slot);
            self.doff = offset as usize;
        }
        self.dlen = dlen;
        self.dgot = 0;
        self.tgot = 0;
        self.twant = pad4(dlen) - dlen + if self.p.data_digest && dlen > 0 { 4 } else { 0 };
        self.crc = 0;
        self.phase = RxPhase::Data;
        Ok(true)
    }

    /// The whole PDU is in: check the data digest, act on it.
    fn pdu_done(&mut self) -> Result<(), RxError> {
        let pad = pad4(self.dlen) - self.dlen;
        if self.p.data_digest && self.dlen > 0 {
            let crc = crc32c::crc32c_append(self.crc, &self.tail[..pad]);
            let got = u32::from_le_bytes([
                self.tail[pad],
                self.tail[pad + 1],
                self.tail[pad + 2],
                self.tail[pad + 3],
            ]);
            if crc != got {
                self.stats.data_digest_errors += 1;
                return Err(WireError::DataDigest.into());
            }
        }
        self.phase = RxPhase::Header;
        let b = self.cur;
        self.on_pdu(&b)
    }

    /// Acts on one complete target PDU (its data is in the task's buffer or
    /// in `scratch[..dlen]`).
    fn on_pdu(&mut self, b: &Bhs) -> Result<(), RxError> {
        let pdu = TargetPdu::decode(b)?;
        let dlen = self.dlen;
        match pdu {
            TargetPdu::DataIn {
                itt,
                status,
                statsn,
                maxcmdsn,
                residual,
                underflow,
                ..
            } => {
                let slot = self.active_slot(itt).ok_or(RxError::UnknownTask(itt))?;
                let t = &mut self.tasks[slot as usize];
                if dlen > 0 && !t.read {
                    return Err(RxError::UnexpectedData(dlen));
                }
                t.received = t.received.saturating_add(dlen as u32);
                self.stats.data_in_bytes += dlen as u64;
                if let Some(st) = status {
                    self.update_sn(Some(statsn), maxcmdsn);
                    let resid = if underflow { residual } else { 0 };
                    self.finish(slot, Ok(ScsiStatus::from_u8(st)), resid);
                } else {
                    self.update_sn(None, maxcmdsn);
                }
            }
            TargetPdu::ScsiResponse {
                itt,
                response,
                status,
                statsn,
                maxcmdsn,
                residual,
                underflow,
            } => {
                self.update_sn(Some(statsn), maxcmdsn);
                let slot = self.active_slot(itt).ok_or(RxError::UnknownTask(itt))?;
                let data = &self.scratch[..dlen];
                let t = &mut self.tasks[slot as usize];
                if data.len() >= 2 {
                    let n = (u16::from_be_bytes([data[0], data[1]]) as usize)
                        .min(data.len() - 2)
                        .min(SENSE_MAX);
                    t.sense[..n].copy_from_slice(&data[2..2 + n]);
                    t.sense_len = n;
                }
                let status = if response == 0 {
                    Ok(ScsiStatus::from_u8(status))
                } else {
                    Err(TransportError::Protocol("target failure response"))
                };
                self.finish(slot, status, if underflow { residual } else { 0 });
            }
            TargetPdu::R2t {
                itt,
                ttt,
                maxcmdsn,
                offset,
                len,
                ..
            } => {
                self.update_sn(None, maxcmdsn);
                self.on_r2t(itt, ttt, offset, len)?;
            }
            TargetPdu::NopIn {
                itt,
                ttt,
                statsn,
                maxcmdsn,
            } => {
                // StatSN advances only on the answer to our ping; an
                // unsolicited NOP-In (ITT reserved) carries the next one
                // without using it (RFC 7143 §11.19.3).
                if itt != RESERVED_TAG {
                    self.update_sn(Some(statsn), maxcmdsn);
                    if self.ping_itt == Some(itt) {
                        self.ping_itt = None;
                        self.stats.pings_answered += 1;
                    }
                } else if ttt != RESERVED_TAG {
                    self.update_sn(None, maxcmdsn);
                    // The target pings us: echo its TTT.
                    let nop =
                        build::nop_out(b.lun(), RESERVED_TAG, ttt, self.cmdsn, self.expstatsn);
                    self.send_ctl(nop);
                    self.stats.target_nops_answered += 1;
                } else {
                    self.update_sn(None, maxcmdsn);
                }
            }
            TargetPdu::TmfResponse {
                itt,
                response,
                statsn,
                maxcmdsn,
            } => {
                self.update_sn(Some(statsn), maxcmdsn);
                self.tmf_resp = Some((itt, response));
            }
            TargetPdu::Async {
                statsn,
                maxcmdsn,
                event,
            } => {
                self.update_sn(Some(statsn), maxcmdsn);
                tracing::info!("iscsi: async event {event}");
            }
            TargetPdu::Reject { reason, statsn } => {
                self.update_sn(Some(statsn), self.maxcmdsn);
                tracing::warn!("iscsi: reject reason {reason:#x}");
            }
            TargetPdu::LogoutResponse { statsn, .. } => {
                self.update_sn(Some(statsn), self.maxcmdsn);
            }
            // Login and text responses have no place in full feature phase.
            TargetPdu::LoginResponse { .. } | TargetPdu::TextResponse { .. } => {
                return Err(WireError::Opcode(b.opcode()).into())
            }
        }
        Ok(())
    }

    fn on_r2t(&mut self, itt: u32, ttt: u32, offset: u32, len: u32) -> Result<(), RxError> {
        let slot = self.active_slot(itt).ok_or(RxError::UnknownTask(itt))?;
        let max_burst = self.p.max_burst;
        let t = &mut self.tasks[slot as usize];
        let end = offset as u64 + len as u64;
        if !t.write || len == 0 || len > max_burst || end > t.data_len as u64 || ttt == RESERVED_TAG
        {
            return Err(RxError::BadR2t);
        }
        let b = Burst {
            ttt,
            off: offset,
            end: end as u32,
            datasn: 0,
        };
        match (t.out, t.next_r2t) {
            (None, _) => t.out = Some(b),
            (Some(_), None) => t.next_r2t = Some(b),
            _ => return Err(RxError::BadR2t),
        }
        self.stats.r2ts += 1;
        self.enqueue(slot);
        Ok(())
    }
}

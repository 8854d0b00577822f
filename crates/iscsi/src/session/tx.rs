//! The send machine: stages the next PDUs (control first, then commands and
//! their Data-Out) and lays them out as iovecs, header plus the command's
//! own buffer.

use super::*;

impl State {
    /// Whether the sender has anything to do.
    pub fn tx_pending(&self) -> bool {
        self.nstaged > 0 || !self.ctl.is_empty() || !self.ready.is_empty()
    }

    /// Stages PDUs (up to a batch) and lays them out in `out`; returns the
    /// iovec count (0 = nothing to send).
    pub fn tx_iovecs(&mut self, out: &mut [libc::iovec; TX_IOVS]) -> usize {
        while self.nstaged < TX_BATCH {
            let Some(p) = self.next_pdu() else { break };
            self.staged[self.nstaged] = Some(p);
            self.nstaged += 1;
        }
        let mut n = 0;
        for i in 0..self.nstaged {
            let Some(p) = self.staged[i].as_ref() else {
                continue;
            };
            let mut skip = p.sent;
            let mut add = |base: *const u8, len: usize, n: &mut usize, skip: &mut usize| {
                if *skip >= len {
                    *skip -= len;
                    return;
                }
                out[*n] = libc::iovec {
                    // SAFETY: skip < len, inside the piece.
                    iov_base: unsafe { base.add(*skip) } as *mut libc::c_void,
                    iov_len: len - *skip,
                };
                *skip = 0;
                *n += 1;
            };
            add(p.hdr.as_ptr(), p.hlen, &mut n, &mut skip);
            if p.len > 0 {
                if p.spilled {
                    add(self.spill.as_ptr(), p.len as usize, &mut n, &mut skip);
                } else if let Some(slot) = p.slot {
                    let mut segs = [libc::iovec {
                        iov_base: std::ptr::null_mut(),
                        iov_len: 0,
                    }; crate::MAX_SEGS];
                    let r = p.off as usize..(p.off + p.len) as usize;
                    let (k, _) = self.tasks[slot as usize].slices(r, &mut segs);
                    for s in &segs[..k] {
                        add(s.iov_base as *const u8, s.iov_len, &mut n, &mut skip);
                    }
                }
            }
            add(p.tail.as_ptr(), p.tlen, &mut n, &mut skip);
        }
        n
    }

    /// `n` bytes of the laid-out PDUs went out.
    pub fn tx_advance(&mut self, mut n: usize) {
        let mut done = 0;
        for i in 0..self.nstaged {
            let Some(p) = self.staged[i].as_mut() else {
                done += 1;
                continue;
            };
            let k = n.min(p.total() - p.sent);
            p.sent += k;
            n -= k;
            if p.sent < p.total() {
                break;
            }
            if p.spilled {
                self.spill.clear();
            }
            self.stats.pdus_tx += 1;
            done += 1;
        }
        if done > 0 {
            self.staged.copy_within(done..self.nstaged, 0);
            for s in &mut self.staged[self.nstaged - done..self.nstaged] {
                *s = None;
            }
            self.nstaged -= done;
        }
    }

    /// The next PDU: control first, then task output round-robin.
    fn next_pdu(&mut self) -> Option<TxPdu> {
        if let Some(mut b) = self.ctl.pop_front() {
            b.set_u32(28, self.expstatsn);
            return Some(self.header_pdu(&b));
        }
        while let Some(slot) = self.ready.pop_front() {
            let expstatsn = self.expstatsn;
            let t = &mut self.tasks[slot as usize];
            t.queued = false;
            if t.state != TaskState::Active {
                continue;
            }
            if t.cmd_pending {
                t.cmd_pending = false;
                let mut b = t.bhs;
                b.set_u32(28, expstatsn);
                let imm = t.imm;
                let more = t.out.is_some();
                let p = self.data_pdu(&b, slot, 0, imm);
                self.stats.immediate_bytes += imm as u64;
                if more {
                    self.enqueue(slot);
                }
                return Some(p);
            }
            let Some(mut o) = t.out else { continue };
            let seg = self.p.max_send_seg.max(512);
            let len = seg.min(o.end - o.off);
            let last = o.off + len == o.end;
            let b = build::data_out(
                t.lun,
                t.tag,
                o.ttt,
                expstatsn,
                o.datasn,
                o.off,
                len as usize,
                last,
            );
            let off = o.off;
            o.off += len;
            o.datasn += 1;
            t.out = if last { t.next_r2t.take() } else { Some(o) };
            let more = t.out.is_some();
            let p = self.data_pdu(&b, slot, off, len);
            self.stats.data_out_bytes += len as u64;
            if more {
                self.enqueue(slot);
            }
            return Some(p);
        }
        None
    }

    fn header_pdu(&self, b: &Bhs) -> TxPdu {
        let mut hdr = [0u8; BHS_LEN + 4];
        hdr[..BHS_LEN].copy_from_slice(&b.0);
        let mut hlen = BHS_LEN;
        if self.p.header_digest {
            hdr[BHS_LEN..].copy_from_slice(&crc32c::crc32c(&b.0).to_le_bytes());
            hlen += 4;
        }
        TxPdu {
            hdr,
            hlen,
            slot: None,
            off: 0,
            len: 0,
            spilled: false,
            tail: [0; 8],
            tlen: 0,
            sent: 0,
        }
    }

    fn data_pdu(&self, b: &Bhs, slot: u16, off: u32, len: u32) -> TxPdu {
        let mut p = self.header_pdu(b);
        if len == 0 {
            return p;
        }
        p.slot = Some(slot);
        p.off = off;
        p.len = len;
        let pad = pad4(len as usize) - len as usize;
        p.tlen = pad;
        if self.p.data_digest {
            let r = off as usize..(off + len) as usize;
            let crc = self.tasks[slot as usize].crc(0, r);
            let crc = crc32c::crc32c_append(crc, &[0u8; 3][..pad]);
            p.tail[pad..pad + 4].copy_from_slice(&crc.to_le_bytes());
            p.tlen += 4;
        }
        p
    }

    /// A task goes away: staged PDUs that still point into its buffer are
    /// dropped if none of their bytes went out, or (the one half-sent PDU)
    /// have their rest copied aside, so the stream stays whole.
    pub(super) fn release_tx(&mut self, slot: u16) {
        let mut keep = 0;
        for i in 0..self.nstaged {
            let Some(mut p) = self.staged[i] else {
                continue;
            };
            if p.slot == Some(slot) && !p.spilled && p.len > 0 {
                if p.sent == 0 {
                    continue;
                }
                self.spill.clear();
                // The spill holds the whole data part; the sent prefix is
                // skipped by `sent` as before.
                let r = p.off as usize..(p.off + p.len) as usize;
                self.tasks[slot as usize].copy_out(r, &mut self.spill);
                p.spilled = true;
                self.stats.spills += 1;
            }
            self.staged[keep] = Some(p);
            keep += 1;
        }
        for s in &mut self.staged[keep..] {
            *s = None;
        }
        self.nstaged = keep;
    }

    pub(super) fn reset_tx(&mut self) {
        self.staged = [None; TX_BATCH];
        self.nstaged = 0;
        self.ready.clear();
        self.ctl.clear();
        self.spill.clear();
        for t in &mut self.tasks {
            t.queued = false;
        }
    }
}

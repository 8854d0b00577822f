//! Writes: the grant (placement slots posted over the planned blocks, or
//! fragments asked for), frames landing in the slots, fragments copied
//! into place, and the commit.

use std::time::{Duration, Instant};

use super::life::Outcome;
use super::{bump, err_reply, scratch, Engine, Key, MAX_GRANTS};
use crate::fs::WritePlan;
use crate::proto::Header;
use crate::serve::{self, Reply};
use crate::xdp_wire::{self as w, Ctrl, Grant, Kind, PLACE_HDR};

/// How long a placement's slots stay posted: a client that took a grant
/// and went silent would otherwise hold the export (every other frame
/// would land in its slots). Far above what a 1 MiB write's frames take.
pub(super) const GRANT_DEADLINE: Duration = Duration::from_secs(1);

/// A write whose payload is coming.
pub(super) struct Pending {
    pub rid: u64,
    h: Header,
    plan: WritePlan,
    crc: u32,
    len: usize,
    seq: u8,
    place: bool,
    have: Vec<bool>,
    got: usize,
    /// Bytes of every fragment but the last (copied writes).
    unit: usize,
}

/// The placement in progress (one per export at a time).
pub(super) struct Placement {
    pub key: Key,
    seq: u8,
    /// The 16 bytes before each segment, saved when the slots were posted.
    pub saved: Vec<(usize, [u8; PLACE_HDR])>,
    /// Slots posted and not yet filled.
    outstanding: usize,
    bad: bool,
    pub until: Instant,
}

/// A posted placement slot: where its frame lands, for whom, how long.
pub(super) struct Slot {
    addr: u64,
    key: Key,
    len: u32,
}

impl Engine {
    pub(super) fn begin_write(
        &mut self,
        key: Key,
        rid: u64,
        h: Header,
        off: u64,
        len: u32,
        rest: &[u8],
    ) {
        if self.svc.read_only {
            return self.reply_err(key, rid, h.op, h.tag, libc::EROFS);
        }
        let Some(crc) = rest
            .get(..4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4")))
        else {
            return self.reply_err(key, rid, h.op, h.tag, libc::EINVAL);
        };
        self.with_vol(
            key,
            rid,
            Box::new(move |v, _| {
                v.st.requests += 1;
                let plan =
                    v.fs.begin_write(h.ino, off, len as usize)
                        .map(Box::new)
                        .map_err(|e| {
                            v.st.errors += 1;
                            e.errno()
                        });
                Outcome::Planned { h, plan, crc }
            }),
        );
    }

    /// A write was planned (or refused): its grant goes out next.
    pub(super) fn planned(&mut self, key: Key, rid: u64, h: Header, plan: WritePlan, crc: u32) {
        let Some(s) = self.sessions.get_mut(&key) else {
            return self.abort(plan, None);
        };
        let place = placeable(&plan, self.frame - PLACE_HDR);
        s.write = Some(Pending {
            rid,
            h,
            crc,
            len: plan.segs.iter().map(|s| s.1).sum(),
            plan,
            seq: 0,
            place,
            have: Vec::new(),
            got: 0,
            unit: 0,
        });
        self.regrant.push(key);
    }

    /// Posts a write's placement slots (or asks for fragments) and tells
    /// the client.
    pub(super) fn grant(&mut self, key: Key) {
        // Pieces fill our socket's frames; a client that cannot send
        // frames that large sends fragments of its own size.
        let frame = self.frame_to(&key);
        let piece = self.frame - PLACE_HDR;
        let Some(p) = self.sessions.get_mut(&key).and_then(|s| s.write.as_mut()) else {
            return;
        };
        p.seq = p.seq.wrapping_add(1);
        if p.seq > MAX_GRANTS {
            return self.fail_write(key, libc::EIO);
        }
        let nops = self.posted - self.received;
        let room = (super::super::RING as u64).saturating_sub(nops) as usize;
        let slots = if p.place {
            count_slots(&p.plan, piece)
        } else {
            0
        };
        let place = p.place
            && frame == self.frame
            && self.placing.is_none()
            && self.jobs == 0
            && slots + 64 <= room;
        let mut g = Grant {
            place,
            seq: p.seq,
            nops: nops as u32,
            piece: piece as u16,
            frag: w::ctrl_payload(frame) as u16,
            segs: Vec::new(),
        };
        if place {
            let (region, _, _) = scratch();
            let base = self.svc.vol.base;
            let mut saved = Vec::new();
            for &(o, n) in &p.plan.segs {
                let mut b = [0u8; PLACE_HDR];
                // SAFETY: o >= PLACE_HDR (data blocks follow the
                // superblock), and the range lies inside the region.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        base.add(o - PLACE_HDR),
                        b.as_mut_ptr(),
                        PLACE_HDR,
                    )
                };
                saved.push((o, b));
                g.segs.push(n as u32);
                for (ps, pl) in w::pieces(n, piece) {
                    let addr = region + (o + ps - PLACE_HDR) as u64;
                    let len = (PLACE_HDR + pl) as u32;
                    self.slots.push_back(Slot { addr, key, len });
                    let fill = addr - self.xsk.landing_offset();
                    let ok = self.xsk.fill(&[fill]);
                    debug_assert_eq!(ok, 1, "room was checked");
                    self.posted += 1;
                }
            }
            self.placing = Some(Placement {
                key,
                seq: p.seq,
                saved,
                outstanding: slots,
                bad: false,
                until: self.now + GRANT_DEADLINE,
            });
        } else {
            p.place = false;
            p.unit = g.frag as usize;
            p.have = vec![false; w::nfrags(p.len, p.unit) as usize];
            // NOPs only to fill slots of an earlier grant; buffers for
            // the burst of fragments are posted before the client sends.
            if self.placing.is_none() {
                g.nops = 0;
            }
            p.got = 0;
        }
        let burst = if place { 0 } else { p.have.len() };
        let (rid, body, again) = (p.rid, g.encode(), p.seq > 1);
        self.post_scratch(burst);
        if again {
            bump(&self.c.retransmits, 1);
        }
        self.send_msg(key, Kind::Go, rid, &body);
    }

    /// A frame landed in a placement slot.
    pub(super) fn on_slot(&mut self, d: ustor_net::xdp::Desc) {
        let (Some(slot), Some(pl)) = (self.slots.pop_front(), self.placing.as_mut()) else {
            return bump(&self.c.drops, 1);
        };
        if slot.addr != d.addr || slot.len != d.len || slot.key != pl.key {
            pl.bad = true;
        } else {
            bump(&self.c.placed_bytes, (d.len as usize - PLACE_HDR) as u64);
        }
        pl.outstanding -= 1;
        if pl.outstanding > 0 {
            return;
        }
        let pl = self.placing.take().expect("placing");
        self.restore(&pl.saved);
        let Some(p) = self.sessions.get(&pl.key).and_then(|s| s.write.as_ref()) else {
            return;
        };
        // The write went on in fragments (a later grant): it may complete
        // now that no frame can land in its blocks any more.
        let current = p.place && p.seq == pl.seq;
        let done = !p.place && p.got == p.have.len();
        if (current && !pl.bad || done) && self.payload_crc(&pl.key) {
            self.commit(pl.key);
        } else if current || done {
            // Wrong frames in the slots (another sender's, or lost ones):
            // the next grant asks for fragments, which no frame can spoil.
            if let Some(p) = self
                .sessions
                .get_mut(&pl.key)
                .and_then(|s| s.write.as_mut())
            {
                p.place = false;
            }
            bump(&self.c.drops, 1);
            self.regrant.push(pl.key);
        }
    }

    /// Puts back the bytes saved before each placed segment.
    pub(super) fn restore(&self, saved: &[(usize, [u8; PLACE_HDR])]) {
        let base = self.svc.vol.base;
        for (o, b) in saved {
            // SAFETY: restores the bytes saved when the slots were posted,
            // inside the region; no frame lands there any more.
            unsafe {
                std::ptr::copy_nonoverlapping(b.as_ptr(), base.add(o - PLACE_HDR), PLACE_HDR)
            };
        }
    }

    fn payload_crc(&self, key: &Key) -> bool {
        let p = self.sessions[key].write.as_ref().expect("pending");
        let mut crc = 0;
        for &(o, n) in &p.plan.segs {
            // SAFETY: planned ranges lie inside the region.
            let b = unsafe { std::slice::from_raw_parts(self.svc.vol.base.add(o), n) };
            crc = crc32c::crc32c_append(crc, b);
        }
        crc == p.crc
    }

    /// A fragment of a copied write.
    pub(super) fn on_wdata(&mut self, key: Key, h: &Ctrl, payload: &[u8]) {
        let base = self.svc.vol.base;
        let now = self.now;
        let Some(s) = self.sessions.get_mut(&key) else {
            return bump(&self.c.drops, 1);
        };
        s.seen = now;
        let Some(p) = s.write.as_mut() else {
            return bump(&self.c.drops, 1);
        };
        let at = h.frag as usize * p.unit;
        let ok = !p.place
            && p.rid == h.rid
            && h.nfrag as usize == p.have.len()
            && (payload.len() == p.unit || h.frag + 1 == h.nfrag)
            && at + payload.len() <= p.len
            && (h.frag + 1 < h.nfrag || at + payload.len() == p.len);
        if !ok {
            return bump(&self.c.drops, 1);
        }
        if p.have[h.frag as usize] {
            return;
        }
        scatter(base, &p.plan.segs, at, payload);
        bump(&self.c.copied_bytes, payload.len() as u64);
        p.have[h.frag as usize] = true;
        p.got += 1;
        if p.got < p.have.len() || self.placing.as_ref().is_some_and(|pl| pl.key == key) {
            // Not all in, or slots of an earlier grant can still land in
            // the blocks: `on_slot` completes it once they are filled.
            return;
        }
        if self.payload_crc(&key) {
            self.commit(key);
        } else {
            self.regrant.push(key);
        }
    }

    fn commit(&mut self, key: Key) {
        let p = self
            .sessions
            .get_mut(&key)
            .and_then(|s| s.write.take())
            .expect("pending");
        let (h, len, plan) = (p.h, p.len, p.plan);
        self.with_vol(
            key,
            p.rid,
            Box::new(move |v, _| {
                let before = v.fs.conflict_copied;
                let r = v.fs.finish_write(plan).and_then(|_| v.fs.getattr(h.ino));
                v.st.copied_bytes += v.fs.conflict_copied - before;
                match &r {
                    Ok(_) => v.st.bytes_written += len as u64,
                    Err(_) => v.st.errors += 1,
                }
                Outcome::Reply(serve::encode_reply(h.tag, h.op, &r.map(Reply::Attr)))
            }),
        );
    }

    /// Gives a pending write's blocks back and answers `errno`.
    pub(super) fn fail_write(&mut self, key: Key, errno: i32) {
        let Some(p) = self.sessions.get_mut(&key).and_then(|s| s.write.take()) else {
            return;
        };
        let rep = err_reply(p.h.op, p.h.tag, errno);
        self.abort(p.plan, Some((key, p.rid, rep)));
    }

    /// Gives a plan's blocks back; sends `reply` when given.
    pub(super) fn abort(&mut self, plan: WritePlan, reply: Option<(Key, u64, Vec<u8>)>) {
        let (key, rid, rep) = reply.unwrap_or(((self.mac, 0), 0, Vec::new()));
        self.with_vol(
            key,
            rid,
            Box::new(move |v, _| {
                v.fs.abort_write(plan);
                v.st.errors += 1;
                if rep.is_empty() {
                    Outcome::Quiet
                } else {
                    Outcome::Reply(rep)
                }
            }),
        );
    }

    /// Drops an expired session's pending write (no one to answer).
    pub(super) fn drop_write(&mut self, p: Pending) {
        self.abort(p.plan, None);
    }
}

/// Whether every segment of a plan can be placed and no segment's saved
/// bytes overlap another segment. Only fresh blocks are placed: frames
/// of other senders can land in a placement's slots (and do, when its
/// client vanished), and the file's old data must not be under them;
/// an overwrite of existing blocks goes in fragments.
fn placeable(plan: &WritePlan, piece: usize) -> bool {
    let segs = &plan.segs;
    // An empty write has nothing to place (and a placement with no slots
    // would never complete).
    !segs.is_empty()
        && plan.all_fresh()
        && segs.iter().all(|&(_, n)| w::placeable(n, piece))
        && segs.len() <= w::MAX_GRANT_SEGS
        && segs
            .iter()
            .all(|&(o, _)| segs.iter().all(|&(p, n)| o - PLACE_HDR >= p + n || o <= p))
}

fn count_slots(plan: &WritePlan, piece: usize) -> usize {
    plan.segs
        .iter()
        .map(|&(_, n)| w::pieces(n, piece).count())
        .sum()
}

/// Copies payload bytes `[at, at + b.len())` into the plan's segments.
fn scatter(base: *mut u8, segs: &[(usize, usize)], mut at: usize, mut b: &[u8]) {
    let mut start = 0;
    for &(o, n) in segs {
        if b.is_empty() {
            break;
        }
        if at < start + n {
            let k = (start + n - at).min(b.len());
            // SAFETY: `o + (at - start) + k <= o + n`, a planned range
            // inside the region.
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), base.add(o + at - start), k) };
            b = &b[k..];
            at += k;
        }
        start += n;
    }
}

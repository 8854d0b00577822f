//! The xdp export's engine: receive buffers, sessions (one per client MAC
//! and session number), requests, grants and placed writes.
//!
//! Every receive buffer the engine posts is taken by the kernel in order,
//! one per frame of our EtherType, and shows up in the rx ring in the same
//! order (the rx ring has a slot for every buffer, so it never overflows
//! and no buffer is recycled out of order). So after draining the rx ring,
//! `posted - received` is exactly how many frames land before a placement
//! slot posted now: the grant's NOP count.
//!
//! Retries: a client resends a request whose reply did not come. The last
//! reply of each session is kept and resent for a repeated request id
//! (so a create or a rename is never run twice); an older id is dropped.
//! A write resent while its payload is pending gets a new grant. A placed
//! write whose slots got the wrong frames (lengths or CRC32C wrong) is
//! granted again, up to [`MAX_GRANTS`] times, then fails with EIO.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use ustor_net::xdp::{Desc, XdpProgram, XskSocket};

use super::{bump, desc, scratch, Counters, Umem};
use crate::fs::WritePlan;
use crate::proto::{self, Header, Op, Request, HEADER_LEN, NONCE_LEN};
use crate::serve::{self, Reply};
use crate::server::ExportSvc;
use crate::xdp_wire::{
    self as w, Assembly, Ctrl, Frame, Grant, Kind, MAX_CTRL_PAYLOAD, MAX_FRAME, PLACE_HDR,
};

/// Receive buffers kept posted between requests.
const AHEAD: u64 = 8;

/// Grants of one write before it fails with EIO.
const MAX_GRANTS: u8 = 4;

type Key = ([u8; 6], u16);

/// A write whose payload is coming.
struct Pending {
    rid: u64,
    h: Header,
    plan: WritePlan,
    crc: u32,
    len: usize,
    seq: u8,
    place: bool,
    have: Vec<bool>,
    got: usize,
}

#[derive(Default)]
struct Session {
    authed: bool,
    cn: [u8; NONCE_LEN],
    sn: Option<[u8; NONCE_LEN]>,
    asm: Assembly,
    done_rid: u64,
    cache: Option<(u64, Kind, Vec<u8>)>,
    write: Option<Pending>,
}

/// The placement in progress (one per export at a time).
struct Placement {
    key: Key,
    seq: u8,
    /// The 16 bytes before each segment, saved when the slots were posted.
    saved: Vec<(usize, [u8; PLACE_HDR])>,
    /// Slots posted and not yet filled.
    outstanding: usize,
    bad: bool,
}

/// A posted placement slot: where its frame lands, for whom, how long.
struct Slot {
    addr: u64,
    key: Key,
    len: u32,
}

pub(crate) struct Engine {
    xsk: XskSocket,
    _prog: XdpProgram,
    _umem: Umem,
    svc: Arc<ExportSvc>,
    mac: [u8; 6],
    free_rx: Vec<u64>,
    free_tx: Vec<u64>,
    posted: u64,
    received: u64,
    /// Receive buffers posted and not yet filled.
    ahead: u64,
    slots: VecDeque<Slot>,
    sessions: HashMap<Key, Session>,
    max_sessions: usize,
    regrant: Vec<Key>,
    /// The session whose placement slots are posted: while one is, the
    /// 16 bytes before its segments hold frame headers, so requests of
    /// other sessions (which could change those bytes) wait in `held`.
    placing: Option<Placement>,
    held: VecDeque<(Key, u64, Vec<u8>)>,
    c: Arc<Counters>,
    rx: Vec<Desc>,
    tx: Vec<Desc>,
}

impl Engine {
    pub(crate) fn new(
        xsk: XskSocket,
        prog: XdpProgram,
        umem: Umem,
        svc: Arc<ExportSvc>,
        mac: [u8; 6],
        c: Arc<Counters>,
        max_sessions: usize,
    ) -> Engine {
        let (_, nrx, ntx) = scratch();
        let chunk = w::CHUNK as u64;
        let mut e = Engine {
            xsk,
            _prog: prog,
            _umem: umem,
            svc,
            mac,
            free_rx: (0..nrx).map(|i| i * chunk).collect(),
            free_tx: (nrx..nrx + ntx).map(|i| i * chunk).collect(),
            posted: 0,
            received: 0,
            ahead: 0,
            slots: VecDeque::new(),
            sessions: HashMap::new(),
            max_sessions: max_sessions.max(1),
            regrant: Vec::new(),
            placing: None,
            held: VecDeque::new(),
            c,
            rx: Vec::with_capacity(64),
            tx: Vec::with_capacity(64),
        };
        e.refill();
        e
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.xsk.as_raw_fd()
    }

    /// Keeps [`AHEAD`] receive buffers posted: few, because a placed
    /// write's client sends one NOP per buffer posted before its slots.
    fn refill(&mut self) {
        let want = AHEAD.saturating_sub(self.ahead) as usize;
        self.post_scratch(want);
    }

    fn post_scratch(&mut self, want: usize) {
        let k = want.min(self.free_rx.len());
        let at = self.free_rx.len() - k;
        let n = self.xsk.fill(&self.free_rx[at..]);
        self.free_rx.truncate(self.free_rx.len() - n);
        self.posted += n as u64;
        self.ahead += n as u64;
    }

    /// One pass: drains the rx ring, runs what came, sends grants.
    /// Returns whether anything happened.
    pub(crate) fn step(&mut self) -> bool {
        let mut any = false;
        loop {
            self.rx.clear();
            let mut rx = std::mem::take(&mut self.rx);
            let n = self.xsk.recv(&mut rx, 64);
            for d in &rx {
                self.received += 1;
                self.on_frame(*d);
            }
            self.rx = rx;
            self.refill();
            if n == 0 {
                break;
            }
            any = true;
        }
        // Grants go out with the ring drained, so their NOP count is exact.
        for key in std::mem::take(&mut self.regrant) {
            self.grant(key);
        }
        while self.placing.is_none() {
            let Some((key, rid, msg)) = self.held.pop_front() else {
                break;
            };
            if self.sessions.contains_key(&key) {
                self.on_request(key, rid, &msg);
            }
        }
        if !self.regrant.is_empty() {
            for key in std::mem::take(&mut self.regrant) {
                self.grant(key);
            }
        }
        self.reclaim();
        any
    }

    fn on_frame(&mut self, d: Desc) {
        bump(&self.c.frames_rx, 1);
        let (region, _, _) = scratch();
        if d.addr >= region {
            return self.on_slot(d);
        }
        self.ahead -= 1;
        let chunk = d.addr - d.addr % w::CHUNK as u64;
        let f = self
            .xsk
            .frame(d.addr, d.len as usize)
            .map(|f| f.to_vec())
            .unwrap_or_default();
        self.free_rx.push(chunk);
        match w::parse(&f) {
            Ok(Frame::Ctrl { src, hdr, payload }) => self.on_ctrl(src, hdr, payload),
            Ok(Frame::Data { .. }) | Err(_) => bump(&self.c.drops, 1),
        }
    }

    fn on_ctrl(&mut self, src: [u8; 6], h: Ctrl, payload: &[u8]) {
        let key = (src, h.session);
        match h.kind {
            Kind::Nop => {}
            Kind::Req => {
                if !self.sessions.contains_key(&key) {
                    if self.sessions.len() >= self.max_sessions {
                        return bump(&self.c.drops, 1);
                    }
                    self.sessions.insert(key, Session::default());
                    bump(&self.c.sessions, 1);
                }
                let s = self.sessions.get_mut(&key).expect("inserted");
                if let Some(msg) = s.asm.add(&h, payload) {
                    let msg = msg.to_vec();
                    if self.placing.as_ref().is_some_and(|p| p.key != key) {
                        return self.held.push_back((key, h.rid, msg));
                    }
                    self.on_request(key, h.rid, &msg);
                }
            }
            Kind::WData => self.on_wdata(key, &h, payload),
            Kind::Resp | Kind::Go | Kind::Data => bump(&self.c.drops, 1),
        }
    }

    fn on_request(&mut self, key: Key, rid: u64, msg: &[u8]) {
        let s = self.sessions.get_mut(&key).expect("session");
        let hello = msg.len() > 4 && msg[4] == Op::Hello as u8;
        let repeat = s.cache.as_ref().is_some_and(|c| c.0 == rid);
        if hello && !repeat && s.write.is_none() {
            // A new client that drew the same session number (or this
            // one, restarted): start over.
            *s = Session::default();
        }
        if s.write.as_ref().is_some_and(|p| p.rid == rid) {
            bump(&self.c.retransmits, 1);
            return self.regrant.push(key);
        }
        if let Some((r, kind, rep)) = &s.cache {
            if *r == rid {
                let (kind, rep) = (*kind, rep.clone());
                bump(&self.c.retransmits, 1);
                return self.send_msg(key, kind, rid, &rep);
            }
        }
        if rid <= s.done_rid || s.write.is_some() {
            // An old duplicate, or a new request while a write's payload
            // is still owed (the client gave up on it): dropped.
            return bump(&self.c.drops, 1);
        }
        if msg.len() < HEADER_LEN {
            return bump(&self.c.drops, 1);
        }
        let h = match proto::decode_header(msg[..HEADER_LEN].try_into().expect("24")) {
            Ok(h) => h,
            Err(_) => return self.reply_err(key, rid, Op::Getattr, 0, libc::EINVAL),
        };
        let body = &msg[HEADER_LEN..];
        let pre = proto::body_prefix(&h).min(body.len());
        match proto::decode_request(&h, &body[..pre]) {
            Ok(req) => self.run(key, rid, h, req, &body[pre..]),
            Err(_) => self.reply_err(key, rid, h.op, h.tag, libc::EINVAL),
        }
    }

    fn reply_err(&mut self, key: Key, rid: u64, op: Op, tag: u64, errno: i32) {
        let mut f = proto::encode_header(&Header {
            len: 0,
            op,
            tag,
            ino: errno as u64,
        });
        f.truncate(HEADER_LEN);
        self.finish(key, rid, f);
    }

    /// Sends a final reply and keeps it for a repeated request id.
    fn finish(&mut self, key: Key, rid: u64, rep: Vec<u8>) {
        self.send_msg(key, Kind::Resp, rid, &rep);
        if let Some(s) = self.sessions.get_mut(&key) {
            s.done_rid = rid;
            s.cache = Some((rid, Kind::Resp, rep));
        }
    }

    fn run(&mut self, key: Key, rid: u64, h: Header, req: Request<'_>, rest: &[u8]) {
        let s = self.sessions.get_mut(&key).expect("session");
        match req {
            Request::Hello { nonce, export } => {
                if export != self.svc.vol.name.as_bytes() {
                    return self.reply_err(key, rid, h.op, h.tag, libc::ENOENT);
                }
                let Some(sn) = nonce_now() else {
                    return self.reply_err(key, rid, h.op, h.tag, libc::EIO);
                };
                (s.cn, s.sn) = (nonce, Some(sn));
                let mut r = proto::encode_header(&Header {
                    len: NONCE_LEN as u32,
                    op: Op::Hello,
                    tag: h.tag,
                    ino: 0,
                });
                r.extend_from_slice(&sn);
                self.finish(key, rid, r)
            }
            Request::Auth { mac } => {
                let ok = s.sn.is_some_and(|sn| {
                    self.svc.secret.is_empty()
                        || super::super::conn::mac_ok(&self.svc.secret, &s.cn, &sn, &mac)
                });
                s.authed = ok;
                if !ok {
                    bump(&self.svc.auth_failures, 1);
                }
                let errno = if ok { 0 } else { libc::EACCES };
                self.reply_err(key, rid, h.op, h.tag, errno);
                if !ok {
                    self.sessions.remove(&key);
                }
            }
            _ if !s.authed => self.reply_err(key, rid, h.op, h.tag, libc::EACCES),
            Request::Write { off, len } => self.begin_write(key, rid, h, off, len, rest),
            req => {
                let rep = self.handle(&h, &req);
                self.finish(key, rid, rep)
            }
        }
    }

    /// Runs a request that is not a write; a read's data is copied into
    /// the reply.
    fn handle(&self, h: &Header, req: &Request<'_>) -> Vec<u8> {
        let mut g = self.svc.vol.lock();
        let inner = &mut *g;
        let r = serve::handle(&mut inner.fs, self.svc.read_only, &mut inner.st, h.ino, req);
        let Ok(Reply::Data(segs)) = r else {
            return serve::encode_reply(h.tag, h.op, &r);
        };
        let total: usize = segs.iter().map(serve::seg_len).sum();
        let mut f = serve::encode_reply(h.tag, h.op, &Ok(Reply::Data(Vec::new())));
        f[..4].copy_from_slice(&(total as u32).to_le_bytes());
        let region = inner.fs.region();
        for s in segs {
            match s {
                crate::ReadSeg::Region { off, len } => f.extend_from_slice(&region[off..off + len]),
                crate::ReadSeg::Zero(len) => f.resize(f.len() + len, 0),
            }
        }
        bump(&self.c.copied_bytes, total as u64);
        f
    }

    fn begin_write(&mut self, key: Key, rid: u64, h: Header, off: u64, len: u32, rest: &[u8]) {
        if self.svc.read_only {
            return self.reply_err(key, rid, h.op, h.tag, libc::EROFS);
        }
        let Some(crc) = rest
            .get(..4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4")))
        else {
            return self.reply_err(key, rid, h.op, h.tag, libc::EINVAL);
        };
        let plan = {
            let mut g = self.svc.vol.lock();
            g.st.requests += 1;
            match g.fs.begin_write(h.ino, off, len as usize) {
                Ok(p) => p,
                Err(e) => {
                    g.st.errors += 1;
                    drop(g);
                    return self.reply_err(key, rid, h.op, h.tag, e.errno());
                }
            }
        };
        let place = placeable(&plan);
        let s = self.sessions.get_mut(&key).expect("session");
        s.write = Some(Pending {
            rid,
            h,
            plan,
            crc,
            len: len as usize,
            seq: 0,
            place,
            have: Vec::new(),
            got: 0,
        });
        self.regrant.push(key);
    }

    /// Posts a write's placement slots (or asks for fragments) and tells
    /// the client.
    fn grant(&mut self, key: Key) {
        let Some(p) = self.sessions.get_mut(&key).and_then(|s| s.write.as_mut()) else {
            return;
        };
        p.seq = p.seq.wrapping_add(1);
        if p.seq > MAX_GRANTS {
            return self.fail_write(key, libc::EIO);
        }
        let nops = self.posted - self.received;
        let room = (super::RING as u64).saturating_sub(nops) as usize;
        let slots = if p.place { count_slots(&p.plan) } else { 0 };
        let place = p.place && self.placing.is_none() && slots + 64 <= room;
        let mut g = Grant {
            place,
            seq: p.seq,
            nops: nops as u32,
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
                for (ps, pl) in w::pieces(n) {
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
            });
        } else {
            p.place = false;
            p.have = vec![false; p.len.div_ceil(MAX_CTRL_PAYLOAD).max(1)];
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
    fn on_slot(&mut self, d: Desc) {
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
        let base = self.svc.vol.base;
        for (o, b) in &pl.saved {
            // SAFETY: restores the bytes saved when the slots were posted,
            // inside the region; every slot has been filled.
            unsafe {
                std::ptr::copy_nonoverlapping(b.as_ptr(), base.add(o - PLACE_HDR), PLACE_HDR)
            };
        }
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
            bump(&self.c.drops, 1);
            self.regrant.push(pl.key);
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
    fn on_wdata(&mut self, key: Key, h: &Ctrl, payload: &[u8]) {
        let base = self.svc.vol.base;
        let Some(p) = self.sessions.get_mut(&key).and_then(|s| s.write.as_mut()) else {
            return bump(&self.c.drops, 1);
        };
        let at = h.frag as usize * MAX_CTRL_PAYLOAD;
        let ok = !p.place
            && p.rid == h.rid
            && h.nfrag as usize == p.have.len()
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
        let rep = {
            let mut g = self.svc.vol.lock();
            let inner = &mut *g;
            let before = inner.fs.conflict_copied;
            let r = inner
                .fs
                .finish_write(p.plan)
                .and_then(|_| inner.fs.getattr(p.h.ino));
            inner.st.copied_bytes += inner.fs.conflict_copied - before;
            match &r {
                Ok(_) => inner.st.bytes_written += p.len as u64,
                Err(_) => inner.st.errors += 1,
            }
            serve::encode_reply(p.h.tag, p.h.op, &r.map(Reply::Attr))
        };
        self.finish(key, p.rid, rep);
    }

    fn fail_write(&mut self, key: Key, errno: i32) {
        let Some(p) = self.sessions.get_mut(&key).and_then(|s| s.write.take()) else {
            return;
        };
        {
            let mut g = self.svc.vol.lock();
            g.fs.abort_write(p.plan);
            g.st.errors += 1;
        }
        self.reply_err(key, p.rid, p.h.op, p.h.tag, errno);
    }

    /// Sends a message in control frames from the send buffers.
    fn send_msg(&mut self, key: Key, kind: Kind, rid: u64, msg: &[u8]) {
        let nfrag = msg.len().div_ceil(MAX_CTRL_PAYLOAD).max(1) as u16;
        for (i, p) in w::fragments(msg).enumerate() {
            let Some(addr) = self.tx_buf() else {
                return bump(&self.c.drops, 1);
            };
            let h = Ctrl {
                kind,
                flags: 0,
                frag: i as u16,
                nfrag,
                session: key.1,
                rid,
            };
            let f = self
                .xsk
                .frame_mut(addr, MAX_FRAME)
                .expect("tx buffer in umem");
            let n = w::encode_ctrl(f, key.0, self.mac, &h, p);
            self.tx.push(desc(addr, n));
            if self.tx.len() == 64 {
                self.flush();
            }
        }
        self.flush();
    }

    fn flush(&mut self) {
        let mut at = 0;
        while at < self.tx.len() {
            match self.xsk.send(&self.tx[at..]) {
                Ok(n) => at += n,
                Err(_) => break,
            }
            if at < self.tx.len() {
                self.reclaim();
            }
        }
        bump(&self.c.frames_tx, at as u64);
        self.tx.clear();
    }

    fn reclaim(&mut self) {
        let _ = self.xsk.kick();
        self.xsk.completed(&mut self.free_tx, 512);
    }

    /// A free send buffer; waits for completions when all are in flight
    /// (copy mode completes them within the send call or soon after).
    fn tx_buf(&mut self) -> Option<u64> {
        for _ in 0..100_000 {
            if let Some(a) = self.free_tx.pop() {
                return Some(a);
            }
            self.flush();
            self.reclaim();
        }
        None
    }
}

/// Whether every segment of a plan can be placed and no segment's saved
/// bytes overlap another segment.
fn placeable(plan: &WritePlan) -> bool {
    let segs = &plan.segs;
    // An empty write has nothing to place (and a placement with no slots
    // would never complete).
    !segs.is_empty()
        && segs.iter().all(|&(_, n)| w::placeable(n))
        && segs.len() <= w::MAX_GRANT_SEGS
        && segs
            .iter()
            .all(|&(o, _)| segs.iter().all(|&(p, n)| o - PLACE_HDR >= p + n || o <= p))
}

fn count_slots(plan: &WritePlan) -> usize {
    plan.segs.iter().map(|&(_, n)| w::pieces(n).count()).sum()
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

fn nonce_now() -> Option<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    // SAFETY: `n` is writable for its length.
    let r = unsafe { libc::getrandom(n.as_mut_ptr().cast(), n.len(), 0) };
    (r == NONCE_LEN as isize).then_some(n)
}

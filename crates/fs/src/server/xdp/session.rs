//! The xdp export's engine: receive buffers, sessions (one per client MAC
//! and session number) and their requests. Writes and their placement are
//! in [`place`]; the volume's lock, deadlines and the socket's rebuild in
//! [`life`].
//!
//! Every receive buffer the engine posts is taken by the kernel in order,
//! one per frame of our EtherType, and shows up in the rx ring in the same
//! order (the rx ring has a slot for every buffer, so it never overflows
//! and no buffer is recycled out of order). So after draining the rx ring,
//! `posted - received` is exactly how many frames land before a placement
//! slot posted now: the grant's NOP count.
//!
//! Requests in flight: a client may have several (by request id). Each
//! session keeps the ids it answered, the last [`WINDOW`], with the reply
//! when it is small, so a repeated id is answered again without running
//! twice (a create or a rename); a repeat whose large reply was not kept
//! (a read, a readdir: both idempotent) runs again; an id older than the
//! window is dropped. A session's requests run in order of arrival;
//! while a write's payload is owed, its later requests wait.
//!
//! Retries: a client resends a request whose reply did not come. A write
//! resent while its payload is pending gets a new grant. A placed write
//! whose slots got the wrong frames (lengths or CRC32C wrong) is granted
//! again in fragments, up to [`MAX_GRANTS`] grants, then fails with EIO.

mod life;
mod place;

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Instant;

use ustor_net::xdp::{Desc, XdpProgram, XskSocket};

use super::{bump, desc, scratch, Counters, Umem};
use crate::proto::{self, Header, Op, Request, HEADER_LEN, NONCE_LEN};
use crate::serve::{self, Reply};
use crate::server::{ExportSvc, Inner};
use crate::xdp_wire::{self as w, Assembly, Ctrl, Frame, Kind, BASE_FRAME};

pub(crate) use life::Inbox;
use life::Outcome;
use place::{Pending, Placement, Slot};

/// Receive buffers kept posted between requests.
const AHEAD: u64 = 8;

/// Grants of one write before it fails with EIO.
const MAX_GRANTS: u8 = 4;

/// Answered request ids a session keeps: more than twice the span of ids
/// a client may have in flight (`ustor_fs_client::xdp` keeps them within
/// 32), so an id still in flight is never pushed out by later ones.
const WINDOW: usize = 64;

/// Replies larger than this are not kept for a repeat: they are reads and
/// directory listings, which run again.
const KEEP_MAX: usize = 4096;

/// Requests waiting to run, all sessions together, before more are
/// dropped (their clients resend).
const MAX_HELD: usize = 1024;

type Key = ([u8; 6], u16);

/// An answered request id, with its reply when kept.
type Answered = (u64, Option<(Kind, Vec<u8>)>);

struct Session {
    authed: bool,
    cn: [u8; NONCE_LEN],
    sn: Option<[u8; NONCE_LEN]>,
    asm: Assembly,
    /// The client's receive frame, as its last control frame announced.
    peer: usize,
    /// Answered ids, oldest first, with the reply when kept.
    done: VecDeque<Answered>,
    /// The highest id pushed out of `done`: an id at or below it is old.
    floor: u64,
    write: Option<Pending>,
    /// The last frame from this session (idle sessions expire).
    seen: Instant,
}

/// What a session knows of a request id.
enum Seen {
    New,
    /// Answered; the reply is kept.
    Kept(Kind, Vec<u8>),
    /// Answered; the reply was not kept (it runs again).
    Rerun,
    Old,
}

impl Session {
    fn new(now: Instant) -> Session {
        Session {
            authed: false,
            cn: [0; NONCE_LEN],
            sn: None,
            asm: Assembly::default(),
            peer: BASE_FRAME,
            done: VecDeque::new(),
            floor: 0,
            write: None,
            seen: now,
        }
    }

    fn seen(&self, rid: u64) -> Seen {
        match self.done.iter().find(|d| d.0 == rid) {
            Some((_, Some((k, r)))) => Seen::Kept(*k, r.clone()),
            Some((_, None)) => Seen::Rerun,
            None if rid <= self.floor => Seen::Old,
            None => Seen::New,
        }
    }

    fn record(&mut self, rid: u64, kind: Kind, rep: &[u8]) {
        let keep = (rep.len() <= KEEP_MAX).then(|| (kind, rep.to_vec()));
        if let Some(d) = self.done.iter_mut().find(|d| d.0 == rid) {
            d.1 = keep;
            return;
        }
        self.done.push_back((rid, keep));
        while self.done.len() > WINDOW {
            let (old, _) = self.done.pop_front().expect("non-empty");
            self.floor = self.floor.max(old);
        }
    }
}

pub(crate) struct Engine {
    xsk: XskSocket,
    prog: XdpProgram,
    umem: Umem,
    svc: Arc<ExportSvc>,
    mac: [u8; 6],
    /// Our socket's largest frame (the export's MTU), and its UMEM chunk.
    frame: usize,
    chunk: u64,
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
    /// 16 bytes before its segments hold frame headers, so requests
    /// (which could read or change those bytes) wait in `held`.
    placing: Option<Placement>,
    held: VecDeque<(Key, u64, Vec<u8>)>,
    /// Requests running on the offload pool (the volume was busy); while
    /// one runs, others wait in `held` and no slots are posted.
    jobs: usize,
    inbox: Arc<Inbox>,
    /// The socket was rebuilt and is not bound yet (see [`life`]).
    down: bool,
    now: Instant,
    next_sweep: Instant,
    c: Arc<Counters>,
    rx: Vec<Desc>,
    tx: Vec<Desc>,
    /// The control frame being handled (see `on_frame`).
    frame_buf: Vec<u8>,
    ep: OwnedFd,
}

impl Engine {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        xsk: XskSocket,
        prog: XdpProgram,
        umem: Umem,
        svc: Arc<ExportSvc>,
        mac: [u8; 6],
        c: Arc<Counters>,
        max_sessions: usize,
        inbox: Arc<Inbox>,
        frame: usize,
    ) -> std::io::Result<Engine> {
        let now = Instant::now();
        // SAFETY: plain epoll_create1; the result is checked.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a new descriptor we own.
        let ep = unsafe { OwnedFd::from_raw_fd(ep) };
        watch(&ep, xsk.as_raw_fd())?;
        let mut e = Engine {
            xsk,
            prog,
            umem,
            svc,
            mac,
            frame,
            chunk: w::chunk_for(frame).0 as u64,
            free_rx: Vec::new(),
            free_tx: Vec::new(),
            posted: 0,
            received: 0,
            ahead: 0,
            slots: VecDeque::new(),
            sessions: HashMap::new(),
            max_sessions: max_sessions.max(1),
            regrant: Vec::new(),
            placing: None,
            held: VecDeque::new(),
            jobs: 0,
            inbox,
            down: false,
            now,
            next_sweep: now,
            c,
            rx: Vec::with_capacity(64),
            tx: Vec::with_capacity(64),
            frame_buf: Vec::new(),
            ep,
        };
        e.reset_buffers();
        e.refill();
        Ok(e)
    }

    /// The fd the task sleeps on: an epoll set holding the socket, not the
    /// socket itself, so a poll left in flight in io_uring holds no
    /// reference to the socket and a rebuild really closes it (the old
    /// socket leaves the set as it closes; the new one is added).
    pub(crate) fn fd(&self) -> RawFd {
        self.ep.as_raw_fd()
    }

    /// Every scratch buffer back with us (a new socket: nothing posted).
    fn reset_buffers(&mut self) {
        let (_, nrx, ntx) = scratch();
        let chunk = self.chunk;
        self.free_rx = (0..nrx).map(|i| i * chunk).collect();
        self.free_tx = (nrx..nrx + ntx).map(|i| i * chunk).collect();
        (self.posted, self.received, self.ahead) = (0, 0, 0);
        self.slots.clear();
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

    /// One pass: finishes offloaded requests, drains the rx ring, runs
    /// what came, sends grants, checks deadlines. Returns whether
    /// anything happened.
    pub(crate) fn step(&mut self) -> bool {
        self.now = Instant::now();
        if self.down && !self.try_up() {
            return false;
        }
        let mut any = self.drain_inbox();
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
        self.send_grants();
        self.drain_held();
        self.send_grants();
        any |= self.deadlines();
        self.reclaim();
        any
    }

    fn send_grants(&mut self) {
        for key in std::mem::take(&mut self.regrant) {
            self.grant(key);
        }
    }

    /// Runs waiting requests in order until one must wait again.
    fn drain_held(&mut self) {
        let mut old = std::mem::take(&mut self.held);
        while let Some(e) = old.pop_front() {
            if self.jobs > 0 || self.placing.is_some() {
                self.held.push_back(e);
                self.held.append(&mut old);
                return;
            }
            if self.sessions.contains_key(&e.0) {
                self.on_request(e.0, e.1, e.2);
            }
        }
    }

    fn on_frame(&mut self, d: Desc) {
        bump(&self.c.frames_rx, 1);
        let (region, _, _) = scratch();
        if d.addr >= region {
            return self.on_slot(d);
        }
        self.ahead -= 1;
        let chunk = d.addr - d.addr % self.chunk;
        // The frame is copied out (its handling needs `&mut self`) into a
        // buffer kept across frames: a fresh Vec per frame before.
        let mut f = std::mem::take(&mut self.frame_buf);
        f.clear();
        f.extend_from_slice(self.xsk.frame(d.addr, d.len as usize).unwrap_or_default());
        self.free_rx.push(chunk);
        match w::parse(&f) {
            Ok(Frame::Ctrl { src, hdr, payload }) => self.on_ctrl(src, hdr, payload),
            Ok(Frame::Data { .. }) | Err(_) => bump(&self.c.drops, 1),
        }
        self.frame_buf = f;
    }

    fn on_ctrl(&mut self, src: [u8; 6], h: Ctrl, payload: &[u8]) {
        let key = (src, h.session);
        let now = self.now;
        if let Some(s) = self.sessions.get_mut(&key) {
            s.peer = w::frame_of_code(h.rxf);
        }
        match h.kind {
            Kind::Nop => {
                if let Some(s) = self.sessions.get_mut(&key) {
                    s.seen = now;
                }
            }
            Kind::Req => {
                if !self.sessions.contains_key(&key) {
                    if self.sessions.len() >= self.max_sessions {
                        return bump(&self.c.drops, 1);
                    }
                    self.sessions.insert(key, Session::new(now));
                    bump(&self.c.sessions, 1);
                }
                let s = self.sessions.get_mut(&key).expect("inserted");
                (s.seen, s.peer) = (now, w::frame_of_code(h.rxf));
                if let Some(msg) = s.asm.add(&h, payload) {
                    let msg = msg.to_vec();
                    self.on_request(key, h.rid, msg);
                }
            }
            Kind::WData => self.on_wdata(key, &h, payload),
            Kind::Resp | Kind::Go | Kind::Data => bump(&self.c.drops, 1),
        }
    }

    /// Whether a new request of session `key` must wait: a request on the
    /// pool, a placement, its own write's payload, or its earlier
    /// requests waiting.
    fn must_wait(&self, key: Key) -> bool {
        self.jobs > 0
            || self.placing.is_some()
            || self.sessions[&key].write.is_some()
            || self.held.iter().any(|e| e.0 == key)
    }

    fn on_request(&mut self, key: Key, rid: u64, msg: Vec<u8>) {
        let now = self.now;
        let s = self.sessions.get_mut(&key).expect("session");
        let hello = msg.len() > 4 && msg[4] == Op::Hello as u8;
        let seen = s.seen(rid);
        if hello && matches!(seen, Seen::New) && s.write.is_none() {
            // A new client that drew the same session number (or this
            // one, restarted or re-authenticating): start over.
            *s = Session::new(now);
        }
        if s.write.as_ref().is_some_and(|p| p.rid == rid) {
            bump(&self.c.retransmits, 1);
            return self.regrant.push(key);
        }
        match seen {
            Seen::Kept(kind, rep) => {
                bump(&self.c.retransmits, 1);
                return self.send_msg(key, kind, rid, &rep);
            }
            Seen::Old => return bump(&self.c.drops, 1),
            Seen::Rerun | Seen::New => {}
        }
        if self.must_wait(key) {
            let dup = self.held.iter().any(|e| e.0 == key && e.1 == rid);
            if dup || self.held.len() >= MAX_HELD {
                return bump(&self.c.drops, 1);
            }
            return self.held.push_back((key, rid, msg));
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
            Ok(req) if matches!(req, Request::Hello { .. } | Request::Auth { .. }) => {
                self.run(key, rid, h, req, &[])
            }
            Ok(req @ Request::Write { .. }) => {
                let rest = body[pre..].to_vec();
                self.run(key, rid, h, req, &rest)
            }
            // The rest run under the volume's lock: the message moves there
            // (it was copied for each request before).
            Ok(_) => self.run_other(key, rid, h, msg),
            Err(_) => self.reply_err(key, rid, h.op, h.tag, libc::EINVAL),
        }
    }

    /// A request other than Hello, Auth or Write, encoded in `msg`.
    fn run_other(&mut self, key: Key, rid: u64, h: Header, msg: Vec<u8>) {
        // No session (it expired, or the server restarted): the client
        // runs the handshake again and resends.
        if !self.sessions[&key].authed {
            return self.reply_err(key, rid, h.op, h.tag, libc::ENOTCONN);
        }
        let ro = self.svc.read_only;
        self.with_vol(key, rid, Box::new(move |v, c| handle(v, c, ro, &msg)));
    }

    fn reply_err(&mut self, key: Key, rid: u64, op: Op, tag: u64, errno: i32) {
        self.finish(key, rid, err_reply(op, tag, errno));
    }

    /// Sends a final reply and keeps it for a repeated request id.
    fn finish(&mut self, key: Key, rid: u64, rep: Vec<u8>) {
        self.send_msg(key, Kind::Resp, rid, &rep);
        if let Some(s) = self.sessions.get_mut(&key) {
            s.record(rid, Kind::Resp, &rep);
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
            // No session (it expired, or the server restarted): the client
            // runs the handshake again and resends.
            _ if !s.authed => self.reply_err(key, rid, h.op, h.tag, libc::ENOTCONN),
            Request::Write { off, len } => self.begin_write(key, rid, h, off, len, rest),
            _ => unreachable!("run_other's requests"),
        }
    }

    /// The frame size of session `key`: ours or its client's, the smaller.
    fn frame_to(&self, key: &Key) -> usize {
        let peer = self.sessions.get(key).map_or(BASE_FRAME, |s| s.peer);
        self.frame.min(peer)
    }

    /// Sends a message in control frames from the send buffers.
    fn send_msg(&mut self, key: Key, kind: Kind, rid: u64, msg: &[u8]) {
        let frame = self.frame_to(&key);
        let unit = w::ctrl_payload(frame);
        let nfrag = w::nfrags(msg.len(), unit);
        for (i, p) in w::fragments(msg, unit).enumerate() {
            let Some(addr) = self.tx_buf() else {
                return bump(&self.c.drops, 1);
            };
            let h = Ctrl {
                kind,
                rxf: w::frame_code(self.frame),
                frag: i as u16,
                nfrag,
                session: key.1,
                rid,
            };
            let f = self.xsk.frame_mut(addr, frame).expect("tx buffer in umem");
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
        // Buffers of frames not sent are free again.
        self.free_tx.extend(self.tx[at..].iter().map(|d| d.addr));
        self.tx.clear();
    }

    fn reclaim(&mut self) {
        self.xsk.completed(&mut self.free_tx, 512);
        // A kick (a sendto) only while a send buffer is out: with all of
        // them back the tx ring is empty. Every pass kicked before, so an
        // idle pass cost a system call and the export's spin never got to
        // its sleep between QD1 requests.
        if !self.down && (self.free_tx.len() as u64) < scratch().2 {
            let _ = self.xsk.kick();
            self.xsk.completed(&mut self.free_tx, 512);
        }
    }

    /// A free send buffer; waits for completions when all are in flight
    /// (copy mode completes them within the send call or soon after).
    fn tx_buf(&mut self) -> Option<u64> {
        if self.down {
            return None;
        }
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

/// Adds socket `fd` to epoll set `ep` (readable: frames in the rx ring).
fn watch(ep: &OwnedFd, fd: RawFd) -> std::io::Result<()> {
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: 0,
    };
    // SAFETY: both descriptors are open; `ev` is valid for the call.
    let r = unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// An error reply: the header alone, the errno in its `ino` field.
fn err_reply(op: Op, tag: u64, errno: i32) -> Vec<u8> {
    let mut f = proto::encode_header(&Header {
        len: 0,
        op,
        tag,
        ino: errno as u64,
    });
    f.truncate(HEADER_LEN);
    f
}

/// Runs a request that is not a write (under the volume's lock, here or
/// on the pool); a read's data is copied into the reply.
fn handle(inner: &mut Inner, c: &Counters, read_only: bool, msg: &[u8]) -> Outcome {
    let Ok(h) = proto::decode_header(msg[..HEADER_LEN].try_into().expect("24")) else {
        return Outcome::Reply(err_reply(Op::Getattr, 0, libc::EINVAL));
    };
    let body = &msg[HEADER_LEN..];
    let pre = proto::body_prefix(&h).min(body.len());
    let Ok(req) = proto::decode_request(&h, &body[..pre]) else {
        return Outcome::Reply(err_reply(h.op, h.tag, libc::EINVAL));
    };
    let r = serve::handle(&mut inner.fs, read_only, &mut inner.st, h.ino, &req);
    let Ok(Reply::Data(segs)) = r else {
        return Outcome::Reply(serve::encode_reply(h.tag, h.op, &r));
    };
    let total: usize = segs.iter().map(serve::seg_len).sum();
    // One allocation for the reply (it grew in steps as the data went in).
    let mut f = Vec::with_capacity(HEADER_LEN + total);
    f.extend_from_slice(&proto::header_bytes(&Header {
        len: total as u32,
        op: h.op,
        tag: h.tag,
        ino: 0,
    }));
    let region = inner.fs.region();
    for s in segs {
        match s {
            crate::ReadSeg::Region { off, len } => f.extend_from_slice(&region[off..off + len]),
            crate::ReadSeg::Zero(len) => f.resize(f.len() + len, 0),
        }
    }
    bump(&c.copied_bytes, total as u64);
    Outcome::Reply(f)
}

fn nonce_now() -> Option<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    // SAFETY: `n` is writable for its length.
    let r = unsafe { libc::getrandom(n.as_mut_ptr().cast(), n.len(), 0) };
    (r == NONCE_LEN as isize).then_some(n)
}

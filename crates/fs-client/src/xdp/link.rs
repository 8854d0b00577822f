//! The client's side of the raw-Ethernet link: frames out (a request in
//! one frame or in fragments, a write's payload as placed pieces or
//! fragments), frames in (a reply reassembled, or received straight into
//! the caller's buffer), the handshake, and a request's retries.

use std::os::fd::AsRawFd;
use std::time::Instant;

use ustor_fs::proto::{self, Request, HEADER_LEN, NONCE_LEN};
use ustor_fs::xdp_wire::{self as w, Ctrl, Frame, Grant, Kind, Split, BASE_FRAME, PLACE_HDR};
use ustor_net::xdp::Desc;

use super::{xerr, Got, Link, Rep, BROADCAST, TX_BUFS};
use crate::{wire, ClientError, Result};

impl Link {
    pub(super) fn tx_buf(&mut self) -> Result<u64> {
        let deadline = Instant::now() + self.cfg.timeout;
        loop {
            if let Some(a) = self.free_tx.pop() {
                return Ok(a);
            }
            self.xsk.kick().map_err(xerr)?;
            self.xsk.completed(&mut self.free_tx, 1024);
            if Instant::now() > deadline {
                return Err(ClientError::Timeout(self.cfg.timeout));
            }
        }
    }

    pub(super) fn push(&mut self, batch: &mut Vec<Desc>, force: bool) -> Result<()> {
        if batch.len() < 64 && !force {
            return Ok(());
        }
        let mut at = 0;
        while at < batch.len() {
            at += self.xsk.send(&batch[at..]).map_err(xerr)?;
            self.xsk.completed(&mut self.free_tx, 1024);
        }
        batch.clear();
        Ok(())
    }

    /// Sends a message as control frames of `kind`, of our frame size or
    /// the server's, the smaller.
    pub(super) fn send_msg(&mut self, kind: Kind, msg: &[u8]) -> Result<()> {
        self.send_frags(kind, msg, w::ctrl_payload(self.frame.min(self.peer)))
    }

    /// Sends a message as control frames of `kind` carrying `unit` bytes
    /// each (the last fewer).
    pub(super) fn send_frags(&mut self, kind: Kind, msg: &[u8], unit: usize) -> Result<()> {
        let nfrag = w::nfrags(msg.len(), unit);
        let frame = unit + w::ETH_LEN + w::CTRL_HDR;
        let mut batch = std::mem::take(&mut self.batch);
        for (i, p) in w::fragments(msg, unit).enumerate() {
            let a = self.tx_buf()?;
            let h = Ctrl {
                kind,
                rxf: w::frame_code(self.frame),
                frag: i as u16,
                nfrag,
                session: self.session,
                rid: self.rid,
            };
            let (dst, src) = (self.server, self.mac);
            let f = self.xsk.frame_mut(a, frame).expect("tx buffer");
            let n = w::encode_ctrl(f, dst, src, &h, p);
            batch.push(Desc {
                addr: a,
                len: n as u32,
            });
            self.push(&mut batch, false)?;
        }
        self.push(&mut batch, true)?;
        self.batch = batch;
        Ok(())
    }

    /// Waits up to `until` for the message of the current request id
    /// (a reply or a grant). With `into`, a reply's body is received
    /// straight into it (its header into `head`): [`Got::Into`].
    pub(super) fn wait(
        &mut self,
        until: Instant,
        mut into: Option<&mut [u8]>,
    ) -> Result<Option<Got>> {
        let mut last = Instant::now();
        loop {
            self.rx.clear();
            let mut rx = std::mem::take(&mut self.rx);
            let mut bufs = std::mem::take(&mut self.bufs);
            bufs.clear();
            self.xsk.recv(&mut rx, 64);
            let mut got = None;
            for d in &rx {
                bufs.push(d.addr - d.addr % self.chunk);
                if got.is_none() {
                    got = self.on_frame(*d, into.as_deref_mut());
                }
            }
            self.rx = rx;
            self.xsk.fill(&bufs);
            let idle = bufs.is_empty();
            self.bufs = bufs;
            if got.is_some() {
                return Ok(got);
            }
            let now = Instant::now();
            if now >= until {
                return Ok(None);
            }
            // Copy mode sends only inside a syscall, and at most a batch
            // per call: frames left in the tx ring go out with this kick
            // (all send buffers back: the ring is empty, no system call).
            self.xsk.completed(&mut self.free_tx, 1024);
            if self.free_tx.len() < TX_BUFS as usize {
                self.xsk.kick().map_err(xerr)?;
                self.xsk.completed(&mut self.free_tx, 1024);
            }
            if !idle {
                last = now;
                continue;
            }
            // The reply (or the rest of it) is near: spin, yielding the
            // CPU each pass to whatever shares it (the export, pinned).
            let spin = now - last < self.cfg.spin;
            if spin {
                std::thread::yield_now();
            }
            if !self.cfg.busy_poll && !spin {
                let mut p = libc::pollfd {
                    fd: self.xsk.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut p, 1, 1) };
            }
        }
    }

    pub(super) fn on_frame(&mut self, d: Desc, into: Option<&mut [u8]>) -> Option<Got> {
        let f = self.xsk.frame(d.addr, d.len as usize)?;
        let Ok(Frame::Ctrl { src, hdr, payload }) = w::parse(f) else {
            return None;
        };
        let ours = hdr.session == self.session && hdr.rid == self.rid;
        if !ours || !matches!(hdr.kind, Kind::Resp | Kind::Go) {
            return None;
        }
        if self.server == BROADCAST {
            self.server = src;
        }
        self.peer = w::frame_of_code(hdr.rxf);
        if hdr.kind == Kind::Go {
            return Some(Got::Go(payload.to_vec()));
        }
        let Some(body) = into else {
            return self.asm.add(&hdr, payload).map(|m| Got::Resp(m.to_vec()));
        };
        let mut sink = Split {
            head: &mut self.head,
            body,
        };
        self.asm.add_to(&hdr, payload, &mut sink).map(Got::Into)
    }

    /// Sends a request (again after each `retry`) until its reply or a
    /// grant comes.
    pub(super) fn exchange(
        &mut self,
        msg: &[u8],
        deadline: Instant,
        mut into: Option<&mut [u8]>,
    ) -> Result<Got> {
        loop {
            self.send_msg(Kind::Req, msg)?;
            let until = (Instant::now() + self.cfg.retry).min(deadline);
            if let Some(r) = self.wait(until, into.as_deref_mut())? {
                return Ok(r);
            }
            // The server may have restarted on a smaller MTU: resend at
            // the size every end takes until it announces its own again.
            self.peer = BASE_FRAME;
            if Instant::now() >= deadline {
                return Err(ClientError::Timeout(self.cfg.timeout));
            }
        }
    }

    pub(super) fn call(
        &mut self,
        ino: u64,
        req: &Request<'_>,
        into: Option<&mut [u8]>,
    ) -> Result<Rep> {
        self.rid += 1;
        let mut msg = std::mem::take(&mut self.req);
        proto::encode_request_into(&mut msg, self.rid, ino, req);
        let deadline = Instant::now() + self.cfg.timeout;
        let got = self.exchange(&msg, deadline, into);
        self.req = msg;
        match got? {
            Got::Resp(m) => rep_of(m),
            Got::Into(n) => rep_into(&self.head, n),
            Got::Go(_) => Err(ClientError::Protocol(
                "grant for a request that is not a write".into(),
            )),
        }
    }

    pub(super) fn handshake(&mut self) -> Result<()> {
        let mut cn = [0u8; NONCE_LEN];
        // SAFETY: `cn` is writable for its length.
        let r = unsafe { libc::getrandom(cn.as_mut_ptr().cast(), NONCE_LEN, 0) };
        if r != NONCE_LEN as isize {
            return Err(ClientError::Disconnected("getrandom".into()));
        }
        let export = self.cfg.export.clone();
        let hello = Request::Hello {
            nonce: cn,
            export: export.as_bytes(),
        };
        let rep = self.call(0, &hello, None)?;
        if rep.errno != 0 {
            return Err(ClientError::Errno(rep.errno as i32));
        }
        let sn: [u8; NONCE_LEN] = rep
            .body
            .get(..NONCE_LEN)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| ClientError::Protocol("short Hello reply".into()))?;
        let mac = wire::auth_mac(&self.cfg.secret, &cn, &sn);
        let rep = self.call(0, &Request::Auth { mac }, None)?;
        if rep.errno != 0 {
            return Err(ClientError::Auth);
        }
        Ok(())
    }

    pub(super) fn write(&mut self, ino: u64, off: u64, data: &[u8]) -> Result<Rep> {
        self.rid += 1;
        let req = Request::Write {
            off,
            len: data.len() as u32,
        };
        let mut msg = std::mem::take(&mut self.req);
        proto::encode_request_into(&mut msg, self.rid, ino, &req);
        msg.extend_from_slice(&crc32c::crc32c(data).to_le_bytes());
        let r = self.write_msg(&msg, data);
        self.req = msg;
        r
    }

    /// [`Link::write`] once its request is encoded in `msg`.
    pub(super) fn write_msg(&mut self, msg: &[u8], data: &[u8]) -> Result<Rep> {
        let deadline = Instant::now() + self.cfg.timeout;
        let mut out = self.exchange(msg, deadline, None)?;
        let mut last = 0u8;
        loop {
            let m = match out {
                Got::Resp(m) => return rep_of(m),
                Got::Into(_) => return Err(ClientError::Protocol("reply into no buffer".into())),
                Got::Go(m) => m,
            };
            let g = Grant::decode(&m).map_err(|e| ClientError::Protocol(e.to_string()))?;
            // A grant seen before (a duplicate) is not acted on again.
            if g.seq > last {
                last = g.seq;
                self.send_payload(&g, data)?;
            }
            let until = (Instant::now() + self.cfg.retry).min(deadline);
            out = match self.wait(until, None)? {
                Some(r) => r,
                None => self.exchange(msg, deadline, None)?,
            };
        }
    }

    /// Sends a write's payload as the grant asks.
    pub(super) fn send_payload(&mut self, g: &Grant, data: &[u8]) -> Result<()> {
        if g.place && g.segs.iter().map(|&s| s as usize).sum::<usize>() != data.len() {
            return Err(ClientError::Protocol(
                "grant does not cover the payload".into(),
            ));
        }
        let frag_frame = g.frag as usize + w::ETH_LEN + w::CTRL_HDR;
        if frag_frame > self.frame || g.place && g.piece as usize + PLACE_HDR > self.frame {
            return Err(ClientError::Protocol(
                "grant asks for frames larger than ours".into(),
            ));
        }
        // NOPs first, in either mode: they fill the buffers the server
        // posted before this grant (slots of an earlier one included).
        let mut batch = std::mem::take(&mut self.batch);
        for _ in 0..g.nops {
            let a = self.tx_buf()?;
            let h = Ctrl {
                kind: Kind::Nop,
                rxf: w::frame_code(self.frame),
                frag: 0,
                nfrag: 1,
                session: self.session,
                rid: self.rid,
            };
            let (dst, src) = (self.server, self.mac);
            let n = w::encode_ctrl(
                self.xsk.frame_mut(a, BASE_FRAME).expect("tx"),
                dst,
                src,
                &h,
                &[],
            );
            batch.push(Desc {
                addr: a,
                len: n as u32,
            });
            self.push(&mut batch, false)?;
        }
        if !g.place {
            self.push(&mut batch, true)?;
            self.batch = batch;
            return self.send_frags(Kind::WData, data, g.frag as usize);
        }
        let mut at = 0;
        let mut i = 0;
        for &seg in &g.segs {
            let seg = &data[at..at + seg as usize];
            for (ps, pl) in w::pieces(seg.len(), g.piece as usize) {
                let a = self.tx_buf()?;
                let (dst, src) = (self.server, self.mac);
                let f = self.xsk.frame_mut(a, PLACE_HDR + pl).expect("tx");
                w::encode_data_hdr(f, dst, src, w::data_tag(g.seq, i));
                f[PLACE_HDR..].copy_from_slice(&seg[ps..ps + pl]);
                batch.push(Desc {
                    addr: a,
                    len: (PLACE_HDR + pl) as u32,
                });
                self.push(&mut batch, false)?;
                i += 1;
            }
            at += seg.len();
        }
        self.push(&mut batch, true)?;
        self.batch = batch;
        Ok(())
    }
}

impl Link {
    /// [`Link::call`], once more after a new handshake when the server
    /// dropped our session (idle, or it restarted); an errno is an error.
    pub(super) fn call_again(
        &mut self,
        ino: u64,
        req: &Request<'_>,
        mut into: Option<&mut [u8]>,
    ) -> Result<Rep> {
        let mut r = self.call(ino, req, into.as_deref_mut())?;
        if r.errno == libc::ENOTCONN as u64 {
            self.handshake()?;
            r = self.call(ino, req, into)?;
        }
        if r.errno != 0 {
            return Err(ClientError::Errno(r.errno as i32));
        }
        Ok(r)
    }
}

/// A whole reply: its body moves down over the header (no new Vec).
pub(super) fn rep_of(mut m: Vec<u8>) -> Result<Rep> {
    if m.len() < HEADER_LEN {
        return Err(ClientError::Protocol("short reply".into()));
    }
    let errno = u64::from_le_bytes(m[16..24].try_into().expect("8"));
    m.drain(..HEADER_LEN);
    Ok(Rep {
        errno,
        body: m,
        placed: 0,
    })
}

/// A reply of `n` bytes whose body went to the caller's buffer.
fn rep_into(head: &[u8; HEADER_LEN], n: usize) -> Result<Rep> {
    if n < HEADER_LEN {
        return Err(ClientError::Protocol("short reply".into()));
    }
    Ok(Rep {
        errno: u64::from_le_bytes(head[16..24].try_into().expect("8")),
        body: Vec::new(),
        placed: n - HEADER_LEN,
    })
}

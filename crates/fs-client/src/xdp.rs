//! The client of the raw-Ethernet transport (`ustor_fs::xdp_wire`): one
//! AF_XDP socket on an interface, one request in flight (calls from
//! several threads take turns), the same requests as the TCP client.
//!
//! Address: `xdp://IFNAME/EXPORT` (the server is found by a broadcast
//! Hello: its reply's source address is the server's) or
//! `xdp://IFNAME@SERVER_MAC/EXPORT`. The secret comes as for TCP.
//!
//! A request with no reply within [`XdpConfig::retry`] is sent again with
//! the same request id (the server answers a repeat from its last reply,
//! so nothing runs twice); after [`XdpConfig::timeout`] the call fails
//! with ETIMEDOUT. A write is sent as its header and the payload's CRC32C;
//! the server's grant says whether to send the payload as placed pieces
//! (after the NOP frames that realign its ring) or as fragments.

use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ustor_fs::proto::{self, Request, HEADER_LEN, NONCE_LEN};
use ustor_fs::xdp_wire::{
    self as w, Assembly, Ctrl, Frame, Grant, Kind, Split, BASE_FRAME, PLACE_HDR,
};
use ustor_fs::{Attr, DirEntry, SetAttr, StatFs, MAX_WRITE};
use ustor_net::xdp::{self, Desc, XskConfig, XskSocket};

use crate::{wire, ClientError, Result};

const RX_BUFS: u64 = 1024;
const TX_BUFS: u64 = 1024;
const BROADCAST: [u8; 6] = [0xff; 6];
/// See [`XdpConfig::spin`].
pub const DEFAULT_SPIN: Duration = Duration::from_micros(0);

/// How to reach an export over raw Ethernet.
#[derive(Debug, Clone)]
pub struct XdpConfig {
    pub ifname: String,
    pub queue: u32,
    /// The server's MAC; `None`: found by a broadcast Hello.
    pub server: Option<[u8; 6]>,
    pub export: String,
    pub secret: Vec<u8>,
    /// Spin on the rx ring instead of sleeping in poll().
    pub busy_poll: bool,
    /// How long to spin on the rx ring (yielding the CPU each pass) after
    /// a request is sent and after each frame of its reply before
    /// sleeping in poll(). Default from `USTOR_FS_XDP_SPIN_US` (read
    /// once, at connect), else [`DEFAULT_SPIN`].
    pub spin: Duration,
    pub retry: Duration,
    pub timeout: Duration,
}

impl XdpConfig {
    pub fn new(ifname: &str, export: &str, secret: &[u8]) -> XdpConfig {
        XdpConfig {
            ifname: ifname.into(),
            queue: 0,
            server: None,
            export: export.into(),
            secret: secret.to_vec(),
            busy_poll: false,
            spin: std::env::var("USTOR_FS_XDP_SPIN_US")
                .ok()
                .and_then(|v| v.parse().ok())
                .map_or(DEFAULT_SPIN, Duration::from_micros),
            retry: Duration::from_millis(200),
            timeout: Duration::from_secs(10),
        }
    }

    /// Parses `xdp://IFNAME[@MAC]/EXPORT`.
    pub fn parse(url: &str, secret: &[u8]) -> Result<XdpConfig> {
        let rest = url
            .strip_prefix("xdp://")
            .ok_or(ClientError::Invalid("an xdp address starts with xdp://"))?;
        let (dev, export) = rest
            .split_once('/')
            .ok_or(ClientError::Invalid("xdp://IFNAME[@MAC]/EXPORT"))?;
        let (ifname, mac) = match dev.split_once('@') {
            Some((i, m)) => (i, Some(parse_mac(m)?)),
            None => (dev, None),
        };
        if ifname.is_empty() || export.is_empty() {
            return Err(ClientError::Invalid("xdp://IFNAME[@MAC]/EXPORT"));
        }
        let mut c = XdpConfig::new(ifname, export, secret);
        c.server = mac;
        Ok(c)
    }
}

fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let v: Vec<u8> = s
        .split(':')
        .map(|p| u8::from_str_radix(p, 16))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| ClientError::Invalid("MAC address"))?;
    v.try_into()
        .map_err(|_| ClientError::Invalid("MAC address"))
}

fn xerr(e: xdp::XdpError) -> ClientError {
    ClientError::Disconnected(e.to_string())
}

/// A reply: errno and body, or with the body received into a caller's
/// buffer, the count that went there.
struct Rep {
    errno: u64,
    body: Vec<u8>,
    placed: usize,
}

/// What a wait brought for the current request id.
enum Got {
    /// A write's grant (its encoding).
    Go(Vec<u8>),
    /// A whole reply, header and body.
    Resp(Vec<u8>),
    /// A reply received into the caller's buffer: its message length
    /// (header included) and its header in `Link::head`.
    Into(usize),
}

struct Link {
    xsk: XskSocket,
    mac: [u8; 6],
    server: [u8; 6],
    session: u16,
    rid: u64,
    /// Our socket's largest frame (the interface's MTU) and UMEM chunk.
    frame: usize,
    chunk: u64,
    /// The server's receive frame, as its last control frame announced.
    peer: usize,
    free_tx: Vec<u64>,
    asm: Assembly,
    /// The header of a reply received into a caller's buffer.
    head: [u8; HEADER_LEN],
    /// The request being sent and a batch of frames to send: kept, so a
    /// request allocates neither.
    req: Vec<u8>,
    batch: Vec<Desc>,
    rx: Vec<Desc>,
    /// Buffers of received frames, to post again.
    bufs: Vec<u64>,
    cfg: XdpConfig,
    _prog: xdp::XdpProgram,
}

/// A client of one export over AF_XDP.
pub struct XdpClient {
    link: Mutex<Link>,
}

impl XdpClient {
    /// Opens the socket (in the calling thread's network namespace) and
    /// runs the handshake.
    pub fn connect(cfg: XdpConfig) -> Result<XdpClient> {
        let idx = xdp::ifindex(&cfg.ifname).map_err(xerr)?;
        let mac = xdp::mac_address(&cfg.ifname).map_err(xerr)?;
        let frame = w::frame_for_mtu(xdp::mtu(&cfg.ifname).map_err(xerr)? as usize);
        let (chunk_size, headroom) = w::chunk_for(frame);
        let chunk = chunk_size as u64;
        let mut xc = XskConfig::new(idx, cfg.queue);
        (xc.chunk_size, xc.headroom, xc.ring_size) = (chunk_size, headroom, 2048);
        let len = ((RX_BUFS + TX_BUFS) * chunk) as usize;
        let mut xsk = XskSocket::new(xc, len).map_err(xerr)?;
        // The server's program steers our EtherType on its side; ours does
        // the same here so replies reach this socket.
        let prog =
            xdp::XdpProgram::attach(idx, w::ETHERTYPE, cfg.queue + 1, xdp::AttachMode::Generic)
                .map_err(xerr)?;
        prog.register(cfg.queue, xsk.as_raw_fd()).map_err(xerr)?;
        let rx: Vec<u64> = (0..RX_BUFS).map(|i| i * chunk).collect();
        xsk.fill(&rx);
        let mut r = [0u8; 2];
        // SAFETY: `r` is writable for its length.
        if unsafe { libc::getrandom(r.as_mut_ptr().cast(), 2, 0) } != 2 {
            return Err(ClientError::Disconnected("getrandom".into()));
        }
        let session = u16::from_le_bytes(r);
        let mut link = Link {
            xsk,
            mac,
            server: cfg.server.unwrap_or(BROADCAST),
            session,
            rid: 0,
            frame,
            chunk,
            peer: BASE_FRAME,
            free_tx: (RX_BUFS..RX_BUFS + TX_BUFS).map(|i| i * chunk).collect(),
            asm: Assembly::default(),
            head: [0; HEADER_LEN],
            req: Vec::new(),
            batch: Vec::with_capacity(64),
            rx: Vec::with_capacity(64),
            bufs: Vec::new(),
            cfg,
            _prog: prog,
        };
        link.handshake()?;
        Ok(XdpClient {
            link: Mutex::new(link),
        })
    }
}

impl Link {
    fn tx_buf(&mut self) -> Result<u64> {
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

    fn push(&mut self, batch: &mut Vec<Desc>, force: bool) -> Result<()> {
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
    fn send_msg(&mut self, kind: Kind, msg: &[u8]) -> Result<()> {
        self.send_frags(kind, msg, w::ctrl_payload(self.frame.min(self.peer)))
    }

    /// Sends a message as control frames of `kind` carrying `unit` bytes
    /// each (the last fewer).
    fn send_frags(&mut self, kind: Kind, msg: &[u8], unit: usize) -> Result<()> {
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
    fn wait(&mut self, until: Instant, mut into: Option<&mut [u8]>) -> Result<Option<Got>> {
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

    fn on_frame(&mut self, d: Desc, into: Option<&mut [u8]>) -> Option<Got> {
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
    fn exchange(
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

    fn call(&mut self, ino: u64, req: &Request<'_>, into: Option<&mut [u8]>) -> Result<Rep> {
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

    fn handshake(&mut self) -> Result<()> {
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

    fn write(&mut self, ino: u64, off: u64, data: &[u8]) -> Result<Rep> {
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
    fn write_msg(&mut self, msg: &[u8], data: &[u8]) -> Result<Rep> {
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
    fn send_payload(&mut self, g: &Grant, data: &[u8]) -> Result<()> {
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
    fn call_again(
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
fn rep_of(mut m: Vec<u8>) -> Result<Rep> {
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

impl XdpClient {
    fn call(&self, ino: u64, req: &Request<'_>) -> Result<Vec<u8>> {
        let mut l = self.link.lock().unwrap_or_else(|e| e.into_inner());
        Ok(l.call_again(ino, req, None)?.body)
    }

    pub fn lookup(&self, dir: u64, name: &[u8]) -> Result<Attr> {
        wire::decode_attr(&self.call(dir, &Request::Lookup { name })?)
    }

    pub fn getattr(&self, ino: u64) -> Result<Attr> {
        wire::decode_attr(&self.call(ino, &Request::Getattr)?)
    }

    pub fn create(&self, dir: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr> {
        let req = Request::Create {
            mode,
            uid,
            gid,
            name,
        };
        wire::decode_attr(&self.call(dir, &req)?)
    }

    pub fn mkdir(&self, dir: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr> {
        let req = Request::Mkdir {
            mode,
            uid,
            gid,
            name,
        };
        wire::decode_attr(&self.call(dir, &req)?)
    }

    pub fn unlink(&self, dir: u64, name: &[u8]) -> Result<()> {
        self.call(dir, &Request::Unlink { name }).map(|_| ())
    }

    pub fn setattr(&self, ino: u64, a: &SetAttr) -> Result<Attr> {
        let req = wire::setattr_request(a);
        wire::decode_attr(&self.call(ino, &req)?)
    }

    pub fn symlink(
        &self,
        dir: u64,
        name: &[u8],
        target: &[u8],
        uid: u32,
        gid: u32,
    ) -> Result<Attr> {
        let req = Request::Symlink {
            uid,
            gid,
            name,
            target,
        };
        wire::decode_attr(&self.call(dir, &req)?)
    }

    /// Links inode `ino` into `dir` as `name`.
    pub fn link(&self, ino: u64, dir: u64, name: &[u8]) -> Result<Attr> {
        wire::decode_attr(&self.call(ino, &Request::Link { dir, name })?)
    }

    pub fn rmdir(&self, dir: u64, name: &[u8]) -> Result<()> {
        self.call(dir, &Request::Rmdir { name }).map(|_| ())
    }

    pub fn rename(&self, sdir: u64, sname: &[u8], ddir: u64, dname: &[u8]) -> Result<()> {
        let req = Request::Rename { ddir, sname, dname };
        self.call(sdir, &req).map(|_| ())
    }

    pub fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        self.call(ino, &Request::Readlink)
    }

    pub fn readdir(&self, dir: u64, cookie: u64, max: u32) -> Result<Vec<DirEntry>> {
        wire::decode_entries(&self.call(dir, &Request::Readdir { cookie, max })?)
    }

    pub fn statfs(&self) -> Result<StatFs> {
        wire::decode_statfs(&self.call(ustor_fs::ROOT_INO, &Request::Statfs)?)
    }

    pub fn fsync(&self, ino: u64) -> Result<()> {
        self.call(ino, &Request::Fsync).map(|_| ())
    }

    /// Reads up to `len` bytes at `off` (1 MiB per request).
    pub fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        let mut out = vec![0; len];
        let n = self.read_into(ino, off, &mut out)?;
        out.truncate(n);
        Ok(out)
    }

    /// Reads up to `out.len()` bytes at `off` into `out` (1 MiB per
    /// request; fewer at the end of the file); the count. Each reply
    /// fragment is copied once, from its frame into `out`.
    pub fn read_into(&self, ino: u64, off: u64, out: &mut [u8]) -> Result<usize> {
        let mut l = self.link.lock().unwrap_or_else(|e| e.into_inner());
        let mut got = 0;
        while got < out.len() {
            let n = (out.len() - got).min(MAX_WRITE);
            let req = Request::Read {
                off: off + got as u64,
                len: n as u32,
            };
            let placed = l
                .call_again(ino, &req, Some(&mut out[got..got + n]))?
                .placed;
            got += placed;
            if placed < n {
                break;
            }
        }
        Ok(got)
    }

    /// Writes `data` at `off` (1 MiB per request); returns the file's
    /// attribute after the last one.
    pub fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<Option<Attr>> {
        let mut l = self.link.lock().unwrap_or_else(|e| e.into_inner());
        let mut last = Vec::new();
        // An empty write still goes out (it answers the attribute).
        let chunks: Vec<&[u8]> = if data.is_empty() {
            vec![data]
        } else {
            data.chunks(MAX_WRITE).collect()
        };
        for (k, c) in chunks.into_iter().enumerate() {
            let at = off + (k * MAX_WRITE) as u64;
            let mut r = l.write(ino, at, c)?;
            if r.errno == libc::ENOTCONN as u64 {
                l.handshake()?;
                r = l.write(ino, at, c)?;
            }
            if r.errno != 0 {
                return Err(ClientError::Errno(r.errno as i32));
            }
            last = r.body;
        }
        wire::decode_write(&last)
    }

    /// Sends a write request for `len` bytes at `off` and returns once the
    /// server granted it (whether to place), sending no payload: a client
    /// that vanishes holding a grant (tests of the server's deadline).
    #[doc(hidden)]
    pub fn take_grant(&self, ino: u64, off: u64, len: u32) -> Result<bool> {
        let mut l = self.link.lock().unwrap_or_else(|e| e.into_inner());
        l.rid += 1;
        let mut msg = proto::encode_request(l.rid, ino, &Request::Write { off, len });
        msg.extend_from_slice(&0u32.to_le_bytes());
        let deadline = Instant::now() + l.cfg.timeout;
        match l.exchange(&msg, deadline, None)? {
            Got::Go(m) => Ok(Grant::decode(&m)
                .map_err(|e| ClientError::Protocol(e.to_string()))?
                .place),
            Got::Resp(m) => Err(ClientError::Errno(rep_of(m)?.errno as i32)),
            Got::Into(_) => Err(ClientError::Protocol("reply into no buffer".into())),
        }
    }

    /// Sends one raw frame of any content (tests of the server's parser).
    pub fn send_raw(&self, frame: &[u8]) -> Result<()> {
        let mut l = self.link.lock().unwrap_or_else(|e| e.into_inner());
        let a = l.tx_buf()?;
        let n = frame.len().min(l.frame);
        l.xsk
            .frame_mut(a, n)
            .expect("tx")
            .copy_from_slice(&frame[..n]);
        let mut b = vec![Desc {
            addr: a,
            len: n as u32,
        }];
        l.push(&mut b, true)
    }

    /// The server's MAC and ours.
    pub fn macs(&self) -> ([u8; 6], [u8; 6]) {
        let l = self.link.lock().unwrap_or_else(|e| e.into_inner());
        (l.server, l.mac)
    }
}

/// The FUSE mount's calls (`ustor fs mount xdp://...`).
impl crate::RemoteFs for XdpClient {
    fn lookup(&self, dir: u64, name: &[u8]) -> Result<Attr> {
        XdpClient::lookup(self, dir, name)
    }
    fn getattr(&self, ino: u64) -> Result<Attr> {
        XdpClient::getattr(self, ino)
    }
    fn setattr(&self, ino: u64, a: &SetAttr) -> Result<Attr> {
        XdpClient::setattr(self, ino, a)
    }
    fn create(&self, dir: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr> {
        XdpClient::create(self, dir, name, mode, uid, gid)
    }
    fn mkdir(&self, dir: u64, name: &[u8], mode: u32, uid: u32, gid: u32) -> Result<Attr> {
        XdpClient::mkdir(self, dir, name, mode, uid, gid)
    }
    fn symlink(&self, dir: u64, name: &[u8], target: &[u8], uid: u32, gid: u32) -> Result<Attr> {
        XdpClient::symlink(self, dir, name, target, uid, gid)
    }
    fn link(&self, ino: u64, dir: u64, name: &[u8]) -> Result<Attr> {
        XdpClient::link(self, ino, dir, name)
    }
    fn unlink(&self, dir: u64, name: &[u8]) -> Result<()> {
        XdpClient::unlink(self, dir, name)
    }
    fn rmdir(&self, dir: u64, name: &[u8]) -> Result<()> {
        XdpClient::rmdir(self, dir, name)
    }
    fn rename(&self, sdir: u64, sname: &[u8], ddir: u64, dname: &[u8]) -> Result<()> {
        XdpClient::rename(self, sdir, sname, ddir, dname)
    }
    fn readlink(&self, ino: u64) -> Result<Vec<u8>> {
        XdpClient::readlink(self, ino)
    }
    fn readdir(&self, dir: u64, cookie: u64, max: u32) -> Result<Vec<DirEntry>> {
        XdpClient::readdir(self, dir, cookie, max)
    }
    fn statfs(&self) -> Result<StatFs> {
        XdpClient::statfs(self)
    }
    fn fsync(&self, ino: u64) -> Result<()> {
        XdpClient::fsync(self, ino)
    }
    fn read(&self, ino: u64, off: u64, len: usize) -> Result<Vec<u8>> {
        XdpClient::read(self, ino, off, len)
    }
    fn read_into(&self, ino: u64, off: u64, out: &mut [u8]) -> Result<usize> {
        XdpClient::read_into(self, ino, off, out)
    }
    fn write(&self, ino: u64, off: u64, data: &[u8]) -> Result<Option<Attr>> {
        XdpClient::write(self, ino, off, data)
    }
}

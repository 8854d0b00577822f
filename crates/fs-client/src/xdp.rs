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

use ustor_fs::proto::{self, Request, HEADER_LEN};
use ustor_fs::xdp_wire::{self as w, Assembly, Grant, BASE_FRAME};
use ustor_fs::{Attr, DirEntry, SetAttr, StatFs, MAX_WRITE};
use ustor_net::xdp::{self, Desc, XskConfig, XskSocket};

use crate::{wire, ClientError, Result};

mod link;
use link::rep_of;

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

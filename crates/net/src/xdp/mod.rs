//! AF_XDP sockets: raw Ethernet frames between a NIC queue and user memory,
//! no IP stack in between (Transport 2 of the file service).
//!
//! - [`XskSocket`]: one socket bound to an interface's queue, its UMEM
//!   registered over memory the caller gives (so a file system's mapped
//!   region can itself be the UMEM and frames land in place) or over an
//!   anonymous mapping it owns; the fill/completion/rx/tx rings
//!   ([`ring`]); unaligned-chunk mode, so a fill address may point at any
//!   byte, not only at chunk boundaries.
//! - [`bpf`]: the XDP program that sends one EtherType to the sockets and
//!   passes every other frame.
//!
//! Where the kernel copies (copy mode, the only mode a veth has), a frame
//! posted at fill address `a` lands at `a + headroom + XDP_PACKET_HEADROOM`
//! ([`XskSocket::landing_offset`]); the rx descriptor says where it is.

pub mod bpf;
mod ring;

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use ring::Ring;

pub use bpf::{AttachMode, XdpProgram};

/// The kernel puts this much headroom before every received frame in a
/// chunk (include/uapi/linux/bpf.h, `XDP_PACKET_HEADROOM`).
pub const XDP_PACKET_HEADROOM: u64 = 256;
/// In unaligned-chunk mode an rx/tx address carries an offset in its top
/// 16 bits (`XSK_UNALIGNED_BUF_OFFSET_SHIFT`).
const OFFSET_SHIFT: u32 = 48;

/// Errors of the AF_XDP layer.
#[derive(Debug, thiserror::Error)]
pub enum XdpError {
    #[error("{what}: {source}")]
    Sys {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the verifier refused the XDP program: {0}")]
    Verifier(String),
    #[error("invalid configuration: {0}")]
    Config(&'static str),
    #[error("no interface named {0}")]
    NoInterface(String),
}

impl XdpError {
    /// The last OS error, for the call `what`.
    pub(crate) fn sys(what: &'static str) -> XdpError {
        XdpError::Sys {
            what,
            source: io::Error::last_os_error(),
        }
    }
}

/// The interface index of `name` in the calling thread's namespace.
pub fn ifindex(name: &str) -> Result<u32, XdpError> {
    let c = std::ffi::CString::new(name).map_err(|_| XdpError::NoInterface(name.into()))?;
    // SAFETY: `c` is a NUL-terminated string that outlives the call.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        return Err(XdpError::NoInterface(name.into()));
    }
    Ok(i)
}

/// The hardware address of interface `name` in the calling thread's
/// namespace (SIOCGIFHWADDR; /sys shows the namespace it was mounted in,
/// not the thread's).
pub fn mac_address(name: &str) -> Result<[u8; 6], XdpError> {
    let req = ifreq(name, libc::SIOCGIFHWADDR, "socket for SIOCGIFHWADDR")?;
    // SAFETY: SIOCGIFHWADDR filled the hwaddr member of the union.
    let sa = unsafe { req.ifr_ifru.ifru_hwaddr };
    let mut mac = [0u8; 6];
    for (d, s) in mac.iter_mut().zip(sa.sa_data.iter()) {
        *d = *s as u8;
    }
    Ok(mac)
}

/// The MTU of interface `name` (in this thread's network namespace).
pub fn mtu(name: &str) -> Result<u32, XdpError> {
    let req = ifreq(name, libc::SIOCGIFMTU, "socket for SIOCGIFMTU")?;
    // SAFETY: SIOCGIFMTU filled the mtu member of the union.
    Ok(unsafe { req.ifr_ifru.ifru_mtu } as u32)
}

/// Runs interface ioctl `op` on `name`; returns the filled request.
fn ifreq(name: &str, op: libc::c_ulong, what: &'static str) -> Result<libc::ifreq, XdpError> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(XdpError::NoInterface(name.into()));
    }
    // SAFETY: plain socket(2); closed by OwnedFd.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(XdpError::sys(what));
    }
    // SAFETY: `raw` is a new descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: all-zero is a valid ifreq.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: `req` is a valid ifreq the ioctl fills.
    if unsafe { libc::ioctl(fd.as_raw_fd(), op, &mut req) } != 0 {
        return Err(XdpError::NoInterface(name.into()));
    }
    Ok(req)
}

/// How a socket is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XskConfig {
    pub ifindex: u32,
    pub queue: u32,
    /// Bytes per chunk: the most one frame plus headroom may take (≤ 4096
    /// in copy mode on this kernel's veth).
    pub chunk_size: u32,
    /// Bytes the kernel leaves free before each received frame, on top of
    /// `XDP_PACKET_HEADROOM`.
    pub headroom: u32,
    /// Slots of each ring (a power of two).
    pub ring_size: u32,
    /// Ask the kernel to copy (`XDP_COPY`); zero-copy needs a driver that
    /// supports it, which a veth does not.
    pub copy: bool,
}

impl XskConfig {
    pub fn new(ifindex: u32, queue: u32) -> XskConfig {
        XskConfig {
            ifindex,
            queue,
            chunk_size: 4096,
            headroom: 0,
            ring_size: 512,
            copy: true,
        }
    }
}

/// A descriptor of the rx or tx ring: where a frame is in the UMEM and how
/// long it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    /// Byte offset in the UMEM (unaligned offsets already folded in).
    pub addr: u64,
    pub len: u32,
}

/// Memory behind the UMEM: mapped by us, or the caller's.
enum Area {
    Owned { ptr: *mut u8, len: usize },
    Borrowed { ptr: *mut u8, len: usize },
}

impl Area {
    fn ptr_len(&self) -> (*mut u8, usize) {
        match *self {
            Area::Owned { ptr, len } | Area::Borrowed { ptr, len } => (ptr, len),
        }
    }
}

impl Drop for Area {
    fn drop(&mut self) {
        if let Area::Owned { ptr, len } = *self {
            // SAFETY: unmaps the anonymous mapping `XskSocket::new` made.
            unsafe { libc::munmap(ptr.cast(), len) };
        }
    }
}

/// Counters the kernel keeps for a socket (`XDP_STATISTICS`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XskStats {
    pub rx_dropped: u64,
    pub rx_invalid_descs: u64,
    pub tx_invalid_descs: u64,
    pub rx_ring_full: u64,
    pub rx_fill_ring_empty: u64,
    pub tx_ring_empty: u64,
}

/// One AF_XDP socket with its own UMEM. Fields drop in order: rings
/// before the socket, the socket before the memory it registered.
pub struct XskSocket {
    fill: Ring<u64>,
    comp: Ring<u64>,
    rx: Ring<libc::xdp_desc>,
    tx: Ring<libc::xdp_desc>,
    fd: OwnedFd,
    area: Area,
    cfg: XskConfig,
}

// SAFETY: the socket owns its rings and (for `Owned`) its memory; a
// borrowed area's owner promised in `with_area` that it outlives the
// socket and may be written by the kernel from any thread.
unsafe impl Send for XskSocket {}

fn setsockopt<T>(fd: RawFd, opt: libc::c_int, v: &T, what: &'static str) -> Result<(), XdpError> {
    // SAFETY: `v` is a valid `T` for the duration of the call and its size
    // is passed with it.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_XDP,
            opt,
            (v as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(XdpError::sys(what));
    }
    Ok(())
}

fn getsockopt<T: Copy>(
    fd: RawFd,
    opt: libc::c_int,
    v: &mut T,
    what: &'static str,
) -> Result<(), XdpError> {
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    // SAFETY: `v` is writable for `len` bytes.
    let r = unsafe { libc::getsockopt(fd, libc::SOL_XDP, opt, (v as *mut T).cast(), &mut len) };
    if r != 0 {
        return Err(XdpError::sys(what));
    }
    Ok(())
}

impl XskSocket {
    /// A socket whose UMEM is a fresh anonymous mapping of `len` bytes.
    pub fn new(cfg: XskConfig, len: usize) -> Result<XskSocket, XdpError> {
        // SAFETY: a fresh private anonymous mapping; checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(XdpError::sys("mmap of the UMEM"));
        }
        Self::setup(
            cfg,
            Area::Owned {
                ptr: ptr.cast(),
                len,
            },
        )?
        .bind_waiting()
    }

    /// A socket whose UMEM is the caller's memory `[ptr, ptr + len)` (the
    /// file system's region): received frames are written into it.
    ///
    /// # Safety
    /// The memory must be page-aligned, mapped read-write, stay mapped
    /// for the socket's whole life, and the caller must accept that the
    /// kernel writes received frames at the fill addresses it posts.
    pub unsafe fn with_area(
        cfg: XskConfig,
        ptr: *mut u8,
        len: usize,
    ) -> Result<XskSocket, XdpError> {
        if ptr as usize % 4096 != 0 {
            return Err(XdpError::Config("UMEM must be page-aligned"));
        }
        Self::setup(cfg, Area::Borrowed { ptr, len })?.bind_waiting()
    }

    fn setup(cfg: XskConfig, area: Area) -> Result<XskSocket, XdpError> {
        if !cfg.ring_size.is_power_of_two() {
            return Err(XdpError::Config("ring size must be a power of two"));
        }
        // SAFETY: plain socket(2).
        let raw = unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(XdpError::sys("socket(AF_XDP)"));
        }
        // SAFETY: `raw` is a new descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let (ptr, len) = area.ptr_len();
        let reg = libc::xdp_umem_reg {
            addr: ptr as u64,
            len: len as u64,
            chunk_size: cfg.chunk_size,
            headroom: cfg.headroom,
            flags: libc::XDP_UMEM_UNALIGNED_CHUNK_FLAG,
            tx_metadata_len: 0,
        };
        setsockopt(raw, libc::XDP_UMEM_REG, &reg, "XDP_UMEM_REG")?;
        let n = cfg.ring_size;
        setsockopt(raw, libc::XDP_UMEM_FILL_RING, &n, "XDP_UMEM_FILL_RING")?;
        setsockopt(
            raw,
            libc::XDP_UMEM_COMPLETION_RING,
            &n,
            "XDP_UMEM_COMPLETION_RING",
        )?;
        setsockopt(raw, libc::XDP_RX_RING, &n, "XDP_RX_RING")?;
        setsockopt(raw, libc::XDP_TX_RING, &n, "XDP_TX_RING")?;
        // SAFETY: all-zero is a valid value of this plain C struct.
        let mut off: libc::xdp_mmap_offsets = unsafe { std::mem::zeroed() };
        getsockopt(raw, libc::XDP_MMAP_OFFSETS, &mut off, "XDP_MMAP_OFFSETS")?;
        let fill = Ring::map(raw, &off.fr, n, libc::XDP_UMEM_PGOFF_FILL_RING, true)?;
        let comp = Ring::map(raw, &off.cr, n, libc::XDP_UMEM_PGOFF_COMPLETION_RING, false)?;
        let rx = Ring::map(raw, &off.rx, n, libc::XDP_PGOFF_RX_RING as u64, false)?;
        let tx = Ring::map(raw, &off.tx, n, libc::XDP_PGOFF_TX_RING as u32 as u64, true)?;
        Ok(XskSocket {
            fill,
            comp,
            rx,
            tx,
            fd,
            area,
            cfg,
        })
    }

    /// Like [`XskSocket::with_area`], but not yet bound: the caller binds
    /// with [`XskSocket::try_bind`] (a server rebuilding its socket on the
    /// reactor retries that from a timer instead of sleeping).
    ///
    /// # Safety
    /// As for [`XskSocket::with_area`].
    pub unsafe fn with_area_unbound(
        cfg: XskConfig,
        ptr: *mut u8,
        len: usize,
    ) -> Result<XskSocket, XdpError> {
        if ptr as usize % 4096 != 0 {
            return Err(XdpError::Config("UMEM must be page-aligned"));
        }
        Self::setup(cfg, Area::Borrowed { ptr, len })
    }

    /// Binds to the configured interface queue; `Ok(false)` while the
    /// queue is still held by a socket closed just now (EBUSY: the kernel
    /// frees it from a work item, the buffer pool's deferred release).
    pub fn try_bind(&self) -> Result<bool, XdpError> {
        let sa = libc::sockaddr_xdp {
            sxdp_family: libc::AF_XDP as u16,
            sxdp_flags: if self.cfg.copy {
                libc::XDP_COPY
            } else {
                libc::XDP_ZEROCOPY
            } | libc::XDP_USE_NEED_WAKEUP,
            sxdp_ifindex: self.cfg.ifindex,
            sxdp_queue_id: self.cfg.queue,
            sxdp_shared_umem_fd: 0,
        };
        // SAFETY: `sa` is a valid sockaddr_xdp and its size is passed.
        let r = unsafe {
            libc::bind(
                self.fd.as_raw_fd(),
                (&sa as *const libc::sockaddr_xdp).cast(),
                std::mem::size_of::<libc::sockaddr_xdp>() as libc::socklen_t,
            )
        };
        if r == 0 {
            return Ok(true);
        }
        let e = XdpError::sys("bind(AF_XDP)");
        match &e {
            XdpError::Sys { source, .. } if source.raw_os_error() == Some(libc::EBUSY) => Ok(false),
            _ => Err(e),
        }
    }

    /// Binds, waiting a bounded time (2 s) for a queue a closed socket
    /// still holds.
    fn bind_waiting(self) -> Result<XskSocket, XdpError> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while !self.try_bind()? {
            if std::time::Instant::now() > deadline {
                return Err(XdpError::Sys {
                    what: "bind(AF_XDP)",
                    source: io::Error::from_raw_os_error(libc::EBUSY),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(self)
    }

    pub fn config(&self) -> &XskConfig {
        &self.cfg
    }

    /// Bytes of the UMEM.
    pub fn umem_len(&self) -> usize {
        self.area.ptr_len().1
    }

    /// Where a frame posted at fill address `a` starts: `a` plus this.
    pub fn landing_offset(&self) -> u64 {
        self.cfg.headroom as u64 + XDP_PACKET_HEADROOM
    }

    /// The largest frame a chunk holds after the headroom.
    pub fn max_frame(&self) -> usize {
        (self.cfg.chunk_size as u64 - self.landing_offset()) as usize
    }

    /// Posts receive buffers (UMEM offsets, any byte in unaligned mode, a
    /// whole chunk each); returns how many the fill ring took.
    pub fn fill(&mut self, addrs: &[u64]) -> usize {
        self.fill.produce(addrs)
    }

    /// Fill entries the kernel has not taken yet.
    pub fn fill_outstanding(&mut self) -> u32 {
        self.fill.outstanding()
    }

    /// Takes up to `max` received frames.
    pub fn recv(&mut self, out: &mut Vec<Desc>, max: usize) -> usize {
        self.rx.consume_map(out, max, |d| Desc {
            addr: fold(d.addr),
            len: d.len,
        })
    }

    /// Queues frames for sending (UMEM offset and length each) and wakes
    /// the kernel; returns how many the tx ring took.
    pub fn send(&mut self, frames: &[Desc]) -> Result<usize, XdpError> {
        let n = self.tx.produce_map(frames, |f| libc::xdp_desc {
            addr: f.addr,
            len: f.len,
            options: 0,
        });
        self.kick()?;
        Ok(n)
    }

    /// Tells the kernel the tx ring has work (copy mode sends only on a
    /// syscall).
    pub fn kick(&self) -> Result<(), XdpError> {
        // SAFETY: a zero-length sendto on our own socket.
        let r = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                std::ptr::null(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null(),
                0,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            // The ring is full or the kernel is busy: it sends later.
            if !matches!(
                e.raw_os_error(),
                Some(libc::EAGAIN | libc::EBUSY | libc::ENOBUFS)
            ) {
                return Err(XdpError::Sys {
                    what: "sendto(AF_XDP)",
                    source: e,
                });
            }
        }
        Ok(())
    }

    /// Whether the kernel wants a wake-up (poll or recvfrom) before it
    /// fills the rx ring again.
    pub fn fill_needs_wakeup(&self) -> bool {
        self.fill.flags() & libc::XDP_RING_NEED_WAKEUP != 0
    }

    /// Takes the UMEM offsets of sent frames (their buffers are free).
    pub fn completed(&mut self, out: &mut Vec<u64>, max: usize) -> usize {
        let start = out.len();
        let n = self.comp.consume(out, max);
        for a in &mut out[start..] {
            *a = fold(*a);
        }
        n
    }

    /// The UMEM's bytes `[addr, addr + len)`.
    pub fn frame(&self, addr: u64, len: usize) -> Option<&[u8]> {
        let (ptr, total) = self.area.ptr_len();
        let end = (addr as usize).checked_add(len)?;
        if end > total {
            return None;
        }
        // SAFETY: in bounds of the area; the kernel does not write a frame
        // while its descriptor is ours (received, not yet refilled).
        Some(unsafe { std::slice::from_raw_parts(ptr.add(addr as usize), len) })
    }

    /// The UMEM's bytes `[addr, addr + len)` to write a frame to send.
    pub fn frame_mut(&mut self, addr: u64, len: usize) -> Option<&mut [u8]> {
        let (ptr, total) = self.area.ptr_len();
        let end = (addr as usize).checked_add(len)?;
        if end > total {
            return None;
        }
        // SAFETY: in bounds, and `&mut self` makes the slice unique on our
        // side; the caller does not post this range to fill or tx while
        // it holds the slice.
        Some(unsafe { std::slice::from_raw_parts_mut(ptr.add(addr as usize), len) })
    }

    /// The kernel's counters for this socket.
    pub fn stats(&self) -> Result<XskStats, XdpError> {
        // SAFETY: all-zero is a valid value of this plain C struct.
        let mut s: libc::xdp_statistics = unsafe { std::mem::zeroed() };
        getsockopt(
            self.fd.as_raw_fd(),
            libc::XDP_STATISTICS,
            &mut s,
            "XDP_STATISTICS",
        )?;
        Ok(XskStats {
            rx_dropped: s.rx_dropped,
            rx_invalid_descs: s.rx_invalid_descs,
            tx_invalid_descs: s.tx_invalid_descs,
            rx_ring_full: s.rx_ring_full,
            rx_fill_ring_empty: s.rx_fill_ring_empty_descs,
            tx_ring_empty: s.tx_ring_empty_descs,
        })
    }
}

impl AsRawFd for XskSocket {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Folds an unaligned-mode address (offset in the top 16 bits) into one
/// UMEM offset.
fn fold(a: u64) -> u64 {
    (a & ((1 << OFFSET_SHIFT) - 1)) + (a >> OFFSET_SHIFT)
}

#[cfg(test)]
mod tests {
    #[test]
    fn unaligned_addresses_fold_their_offset_in() {
        assert_eq!(super::fold(4096), 4096);
        assert_eq!(super::fold((256 << 48) | 1000), 1256);
    }
}

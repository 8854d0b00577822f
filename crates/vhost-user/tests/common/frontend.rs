//! A small vhost-user frontend for tests that need more than libblkio
//! gives: virtio-scsi (commands, task management on the control queue),
//! and a reconnect that hands the inflight region back. rust-vmm's `vhost`
//! crate speaks the protocol (its `Frontend`); the rings, split or packed
//! ([`Fe::connect_packed`]), are driven here, in a shared memfd that
//! stands in for guest memory (a guest physical address is an offset in
//! it).
//!
//! Layout of the memory: ring `q` at `q * RING_AREA` (descriptor table,
//! then the avail ring at +0x800, the used ring at +0x1000; packed: the
//! descriptor ring, the driver's event suppression structure at +0x800,
//! the device's at +0x1000), request headers from [`HDR_BASE`], data from
//! [`DATA_BASE`].

#![allow(dead_code)]

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;
use std::sync::atomic::{fence, AtomicU16, Ordering};
use std::time::Duration;

use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserInflight};
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserProtocolFeatures};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Entries per ring.
pub const QSIZE: u16 = 128;
const RING_AREA: u64 = 0x2000;
const AVAIL: u64 = 0x800;
const USED: u64 = 0x1000;
/// Rings the memory has room for.
pub const MAX_RINGS: usize = 8;
/// Request headers: 256 bytes per (ring, slot).
pub const HDR_BASE: u64 = RING_AREA * MAX_RINGS as u64;
pub const HDR_SLOT: u64 = 256;
/// Data buffers.
pub const DATA_BASE: u64 = HDR_BASE + MAX_RINGS as u64 * QSIZE as u64 * HDR_SLOT;
pub const MEM_BYTES: u64 = 16 << 20;

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const VERSION_1: u64 = 1 << 32;
const EVENT_IDX: u64 = 1 << 29;
const PROTOCOL_FEATURES: u64 = 1 << 30;
const RING_PACKED: u64 = 1 << 34;
/// Packed descriptor flags: available, used (virtio 1.1, 2.8.1).
const P_AVAIL: u16 = 1 << 7;
const P_USED: u16 = 1 << 15;

/// The shared memory (a memfd mapped here, handed to the backend).
pub struct Mem {
    base: *mut u8,
    len: u64,
    file: File,
}

impl Mem {
    fn new(len: u64) -> Mem {
        // SAFETY: memfd_create with a valid C string; the fd is owned by
        // the File right after.
        let fd = unsafe { libc::memfd_create(c"vu-test-mem".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create");
        // SAFETY: a new descriptor nobody else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len).expect("memfd size");
        // SAFETY: a fresh shared mapping of the whole file; unmapped in Drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert!(p != libc::MAP_FAILED, "mmap");
        Mem {
            base: p.cast(),
            len,
            file,
        }
    }

    /// The frontend's address of `gpa` (what SET_VRING_ADDR carries).
    pub fn va(&self, gpa: u64) -> u64 {
        self.base as u64 + gpa
    }

    fn at(&self, gpa: u64, n: usize) -> *mut u8 {
        assert!(gpa + n as u64 <= self.len, "{gpa:#x}+{n} outside memory");
        // SAFETY: inside the mapping (checked above).
        unsafe { self.base.add(gpa as usize) }
    }

    pub fn write(&self, gpa: u64, src: &[u8]) {
        let p = self.at(gpa, src.len());
        // SAFETY: `p..p+len` lies in the mapping; the backend touches it
        // only while a request naming it is in flight, and the tests write
        // only buffers of requests not in flight.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len()) }
    }

    pub fn read(&self, gpa: u64, dst: &mut [u8]) {
        let p = self.at(gpa, dst.len());
        // SAFETY: as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr(), dst.len()) }
    }

    pub fn bytes(&self, gpa: u64, n: usize) -> Vec<u8> {
        let mut v = vec![0; n];
        self.read(gpa, &mut v);
        v
    }

    fn u16(&self, gpa: u64) -> &AtomicU16 {
        assert!(gpa & 1 == 0, "unaligned");
        // SAFETY: aligned, inside the mapping, which lives as long as self.
        unsafe { &*(self.at(gpa, 2) as *const AtomicU16) }
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, not used after this.
        unsafe { libc::munmap(self.base.cast(), self.len as usize) };
    }
}

/// The driver side of one split ring.
pub struct Ring {
    base: u64,
    free: Vec<u16>,
    chains: Vec<Vec<u16>>,
    avail_idx: u16,
    last_used: u16,
    pub kick: EventFd,
    pub call: EventFd,
    /// Call-eventfd signals the device sent (as read from it).
    pub signals: u64,
    /// Packed: the next slot to fill and the driver's wrap counter, the
    /// next used slot and its wrap counter, the slots free.
    p_avail: (u16, bool),
    p_used: (u16, bool),
    p_free: u16,
}

impl Ring {
    fn new(q: usize) -> Ring {
        Ring {
            base: q as u64 * RING_AREA,
            free: (0..QSIZE).rev().collect(),
            chains: vec![Vec::new(); QSIZE as usize],
            avail_idx: 0,
            last_used: 0,
            kick: EventFd::new(EFD_NONBLOCK).expect("eventfd"),
            call: EventFd::new(EFD_NONBLOCK).expect("eventfd"),
            signals: 0,
            p_avail: (0, true),
            p_used: (0, true),
            p_free: QSIZE,
        }
    }

    /// Chains not yet returned used.
    pub fn in_flight(&self) -> usize {
        QSIZE as usize - self.free.len()
    }
}

/// Where ring `r` lies, as SET_VRING_ADDR gives it.
fn vring_config(mem: &Mem, r: &Ring) -> VringConfigData {
    VringConfigData {
        queue_max_size: QSIZE,
        queue_size: QSIZE,
        flags: 0,
        desc_table_addr: mem.va(r.base),
        used_ring_addr: mem.va(r.base + USED),
        avail_ring_addr: mem.va(r.base + AVAIL),
        log_addr: None,
    }
}

/// One connection to a backend.
pub struct Fe {
    pub fe: Frontend,
    pub mem: Mem,
    pub rings: Vec<Ring>,
    pub features: u64,
    pub inflight: Option<(VhostUserInflight, File)>,
    /// The rings are packed (VIRTIO_F_RING_PACKED acked).
    pub packed: bool,
}

/// What a backend is asked for (on top of the device's own bits).
fn wanted_protocol() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::INFLIGHT_SHMFD
        | VhostUserProtocolFeatures::RESET_DEVICE
}

impl Fe {
    /// Connects and starts `rings` rings; with `inflight`, asks for an
    /// inflight region first (as QEMU does when the backend offers it).
    pub fn connect(path: &Path, rings: usize, inflight: bool) -> Fe {
        Self::open(path, rings, inflight, false)
    }

    /// Connects and starts `rings` packed rings (the device must offer
    /// them); no inflight region.
    pub fn connect_packed(path: &Path, rings: usize) -> Fe {
        Self::open(path, rings, false, true)
    }

    /// [`Self::connect_packed`] with an inflight region, as QEMU asks.
    pub fn connect_packed_tracked(path: &Path, rings: usize) -> Fe {
        Self::open(path, rings, true, true)
    }

    fn open(path: &Path, rings: usize, inflight: bool, packed: bool) -> Fe {
        assert!(rings <= MAX_RINGS);
        let mut f = Fe {
            fe: Frontend::connect(path, MAX_RINGS as u64).expect("connect"),
            mem: Mem::new(MEM_BYTES),
            rings: (0..rings).map(Ring::new).collect(),
            features: 0,
            inflight: None,
            packed,
        };
        f.negotiate(inflight, true);
        f
    }

    /// After the backend went away: connects again to `path`, hands the
    /// inflight region back and restarts the rings where the used rings
    /// are (the frontend's guess after a crash, as QEMU's).
    pub fn reconnect(&mut self, path: &Path) {
        self.fe = Frontend::connect(path, MAX_RINGS as u64).expect("reconnect");
        self.negotiate(false, false);
    }

    fn negotiate(&mut self, new_inflight: bool, first: bool) {
        let fe = &mut self.fe;
        fe.set_owner().expect("SET_OWNER");
        let offered = fe.get_features().expect("GET_FEATURES");
        assert!(offered & PROTOCOL_FEATURES != 0, "no protocol features");
        assert!(offered & VERSION_1 != 0, "not a VERSION_1 device");
        // Split rings unless asked (a device may offer both).
        let features = if self.packed {
            assert!(offered & RING_PACKED != 0, "packed rings not offered");
            offered
        } else {
            offered & !RING_PACKED
        };
        self.features = features;
        fe.set_features(features).expect("SET_FEATURES");
        let pf = fe.get_protocol_features().expect("GET_PROTOCOL_FEATURES");
        fe.set_protocol_features(pf & wanted_protocol())
            .expect("SET_PROTOCOL_FEATURES");
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: self.mem.len,
            userspace_addr: self.mem.base as u64,
            mmap_offset: 0,
            mmap_handle: self.mem.file.as_raw_fd(),
        };
        fe.set_mem_table(&[region]).expect("SET_MEM_TABLE");
        if new_inflight {
            let ask = VhostUserInflight::new(0, 0, self.rings.len() as u16, QSIZE);
            let (info, file) = fe.get_inflight_fd(&ask).expect("GET_INFLIGHT_FD");
            self.inflight = Some((info, file));
        }
        if let Some((info, file)) = &self.inflight {
            fe.set_inflight_fd(info, file.as_raw_fd())
                .expect("SET_INFLIGHT_FD");
        }
        for (q, r) in self.rings.iter().enumerate() {
            let used = self.mem.u16(r.base + USED + 2).load(Ordering::Acquire);
            let base = match (self.packed, first) {
                // Slot 0 with wrap counter 1: a fresh packed ring (the
                // used side, bits 16-31, does not fit this crate's u16
                // base; 0 there means "where the available side is").
                (true, _) => 1 << 15,
                (false, true) => 0,
                (false, false) => used,
            };
            fe.set_vring_num(q, QSIZE).expect("SET_VRING_NUM");
            fe.set_vring_base(q, base).expect("SET_VRING_BASE");
            fe.set_vring_addr(q, &vring_config(&self.mem, r))
                .expect("SET_VRING_ADDR");
            fe.set_vring_kick(q, &r.kick).expect("SET_VRING_KICK");
            fe.set_vring_call(q, &r.call).expect("SET_VRING_CALL");
            fe.set_vring_enable(q, true).expect("SET_VRING_ENABLE");
        }
    }

    /// Stops split ring `q` (GET_VRING_BASE) and starts it again with its
    /// kick fd but no call fd, as QEMU does while the guest's vector is
    /// masked (the call fd comes later, with SET_VRING_CALL).
    pub fn restart_without_call(&mut self, q: usize) {
        let fe = &mut self.fe;
        let base = fe.get_vring_base(q).expect("GET_VRING_BASE");
        let r = &self.rings[q];
        fe.set_vring_base(q, base as u16).expect("SET_VRING_BASE");
        fe.set_vring_addr(q, &vring_config(&self.mem, r))
            .expect("SET_VRING_ADDR");
        fe.set_vring_kick(q, &r.kick).expect("SET_VRING_KICK");
        fe.set_vring_enable(q, true).expect("SET_VRING_ENABLE");
    }

    /// Hands ring `q` a new call fd (SET_VRING_CALL).
    pub fn set_call(&mut self, q: usize, call: EventFd) {
        self.fe.set_vring_call(q, &call).expect("SET_VRING_CALL");
        self.rings[q].call = call;
    }

    /// The device's config space (`len` bytes from 0).
    pub fn config(&mut self, len: u32) -> Vec<u8> {
        let buf = vec![0u8; len as usize];
        let (_, payload) = self
            .fe
            .get_config(0, len, VhostUserConfigFlags::empty(), &buf)
            .expect("GET_CONFIG");
        payload
    }

    /// Makes a chain of `(gpa, len, device-writable)` available on ring
    /// `q` and kicks; returns its head.
    pub fn add(&mut self, q: usize, bufs: &[(u64, u32, bool)]) -> u16 {
        if self.packed {
            return self.add_packed(q, bufs);
        }
        let r = &mut self.rings[q];
        assert!(
            !bufs.is_empty() && bufs.len() <= r.free.len(),
            "ring {q} full"
        );
        let ids: Vec<u16> = (0..bufs.len()).map(|_| r.free.pop().unwrap()).collect();
        for (i, &(addr, len, write)) in bufs.iter().enumerate() {
            let mut d = [0u8; 16];
            d[0..8].copy_from_slice(&addr.to_le_bytes());
            d[8..12].copy_from_slice(&len.to_le_bytes());
            let mut flags = if write { F_WRITE } else { 0 };
            let next = ids.get(i + 1).copied().unwrap_or(0);
            if i + 1 < bufs.len() {
                flags |= F_NEXT;
            }
            d[12..14].copy_from_slice(&flags.to_le_bytes());
            d[14..16].copy_from_slice(&next.to_le_bytes());
            self.mem.write(r.base + ids[i] as u64 * 16, &d);
        }
        let head = ids[0];
        let slot = r.avail_idx % QSIZE;
        self.mem
            .write(r.base + AVAIL + 4 + 2 * slot as u64, &head.to_le_bytes());
        r.avail_idx = r.avail_idx.wrapping_add(1);
        fence(Ordering::SeqCst);
        self.mem
            .u16(r.base + AVAIL + 2)
            .store(r.avail_idx, Ordering::Release);
        r.chains[head as usize] = ids;
        let _ = r.kick.write(1);
        head
    }

    /// A packed ring's [`Self::add`]: the chain in consecutive slots with
    /// one buffer ID, the flags of each slot's lap, the first slot's flags
    /// written last (release); returns the buffer ID.
    fn add_packed(&mut self, q: usize, bufs: &[(u64, u32, bool)]) -> u16 {
        let r = &mut self.rings[q];
        let n = bufs.len() as u16;
        assert!(
            n > 0 && n <= r.p_free && !r.free.is_empty(),
            "ring {q} full"
        );
        let id = r.free.pop().unwrap();
        let first = r.p_avail.0;
        let mut first_flags = 0;
        for (i, &(addr, len, write)) in bufs.iter().enumerate() {
            let (slot, wrap) = r.p_avail;
            let mut flags = if wrap { P_AVAIL } else { P_USED };
            if write {
                flags |= F_WRITE;
            }
            if i + 1 < bufs.len() {
                flags |= F_NEXT;
            }
            let mut d = [0u8; 16];
            d[0..8].copy_from_slice(&addr.to_le_bytes());
            d[8..12].copy_from_slice(&len.to_le_bytes());
            d[12..14].copy_from_slice(&id.to_le_bytes());
            if i == 0 {
                // Flags 0 are never available: the chain shows at once.
                first_flags = flags;
            } else {
                d[14..16].copy_from_slice(&flags.to_le_bytes());
            }
            self.mem.write(r.base + slot as u64 * 16, &d);
            r.p_avail = if slot + 1 == QSIZE {
                (0, !wrap)
            } else {
                (slot + 1, wrap)
            };
        }
        r.p_free -= n;
        r.chains[id as usize] = vec![id; n as usize];
        self.mem
            .u16(r.base + first as u64 * 16 + 14)
            .store(first_flags, Ordering::Release);
        fence(Ordering::SeqCst);
        let _ = r.kick.write(1);
        id
    }

    /// A packed ring's [`Self::used`]: used descriptors (AVAIL and USED
    /// both equal to the used wrap counter), each moving on by the slots
    /// its chain took.
    fn used_packed(&mut self, q: usize) -> Vec<(u16, u32)> {
        let r = &mut self.rings[q];
        let mut out = Vec::new();
        loop {
            let (slot, wrap) = r.p_used;
            let at = r.base + slot as u64 * 16;
            let f = self.mem.u16(at + 14).load(Ordering::Acquire);
            if (f & P_AVAIL != 0) != wrap || (f & P_USED != 0) != wrap {
                return out;
            }
            let mut e = [0u8; 16];
            self.mem.read(at, &mut e);
            let id = u16::from_le_bytes([e[12], e[13]]);
            let len = u32::from_le_bytes(e[8..12].try_into().unwrap());
            assert!((id as usize) < QSIZE as usize, "ring {q}: used id {id}");
            let ids = std::mem::take(&mut r.chains[id as usize]);
            assert!(!ids.is_empty(), "ring {q}: id {id} used twice");
            let n = ids.len() as u16;
            r.p_free += n;
            r.free.push(id);
            let s = slot + n;
            r.p_used = if s >= QSIZE {
                (s - QSIZE, !wrap)
            } else {
                (s, wrap)
            };
            out.push((id, len));
        }
    }

    /// Chains the device returned since the last call: `(head, len)`.
    pub fn used(&mut self, q: usize) -> Vec<(u16, u32)> {
        if self.packed {
            return self.used_packed(q);
        }
        let r = &mut self.rings[q];
        let idx = self.mem.u16(r.base + USED + 2).load(Ordering::Acquire);
        let mut out = Vec::new();
        while r.last_used != idx {
            let mut e = [0u8; 8];
            let at = r.base + USED + 4 + 8 * (r.last_used % QSIZE) as u64;
            self.mem.read(at, &mut e);
            let head = u32::from_le_bytes(e[0..4].try_into().unwrap()) as u16;
            let len = u32::from_le_bytes(e[4..8].try_into().unwrap());
            let ids = std::mem::take(&mut r.chains[head as usize]);
            assert!(!ids.is_empty(), "ring {q}: head {head} used twice");
            r.free.extend(ids);
            r.last_used = r.last_used.wrapping_add(1);
            out.push((head, len));
        }
        out
    }

    /// Waits (up to `timeout`) until ring `q` returns something; what it
    /// returned (empty on timeout).
    pub fn wait(&mut self, q: usize, timeout: Duration) -> Vec<(u16, u32)> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            self.arm(q);
            let got = self.used(q);
            if !got.is_empty() {
                return got;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return got;
            }
            let mut p = libc::pollfd {
                fd: self.rings[q].call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, left.as_millis().max(1) as i32) };
            if let Ok(n) = self.rings[q].call.read() {
                self.rings[q].signals += n;
            }
        }
    }

    /// Asks for a signal when ring `q` returns its next chain (EVENT_IDX:
    /// the next used entry; packed: that slot, or every one without it).
    pub fn arm(&self, q: usize) {
        let r = &self.rings[q];
        if self.packed {
            let (slot, wrap) = r.p_used;
            let off = slot | if wrap { P_USED } else { 0 };
            let flags = if self.event_idx() { 2 } else { 0 };
            self.mem.u16(r.base + AVAIL).store(off, Ordering::Release);
            self.mem
                .u16(r.base + AVAIL + 2)
                .store(flags, Ordering::Release);
        } else {
            let used_event = r.base + AVAIL + 4 + 2 * QSIZE as u64;
            self.mem
                .u16(used_event)
                .store(r.last_used, Ordering::Release);
        }
        fence(Ordering::SeqCst);
    }

    /// Waits until `n` chains came back on ring `q` (10 s at most each).
    pub fn wait_n(&mut self, q: usize, n: usize) -> Vec<(u16, u32)> {
        let mut all = Vec::with_capacity(n);
        while all.len() < n {
            let got = self.wait(q, Duration::from_secs(10));
            assert!(
                !got.is_empty(),
                "ring {q}: {}/{n} returned, then none",
                all.len()
            );
            all.extend(got);
        }
        all
    }

    /// Whether the event-index feature was negotiated.
    pub fn event_idx(&self) -> bool {
        self.features & EVENT_IDX != 0
    }
}

impl Fe {
    /// Heads the inflight region marks as taken on ring `q` (what a
    /// backend holds now, or held when it died).
    pub fn inflight_marked(&self, q: usize) -> usize {
        use std::os::unix::fs::FileExt;
        let Some((info, file)) = &self.inflight else {
            return 0;
        };
        // The part's stride from the region's size; the layout from the
        // rings: split (16-byte header and entries) or packed (32).
        let part = info.mmap_size / info.num_queues as u64;
        let (hdr, entry) = if self.packed { (32, 32) } else { (16, 16) };
        let mut b = vec![0u8; hdr + entry * QSIZE as usize];
        let at = info.mmap_offset + q as u64 * part;
        file.read_exact_at(&mut b, at)
            .expect("read the inflight region");
        (0..QSIZE as usize)
            .filter(|h| b[hdr + h * entry] == 1)
            .count()
    }
}

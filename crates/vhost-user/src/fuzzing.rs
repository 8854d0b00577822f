//! Entry points for the fuzz targets (fuzz/fuzz_targets/vhost_*.rs); the
//! same bodies run as proptests on stable (tests/proptests.rs).
//!
//! [`ring_chains`]: the bytes are a guest's memory holding a split ring
//! (descriptor table, avail ring) that a hostile driver wrote; every
//! available chain is popped, walked and parsed exactly as the data path
//! does ([`crate::virtq::Virtq::pop`], [`crate::blk::parse_chain`]), and
//! every buffer of an accepted request must lie inside guest memory with
//! the direction the request needs (half the inputs through a take-all
//! pass's look made ahead, `Virtq::look_ahead`). Our take path is also
//! checked against `virtio-queue`'s (the same chains, descriptor for
//! descriptor).
//!
//! [`packed_chains`]: the same for a packed ring ([`crate::packed`]): the
//! bytes hold the descriptor ring, indirect tables, buffers and the
//! driver's event suppression structure; every chain the ring offers is
//! taken, parsed and returned used in a scrambled order, with the
//! notification check after each, until the ring is empty or broken.
//!
//! [`messages`]: the bytes are what a frontend sends on the socket (no
//! file descriptors); they go through `vhost`'s `BackendReqHandler` to
//! [`crate::backend::BlkBackend`] over a malloc bdev, as the control
//! thread does (SET_BACKEND_REQ_FD taken by [`crate::notify`] first),
//! until the stream ends or breaks.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, OnceLock};

use ustor_bdev::Registry;
use ustor_runtime::{PollMode, Runtime, RuntimeConfig};
use vhost::vhost_user::BackendReqHandler;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryMmap, Permissions};

use crate::blk::{self, Kind};
use crate::guest::GuestMem;
use crate::packed::PackedRing;
use crate::virtq::{SplitRing, Virtq};

/// Guest memory of the harness: the ring and every buffer must fit.
pub const MEM_BYTES: usize = 64 << 10;
const DESC_AT: u64 = 0;
const AVAIL_AT: u64 = 0x1000;
const USED_AT: u64 = 0x2000;
/// Ring size (`1 << (byte % 9)`), EVENT_IDX (bit 0) and the look made
/// ahead (bit 1) come from these bytes, past the largest used ring.
pub const SIZE_AT: usize = 0x2ff0;
pub const EVENT_IDX_AT: usize = 0x2ff1;

/// What [`ring_chains`] made of the chains it popped.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Valid requests (the data path would run them).
    pub accepted: u32,
    /// Refused with IOERR in their status byte.
    pub ioerr: u32,
    /// Refused with no status byte (returned used with length 0).
    pub no_status: u32,
}

/// Pops, walks and parses every chain a ring in `data` offers (see the
/// module comment); panics if an accepted request reaches outside guest
/// memory or writes into a device-readable buffer.
pub fn ring_chains(data: &[u8]) -> Outcome {
    let mut out = Outcome::default();
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_BYTES)])
        .expect("harness memory");
    let n = data.len().min(MEM_BYTES);
    mem.write_slice(&data[..n], GuestAddress(0))
        .expect("harness write");
    let mem = GuestMem::from_map(mem);
    let size = 1u16 << (data.get(SIZE_AT).copied().unwrap_or(8) % 9);
    let event_idx = data.get(EVENT_IDX_AT).is_some_and(|b| b & 1 != 0);
    let Some(q) = split_queue(&mem, size, event_idx) else {
        return out;
    };
    if let Some(theirs) = split_queue(&mem, size, event_idx) {
        same_chains_as_virtio_queue(&mem, theirs, size);
    }
    let mut v = Virtq::Split(SplitRing::new(q, 0));
    let mut descs = blk::chain_buf();
    let mut segs = Vec::new();
    // Half the inputs take as a take-all pass does: the look made ahead
    // (its prefetches read the hostile table and headers), then the pops
    // of that one look, which here (nothing changes meanwhile) are the
    // chains the plain pops give.
    let mut looked = false;
    let ahead = data.get(EVENT_IDX_AT).is_some_and(|b| b & 2 != 0);
    if ahead {
        v.look_ahead(&mem, &mut looked);
    }
    for _ in 0..size {
        let t = if ahead {
            v.pop_in_pass(&mem, &mut descs, &mut looked)
        } else {
            v.pop(&mem, &mut descs)
        };
        let Some(t) = t else {
            break;
        };
        assert!(t.descs <= blk::CHAIN_MAX + 1);
        let len = judge_chain(&descs[..t.descs], &mem, &mut segs, &mut out);
        // The used ring may itself be garbage; the data path ignores a
        // failed add the same way (the ring is then broken).
        let _ = v.add_used(&mem, t.head, len);
    }
    out
}

/// The harness's split ring over `mem`, if it lies in memory.
fn split_queue(mem: &GuestMemoryMmap, size: u16, event_idx: bool) -> Option<Queue> {
    let mut q = Queue::new(256).ok()?;
    q.set_size(size);
    q.set_desc_table_address(Some(DESC_AT as u32), Some(0));
    q.set_avail_ring_address(Some(AVAIL_AT as u32), Some(0));
    q.set_used_ring_address(Some(USED_AT as u32), Some(0));
    q.set_event_idx(event_idx);
    q.set_ready(true);
    q.is_valid(mem).then_some(q)
}

/// Our split take path ([`Virtq::pop`]) gives the chains `virtio-queue`'s
/// iterator gives, descriptor for descriptor (nothing is written, so both
/// see the same memory); panics where they differ.
fn same_chains_as_virtio_queue(mem: &GuestMem, mut theirs: Queue, size: u16) {
    let Some(q) = split_queue(mem, size, false) else {
        return;
    };
    let mut ours = Virtq::Split(SplitRing::new(q, 0));
    let (mut a, mut b) = (blk::chain_buf(), blk::chain_buf());
    for _ in 0..=size {
        let t = ours.pop(mem, &mut a).map(|t| (t.head, t.descs));
        let r = theirs.pop_descriptor_chain(mem.map()).map(|c| {
            let head = c.head_index();
            (head, blk::collect_chain(c, &mut b))
        });
        match (t, r) {
            (None, None) => return,
            (Some((h, k)), Some((rh, rk))) => {
                assert_eq!((h, &a[..k]), (rh, &b[..rk]), "chain differs");
            }
            (t, r) => panic!("ours {t:?}, virtio-queue's {r:?}"),
        }
    }
}

/// Where [`packed_chains`] reads its ring size (`byte + 1`), a base (u32
/// at `PACKED_BASE_AT`, used when the byte at `PACKED_BASE_AT - 1` is odd;
/// else a fresh ring's) and EVENT_IDX (bit 0 at `EVENT_IDX_AT`).
pub const PACKED_BASE_AT: usize = 0x2ff4;

/// Takes, parses and returns every chain a packed ring in `data` offers
/// (see the module comment); panics if an accepted request reaches
/// outside guest memory or a taken chain overflows its buffer.
pub fn packed_chains(data: &[u8]) -> Outcome {
    let mut out = Outcome::default();
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_BYTES)])
        .expect("harness memory");
    let n = data.len().min(MEM_BYTES);
    mem.write_slice(&data[..n], GuestAddress(0))
        .expect("harness write");
    let gm = GuestMem::from_map(mem);
    let mem = gm.map();
    let byte = |at: usize| data.get(at).copied().unwrap_or(0);
    let size = byte(SIZE_AT) as u16 + 1;
    let mut base = 1 << 15 | 1 << 31;
    if byte(PACKED_BASE_AT - 1) & 1 == 1 {
        let b = |i| byte(PACKED_BASE_AT + i) as u32;
        base = b(0) | b(1) << 8 | b(2) << 16 | b(3) << 24;
    }
    let event_idx = byte(EVENT_IDX_AT) & 1 != 0;
    let g = GuestAddress;
    let Ok(mut r) = PackedRing::new(size, g(DESC_AT), g(AVAIL_AT), g(USED_AT), event_idx, base)
    else {
        return out;
    };
    let mut descs = blk::chain_buf();
    let mut segs = Vec::new();
    let mut held: Vec<(u16, u32)> = Vec::new();
    for step in 0..2 * size as usize {
        let Some(t) = r.pop(mem, &mut descs) else {
            break;
        };
        assert!(t.descs <= descs.len() && t.head < size);
        let len = judge_chain(&descs[..t.descs], &gm, &mut segs, &mut out);
        held.push((t.head, len));
        // Return some now, in an order the bytes pick (out of order).
        if byte(step % MEM_BYTES) & 1 == 1 {
            let (id, len) = held.swap_remove(step % held.len());
            let _ = r.add_used(mem, id, len);
            let _ = r.needs_notification(mem);
        }
    }
    for (id, len) in held.into_iter().rev() {
        let _ = r.add_used(mem, id, len);
        let _ = r.needs_notification(mem);
    }
    assert_eq!(r.in_flight(), 0);
    let _ = r.enable_notification(mem);
    out
}

/// Parses one chain as the data path does, checks what it accepted and
/// counts the outcome; the used length the device would give it (1 when a
/// status byte is written, 0 when there is nowhere to write one).
fn judge_chain(
    descs: &[blk::Desc],
    mem: &GuestMem,
    segs: &mut Vec<blk::Seg>,
    out: &mut Outcome,
) -> u32 {
    match blk::parse_chain(descs, mem, std::mem::take(segs)) {
        Ok(mut req) => {
            check_request(mem.map(), &req);
            out.accepted += 1;
            *segs = std::mem::take(&mut req.segs);
            1
        }
        Err((e, back)) => {
            *segs = back;
            match e.status_addr() {
                Some(a) => {
                    assert!(mem.check_range(a, 1, Permissions::Write));
                    out.ioerr += 1;
                    1
                }
                None => {
                    out.no_status += 1;
                    0
                }
            }
        }
    }
}

fn check_request<M: GuestMemory>(mem: &M, req: &blk::Request) {
    assert!(mem.check_range(req.status, 1, Permissions::Write));
    assert!(req.segs.len() <= blk::SEG_MAX);
    let mut total = 0u64;
    for s in &req.segs {
        assert!(
            mem.check_range(s.addr, s.len as usize, Permissions::Read),
            "segment outside guest memory"
        );
        // A read from the disk fills guest buffers: they must be ones the
        // driver marked device-writable.
        if req.kind == Kind::Read {
            assert!(s.write, "read into a device-readable buffer");
        }
        total += s.len as u64;
    }
    assert_eq!(total, req.data_len as u64);
}

struct MsgFixture {
    rt: Runtime,
    dev: Arc<crate::device::BlkDevice>,
}

fn msg_fixture() -> &'static MsgFixture {
    static F: OnceLock<MsgFixture> = OnceLock::new();
    F.get_or_init(|| {
        let rt = Runtime::start(RuntimeConfig {
            cores: vec![0],
            pin: false,
            poll_mode: PollMode::Adaptive,
            ..RuntimeConfig::default()
        })
        .expect("runtime");
        let registry = Registry::new(Some(rt.handle()));
        let opts = ustor_bdev::modules::RamOpts {
            name: "fuzz".into(),
            num_blocks: 2048,
            block_size: 512,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        };
        ustor_bdev::modules::malloc::create(&registry, opts).expect("malloc bdev");
        let desc = registry.open("fuzz", true, |_| {}).expect("open");
        let mut dev = crate::device::BlkDevice::new(desc, 2, false);
        // Both ring layouts reachable: a stream may ack RING_PACKED.
        dev.packed_ring = true;
        let dev = Arc::new(dev);
        MsgFixture { rt, dev }
    })
}

/// Feeds `data` as one frontend's byte stream to a fresh backend (see
/// the module comment). Ends for any input: at most 256 messages.
pub fn messages(data: &[u8]) {
    let f = msg_fixture();
    let Ok((mut front, back)) = UnixStream::pair() else {
        return;
    };
    // Replies pile up in `front`'s receive buffer, which holds far more
    // than 256 replies.
    if front.write_all(data).is_err() || front.shutdown(std::net::Shutdown::Write).is_err() {
        return;
    }
    let backend = Arc::new(Mutex::new(crate::backend::BlkBackend::new(
        f.dev.clone(),
        f.rt.handle(),
        vec![0],
    )));
    let mut h = BackendReqHandler::from_stream(back, backend.clone());
    let fd = std::os::fd::AsRawFd::as_raw_fd(&h);
    for _ in 0..256 {
        // As the control thread: SET_BACKEND_REQ_FD is taken off the
        // socket before the `vhost` crate sees the message.
        match crate::notify::take_backend_channel(fd) {
            Ok(None) => {}
            Ok(Some(_)) => continue,
            Err(_) => break,
        }
        match h.handle_request() {
            Ok(()) => {}
            Err(e) if crate::controller::ends_connection(&e) => break,
            Err(_) => {}
        }
    }
    backend.lock().unwrap_or_else(|e| e.into_inner()).reset();
}

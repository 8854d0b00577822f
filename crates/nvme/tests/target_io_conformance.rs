//! NVM I/O command handling of the target over raw TCP, checked against the
//! NVMe Base specification (1.4 / 2.0) and the NVM Command Set
//! specification, and against the Identify Controller / Namespace fields a
//! host reads to decide what it may send (FUSES, SGLS, VWC, DLFEAT).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use serde_json::{json, Value};
use ustor_bdev::{Bdev, BdevChannel, BdevError, BdevInfo, IoHandle, IoType};
use ustor_nvme::nvmf::{AddNsParams, NamespaceParams};
use ustor_nvme::wire::*;

/// CDW12 bit 30 of Read / Write / Compare / Write Zeroes.
const FUA: u32 = 1 << 30;

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
}

fn identify(c: &mut Client, cns: u8, nsid: u32) -> Vec<u8> {
    let mut s = Sqe::default();
    s.set_opcode(admin::IDENTIFY)
        .set_nsid(nsid)
        .set_cdw(10, u32::from(cns))
        .set_sgl(SglDesc::transport(4096));
    let (d, c) = c.cmd(&mut s, &[]);
    assert!(c.status().is_success(), "{}", c.status());
    assert_eq!(d.len(), 4096);
    d
}

/// `sqe` with FUSE (byte 1, bits 1:0) set to `fuse`; `Client::cmd` keeps
/// those bits when it sets PSDT.
fn fused(sqe: &Sqe, fuse: u8) -> Sqe {
    let mut b = [0u8; 80];
    encode_capsule_cmd(&mut b, sqe, Digests::default(), 0);
    b[CH_LEN + 1] = (b[CH_LEN + 1] & !3) | fuse;
    let s = Sqe::from_slice(&b[CH_LEN..]).unwrap();
    assert_eq!(s.fuse(), fuse);
    s
}

fn io_pair(e: &Env) -> (Client, Client) {
    let (a, cntlid) = Client::admin(e.port, Digests::default());
    let q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    (a, q)
}

fn write_incapsule(q: &mut Client, slba: u64, data: &[u8], cdw12_flags: u32) -> Status {
    let nlb = (data.len() / 512) as u32;
    let mut w = Client::rw_sqe(io::WRITE, slba, nlb, true);
    w.set_cdw(12, (nlb - 1) | cdw12_flags);
    q.cmd(&mut w, data).1.status()
}

// ---------------------------------------------------------------------
// Fused operations
// ---------------------------------------------------------------------

/// NVMe 1.4 5.15.2.1, FUSES bit 0: Compare and Write is supported (the
/// target reports it); 4.2: "the commands shall be executed as an atomic
/// unit". A namespace whose bdev has no native compare-and-write (malloc)
/// cannot do that, so the pair must not run as two ordinary commands: the
/// Compare gets Invalid Field in Command, the Write Command Aborted due to
/// Failed Fused Command, and the data stays (before FUSES was set, Linux
/// nvmet's answer, Invalid Field, for both). Atomic pairs are tested in
/// target_fused.rs.
#[test]
fn fused_operations_are_refused_where_the_bdev_cannot_compare_and_write() {
    let e = env();
    let (mut a, mut q) = io_pair(&e);
    let id = identify(&mut a, 1, 0);
    assert_eq!(le16(&id, 522), 1, "FUSES: Compare and Write");

    let old = pattern(4096, 1);
    let new = pattern(4096, 2);
    assert_eq!(write_incapsule(&mut q, 64, &old, 0), Status::SUCCESS);

    // Compare (first, FUSE = 01b) then Write (second, FUSE = 10b), sent
    // back to back: the first is answered once its partner is in.
    let mut cmp = fused(&Client::rw_sqe(io::COMPARE, 64, 8, true), 1);
    let c1 = q.next_cid();
    cmp.set_cid(c1).set_sgl_psdt();
    q.send_cmd(&cmp, &old);
    let mut w = fused(&Client::rw_sqe(io::WRITE, 64, 8, true), 2);
    let c2 = q.next_cid();
    w.set_cid(c2).set_sgl_psdt();
    q.send_cmd(&w, &new);
    let mut got = [q.recv().unwrap().cqe(), q.recv().unwrap().cqe()];
    got.sort_by_key(|c| c.cid);
    assert_eq!(
        (got[0].cid, got[0].status(), got[1].cid, got[1].status()),
        (c1, Status::INVALID_FIELD, c2, Status::ABORTED_FAILED_FUSED)
    );
    let (d, c) = q.read(64, 8);
    assert!(c.status().is_success());
    assert_eq!(d, old, "a refused fused Write wrote nothing");

    // FUSE = 11b is reserved; admin commands are never fused.
    let mut r = fused(&Client::rw_sqe(io::READ, 64, 8, false), 3);
    assert_eq!(q.cmd(&mut r, &[]).1.status(), Status::INVALID_FIELD);
    let mut ka = Sqe::default();
    ka.set_opcode(admin::KEEP_ALIVE);
    let mut ka = fused(&ka, 1);
    assert_eq!(a.cmd(&mut ka, &[]).1.status(), Status::INVALID_FIELD);

    // Unfused commands still work on both queues.
    let mut ka = Sqe::default();
    ka.set_opcode(admin::KEEP_ALIVE);
    assert!(a.cmd(&mut ka, &[]).1.status().is_success());
    assert_eq!(write_incapsule(&mut q, 64, &new, 0), Status::SUCCESS);
    assert_eq!(q.read(64, 8).0, new);
}

// ---------------------------------------------------------------------
// Transfer length vs NLB
// ---------------------------------------------------------------------

/// NVMe 1.4 5.15.2.1, SGLS bit 18: "If cleared to '0', then the SGL length
/// shall be equal to the amount of data to be transferred." The target
/// clears it, so a Read whose data SGL is longer (or shorter) than NLB x
/// block size gets Data SGL Length Invalid, as a Write does and as Linux
/// nvmet answers (nvmet_check_transfer_len). Before the fix a longer SGL
/// was accepted and fewer bytes than described were sent.
#[test]
fn read_sgl_length_must_equal_nlb_times_block_size() {
    let e = env();
    let (mut a, mut q) = io_pair(&e);
    let id = identify(&mut a, 1, 0);
    let sgls = u32::from_le_bytes(id[536..540].try_into().unwrap());
    assert_eq!(sgls & 3, 1, "SGLs supported");
    assert_eq!(sgls & 1 << 18, 0, "SGL longer than the data: not supported");

    let data = pattern(2048, 3);
    assert_eq!(write_incapsule(&mut q, 8, &data, 0), Status::SUCCESS);
    for sgl_len in [4096u32, 2560, 1536, 512] {
        let mut r = Client::rw_sqe(io::READ, 8, 4, false);
        r.set_sgl(SglDesc::transport(sgl_len));
        let (d, c) = q.cmd(&mut r, &[]);
        assert_eq!(c.status(), Status::DATA_SGL_LENGTH_INVALID, "{sgl_len}");
        assert!(d.is_empty(), "no data for a refused read");
    }
    // Write: the same rule, SGL longer and shorter than NLB blocks.
    let mut w = Client::rw_sqe(io::WRITE, 8, 2, true);
    w.set_sgl(SglDesc::in_capsule(2048));
    assert_eq!(
        q.cmd(&mut w, &pattern(2048, 4)).1.status(),
        Status::DATA_SGL_LENGTH_INVALID
    );
    let mut w = Client::rw_sqe(io::WRITE, 8, 8, true);
    assert_eq!(
        q.cmd(&mut w, &pattern(2048, 4)).1.status(),
        Status::DATA_SGL_LENGTH_INVALID
    );
    let (d, c) = q.read(8, 4);
    assert!(c.status().is_success());
    assert_eq!(d, data, "refused commands changed nothing");
}

// ---------------------------------------------------------------------
// Field checks that hold (regression cover)
// ---------------------------------------------------------------------

/// NVM Command Set 3.2.4 / 3.2.6: NLB is 0's based; "If the command
/// specifies ... an LBA range that exceeds the namespace size, LBA Out of
/// Range" (also when SLBA + NLB wraps around 2^64). NVMe 1.4 6.1.5: an I/O
/// command with NSID 0, FFFFFFFFh or an inactive NSID gets Invalid
/// Namespace or Format. An opcode the I/O command set does not define gets
/// Invalid Command Opcode.
#[test]
fn lba_ranges_namespaces_and_opcodes() {
    let e = env();
    let (mut a, mut q) = io_pair(&e);
    let id = identify(&mut a, 0, 1);
    let nsze = u64::from_le_bytes(id[0..8].try_into().unwrap());
    assert_eq!(nsze, 32768);

    // NLB 0 = one block; the last block is in range, one past is not.
    let mut r = Client::rw_sqe(io::READ, nsze - 1, 1, false);
    assert_eq!(r.cdw(12) & 0xffff, 0);
    let (d, c) = q.cmd(&mut r, &[]);
    assert!(c.status().is_success());
    assert_eq!(d.len(), 512);
    for op in [io::READ, io::WRITE_ZEROES] {
        let mut s = Client::rw_sqe(op, nsze, 1, false);
        if op != io::READ {
            s.set_sgl(SglDesc::default());
        }
        assert_eq!(q.cmd(&mut s, &[]).1.status(), Status::LBA_OUT_OF_RANGE);
        // SLBA + NLB overflows 64 bits.
        let mut s = Client::rw_sqe(op, u64::MAX - 1, 8, false);
        if op != io::READ {
            s.set_sgl(SglDesc::default());
        }
        assert_eq!(q.cmd(&mut s, &[]).1.status(), Status::LBA_OUT_OF_RANGE);
    }
    let mut w = Client::rw_sqe(io::WRITE, u64::MAX - 1, 1, true);
    assert_eq!(
        q.cmd(&mut w, &[0u8; 512]).1.status(),
        Status::LBA_OUT_OF_RANGE
    );

    for nsid in [0u32, 2, 0xffff_fffe, 0xffff_ffff] {
        let mut r = Client::rw_sqe(io::READ, 0, 1, false);
        r.set_nsid(nsid);
        assert_eq!(
            q.cmd(&mut r, &[]).1.status(),
            Status::INVALID_NAMESPACE,
            "{nsid:#x}"
        );
    }
    // Flush with FFFFFFFFh: VS is 1.3, whose VWC bits 7:1 are reserved
    // (no broadcast support is claimed); refused like Linux nvmet.
    assert_eq!(id_vwc(&mut a), 1);
    let mut f = Sqe::default();
    f.set_opcode(io::FLUSH).set_nsid(0xffff_ffff);
    assert_eq!(q.cmd(&mut f, &[]).1.status(), Status::INVALID_NAMESPACE);

    // Write Uncorrectable (04h, ONCS bit 1 clear), Verify (0Ch), Copy
    // (19h), Reservation Register (0Dh) and admin opcodes on an I/O queue.
    let oncs = le16(&identify(&mut a, 1, 0), 520);
    assert_eq!(oncs & !(1 | 1 << 2 | 1 << 3), 0, "ONCS {oncs:#x}");
    for op in [0x04u8, 0x0c, 0x0d, 0x19, 0x06, 0x7e] {
        let mut s = Sqe::default();
        s.set_opcode(op).set_nsid(1);
        assert_eq!(
            q.cmd(&mut s, &[]).1.status(),
            Status::INVALID_OPCODE,
            "{op:#x}"
        );
    }
}

fn id_vwc(a: &mut Client) -> u8 {
    identify(a, 1, 0)[525]
}

// ---------------------------------------------------------------------
// FUA
// ---------------------------------------------------------------------

/// What reached the device, in order.
#[derive(Default)]
struct Trace {
    ops: Mutex<Vec<(IoType, u64, u64)>>,
    flushes: AtomicU64,
}

/// A bdev over a malloc bdev that claims a volatile write cache and records
/// every operation: FUA is only observable as a flush after the write.
/// With `drop_unmap` it also stands for a device whose deallocation does
/// not zero (an unmap completes and the old data stays).
struct CacheBdev {
    info: BdevInfo,
    inner: Arc<dyn Bdev>,
    trace: Arc<Trace>,
    drop_unmap: bool,
}

struct CacheChannel {
    inner: Box<dyn BdevChannel>,
    trace: Arc<Trace>,
    drop_unmap: bool,
}

impl BdevChannel for CacheChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        if d.kind == IoType::Flush {
            self.trace.flushes.fetch_add(1, Ordering::SeqCst);
        }
        self.trace
            .ops
            .lock()
            .unwrap()
            .push((d.kind, d.offset_blocks, d.num_blocks));
        if d.kind == IoType::Unmap && self.drop_unmap {
            return io.complete(Ok(()));
        }
        self.inner.submit(io);
    }
}

impl Bdev for CacheBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, t: IoType) -> bool {
        self.inner.io_type_supported(t)
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        Ok(Box::new(CacheChannel {
            inner: self.inner.create_channel()?,
            trace: self.trace.clone(),
            drop_unmap: self.drop_unmap,
        }))
    }
    fn config_json(&self) -> Value {
        json!({"method": "test_cache_create", "params": {"name": self.info.name}})
    }
}

/// Namespace 2: a write-cached bdev over a fresh malloc bdev.
fn cached_ns(e: &Env, drop_unmap: bool) -> Arc<Trace> {
    ustor_bdev::modules::malloc::create(
        &e.registry,
        ustor_bdev::modules::RamOpts {
            name: "Malloc1".into(),
            num_blocks: 4096,
            block_size: 512,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .unwrap();
    let inner = e.registry.get("Malloc1").unwrap().bdev().clone();
    let mut info = inner.info().clone();
    info.name = "Cache0".into();
    info.module = "cache_test";
    // Its unmap keeps the data (as a remote device's may).
    info.unmap_reads_zero = false;
    info.write_cache = true;
    info.uuid = serde_json::from_value(json!("5d0c3b8e-7a41-4f1e-9c2d-3b4a5c6d7e8f")).unwrap();
    let trace = Arc::new(Trace::default());
    e.registry
        .register(Arc::new(CacheBdev {
            info,
            inner,
            trace: trace.clone(),
            drop_unmap,
        }))
        .unwrap();
    e.target
        .nvmf_subsystem_add_ns(&AddNsParams {
            nqn: NQN.into(),
            namespace: NamespaceParams {
                bdev_name: "Cache0".into(),
                nsid: 2,
                uuid: None,
                nguid: None,
            },
        })
        .unwrap();
    trace
}

/// NVM Command Set 1.0 3.2.6 (Write), CDW12 bit 30: "If set to '1', then
/// for data and metadata, if any, associated with logical blocks specified
/// by the Write command, the controller shall write that data and
/// metadata, if any, to non-volatile medium before indicating command
/// completion." Likewise for Write Zeroes (3.2.8). Identify Controller
/// reports a volatile write cache (VWC bit 0), so on a write-cached bdev a
/// FUA write must reach the medium: the target passes FUA down as the bdev
/// I/O flag, and on this write-cached bdev (no native FUA) the bdev layer
/// flushes the range before completing (Linux nvmet passes REQ_FUA /
/// IOCB_DSYNC down). Before the fix FUA was ignored and no flush was sent.
#[test]
fn fua_writes_are_flushed_before_completion() {
    let e = env();
    let trace = cached_ns(&e, false);
    let (mut a, mut q) = io_pair(&e);
    assert_eq!(id_vwc(&mut a) & 1, 1, "VWC present");
    let flushes = || trace.flushes.load(Ordering::SeqCst);

    // Without FUA: no flush.
    let data = pattern(1024, 5);
    let mut w = Client::rw_sqe(io::WRITE, 16, 2, true);
    w.set_nsid(2);
    assert!(q.cmd(&mut w, &data).1.status().is_success());
    assert_eq!(flushes(), 0);

    // Write with FUA: the flush follows the write, before the completion.
    trace.ops.lock().unwrap().clear();
    let mut w = Client::rw_sqe(io::WRITE, 16, 2, true);
    w.set_nsid(2).set_cdw(12, 1 | FUA);
    assert!(q.cmd(&mut w, &data).1.status().is_success());
    assert_eq!(flushes(), 1);
    let ops = trace.ops.lock().unwrap().clone();
    assert_eq!(ops.len(), 2, "{ops:?}");
    assert_eq!(ops[0], (IoType::Write, 16, 2));
    assert_eq!(ops[1].0, IoType::Flush);
    assert!(
        ops[1].1 <= 16 && ops[1].1 + ops[1].2 >= 18,
        "the flush covers the written blocks: {ops:?}"
    );

    // Write by R2T with FUA.
    let big = pattern(64 << 10, 6);
    let mut w = Client::rw_sqe(io::WRITE, 256, 128, false);
    w.set_nsid(2).set_cdw(12, 127 | FUA);
    let cid = q.next_cid();
    w.set_cid(cid).set_sgl_psdt();
    q.send_cmd(&w, &[]);
    let p = q.recv().unwrap();
    assert_eq!(p.ty, PduType::R2T as u8);
    let r = DataHdr::decode(&p.hdr).unwrap();
    q.send_h2c(cid, r.ttag, 0, &big, true);
    assert!(q.wait(cid).1.status().is_success());
    assert_eq!(flushes(), 2);

    // Write Zeroes with FUA.
    let mut wz = Sqe::default();
    wz.set_opcode(io::WRITE_ZEROES)
        .set_nsid(2)
        .set_slba(16)
        .set_cdw(12, 1 | FUA);
    assert!(q.cmd(&mut wz, &[]).1.status().is_success());
    assert_eq!(flushes(), 3);
    let mut r = Client::rw_sqe(io::READ, 16, 2, false);
    r.set_nsid(2);
    assert_eq!(q.cmd(&mut r, &[]).0, vec![0u8; 1024]);

    // A failed write is not flushed (and FUA on a read changes nothing).
    let mut w = Client::rw_sqe(io::WRITE, 4095, 2, true);
    w.set_nsid(2).set_cdw(12, 1 | FUA);
    assert_eq!(q.cmd(&mut w, &data).1.status(), Status::LBA_OUT_OF_RANGE);
    let mut r = Client::rw_sqe(io::READ, 256, 128, false);
    r.set_nsid(2).set_cdw(12, 127 | FUA);
    let (d, c) = q.cmd(&mut r, &[]);
    assert!(c.status().is_success());
    assert_eq!(d, big);
    assert_eq!(flushes(), 3);
}

// ---------------------------------------------------------------------
// DLFEAT
// ---------------------------------------------------------------------

/// NVM Command Set 1.0 4.1.5.1 (Identify Namespace), DLFEAT bits 2:0:
/// "001b: A deallocated logical block returns all bytes cleared to 0h";
/// 000b: "The read behavior is not reported". The malloc bdev zeroes what
/// is deallocated, so its namespace may claim 001b (and does); a bdev that
/// promises nothing (here one whose unmap keeps the data, as a remote
/// device may) must report 000b, or a host that trusts DLFEAT (Linux: DEAC
/// in Write Zeroes, discard used as zeroing) reads stale data where it
/// expects zeroes. Bit 3 (Write Zeroes supports DEAC) stays: Write Zeroes
/// always writes zeroes. Before the fix every namespace said 1001b.
#[test]
fn dlfeat_claims_zeroed_deallocation_only_where_it_holds() {
    let e = env();
    cached_ns(&e, true);
    let (mut a, mut q) = io_pair(&e);
    assert_eq!(identify(&mut a, 0, 1)[33], 0b1001, "malloc");
    assert_eq!(identify(&mut a, 0, 2)[33], 0b1000, "unknown deallocation");

    let data = pattern(4096, 7);
    let mut w = Client::rw_sqe(io::WRITE, 40, 8, true);
    w.set_nsid(2);
    assert!(q.cmd(&mut w, &data).1.status().is_success());
    let mut range = [0u8; 16];
    range[4..8].copy_from_slice(&8u32.to_le_bytes());
    range[8..16].copy_from_slice(&40u64.to_le_bytes());
    let mut dsm = Sqe::default();
    dsm.set_opcode(io::DSM)
        .set_nsid(2)
        .set_cdw(11, 1 << 2)
        .set_sgl(SglDesc::in_capsule(16));
    assert!(q.cmd(&mut dsm, &range).1.status().is_success());
    let mut r = Client::rw_sqe(io::READ, 40, 8, false);
    r.set_nsid(2);
    assert_eq!(q.cmd(&mut r, &[]).0, data, "this bdev kept the data");
}

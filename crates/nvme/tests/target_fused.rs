//! Fused Compare + Write over raw NVMe/TCP: a namespace whose bdev does
//! compare-and-write natively runs the pair atomically (a match writes, a
//! miscompare leaves the data and answers Compare Failure + Aborted due to
//! Failed Fused Command); a half without its partner, mismatched ranges,
//! other fused opcodes and a bdev without native compare-and-write get
//! their NVMe statuses and change nothing.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use common::*;
use ustor_bdev::{Bdev, BdevChannel, BdevError, BdevInfo, IoHandle, IoType};
use ustor_nvme::nvmf::{AddNsParams, NamespaceParams};
use ustor_nvme::wire::*;

const BLOCKS: u64 = 64;

/// A RAM bdev with native compare-and-write: compare and write under one
/// lock.
struct CawBdev {
    info: BdevInfo,
    mem: Arc<Mutex<Vec<u8>>>,
}

struct CawChannel(Arc<Mutex<Vec<u8>>>);

impl CawChannel {
    fn caw(mem: &mut [u8], io: &IoHandle, len: usize) -> Result<(), BdevError> {
        // SAFETY: the halves are valid until `io` completes, after this.
        let Some((cmp, new)) = (unsafe { io.desc().compare_and_write_halves(len) }) else {
            return Err(BdevError::Io(libc::EINVAL));
        };
        // SAFETY: each half is `len` bytes (asked for above).
        let (cmp, new) = unsafe {
            (
                std::slice::from_raw_parts(cmp, len),
                std::slice::from_raw_parts(new, len),
            )
        };
        match mem.iter().zip(cmp).position(|(a, b)| a != b) {
            Some(at) => Err(BdevError::Miscompare {
                offset: Some(at as u64),
            }),
            None => {
                mem.copy_from_slice(new);
                Ok(())
            }
        }
    }
}

impl BdevChannel for CawChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        let mut mem = self.0.lock().unwrap();
        let mut pos = d.offset_blocks as usize * 512;
        let len = d.num_blocks as usize * 512;
        let r = match d.kind {
            IoType::Read | IoType::Write => {
                // SAFETY: the iovecs are valid until the completion below.
                for v in unsafe { d.iovecs() } {
                    // SAFETY: as above; each iovec is iov_len bytes.
                    let s =
                        unsafe { std::slice::from_raw_parts_mut(v.iov_base as *mut u8, v.iov_len) };
                    if d.kind == IoType::Read {
                        s.copy_from_slice(&mem[pos..pos + v.iov_len]);
                    } else {
                        mem[pos..pos + v.iov_len].copy_from_slice(s);
                    }
                    pos += v.iov_len;
                }
                Ok(())
            }
            IoType::CompareAndWrite => CawChannel::caw(&mut mem[pos..pos + len], &io, len),
            IoType::Unmap | IoType::WriteZeroes => {
                mem[pos..pos + len].fill(0);
                Ok(())
            }
            _ => Ok(()),
        };
        drop(mem);
        io.complete(r);
    }
}

impl Bdev for CawBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, _t: IoType) -> bool {
        true
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        Ok(Box::new(CawChannel(self.mem.clone())))
    }
    fn config_json(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

/// The test target: namespace 1 is malloc (no native compare-and-write),
/// namespace 2 a [`CawBdev`].
fn fused_env() -> Env {
    let e = env();
    let info = BdevInfo {
        name: "Caw0".into(),
        uuid: uuid::Uuid::new_v4(),
        product_name: "Compare-and-write disk".into(),
        module: "caw",
        block_size: 512,
        num_blocks: BLOCKS,
        required_alignment: 1,
        max_transfer_blocks: 0,
        optimal_boundary_blocks: 0,
        write_cache: false,
        unmap_reads_zero: true,
        memory_resident: true,
    };
    let mem = Arc::new(Mutex::new(vec![0; BLOCKS as usize * 512]));
    e.registry
        .register(Arc::new(CawBdev { info, mem }))
        .unwrap();
    e.target
        .nvmf_subsystem_add_ns(&AddNsParams {
            nqn: NQN.into(),
            namespace: NamespaceParams {
                bdev_name: "Caw0".into(),
                nsid: 2,
                uuid: None,
                nguid: None,
            },
        })
        .unwrap();
    e
}

/// An in-capsule command of `nlb` blocks at `slba` of namespace `nsid`.
fn io_sqe(op: u8, nsid: u32, slba: u64, nlb: u32, fuse: u8) -> Sqe {
    let mut s = Client::rw_sqe(op, slba, nlb, true);
    s.set_nsid(nsid).set_fuse(fuse);
    s
}

/// Sends a command without waiting; its CID.
fn send(q: &mut Client, mut sqe: Sqe, data: &[u8]) -> u16 {
    let cid = q.next_cid();
    sqe.set_cid(cid).set_sgl_psdt();
    q.send_cmd(&sqe, data);
    cid
}

/// The next `n` responses by CID (their order is not promised).
fn answers(q: &mut Client, n: usize) -> HashMap<u16, Status> {
    let mut m = HashMap::new();
    for _ in 0..n {
        let p = q.recv().expect("pdu");
        assert_eq!(p.ty, PduType::CapsuleResp as u8, "{p:?}");
        let c = p.cqe();
        assert!(m.insert(c.cid, c.status()).is_none(), "cid {} twice", c.cid);
    }
    m
}

/// The two answers of fused pair (`first`, `second`): the first's comes
/// first, whoever ran the pair (SPDK's bdev_nvme takes the first
/// completion of a pair for the Compare's); their statuses.
fn pair_answers(q: &mut Client, first: u16, second: u16) -> (Status, Status) {
    let mut got = Vec::new();
    for _ in 0..2 {
        let p = q.recv().expect("pdu");
        assert_eq!(p.ty, PduType::CapsuleResp as u8, "{p:?}");
        got.push((p.cqe().cid, p.cqe().status()));
    }
    assert_eq!((got[0].0, got[1].0), (first, second), "answer order");
    (got[0].1, got[1].1)
}

/// Sends Compare `cmp` (first) and Write `new` (second) fused; their
/// statuses.
fn fused(q: &mut Client, nsid: u32, slba: (u64, u64), cmp: &[u8], new: &[u8]) -> (Status, Status) {
    let nlb = (cmp.len() / 512) as u32;
    let a = send(q, io_sqe(io::COMPARE, nsid, slba.0, nlb, 1), cmp);
    let b = send(q, io_sqe(io::WRITE, nsid, slba.1, nlb, 2), new);
    pair_answers(q, a, b)
}

fn read(q: &mut Client, nsid: u32, slba: u64, nlb: u32) -> Vec<u8> {
    let mut s = Client::rw_sqe(io::READ, slba, nlb, false);
    s.set_nsid(nsid);
    let (d, c) = q.cmd(&mut s, &[]);
    assert!(c.status().is_success(), "{}", c.status());
    d
}

fn write(q: &mut Client, nsid: u32, slba: u64, data: &[u8]) {
    let mut s = io_sqe(io::WRITE, nsid, slba, (data.len() / 512) as u32, 0);
    let c = q.cmd(&mut s, data).1;
    assert!(c.status().is_success(), "{}", c.status());
}

#[test]
fn fused_compare_and_write_runs_atomically_and_answers_per_spec() {
    let e = fused_env();
    let (mut a, cntlid) = Client::admin(e.port, Digests::default());
    let mut id = Sqe::default();
    id.set_opcode(admin::IDENTIFY)
        .set_cdw(10, 1)
        .set_sgl(SglDesc::transport(4096));
    let (d, c) = a.cmd(&mut id, &[]);
    assert!(c.status().is_success());
    assert_eq!(u16::from_le_bytes([d[522], d[523]]) & 1, 1, "FUSES");
    assert_eq!(u16::from_le_bytes([d[532], d[533]]), 0, "ACWU: one block");

    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    let (old, new, other) = (pattern(1024, 1), pattern(1024, 2), pattern(1024, 3));
    write(&mut q, 2, 5, &old);

    // A match writes.
    let ok = (Status::SUCCESS, Status::SUCCESS);
    assert_eq!(fused(&mut q, 2, (5, 5), &old, &new), ok);
    assert_eq!(read(&mut q, 2, 5, 2), new);

    // A miscompare writes nothing.
    let miscompare = (Status::COMPARE_FAILURE, Status::ABORTED_FAILED_FUSED);
    assert_eq!(fused(&mut q, 2, (5, 5), &old, &other), miscompare);
    assert_eq!(read(&mut q, 2, 5, 2), new);

    // Ranges that differ: Invalid Field, nothing written at either.
    let mismatch = (Status::INVALID_FIELD, Status::ABORTED_FAILED_FUSED);
    assert_eq!(fused(&mut q, 2, (5, 6), &new, &other), mismatch);
    assert_eq!(read(&mut q, 2, 5, 3)[..1024], new[..]);
    assert_eq!(read(&mut q, 2, 6, 2)[..512], new[512..]);

    // A first without its second: Missing Fused; the command after it runs.
    let f = send(&mut q, io_sqe(io::COMPARE, 2, 5, 2, 1), &new);
    let w = send(&mut q, io_sqe(io::WRITE, 2, 20, 2, 0), &other);
    let m = answers(&mut q, 2);
    assert_eq!(
        (m[&f], m[&w]),
        (Status::ABORTED_MISSING_FUSED, Status::SUCCESS)
    );
    assert_eq!(read(&mut q, 2, 20, 2), other);

    // A second without its first: Missing Fused, nothing written.
    let s = send(&mut q, io_sqe(io::WRITE, 2, 5, 2, 2), &other);
    assert_eq!(answers(&mut q, 1)[&s], Status::ABORTED_MISSING_FUSED);
    assert_eq!(read(&mut q, 2, 5, 2), new);

    // Only Compare + Write fuse: a fused Read is refused, and the Write
    // after it finds no first.
    let r = send(&mut q, io_sqe(io::READ, 2, 5, 2, 1), &[]);
    let s = send(&mut q, io_sqe(io::WRITE, 2, 5, 2, 2), &other);
    let m = answers(&mut q, 2);
    assert_eq!(
        (m[&r], m[&s]),
        (Status::INVALID_FIELD, Status::ABORTED_MISSING_FUSED)
    );
    assert_eq!(read(&mut q, 2, 5, 2), new);

    // Malloc has no native compare-and-write: Invalid Field, even on a
    // match, and its data stays.
    write(&mut q, 1, 5, &old);
    assert_eq!(fused(&mut q, 1, (5, 5), &old, &new), mismatch);
    assert_eq!(read(&mut q, 1, 5, 2), old);

    // The queue goes on as before: another matching pair writes.
    assert_eq!(fused(&mut q, 2, (5, 5), &new, &other), ok);
    assert_eq!(read(&mut q, 2, 5, 2), other);
}

/// Sends a fused half whose data goes by R2T; its CID and the R2T's tag.
fn send_r2t(q: &mut Client, op: u8, slba: u64, nlb: u32, fuse: u8) -> (u16, u16) {
    let mut s = Client::rw_sqe(op, slba, nlb, false);
    s.set_nsid(2).set_fuse(fuse);
    let cid = send(q, s, &[]);
    let p = q.recv().expect("pdu");
    assert_eq!(p.ty, PduType::R2T as u8, "{p:?}");
    let r = DataHdr::decode(&p.hdr).unwrap();
    assert_eq!((r.cccid, r.offset, r.length), (cid, 0, nlb * 512));
    (cid, r.ttag)
}

/// Either half may be complete first (its data in the capsule, the
/// other's still due after an R2T): the pair runs once both are in. A
/// queue closed with a half waiting for its partner still goes away.
#[test]
fn halves_pair_whichever_is_complete_first_and_a_closed_queue_ends() {
    let e = fused_env();
    let (_a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    let (d1, d2, d3) = (pattern(2048, 7), pattern(2048, 8), pattern(2048, 9));
    write(&mut q, 2, 40, &d1);

    // The Write's data comes after the Compare's worker has it.
    let c = send(&mut q, io_sqe(io::COMPARE, 2, 40, 4, 1), &d1);
    let (w, tag) = send_r2t(&mut q, io::WRITE, 40, 4, 2);
    q.send_h2c(w, tag, 0, &d2, true);
    assert_eq!(
        pair_answers(&mut q, c, w),
        (Status::SUCCESS, Status::SUCCESS)
    );
    assert_eq!(read(&mut q, 2, 40, 4), d2);

    // The Compare's data comes after the Write's worker has it; it differs.
    let (c, tag) = send_r2t(&mut q, io::COMPARE, 40, 4, 1);
    let w = send(&mut q, io_sqe(io::WRITE, 2, 40, 4, 2), &d3);
    q.send_h2c(c, tag, 0, &d1, true);
    assert_eq!(
        pair_answers(&mut q, c, w),
        (Status::COMPARE_FAILURE, Status::ABORTED_FAILED_FUSED)
    );
    assert_eq!(read(&mut q, 2, 40, 4), d2);

    // Queue 2 closes with a Compare waiting for its Write (whose data is
    // due): the queue goes away (its worker does not wait forever) and
    // nothing was written.
    let mut q2 = Client::io_queue(e.port, Digests::default(), cntlid, 2);
    send(&mut q2, io_sqe(io::COMPARE, 2, 40, 4, 1), &d2);
    send_r2t(&mut q2, io::WRITE, 40, 4, 2);
    let io_queues = || {
        let st = e.target.nvmf_get_stats().unwrap();
        st.poll_groups
            .iter()
            .map(|g| g.current_io_qpairs)
            .sum::<u64>()
    };
    assert_eq!(io_queues(), 2);
    drop(q2);
    testkit::wait_until(
        "the closed queue is gone",
        std::time::Duration::from_secs(10),
        || io_queues() == 1,
    );
    assert_eq!(read(&mut q, 2, 40, 4), d2);
}

//! Abort and controller reset / shutdown over raw TCP: an Abort reaches a
//! write that waits for its R2T data on an I/O queue (another reactor than
//! the admin queue's, round robin), or a capsule waiting for a command
//! slot, and completes it with Command Abort Requested; CC.EN = 0 and CC.SHN disconnect the I/O queues, CSTS reports
//! the end, no pool buffer is left behind, and the controller enables again
//! and takes new I/O queues.

mod common;

use std::time::Duration;

use common::*;
use ustor_nvme::wire::*;

/// Free buffers per size class on every reactor (the pool's own view).
fn pool_free(e: &Env) -> Vec<usize> {
    e.rt.handle()
        .call_all(|_| {
            ustor_runtime::buf::pool_usage()
                .map(|(classes, _)| classes.iter().map(|c| c.1).sum::<usize>())
                .unwrap_or(0)
        })
        .unwrap()
}

fn abort_sqe(sqid: u16, cid: u16) -> Sqe {
    let mut s = Sqe::default();
    s.set_opcode(admin::ABORT)
        .set_cdw(10, u32::from(sqid) | u32::from(cid) << 16);
    s
}

/// Polls until `f` holds (bounded).
#[track_caller]
fn eventually(what: &str, f: impl FnMut() -> bool) {
    testkit::wait_until(what, Duration::from_secs(5), f);
}

/// Capsules the target has taken off its sockets (counted before one waits
/// for a command slot).
fn commands(e: &Env) -> u64 {
    let st = e.target.nvmf_get_stats().unwrap();
    st.poll_groups.iter().map(|g| g.commands).sum()
}

#[test]
fn abort_completes_a_write_waiting_for_its_data() {
    let e = env();
    let free0 = pool_free(&e);
    let (mut a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    // 16 KiB > in-capsule size: the target answers with an R2T and waits.
    let mut w = Client::rw_sqe(io::WRITE, 64, 32, false);
    w.set_cid(42).set_sgl_psdt();
    q.send_cmd(&w, &[]);
    let r = q.recv().unwrap();
    assert_eq!(r.ty, PduType::R2T as u8, "{r:?}");
    let (_, c) = a.cmd(&mut abort_sqe(1, 42), &[]);
    assert!(c.status().is_success());
    assert_eq!(c.dw0 & 1, 0, "the waiting write must be aborted");
    let c = q.wait(42).1;
    assert_eq!(c.status(), Status::ABORT_REQUESTED);
    // Nothing was written.
    assert_eq!(q.read(64, 32).0, vec![0; 16384]);
    // A command that already completed, an unknown CID, an unknown queue:
    // not aborted.
    for (sqid, cid) in [(1, 42), (1, 999), (9, 1)] {
        let (_, c) = a.cmd(&mut abort_sqe(sqid, cid), &[]);
        assert!(c.status().is_success());
        assert_eq!(c.dw0 & 1, 1, "sqid {sqid} cid {cid}");
    }
    // The CID and the slot are reusable; the queue still works.
    let data = pattern(16384, 5);
    assert!(q.write_r2t(64, &data).status().is_success());
    assert_eq!(q.read(64, 32).0, data);
    let st = e.target.nvmf_get_stats().unwrap();
    assert_eq!(st.poll_groups.iter().map(|g| g.aborted).sum::<u64>(), 1);
    drop(q);
    drop(a);
    eventually("connections closed", || e.target.connections() == 0);
    eventually("pool buffers back", || pool_free(&e) == free0);
}

/// A host beyond the target's command slots (128 + AERs + 1 = 133 per
/// queue): the next capsule waits for a slot; aborting it marks it, and
/// when a slot frees up it completes with Command Abort Requested without
/// reaching the bdev.
#[test]
fn abort_reaches_a_command_waiting_for_a_slot() {
    const SLOTS: u16 = 133;
    let e = env();
    let free0 = pool_free(&e);
    let (mut a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    // Every slot held by a one-block write waiting for its R2T data.
    for i in 0..SLOTS {
        let mut w = Client::rw_sqe(io::WRITE, u64::from(i), 1, false);
        w.set_cid(100 + i).set_sgl_psdt();
        q.send_cmd(&w, &[]);
    }
    let mut ttag = vec![0u16; SLOTS as usize];
    for _ in 0..SLOTS {
        let p = q.recv().unwrap();
        assert_eq!(p.ty, PduType::R2T as u8);
        let h = DataHdr::decode(&p.hdr).unwrap();
        ttag[usize::from(h.cccid - 100)] = h.ttag;
    }
    let mut r = Client::rw_sqe(io::READ, 0, 1, false);
    r.set_cid(999).set_sgl_psdt();
    let before = commands(&e);
    q.send_cmd(&r, &[]);
    // The receiver parks the read until a slot frees; abort it there.
    eventually("the read to wait for a command slot", || {
        commands(&e) > before
    });
    let (_, c) = a.cmd(&mut abort_sqe(1, 999), &[]);
    assert_eq!(c.dw0 & 1, 0, "a command waiting for a slot must be aborted");
    // Abort one write: its slot goes to the read, which ends aborted.
    let (_, c) = a.cmd(&mut abort_sqe(1, 100), &[]);
    assert_eq!(c.dw0 & 1, 0);
    let mut got = Vec::new();
    for _ in 0..2 {
        let c = q.recv().unwrap().cqe();
        assert_eq!(c.status(), Status::ABORT_REQUESTED, "cid {}", c.cid);
        got.push(c.cid);
    }
    got.sort_unstable();
    assert_eq!(got, [100, 999]);
    // The rest complete normally once their data arrives.
    for i in 1..SLOTS {
        q.send_h2c(100 + i, ttag[usize::from(i)], 0, &[i as u8; 512], true);
    }
    for _ in 1..SLOTS {
        assert!(q.recv().unwrap().cqe().status().is_success());
    }
    assert_eq!(q.read(5, 1).0, vec![5u8; 512]);
    drop((q, a));
    eventually("connections closed", || e.target.connections() == 0);
    eventually("pool buffers back", || pool_free(&e) == free0);
}

#[test]
fn reset_disconnects_io_queues_and_enables_again() {
    let e = env();
    let free0 = pool_free(&e);
    let (mut a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q1 = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    let mut q2 = Client::io_queue(e.port, Digests::default(), cntlid, 2);
    let data = pattern(4096, 8);
    let mut w = Client::rw_sqe(io::WRITE, 0, 8, true);
    assert!(q1.cmd(&mut w, &data).1.status().is_success());
    // q2 holds a pool buffer: a write waiting for its R2T data.
    let mut w = Client::rw_sqe(io::WRITE, 64, 32, false);
    w.set_cid(7).set_sgl_psdt();
    q2.send_cmd(&w, &[]);
    assert_eq!(q2.recv().unwrap().ty, PduType::R2T as u8);

    // CC.EN = 0: both I/O queues see EOF, RDY goes to 0.
    let cc = a.prop_get(prop::CC, false);
    a.prop_set(prop::CC, cc & !1);
    for q in [&mut q1, &mut q2] {
        q.s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert!(q.recv().is_err(), "I/O queue must be disconnected");
    }
    eventually("CSTS.RDY = 0", || a.prop_get(prop::CSTS, false) & 1 == 0);
    // Disabled: an I/O queue connect is refused.
    let mut r = Client::connect_raw(e.port, Digests::default());
    assert_eq!(
        r.fabrics_connect(1, cntlid, NQN, HOSTNQN).status(),
        Status::COMMAND_SEQUENCE
    );
    drop(r);

    // Enable again: the same queue ids connect and serve I/O.
    a.prop_set(prop::CC, cc | 1);
    eventually("CSTS.RDY = 1", || a.prop_get(prop::CSTS, false) & 1 == 1);
    let mut q1 = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    let q2b = Client::io_queue(e.port, Digests::default(), cntlid, 2);
    assert_eq!(q1.read(0, 8).0, data);

    // Shutdown (CC.SHN = 01b): queues go, SHST = complete.
    a.prop_set(prop::CC, cc | 1 | 1 << 14);
    q1.s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(q1.recv().is_err(), "I/O queue must be disconnected");
    eventually("CSTS.SHST = complete", || {
        (a.prop_get(prop::CSTS, false) >> 2) & 3 == 2
    });
    let mut r = Client::connect_raw(e.port, Digests::default());
    assert_eq!(
        r.fabrics_connect(1, cntlid, NQN, HOSTNQN).status(),
        Status::COMMAND_SEQUENCE
    );
    // Reset after shutdown, then enable: usable again.
    a.prop_set(prop::CC, cc & !1);
    eventually("CSTS after reset", || {
        a.prop_get(prop::CSTS, false) & 0xd == 0
    });
    a.prop_set(prop::CC, cc | 1);
    eventually("CSTS.RDY = 1", || a.prop_get(prop::CSTS, false) & 1 == 1);
    let mut q1 = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    assert_eq!(q1.read(0, 8).0, data);

    drop((q1, q2, q2b, r, a));
    eventually("connections closed", || e.target.connections() == 0);
    eventually("pool buffers back", || pool_free(&e) == free0);
}

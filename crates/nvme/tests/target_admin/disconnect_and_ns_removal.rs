//! Fabrics Disconnect and namespace removal while hosts are connected.

use super::*;

// ---------------------------------------------------------------------
// 4. Fabrics Disconnect
// ---------------------------------------------------------------------

fn disconnect_sqe() -> Sqe {
    let mut d = Sqe::default();
    d.set_opcode(admin::FABRICS).set_fctype(fctype::DISCONNECT);
    d
}

/// Disconnect (FCTYPE 08h) on an I/O queue: success (SQID 1); once the
/// host closes the connection the queue id is free again; the admin queue
/// and the other I/O queues never notice.
#[test]
fn disconnect_io_queue() {
    let e = env();
    let (mut a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q1 = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    let mut q2 = Client::io_queue(e.port, Digests::default(), cntlid, 2);
    let data = pattern(4096, 4);
    assert_eq!(write_incapsule(&mut q1, 16, &data), Status::SUCCESS);
    assert_eq!(e.target.connections(), 3);
    let (_, c) = q1.cmd(&mut disconnect_sqe(), &[]);
    assert!(c.status().is_success(), "{}", c.status());
    assert_eq!(c.sqid, 1);
    drop(q1);
    eventually("I/O queue 1 gone", || e.target.connections() == 2);
    // The admin queue still works.
    assert_eq!(keep_alive(&mut a), Status::SUCCESS);
    let (id, c) = identify(&mut a, 1, 0, 0);
    assert!(c.status().is_success());
    assert_eq!(le16(&id, 78), cntlid);
    // So does queue 2; queue id 1 can be connected again.
    assert_eq!(q2.read(16, 8).0, data);
    let mut q1 = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    assert_eq!(q1.read(16, 8).0, data);
}

/// After completing a Disconnect the target ends the queue itself (NVMe-oF
/// deletes the I/O queue the command was submitted on): the sender shuts
/// the socket down once the response is out, which ends the receiver's
/// pending receive, so QID 1 is free for a new Connect without waiting for
/// the host to close its socket, and the old socket sees EOF.
#[test]
fn disconnect_ends_the_queue_without_host_close() {
    let e = env();
    let (_a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q1 = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    let (_, c) = q1.cmd(&mut disconnect_sqe(), &[]);
    assert!(c.status().is_success());
    // The queue id is free without the host closing its socket.
    eventually("I/O queue 1 gone", || e.target.connections() == 1);
    let mut again = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    assert!(again.read(0, 1).1.status().is_success());
    expect_closed(&mut q1);
}

// ---------------------------------------------------------------------
// 5. Namespace removal
// ---------------------------------------------------------------------

/// `nvmf_subsystem_remove_ns`: a parked AER completes with Notice /
/// Namespace Attribute Changed / log 04h; the Changed Namespace List names
/// the NSID; the NSID leaves the active list; I/O to it fails with Invalid
/// Namespace or Format. Adding it back raises the next event.
#[test]
fn remove_ns_raises_event_and_fails_io() {
    let e = env();
    let (mut a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    assert!(set_feature(&mut a, FID_ASYNC_EVENT, 1 << 8)
        .status()
        .is_success());
    assert_eq!(
        write_incapsule(&mut q, 0, &pattern(512, 2)),
        Status::SUCCESS
    );
    post_aer(&mut a, 900);
    expect_quiet(&mut a, 50);
    e.target
        .nvmf_subsystem_remove_ns(&RemoveNsParams {
            nqn: NQN.into(),
            nsid: 1,
        })
        .unwrap();
    let c = a.wait(900).1;
    assert!(c.status().is_success());
    assert_eq!(c.dw0, AEN_NS_ATTR_CHANGED);
    assert_eq!(c.dw0 & 7, 2, "type: Notice");
    assert_eq!((c.dw0 >> 8) & 0xff, 0, "info: Namespace Attribute Changed");
    assert_eq!((c.dw0 >> 16) & 0xff, 4, "log page 04h");
    let (d, _) = get_log(&mut a, LID_CHANGED_NS, 4096, 0, false);
    assert_eq!((le32(&d, 0), le32(&d, 4)), (1, 0));
    let (d, _) = identify(&mut a, 2, 0, 0);
    assert_eq!(le32(&d, 0), 0, "active list must be empty");
    let (d, c) = identify(&mut a, 0, 1, 0);
    assert!(c.status().is_success());
    assert_zero(&d, "inactive NSID reads as zeroes");
    assert_eq!(q.read(0, 1).1.status(), Status::INVALID_NAMESPACE);
    assert_eq!(
        write_incapsule(&mut q, 0, &[1; 512]),
        Status::INVALID_NAMESPACE
    );
    let mut f = Sqe::default();
    f.set_opcode(io::FLUSH).set_nsid(1);
    assert_eq!(q.cmd(&mut f, &[]).1.status(), Status::INVALID_NAMESPACE);
    // Removing it again is an error of the control function.
    assert!(e
        .target
        .nvmf_subsystem_remove_ns(&RemoveNsParams {
            nqn: NQN.into(),
            nsid: 1,
        })
        .is_err());

    // The claim was released: the bdev goes back as NSID 1, the next AER
    // reports it, and I/O works with the old data.
    post_aer(&mut a, 901);
    add_ns(&e, NQN, "Malloc0", 1);
    assert_eq!(a.wait(901).1.dw0, AEN_NS_ATTR_CHANGED);
    let (d, _) = get_log(&mut a, LID_CHANGED_NS, 4096, 0, false);
    assert_eq!((le32(&d, 0), le32(&d, 4)), (1, 0));
    assert_eq!(q.read(0, 1).0, pattern(512, 2));
}

/// NVMe Base 1.4 5.2: "When the controller posts a completion queue entry
/// for an outstanding Asynchronous Event Request command and thus reports
/// an asynchronous event, subsequent events of that event type are
/// automatically masked by the controller until the host clears that
/// event. An event is cleared by reading the log page associated with that
/// event using a Get Log Page command with RAE cleared to 0". SPDK masks
/// (nvmf_ctrlr_mask_aen / unmask in nvmf_get_changed_ns_list_log_page), as
/// does Linux nvmet (aen_masked).
#[test]
fn ns_change_events_are_masked_until_log_read() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    assert!(set_feature(&mut a, FID_ASYNC_EVENT, 1 << 8)
        .status()
        .is_success());
    malloc(&e, "Malloc1", 2048);
    malloc(&e, "Malloc2", 2048);
    malloc(&e, "Malloc3", 2048);
    post_aer(&mut a, 910);
    post_aer(&mut a, 911);
    add_ns(&e, NQN, "Malloc1", 2);
    // Which parked AER carries the event is the controller's choice (the
    // spec names none; SPDK takes the newest): one of the two completes.
    let c = a.recv().unwrap().cqe();
    assert!(matches!(c.cid, 910 | 911), "cid {}", c.cid);
    assert_eq!(c.dw0, AEN_NS_ATTR_CHANGED);
    let other = 910 + 911 - c.cid;
    // Masked: no completion for the second change.
    add_ns(&e, NQN, "Malloc2", 3);
    expect_quiet(&mut a, 200);
    // Reading with RAE = 1 keeps it masked.
    get_log(&mut a, LID_CHANGED_NS, 4096, 0, true);
    add_ns(&e, NQN, "Malloc3", 4);
    expect_quiet(&mut a, 200);
    // RAE = 0 clears it; the next change is reported. The list holds what
    // changed since the last (RAE = 1) read: NSID 4 alone.
    let (d, _) = get_log(&mut a, LID_CHANGED_NS, 4096, 0, false);
    assert_eq!((le32(&d, 0), le32(&d, 4)), (4, 0));
    e.target
        .nvmf_subsystem_remove_ns(&RemoveNsParams {
            nqn: NQN.into(),
            nsid: 4,
        })
        .unwrap();
    assert_eq!(a.wait(other).1.dw0, AEN_NS_ATTR_CHANGED);
}

/// With the namespace notice disabled in Async Event Configuration, a
/// change raises no AER but still lands in the Changed Namespace List.
#[test]
fn ns_change_without_aec_raises_no_event() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    post_aer(&mut a, 920);
    malloc(&e, "Malloc1", 2048);
    add_ns(&e, NQN, "Malloc1", 2);
    expect_quiet(&mut a, 150);
    let (d, _) = get_log(&mut a, LID_CHANGED_NS, 4096, 0, false);
    assert_eq!((le32(&d, 0), le32(&d, 4)), (2, 0));
    assert_eq!(keep_alive(&mut a), Status::SUCCESS);
}

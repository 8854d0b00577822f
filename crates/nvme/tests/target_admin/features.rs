//! Get / Set Features: Number of Queues, KATO, Async Event Config, VWC, error recovery, write atomicity.

use super::*;

// ---------------------------------------------------------------------
// 1. Get / Set Features
// ---------------------------------------------------------------------

/// Number of Queues (07h): DW0 of Set and Get carries NSQA (15:0) and NCQA
/// (31:16), both 0's based; before any Set it reports the controller's
/// default; 0xFFFF is invalid; the grant bounds the I/O queue ids a
/// Connect may use.
#[test]
fn features_number_of_queues() {
    let e = env();
    let (mut a, cntlid) = admin_as(e.port, NQN, HOSTNQN);
    // Default: max_io_qpairs_per_ctrlr (127) queues, 0's based.
    let c = get_feature(&mut a, FID_NUM_QUEUES);
    assert!(c.status().is_success());
    assert_eq!(c.dw0, 126 | 126 << 16);
    // NSQR = 3 (4 SQs), NCQR = 1 (2 CQs): the target grants the same number
    // of each, at least what was asked.
    let c = set_feature(&mut a, FID_NUM_QUEUES, 3 | 1 << 16);
    assert!(c.status().is_success());
    let (nsqa, ncqa) = (c.dw0 & 0xffff, c.dw0 >> 16);
    assert!(nsqa >= 3 && ncqa >= 1, "{:#x}", c.dw0);
    assert_eq!(c.dw0, 3 | 3 << 16);
    let g = get_feature(&mut a, FID_NUM_QUEUES);
    assert!(g.status().is_success());
    assert_eq!(g.dw0, c.dw0, "Get must report what Set granted");
    // 65535 queues (0xFFFF, 0's based) is invalid.
    for v in [0xffff, 0xffff << 16] {
        assert_eq!(
            set_feature(&mut a, FID_NUM_QUEUES, v).status(),
            Status::INVALID_FIELD
        );
    }
    assert_eq!(get_feature(&mut a, FID_NUM_QUEUES).dw0, 3 | 3 << 16);
    // The grant is the limit for I/O queue ids: 4 is fine, 5 is refused
    // with Connect Invalid Parameters naming the QID (command, offset 42).
    let _q4 = io_as(e.port, NQN, HOSTNQN, cntlid, 4);
    let mut q = Client::connect_raw(e.port, Digests::default());
    let r = q.fabrics_connect(5, cntlid, NQN, HOSTNQN);
    assert_eq!(r.status(), Status::CONNECT_INVALID_PARAM);
    assert_eq!(r.dw0, 42 << 16, "IATTR 0 (command), IPO 42 (QID)");
}

/// Asking for more queues than the transport allows grants its limit.
#[test]
fn features_number_of_queues_capped_by_transport() {
    let e = env();
    let (mut a, _) = admin_as(e.port, NQN, HOSTNQN);
    let c = set_feature(&mut a, FID_NUM_QUEUES, 999 | 999 << 16);
    assert!(c.status().is_success());
    assert_eq!(c.dw0, 126 | 126 << 16);
    assert_eq!(get_feature(&mut a, FID_NUM_QUEUES).dw0, 126 | 126 << 16);
}

/// NVMe Base 1.4 5.21.1.7: Number of Queues "shall only be issued during
/// initialization prior to creation of any I/O Submission and/or
/// Completion Queues"; if issued after, "the Set Features command shall
/// abort with status Command Sequence Error". SPDK does so (ctrlr.c
/// nvmf_ctrlr_set_features_number_of_queues, "Queue pairs already active").
#[test]
fn features_number_of_queues_after_io_queues_is_a_sequence_error() {
    let e = env();
    let (mut a, cntlid) = Client::admin(e.port, Digests::default());
    let _q = Client::io_queue(e.port, Digests::default(), cntlid, 2);
    let c = set_feature(&mut a, FID_NUM_QUEUES, 0);
    assert_eq!(c.status(), Status::COMMAND_SEQUENCE);
    assert_eq!(get_feature(&mut a, FID_NUM_QUEUES).dw0, 15 | 15 << 16);
}

/// Keep Alive Timer (0Fh): Get reports the KATO from Connect, then what a
/// Set Features chose, rounded up to the KAS granularity (Identify
/// Controller KAS, bytes 321:320, in 100 ms units: 10 = 1 s).
#[test]
fn features_keep_alive_timer() {
    let e = env();
    let (mut a, _) = admin_as(e.port, NQN, HOSTNQN);
    let (id, _) = identify(&mut a, 1, 0, 0);
    assert_eq!(le16(&id, 320), 10, "KAS");
    // Client::fabrics_connect asks for 10 000 ms.
    let c = get_feature(&mut a, FID_KATO);
    assert!(c.status().is_success());
    assert_eq!(c.dw0, 10_000);
    for (set, want) in [(2_500, 3_000), (4_000, 4_000), (1, 1_000), (0, 0)] {
        assert!(set_feature(&mut a, FID_KATO, set).status().is_success());
        assert_eq!(get_feature(&mut a, FID_KATO).dw0, want, "set {set}");
    }
    // KATO 0 disables the timer: still alive after more than a second
    // without commands (the sleep is that idle second, not a wait).
    std::thread::sleep(Duration::from_millis(1300));
    assert_eq!(keep_alive(&mut a), Status::SUCCESS);
}

/// Asynchronous Event Configuration (0Bh): what Set stored is what Get
/// returns; Identify OAES (bytes 95:92) advertises bit 8 (namespace
/// attribute notices).
#[test]
fn features_async_event_config_and_vwc() {
    let e = env();
    let (mut a, _) = admin_as(e.port, NQN, HOSTNQN);
    let (id, _) = identify(&mut a, 1, 0, 0);
    assert_eq!(le32(&id, 92) & 1 << 8, 1 << 8, "OAES.NSAN");
    assert_eq!(id[525] & 1, 1, "VWC present");
    assert_eq!(get_feature(&mut a, FID_ASYNC_EVENT).dw0, 0);
    assert!(set_feature(&mut a, FID_ASYNC_EVENT, 1 << 8)
        .status()
        .is_success());
    let c = get_feature(&mut a, FID_ASYNC_EVENT);
    assert!(c.status().is_success());
    assert_eq!(c.dw0, 1 << 8);
    assert!(set_feature(&mut a, FID_ASYNC_EVENT, 0)
        .status()
        .is_success());
    assert_eq!(get_feature(&mut a, FID_ASYNC_EVENT).dw0, 0);

    // Volatile Write Cache (06h): DW0 bit 0 = WCE. Enabled by default.
    let c = get_feature(&mut a, FID_VWC);
    assert!(c.status().is_success());
    assert_eq!(c.dw0, 1);
    for wce in [0, 1, 0] {
        assert!(set_feature(&mut a, FID_VWC, wce).status().is_success());
        assert_eq!(get_feature(&mut a, FID_VWC).dw0, wce);
    }
    // Save (CDW10 bit 31) is not supported: Feature Identifier Not Saveable.
    let mut s = Sqe::default();
    s.set_opcode(admin::SET_FEATURES)
        .set_cdw(10, u32::from(FID_VWC) | 1 << 31)
        .set_cdw(11, 1);
    assert_eq!(a.cmd(&mut s, &[]).1.status(), Status::FEATURE_NOT_SAVEABLE);
    assert_eq!(
        get_feature(&mut a, FID_VWC).dw0,
        0,
        "refused Set changed it"
    );
    // An unknown feature.
    assert_eq!(get_feature(&mut a, 0x7e).status(), Status::INVALID_FIELD);
    assert!(get_feature(&mut a, FID_ARBITRATION).status().is_success());
}

/// NVMe Base 1.3/1.4 "Feature Identifiers": Error Recovery (05h) and Write
/// Atomicity Normal (0Ah) are Mandatory. SPDK's target implements both
/// (ctrlr.c nvmf_ctrlr_get_features: ERROR_RECOVERY, WRITE_ATOMICITY).
#[test]
fn features_mandatory_error_recovery_and_write_atomicity() {
    let e = env();
    let (mut a, _) = admin_as(e.port, NQN, HOSTNQN);
    for fid in [FID_ERROR_RECOVERY, FID_WRITE_ATOMICITY] {
        let c = get_feature(&mut a, fid);
        assert!(c.status().is_success(), "FID {fid:#x}: {}", c.status());
        assert_eq!(c.dw0, 0, "FID {fid:#x}");
        assert!(set_feature(&mut a, fid, 0).status().is_success());
    }
}

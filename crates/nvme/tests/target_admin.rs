//! Admin and control paths of the target over raw TCP, checked byte by byte
//! against the NVMe Base (1.3/1.4/2.0) and NVMe-oF specifications: Get/Set
//! Features (Number of Queues, KATO, Async Event Config, VWC), Get Log Page
//! (supported pages, error, SMART, changed namespaces; NUMD and offsets),
//! Identify (NS descriptors, CSI-specific CNS, active NS lists), Fabrics
//! Disconnect, namespace and host removal, discovery filtering by host,
//! Connect checks, Dataset Management and PDUs received in small pieces.

mod common;

use std::io::Write;
use std::time::Duration;

use common::*;
use ustor_nvme::nvmf::{
    AddNsParams, CreateSubsystemParams, HostParams, ListenAddress, ListenerParams, NamespaceParams,
    RemoveNsParams,
};
use ustor_nvme::wire::*;

const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:0000000a-0000-0000-0000-00000000000a";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:0000000b-0000-0000-0000-00000000000b";
const NQN2: &str = "nqn.2024-01.io.ustor:second";

const DG: Digests = Digests {
    header: true,
    data: true,
};

// Feature identifiers (NVMe Base, "Feature Identifiers").
const FID_ARBITRATION: u8 = 0x01;
const FID_ERROR_RECOVERY: u8 = 0x05;
const FID_VWC: u8 = 0x06;
const FID_NUM_QUEUES: u8 = 0x07;
const FID_WRITE_ATOMICITY: u8 = 0x0a;
const FID_ASYNC_EVENT: u8 = 0x0b;
const FID_KATO: u8 = 0x0f;

// Log page identifiers.
const LID_SUPPORTED: u8 = 0x00;
const LID_ERROR: u8 = 0x01;
const LID_SMART: u8 = 0x02;
const LID_CHANGED_NS: u8 = 0x04;
const LID_DISCOVERY: u8 = 0x70;

/// AER completion DW0 for Notice (type 2) / Namespace Attribute Changed
/// (info 00h) / log page 04h.
const AEN_NS_ATTR_CHANGED: u32 = 0x0004_0002;

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
}
fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}
fn le128(b: &[u8], at: usize) -> u128 {
    u128::from_le_bytes(b[at..at + 16].try_into().unwrap())
}

fn assert_zero(d: &[u8], what: &str) {
    if let Some(i) = d.iter().position(|b| *b != 0) {
        panic!("{what}: byte {i} of {} is {:#x}", d.len(), d[i]);
    }
}

/// Polls until `f` holds (bounded).
#[track_caller]
fn eventually(what: &str, f: impl FnMut() -> bool) {
    testkit::wait_until(what, Duration::from_secs(5), f);
}

fn identify(c: &mut Client, cns: u8, nsid: u32, csi: u8) -> (Vec<u8>, Cqe) {
    let mut s = Sqe::default();
    s.set_opcode(admin::IDENTIFY)
        .set_nsid(nsid)
        .set_cdw(10, u32::from(cns))
        .set_cdw(11, u32::from(csi) << 24)
        .set_sgl(SglDesc::transport(4096));
    c.cmd(&mut s, &[])
}

/// Get Log Page of `len` bytes (NUMD = len / 4 - 1, split over NUMDL and
/// NUMDU) at byte `offset` (LPOL/LPOU).
fn get_log(c: &mut Client, lid: u8, len: u32, offset: u64, rae: bool) -> (Vec<u8>, Cqe) {
    let numd = len / 4 - 1;
    let mut s = Sqe::default();
    s.set_opcode(admin::GET_LOG_PAGE)
        .set_nsid(0xffff_ffff)
        .set_cdw(
            10,
            u32::from(lid) | u32::from(rae) << 15 | (numd & 0xffff) << 16,
        )
        .set_cdw(11, numd >> 16)
        .set_cdw(12, offset as u32)
        .set_cdw(13, (offset >> 32) as u32)
        .set_sgl(SglDesc::transport(len));
    c.cmd(&mut s, &[])
}

fn get_feature(c: &mut Client, fid: u8) -> Cqe {
    let mut s = Sqe::default();
    s.set_opcode(admin::GET_FEATURES)
        .set_cdw(10, u32::from(fid));
    c.cmd(&mut s, &[]).1
}

fn set_feature(c: &mut Client, fid: u8, v: u32) -> Cqe {
    let mut s = Sqe::default();
    s.set_opcode(admin::SET_FEATURES)
        .set_cdw(10, u32::from(fid))
        .set_cdw(11, v);
    c.cmd(&mut s, &[]).1
}

fn keep_alive(c: &mut Client) -> Status {
    let mut s = Sqe::default();
    s.set_opcode(admin::KEEP_ALIVE);
    c.cmd(&mut s, &[]).1.status()
}

/// Parks an Asynchronous Event Request with command id `cid`.
fn post_aer(c: &mut Client, cid: u16) {
    let mut s = Sqe::default();
    s.set_opcode(admin::ASYNC_EVENT_REQUEST)
        .set_cid(cid)
        .set_sgl_psdt();
    c.send_cmd(&s, &[]);
}

/// Nothing arrives on `c` within `ms` milliseconds.
fn expect_quiet(c: &mut Client, ms: u64) {
    c.s.set_read_timeout(Some(Duration::from_millis(ms)))
        .unwrap();
    let mut b = [0u8; 1];
    let r = c.s.peek(&mut b);
    assert!(
        matches!(&r, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
        "expected no PDU, got {r:?}"
    );
    c.s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
}

/// The target closes `c` (EOF or reset, not a timeout) without sending
/// anything first.
fn expect_closed(c: &mut Client) {
    c.s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    match c.recv() {
        Ok(p) => panic!("connection must be closed, got {p:?}"),
        Err(e) => assert!(
            !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "connection must be closed, but it is still open: {e}"
        ),
    }
}

/// Admin queue as `hostnqn` to `subnqn`: Connect, CC.EN = 1, no Set
/// Features. Returns the client and its cntlid.
fn admin_as(port: u16, subnqn: &str, hostnqn: &str) -> (Client, u16) {
    let mut c = Client::connect_raw(port, Digests::default());
    let r = c.fabrics_connect(0, 0xffff, subnqn, hostnqn);
    assert!(r.status().is_success(), "{}", r.status());
    c.prop_set(prop::CC, 1 | 6 << 16 | 4 << 20);
    assert_eq!(c.prop_get(prop::CSTS, false) & 1, 1);
    (c, r.dw0 as u16)
}

fn io_as(port: u16, subnqn: &str, hostnqn: &str, cntlid: u16, qid: u16) -> Client {
    let mut c = Client::connect_raw(port, Digests::default());
    let r = c.fabrics_connect(qid, cntlid, subnqn, hostnqn);
    assert!(r.status().is_success(), "{}", r.status());
    c
}

fn malloc(e: &Env, name: &str, blocks: u64) {
    ustor_bdev::modules::malloc::create(
        &e.registry,
        ustor_bdev::modules::RamOpts {
            name: name.into(),
            num_blocks: blocks,
            block_size: 512,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .unwrap();
}

fn add_ns(e: &Env, nqn: &str, bdev: &str, nsid: u32) -> u32 {
    e.target
        .nvmf_subsystem_add_ns(&AddNsParams {
            nqn: nqn.into(),
            namespace: NamespaceParams {
                bdev_name: bdev.into(),
                nsid,
                uuid: None,
                nguid: None,
            },
        })
        .unwrap()
}

/// A second subsystem on the same listener, with `bdev` as namespace 1.
fn second_subsystem(e: &Env, allow_any_host: bool, hosts: &[&str], cntlids: (u16, u16)) {
    e.target
        .nvmf_create_subsystem(&CreateSubsystemParams {
            nqn: NQN2.into(),
            serial_number: "USTOR0002".into(),
            model_number: "ustor second".into(),
            allow_any_host,
            max_namespaces: 4,
            min_cntlid: cntlids.0,
            max_cntlid: cntlids.1,
        })
        .unwrap();
    for h in hosts {
        e.target
            .nvmf_subsystem_add_host(&HostParams {
                nqn: NQN2.into(),
                host: (*h).into(),
            })
            .unwrap();
    }
    malloc(e, "Malloc9", 2048);
    add_ns(e, NQN2, "Malloc9", 1);
    e.target
        .nvmf_subsystem_add_listener(&ListenerParams {
            nqn: NQN2.into(),
            listen_address: ListenAddress {
                trtype: "TCP".into(),
                adrfam: "IPv4".into(),
                traddr: "127.0.0.1".into(),
                trsvcid: e.port.to_string(),
            },
        })
        .unwrap();
}

fn write_incapsule(q: &mut Client, slba: u64, data: &[u8]) -> Status {
    let mut w = Client::rw_sqe(io::WRITE, slba, (data.len() / 512) as u32, true);
    q.cmd(&mut w, data).1.status()
}

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

// ---------------------------------------------------------------------
// 2. Get Log Page
// ---------------------------------------------------------------------

/// Supported Log Pages (00h): 256 dwords, dword N describes LID N, bit 0
/// LSUPP. The target lists 00h..04h and nothing else.
#[test]
fn log_supported_pages_and_offsets() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    let (d, c) = get_log(&mut a, LID_SUPPORTED, 1024, 0, false);
    assert!(c.status().is_success());
    assert_eq!(d.len(), 1024);
    for lid in 0..256 {
        let want = u32::from(lid <= 4);
        assert_eq!(le32(&d, lid * 4) & 1, want, "LSUPP of LID {lid:#x}");
    }
    // Short read: NUMD = 1 (8 bytes) returns the page's prefix.
    let (s, c) = get_log(&mut a, LID_SUPPORTED, 8, 0, false);
    assert!(c.status().is_success());
    assert_eq!(s, d[..8]);
    // Offset 8 (LID 02h onwards), 12 bytes.
    let (s, c) = get_log(&mut a, LID_SUPPORTED, 12, 8, false);
    assert!(c.status().is_success());
    assert_eq!(s, d[8..20]);
    // A request reaching past the page end: the page's tail, then zeroes
    // (the spec leaves those bytes undefined).
    let (s, c) = get_log(&mut a, LID_SUPPORTED, 16, 1016, false);
    assert!(c.status().is_success());
    assert_eq!(s.len(), 16);
    assert_eq!(s[..8], d[1016..]);
    // NUMD larger than the page (4 KiB of a 1 KiB page).
    let (s, c) = get_log(&mut a, LID_SUPPORTED, 4096, 0, false);
    assert!(c.status().is_success());
    assert_eq!(s[..1024], d[..]);
    // Offsets past the page, not dword aligned, or with LPOU set: Invalid
    // Field in Command.
    for off in [1028, 2, 1 << 32] {
        let (_, c) = get_log(&mut a, LID_SUPPORTED, 8, off, false);
        assert_eq!(c.status(), Status::INVALID_FIELD, "offset {off}");
    }
    // Unsupported LID.
    let (_, c) = get_log(&mut a, 0x05, 512, 0, false);
    assert_eq!(c.status(), Status::INVALID_LOG_PAGE);
}

/// Error Information (01h): ELPE + 1 entries of 64 bytes (Identify
/// Controller byte 262 is 0's based). No error is recorded, so each entry
/// reads as empty (Error Count 0 marks an invalid entry).
#[test]
fn log_error_information() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    let (id, _) = identify(&mut a, 1, 0, 0);
    let entries = usize::from(id[262]) + 1;
    assert_eq!(entries, 128);
    let (d, c) = get_log(&mut a, LID_ERROR, (entries * 64) as u32, 0, false);
    assert!(c.status().is_success());
    assert_eq!(d.len(), entries * 64);
    for i in 0..entries {
        assert_eq!(le64(&d, i * 64), 0, "entry {i}: error count");
    }
    // The last entry alone, by offset.
    let (d, c) = get_log(&mut a, LID_ERROR, 64, (entries as u64 - 1) * 64, false);
    assert!(c.status().is_success());
    assert_zero(&d, "last error entry");
}

/// SMART / Health Information (02h): 512 bytes; critical warning 0,
/// composite temperature in Kelvin (bytes 2:1), available spare (3) above
/// its threshold (4), percentage used (5). The counters are 16-byte values
/// from byte 32 (data units read), 48 (written), 64/80 (host read/write
/// commands), 160 (media errors), 176 (error log entries).
#[test]
fn log_smart_health_fields() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    let (d, c) = get_log(&mut a, LID_SMART, 512, 0, false);
    assert!(c.status().is_success());
    assert_eq!(d.len(), 512);
    assert_eq!(d[0], 0, "critical warning");
    let kelvin = le16(&d, 1);
    assert!((273..273 + 100).contains(&kelvin), "{kelvin} K");
    assert_eq!((d[3], d[4]), (100, 10), "available spare / threshold");
    assert!(d[3] > d[4]);
    assert_eq!(d[5], 0, "percentage used");
    assert_eq!(le128(&d, 160), 0, "media errors");
    assert_eq!(le128(&d, 176), 0, "error log entries");
    // A short read is the prefix.
    let (s, c) = get_log(&mut a, LID_SMART, 8, 0, false);
    assert!(c.status().is_success());
    assert_eq!(s, d[..8]);
}

/// NVMe Base 1.4 5.14.1.2 (Figure 194): Data Units Read/Written "contains
/// the number of 512 byte data units the host has read/written ... reported
/// in thousands (i.e., a value of 1 corresponds to 1,000 units of 512
/// bytes) and is rounded up", Host Read/Write Commands "the number of ...
/// commands completed by the controller". None of these fields is optional.
/// (SPDK reports zeroes here: ctrlr.c "TODO: actually fill out log page
/// data".) Compare counts as a read, Write Zeroes not at all.
#[test]
fn log_smart_counts_io() {
    let e = env();
    let (mut a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    let (d0, _) = get_log(&mut a, LID_SMART, 512, 0, false);
    // 1000 units of 512 bytes each way, in 4 KiB commands (125 each).
    let data = pattern(4096, 1);
    for i in 0..125u64 {
        assert_eq!(write_incapsule(&mut q, i * 8, &data), Status::SUCCESS);
        assert!(q.read(i * 8, 8).1.status().is_success());
    }
    let (d1, _) = get_log(&mut a, LID_SMART, 512, 0, false);
    let delta = |off| le128(&d1, off) - le128(&d0, off);
    assert!(delta(32) >= 1, "data units read");
    assert!(delta(48) >= 1, "data units written");
    assert_eq!(delta(64), 125, "host read commands");
    assert_eq!(delta(80), 125, "host write commands");
}

/// Changed Namespace List (04h) after namespace hot-adds: up to 1024 NSIDs
/// (4096 bytes), zero-terminated; read with RAE = 0 it is cleared; short
/// reads and offsets return that part of the list.
#[test]
fn log_changed_namespace_list() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    let (d, c) = get_log(&mut a, LID_CHANGED_NS, 4096, 0, false);
    assert!(c.status().is_success());
    assert_zero(&d, "nothing changed yet");
    malloc(&e, "Malloc1", 2048);
    malloc(&e, "Malloc2", 2048);
    assert_eq!(add_ns(&e, NQN, "Malloc1", 3), 3);
    assert_eq!(add_ns(&e, NQN, "Malloc2", 7), 7);
    // Offset 4, 4 bytes: the second entry. RAE = 1 keeps the list.
    let (d, c) = get_log(&mut a, LID_CHANGED_NS, 4, 4, true);
    assert!(c.status().is_success());
    assert_eq!(le32(&d, 0), 7);
    let (d, c) = get_log(&mut a, LID_CHANGED_NS, 4096, 0, false);
    assert!(c.status().is_success());
    assert_eq!((le32(&d, 0), le32(&d, 4), le32(&d, 8)), (3, 7, 0));
    assert!(d[8..].iter().all(|b| *b == 0));
    // Cleared by that read.
    let (d, _) = get_log(&mut a, LID_CHANGED_NS, 4096, 0, false);
    assert_zero(&d, "4 KiB of zeroes");
    let (_, c) = get_log(&mut a, LID_CHANGED_NS, 4, 4100, false);
    assert_eq!(c.status(), Status::INVALID_FIELD);
}

/// NVMe Base 1.4 5.14.1.4: the Changed Namespace List lists namespaces
/// changed "since the last time the log page was read"; RAE only decides
/// whether the asynchronous event is retained. SPDK
/// (nvmf_get_changed_ns_list_log_page: "Clear log page each time it is
/// read") and Linux nvmet (nvmet_execute_get_log_changed_ns) clear the
/// list on every read.
#[test]
fn log_changed_namespace_list_clears_on_any_read() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    malloc(&e, "Malloc1", 2048);
    add_ns(&e, NQN, "Malloc1", 2);
    let (d, _) = get_log(&mut a, LID_CHANGED_NS, 4096, 0, true);
    assert_eq!(le32(&d, 0), 2);
    let (d, _) = get_log(&mut a, LID_CHANGED_NS, 4096, 0, true);
    assert_zero(&d, "4 KiB of zeroes");
}

// ---------------------------------------------------------------------
// 3. Identify
// ---------------------------------------------------------------------

/// Namespace Identification Descriptor list (CNS 03h): descriptors of
/// NIDT (byte 0), NIDL (byte 1), 2 reserved bytes, then NIDL bytes: NGUID
/// (2h, 16), UUID (3h, 16, the bdev's UUID in RFC 4122 byte order), CSI
/// (4h, 1, NVM = 0), then a zero NIDT. The NGUID matches Identify
/// Namespace bytes 119:104.
#[test]
fn identify_ns_descriptors() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    let uuid = *e.registry.get("Malloc0").unwrap().info().uuid.as_bytes();
    let (d, c) = identify(&mut a, 3, 1, 0);
    assert!(c.status().is_success());
    assert_eq!(d.len(), 4096);
    let mut at = 0;
    let mut seen = Vec::new();
    while d[at] != 0 {
        let (nidt, nidl) = (d[at], usize::from(d[at + 1]));
        assert_eq!(&d[at + 2..at + 4], &[0, 0], "reserved");
        seen.push((nidt, d[at + 4..at + 4 + nidl].to_vec()));
        at += 4 + nidl;
    }
    assert!(d[at..].iter().all(|b| *b == 0));
    assert_eq!(
        seen,
        vec![(2, uuid.to_vec()), (3, uuid.to_vec()), (4, vec![0])],
        "NGUID (= UUID by default), UUID, CSI"
    );
    let (ns, _) = identify(&mut a, 0, 1, 0);
    assert_eq!(&ns[104..120], &uuid, "Identify Namespace NGUID");
    assert_eq!(&ns[120..128], &[0; 8], "EUI64 not reported");

    // A namespace with its own UUID and NGUID.
    malloc(&e, "Malloc1", 2048);
    let nsid = e
        .target
        .nvmf_subsystem_add_ns(&AddNsParams {
            nqn: NQN.into(),
            namespace: NamespaceParams {
                bdev_name: "Malloc1".into(),
                nsid: 0,
                uuid: Some("6b1f2a3c-4d5e-4f60-8172-839495a6b7c8".into()),
                nguid: Some("00112233445566778899AABBCCDDEEFF".into()),
            },
        })
        .unwrap();
    let (d, c) = identify(&mut a, 3, nsid, 0);
    assert!(c.status().is_success());
    assert_eq!((d[0], d[1]), (2, 16));
    assert_eq!(
        d[4..20],
        [
            0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd,
            0xee, 0xff
        ]
    );
    assert_eq!((d[20], d[21]), (3, 16));
    assert_eq!(
        d[24..40],
        [
            0x6b, 0x1f, 0x2a, 0x3c, 0x4d, 0x5e, 0x4f, 0x60, 0x81, 0x72, 0x83, 0x94, 0x95, 0xa6,
            0xb7, 0xc8
        ]
    );
    let (ns, _) = identify(&mut a, 0, nsid, 0);
    assert_eq!(ns[104..120], d[4..20]);
    // An inactive NSID: Invalid Namespace or Format.
    assert_eq!(
        identify(&mut a, 3, 5, 0).1.status(),
        Status::INVALID_NAMESPACE
    );
}

/// CNS 05h / 06h with CSI 00h (NVM): the I/O command set specific Identify
/// Namespace / Controller structures (4096 bytes; all-zero means no NVM
/// specific limits, which is what Linux reads for VSL/WZSL/DMRL/DMRSL);
/// another CSI or an unknown CNS: Invalid Field.
#[test]
fn identify_csi_specific_and_unknown_cns() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    for cns in [5, 6] {
        let (d, c) = identify(&mut a, cns, if cns == 5 { 1 } else { 0 }, 0);
        assert!(c.status().is_success(), "CNS {cns}");
        assert_zero(&d, &format!("CNS {cns}"));
        assert_eq!(
            identify(&mut a, cns, 1, 2).1.status(),
            Status::INVALID_FIELD,
            "CNS {cns} CSI 2 (ZNS)"
        );
    }
    for cns in [0x04, 0x07, 0x10, 0x13] {
        assert_eq!(
            identify(&mut a, cns, 0, 0).1.status(),
            Status::INVALID_FIELD,
            "CNS {cns:#x}"
        );
    }
    // Identify Namespace for the broadcast NSID without namespace
    // management, and for NSID 0.
    for nsid in [0, 0xffff_ffff] {
        assert_eq!(
            identify(&mut a, 0, nsid, 0).1.status(),
            Status::INVALID_NAMESPACE
        );
    }
    // An inactive NSID within NN reads as zeroes.
    let (d, c) = identify(&mut a, 0, 2, 0);
    assert!(c.status().is_success());
    assert_zero(&d, "4 KiB of zeroes");
}

/// Active Namespace ID list (CNS 02h): active NSIDs greater than CDW1.NSID,
/// increasing, zero-terminated, up to 1024 entries.
#[test]
fn identify_active_ns_list_with_start_nsid() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    malloc(&e, "Malloc1", 2048);
    malloc(&e, "Malloc2", 2048);
    add_ns(&e, NQN, "Malloc2", 5);
    add_ns(&e, NQN, "Malloc1", 3);
    let (id, _) = identify(&mut a, 1, 0, 0);
    assert_eq!(le32(&id, 516), 8, "NN");
    let list = |a: &mut Client, start: u32| {
        let (d, c) = identify(a, 2, start, 0);
        assert!(c.status().is_success());
        assert_eq!(d.len(), 4096);
        let ids: Vec<u32> = (0..1024)
            .map(|i| le32(&d, i * 4))
            .take_while(|x| *x != 0)
            .collect();
        let n = ids.len();
        assert!(d[n * 4..].iter().all(|b| *b == 0));
        ids
    };
    assert_eq!(list(&mut a, 0), [1, 3, 5]);
    assert_eq!(list(&mut a, 1), [3, 5]);
    assert_eq!(list(&mut a, 2), [3, 5]);
    assert_eq!(list(&mut a, 3), [5]);
    assert_eq!(list(&mut a, 5), Vec::<u32>::new());
    assert_eq!(list(&mut a, 100), Vec::<u32>::new());
}

/// NVMe Base 1.4 5.15.2.2 (CNS 02h): "If the NSID field is set to
/// FFFFFFFEh or FFFFFFFFh, then the controller shall abort the command with
/// a status of Invalid Namespace or Format". QEMU (nvme_identify_nslist)
/// and SPDK do so.
#[test]
fn identify_active_ns_list_rejects_broadcast_nsids() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    for nsid in [0xffff_fffe, 0xffff_ffff] {
        assert_eq!(
            identify(&mut a, 2, nsid, 0).1.status(),
            Status::INVALID_NAMESPACE,
            "NSID {nsid:#x}"
        );
    }
}

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
    let c = a.recv().unwrap().cqe();
    assert_eq!((c.cid, c.dw0), (910, AEN_NS_ATTR_CHANGED));
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
    assert_eq!(a.wait(911).1.dw0, AEN_NS_ATTR_CHANGED);
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

// ---------------------------------------------------------------------
// 6. Host removal / 7. discovery by host / 8. Connect checks
// ---------------------------------------------------------------------

/// `nvmf_subsystem_remove_host` on a subsystem without allow_any_host:
/// like SPDK (nvmf_rpc.c rpc_nvmf_subsystem_remove_host then
/// spdk_nvmf_subsystem_disconnect_host), the host's controllers are
/// disconnected (admin and I/O queues closed), other hosts keep theirs,
/// and a new Connect from the removed host gets Connect Invalid Host.
#[test]
fn remove_host_disconnects_it_and_refuses_reconnect() {
    let e = env();
    second_subsystem(&e, false, &[HOST_A, HOST_B], (1, 0xffef));
    let (mut a, ca) = admin_as(e.port, NQN2, HOST_A);
    let mut qa = io_as(e.port, NQN2, HOST_A, ca, 1);
    let (mut b, cb) = admin_as(e.port, NQN2, HOST_B);
    let mut qb = io_as(e.port, NQN2, HOST_B, cb, 1);
    assert_eq!(
        write_incapsule(&mut qa, 0, &pattern(512, 3)),
        Status::SUCCESS
    );
    // A on the open subsystem too: not affected by NQN2's host list.
    let (mut open, _) = admin_as(e.port, NQN, HOST_A);
    e.target
        .nvmf_subsystem_remove_host(&HostParams {
            nqn: NQN2.into(),
            host: HOST_A.into(),
        })
        .unwrap();
    expect_closed(&mut a);
    expect_closed(&mut qa);
    assert_eq!(keep_alive(&mut b), Status::SUCCESS);
    assert_eq!(qb.read(0, 1).0, pattern(512, 3));
    assert_eq!(keep_alive(&mut open), Status::SUCCESS);
    let mut c = Client::connect_raw(e.port, Digests::default());
    assert_eq!(
        c.fabrics_connect(0, 0xffff, NQN2, HOST_A).status(),
        Status::CONNECT_INVALID_HOST
    );
    // Nor may A attach an I/O queue to B's controller.
    let mut c = Client::connect_raw(e.port, Digests::default());
    assert_eq!(
        c.fabrics_connect(2, cb, NQN2, HOST_A).status(),
        Status::CONNECT_INVALID_HOST
    );
}

/// The discovery log page (70h) a host reads lists only the subsystems that
/// host may connect to. Header: GENCTR (7:0), NUMREC (15:8), RECFMT
/// (17:16); 1024-byte entries from byte 1024: TRTYPE 3 (TCP), ADRFAM 1
/// (IPv4), SUBTYPE 2 (NVM), PORTID, CNTLID FFFFh (dynamic), ASQSZ,
/// TRSVCID (63:32), SUBNQN (511:256), TRADDR (767:512).
#[test]
fn discovery_log_is_filtered_by_host() {
    let e = env();
    second_subsystem(&e, false, &[HOST_A], (1, 0xffef));
    let discover = |host: &str| {
        let mut d = Client::connect_raw(e.port, Digests::default());
        let r = d.fabrics_connect(0, 0xffff, DISCOVERY_NQN, host);
        assert!(r.status().is_success());
        // Header first (as hosts do), then the whole page.
        let (h, c) = get_log(&mut d, LID_DISCOVERY, 32, 0, false);
        assert!(c.status().is_success());
        let n = le64(&h, 8) as usize;
        let (log, c) = get_log(&mut d, LID_DISCOVERY, (1024 * (n + 1)) as u32, 0, false);
        assert!(c.status().is_success());
        assert_eq!(le64(&log, 0), le64(&h, 0), "GENCTR");
        assert_eq!(le16(&log, 16), 0, "RECFMT");
        let mut subs = Vec::new();
        for i in 0..n {
            let ent = &log[1024 * (i + 1)..1024 * (i + 2)];
            assert_eq!((ent[0], ent[1], ent[2]), (3, 1, 2), "entry {i}");
            assert_eq!(le16(ent, 6), 0xffff, "CNTLID");
            assert!(le16(ent, 8) >= 32, "ASQSZ");
            assert_eq!(get_cstr(&ent[32..64]), Some(e.port.to_string().as_str()));
            assert_eq!(get_cstr(&ent[512..768]), Some("127.0.0.1"));
            subs.push(get_cstr(&ent[256..512]).unwrap().to_string());
        }
        subs.sort();
        (le64(&h, 0), subs)
    };
    let (g_a, subs_a) = discover(HOST_A);
    assert_eq!(subs_a, [NQN2, NQN], "sorted: ...:second < ...:test");
    let (g_b, subs_b) = discover(HOST_B);
    assert_eq!(subs_b, [NQN]);
    assert_eq!(g_a, g_b);
    // Allowing B changes what B sees, and the generation counter.
    e.target
        .nvmf_subsystem_add_host(&HostParams {
            nqn: NQN2.into(),
            host: HOST_B.into(),
        })
        .unwrap();
    let (g2, subs_b) = discover(HOST_B);
    assert_eq!(subs_b, [NQN2, NQN]);
    assert!(g2 > g_b, "GENCTR must change");
}

/// Admin Connects get distinct cntlids within [min_cntlid, max_cntlid]
/// (Connect response DW0, Identify Controller CNTLID bytes 79:78); with
/// the range used up a Connect is refused; a freed id is reused.
#[test]
fn connect_cntlids_within_range() {
    let e = env();
    second_subsystem(&e, true, &[], (5, 6));
    let (mut a1, c1) = admin_as(e.port, NQN2, HOST_A);
    let (mut a2, c2) = admin_as(e.port, NQN2, HOST_B);
    assert_ne!(c1, c2);
    for (a, c) in [(&mut a1, c1), (&mut a2, c2)] {
        assert!((5..=6).contains(&c), "cntlid {c}");
        let (id, _) = identify(a, 1, 0, 0);
        assert_eq!(le16(&id, 78), c);
        assert_eq!(get_cstr(&id[768..1024]), Some(NQN2));
    }
    let mut x = Client::connect_raw(e.port, Digests::default());
    let r = x.fabrics_connect(0, 0xffff, NQN2, HOST_A);
    assert_eq!(r.status(), Status::CONNECT_CTRL_BUSY);
    drop(x);
    drop(a1);
    eventually("first controller gone", || e.target.connections() == 1);
    let (_a3, c3) = admin_as(e.port, NQN2, HOST_A);
    assert_eq!(c3, c1, "the freed cntlid is the only one left");
    drop(a2);
}

/// An I/O queue Connect must come from the host that owns the controller
/// (same Host NQN as its admin queue): otherwise Connect Invalid Host (the
/// host "is not allowed to establish an association to the specified
/// controller"). An unknown cntlid is Connect Invalid Parameters naming
/// the CNTLID field of the Connect data (IATTR 1, IPO 16).
#[test]
fn connect_io_queue_checks_host_and_cntlid() {
    let e = env();
    let (_a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q = Client::connect_raw(e.port, Digests::default());
    let r = q.fabrics_connect(1, cntlid, NQN, HOST_B);
    assert_eq!(r.status(), Status::CONNECT_INVALID_HOST);
    // The queue id was not taken by the refused Connect.
    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    assert_eq!(write_incapsule(&mut q, 0, &[5; 512]), Status::SUCCESS);
    // The same qid twice: refused (IATTR 0, IPO 42 = QID).
    let mut d = Client::connect_raw(e.port, Digests::default());
    let r = d.fabrics_connect(1, cntlid, NQN, HOSTNQN);
    assert_eq!(r.status(), Status::CONNECT_INVALID_PARAM);
    assert_eq!(r.dw0, 42 << 16);
    let mut u = Client::connect_raw(e.port, Digests::default());
    let r = u.fabrics_connect(1, cntlid.wrapping_add(100), NQN, HOSTNQN);
    assert_eq!(r.status(), Status::CONNECT_INVALID_PARAM);
    assert_eq!(r.dw0, 1 | 16 << 16);
}

// ---------------------------------------------------------------------
// 9. Dataset Management
// ---------------------------------------------------------------------

fn dsm_range(slba: u64, nlb: u32) -> [u8; 16] {
    let mut r = [0u8; 16];
    r[4..8].copy_from_slice(&nlb.to_le_bytes());
    r[8..16].copy_from_slice(&slba.to_le_bytes());
    r
}

fn dsm(q: &mut Client, ranges: &[[u8; 16]], attrs: u32) -> Status {
    let data: Vec<u8> = ranges.iter().flatten().copied().collect();
    let mut s = Sqe::default();
    s.set_opcode(io::DSM)
        .set_nsid(1)
        .set_cdw(10, ranges.len() as u32 - 1)
        .set_cdw(11, attrs)
        .set_sgl(SglDesc::in_capsule(data.len() as u32));
    q.cmd(&mut s, &data).1.status()
}

/// Deallocate (DSM AD, CDW11 bit 2) on the malloc bdev, which zeroes
/// unmapped blocks, as Identify Namespace DLFEAT (byte 33) bits 2:0 = 001b
/// promise ("deallocated blocks read as 00h"); ONCS bit 2 advertises DSM.
/// Without AD nothing changes; a bad range fails the command before any
/// range is deallocated.
#[test]
fn dsm_deallocate_reads_zeroes() {
    let e = env();
    let (mut a, cntlid) = Client::admin(e.port, Digests::default());
    let (id, _) = identify(&mut a, 1, 0, 0);
    assert_eq!(le16(&id, 520) & 1 << 2, 1 << 2, "ONCS.DSM");
    let (ns, _) = identify(&mut a, 0, 1, 0);
    assert_eq!(ns[33] & 7, 1, "DLFEAT: deallocated blocks read as zeroes");
    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    let data = pattern(8192, 7);
    assert_eq!(write_incapsule(&mut q, 200, &data), Status::SUCCESS);
    // Attributes without AD (integral read + write): no change.
    assert_eq!(dsm(&mut q, &[dsm_range(200, 16)], 0b011), Status::SUCCESS);
    assert_eq!(q.read(200, 16).0, data);
    // Two ranges, the second out of bounds: LBA Out of Range, nothing
    // deallocated.
    assert_eq!(
        dsm(&mut q, &[dsm_range(200, 4), dsm_range(32768 - 2, 4)], 4),
        Status::LBA_OUT_OF_RANGE
    );
    assert_eq!(q.read(200, 16).0, data);
    // Blocks 204..208 and 210..212 (plus an empty range).
    assert_eq!(
        dsm(
            &mut q,
            &[dsm_range(204, 4), dsm_range(0, 0), dsm_range(210, 2)],
            4
        ),
        Status::SUCCESS
    );
    let (got, c) = q.read(200, 16);
    assert!(c.status().is_success());
    let mut want = data.clone();
    want[4 * 512..8 * 512].fill(0);
    want[10 * 512..12 * 512].fill(0);
    assert!(got == want, "deallocated blocks must read as zeroes");
}

// ---------------------------------------------------------------------
// 10. PDUs received in pieces
// ---------------------------------------------------------------------

fn capsule_bytes(dg: Digests, sqe: &Sqe, data: &[u8]) -> Vec<u8> {
    let mut h = [0u8; 80];
    let n = encode_capsule_cmd(&mut h, sqe, dg, data.len());
    let mut v = h[..n].to_vec();
    v.extend_from_slice(data);
    if dg.data && !data.is_empty() {
        v.extend_from_slice(&crc(data).to_le_bytes());
    }
    v
}

/// Writes `bytes` in pieces whose sizes cycle through `sizes`, pausing
/// between them so each piece is its own segment.
fn send_in_pieces(c: &mut Client, bytes: &[u8], sizes: &[usize], pause: Duration) {
    let mut at = 0;
    let mut i = 0;
    while at < bytes.len() {
        let n = sizes[i % sizes.len()].min(bytes.len() - at);
        c.s.write_all(&bytes[at..at + n]).unwrap();
        at += n;
        i += 1;
        if !pause.is_zero() {
            // Part of the workload: the gap makes each piece its own segment.
            std::thread::sleep(pause);
        }
    }
}

/// A write capsule with in-capsule data arriving 1, 3, 7 bytes at a time
/// (the first two pieces split the 8-byte common header), with and without
/// digests; a read capsule arriving byte by byte; both complete and the
/// data reads back.
#[test]
fn capsules_received_in_small_pieces() {
    let e = env();
    for dg in [Digests::default(), DG] {
        let (_a, cntlid) = Client::admin(e.port, dg);
        let mut q = Client::io_queue(e.port, dg, cntlid, 1);
        let data = pattern(2048, 11);
        let mut w = Client::rw_sqe(io::WRITE, 40, 4, true);
        let cid = q.next_cid();
        w.set_cid(cid).set_sgl_psdt();
        let bytes = capsule_bytes(dg, &w, &data);
        send_in_pieces(&mut q, &bytes, &[1, 3, 7], Duration::from_micros(300));
        let (_, c) = q.wait(cid);
        assert!(c.status().is_success(), "{dg:?}: {}", c.status());
        let mut r = Client::rw_sqe(io::READ, 40, 4, false);
        let cid = q.next_cid();
        r.set_cid(cid).set_sgl_psdt();
        let bytes = capsule_bytes(dg, &r, &[]);
        send_in_pieces(&mut q, &bytes, &[1], Duration::from_micros(300));
        let (got, c) = q.wait(cid);
        assert!(c.status().is_success());
        assert!(got == data, "{dg:?}: data read back differs");
    }
}

/// Several PDUs in one stream cut at odd places (a piece holds the end of
/// one PDU and the start of the next): an 8 KiB in-capsule write, an
/// H2CData PDU for an R2T, and reads, all with digests.
#[test]
fn pdus_split_across_boundaries() {
    let e = env();
    let (_a, cntlid) = Client::admin(e.port, DG);
    let mut q = Client::io_queue(e.port, DG, cntlid, 1);
    // Two in-capsule writes and a read back to back, cut into 5-byte and
    // 1000-byte pieces.
    let d1 = pattern(8192, 21);
    let d2 = pattern(1024, 22);
    let mut stream = Vec::new();
    let mut cids = Vec::new();
    for (slba, d) in [(0u64, &d1[..]), (100, &d2[..])] {
        let mut w = Client::rw_sqe(io::WRITE, slba, (d.len() / 512) as u32, true);
        let cid = q.next_cid();
        w.set_cid(cid).set_sgl_psdt();
        stream.extend(capsule_bytes(DG, &w, d));
        cids.push(cid);
    }
    send_in_pieces(&mut q, &stream, &[5, 1000, 13], Duration::from_micros(100));
    for _ in 0..2 {
        let c = q.recv().unwrap().cqe();
        assert!(c.status().is_success());
        assert!(cids.contains(&c.cid));
    }
    assert_eq!(q.read(0, 16).0, d1);
    assert_eq!(q.read(100, 2).0, d2);
    // R2T write whose H2CData PDU arrives in 3-byte and 501-byte pieces.
    let d3 = pattern(16384, 23);
    let mut w = Client::rw_sqe(io::WRITE, 300, 32, false);
    let cid = q.next_cid();
    w.set_cid(cid).set_sgl_psdt();
    q.send_cmd(&w, &[]);
    let p = q.recv().unwrap();
    assert_eq!(p.ty, PduType::R2T as u8, "{p:?}");
    let r2t = DataHdr::decode(&p.hdr).unwrap();
    let mut h = [0u8; 32];
    let hd = DataHdr {
        cccid: cid,
        ttag: r2t.ttag,
        offset: 0,
        length: d3.len() as u32,
    };
    let n = encode_data_hdr(&mut h, PduType::H2CData, &hd, flags::LAST_PDU, DG);
    let mut v = h[..n].to_vec();
    v.extend_from_slice(&d3);
    v.extend_from_slice(&crc(&d3).to_le_bytes());
    send_in_pieces(&mut q, &v, &[3, 501], Duration::ZERO);
    assert!(q.wait(cid).1.status().is_success());
    assert!(q.read(300, 32).0 == d3, "R2T data read back differs");
}

/// A bdev resize (`BdevEntry::resize`, what the rbd bdev calls when its
/// image is resized by `bdev_rbd_resize` or by another client) raises the
/// namespace-attribute-changed event; Identify Namespace then reports the
/// new size, and I/O is checked against it.
#[test]
fn bdev_resize_raises_event_and_shows_new_size() {
    let e = env();
    let (mut a, cntlid) = Client::admin(e.port, Digests::default());
    let mut q = Client::io_queue(e.port, Digests::default(), cntlid, 1);
    assert!(set_feature(&mut a, FID_ASYNC_EVENT, 1 << 8)
        .status()
        .is_success());
    let entry = e.registry.get("Malloc0").unwrap();
    let before = entry.num_blocks();
    let (d, _) = identify(&mut a, 0, 1, 0);
    assert_eq!(le64(&d, 0), before);
    post_aer(&mut a, 930);
    expect_quiet(&mut a, 50);
    // Shrinking keeps a malloc bdev's memory valid.
    let after = before / 2;
    assert!(entry.resize(after));
    let c = a.wait(930).1;
    assert!(c.status().is_success());
    assert_eq!(c.dw0, AEN_NS_ATTR_CHANGED);
    let (d, _) = get_log(&mut a, LID_CHANGED_NS, 4096, 0, false);
    assert_eq!((le32(&d, 0), le32(&d, 4)), (1, 0));
    let (d, _) = identify(&mut a, 0, 1, 0);
    assert_eq!(
        (le64(&d, 0), le64(&d, 8), le64(&d, 16)),
        (after, after, after)
    );
    assert!(q.read(after - 1, 1).1.status().is_success());
    assert_eq!(q.read(after, 1).1.status(), Status::LBA_OUT_OF_RANGE);
    // The same size again is no change and no event.
    assert!(!entry.resize(after));
}

//! Admin and control paths of the target over raw TCP, checked byte by byte
//! against the NVMe Base (1.3/1.4/2.0) and NVMe-oF specifications: Get/Set
//! Features (Number of Queues, KATO, Async Event Config, VWC), Get Log Page
//! (supported pages, error, SMART, changed namespaces; NUMD and offsets),
//! Identify (NS descriptors, CSI-specific CNS, active NS lists), Fabrics
//! Disconnect, namespace and host removal, discovery filtering by host,
//! Connect checks, Dataset Management and PDUs received in small pieces.

#[path = "../common/mod.rs"]
mod common;
mod disconnect_and_ns_removal;
mod dsm_and_pieces;
mod features;
mod hosts_and_connect;
mod identify;
mod log_page;

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

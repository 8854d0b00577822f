//! Admin commands that need no waiting: Identify, Get/Set Features, Get Log
//! Page (discovery, error, SMART, changed namespaces, supported pages),
//! Keep Alive, Abort, Property Get/Set. Control path: results are built in
//! a `Vec` and copied once into the buffer that is sent.

use std::sync::Arc;

use super::ctrlr::{Ctrl, MAX_AERS, MAX_IO_QUEUE_DEPTH, VERSION};
use super::subsystem::{ListenAddress, SubType, Subsystem};
use crate::wire::{
    admin, fctype, put16, put32, put64, put_ascii, put_cstr, PropertyCmd, Sqe, Status,
};

/// Outcome of an admin command.
#[derive(Debug, Default)]
pub struct AdminOut {
    pub status: Option<Status>,
    pub dw0: u32,
    pub dw1: u32,
    /// Controller-to-host data.
    pub data: Option<Vec<u8>>,
}

impl AdminOut {
    pub fn err(s: Status) -> AdminOut {
        AdminOut {
            status: Some(s),
            ..Default::default()
        }
    }
    fn ok() -> AdminOut {
        AdminOut::default()
    }
    fn data(d: Vec<u8>) -> AdminOut {
        AdminOut {
            data: Some(d),
            ..Default::default()
        }
    }
    pub fn status(&self) -> Status {
        self.status.unwrap_or(Status::SUCCESS)
    }
}

/// Facts of the transport the Identify data reports.
#[derive(Clone, Copy, Debug)]
pub struct TransportFacts {
    pub in_capsule_data_size: u32,
    /// MDTS as a power of two of 4 KiB pages.
    pub mdts: u8,
}

/// The discovery log's view of all subsystems.
pub trait DiscoverySource {
    /// (subsystem, listener) pairs visible to `hostnqn`.
    fn entries(&self, hostnqn: &str) -> Vec<(Arc<Subsystem>, ListenAddress)>;
    fn genctr(&self) -> u64;
}

pub fn execute(
    ctrl: &Ctrl,
    sqe: &Sqe,
    facts: TransportFacts,
    disc: &dyn DiscoverySource,
) -> AdminOut {
    ctrl.touch();
    match sqe.opcode() {
        admin::IDENTIFY => identify(ctrl, sqe, facts),
        admin::GET_LOG_PAGE => get_log_page(ctrl, sqe, disc),
        admin::SET_FEATURES => set_features(ctrl, sqe),
        admin::GET_FEATURES => get_features(ctrl, sqe),
        admin::KEEP_ALIVE => AdminOut::ok(),
        // Commands are not aborted (they complete quickly); dw0 bit 0 says so.
        admin::ABORT => AdminOut {
            dw0: 1,
            ..Default::default()
        },
        admin::FABRICS => fabrics(ctrl, sqe),
        _ => AdminOut::err(Status::INVALID_OPCODE),
    }
}

fn fabrics(ctrl: &Ctrl, sqe: &Sqe) -> AdminOut {
    let p = PropertyCmd::parse(sqe);
    match sqe.fctype() {
        fctype::PROPERTY_GET => match ctrl.property_get(p.offset) {
            Some(v) => AdminOut {
                dw0: v as u32,
                dw1: if p.eight_bytes { (v >> 32) as u32 } else { 0 },
                ..Default::default()
            },
            None => AdminOut::err(Status::INVALID_FIELD),
        },
        fctype::PROPERTY_SET => {
            if ctrl.property_set(p.offset, p.value) {
                AdminOut::ok()
            } else {
                AdminOut::err(Status::INVALID_FIELD)
            }
        }
        _ => AdminOut::err(Status::INVALID_OPCODE),
    }
}

fn identify(ctrl: &Ctrl, sqe: &Sqe, facts: TransportFacts) -> AdminOut {
    let cns = sqe.cdw(10) as u8;
    let csi = (sqe.cdw(11) >> 24) as u8;
    let nsid = sqe.nsid();
    if ctrl.is_discovery() && cns != 1 {
        return AdminOut::err(Status::INVALID_FIELD);
    }
    match cns {
        0x00 => match ctrl.subsys.namespace(nsid) {
            Some(ns) => AdminOut::data(identify_ns(&ns)),
            // An inactive but valid NSID reads as zeroes.
            None if nsid != 0 && nsid <= ctrl.subsys.max_namespaces => {
                AdminOut::data(vec![0; 4096])
            }
            None => AdminOut::err(Status::INVALID_NAMESPACE),
        },
        0x01 => AdminOut::data(identify_ctrl(ctrl, facts)),
        // FFFFFFFEh and FFFFFFFFh name no position in the list (NVMe 1.4
        // 5.15.2.2): Invalid Namespace or Format.
        0x02 if nsid >= 0xffff_fffe => AdminOut::err(Status::INVALID_NAMESPACE),
        0x02 => {
            let mut d = vec![0u8; 4096];
            let list: Vec<u32> = ctrl
                .subsys
                .namespaces()
                .iter()
                .map(|n| n.nsid)
                .filter(|id| *id > nsid)
                .take(1024)
                .collect();
            for (i, id) in list.iter().enumerate() {
                put32(&mut d, i * 4, *id);
            }
            AdminOut::data(d)
        }
        0x03 => match ctrl.subsys.namespace(nsid) {
            Some(ns) => {
                let mut d = vec![0u8; 4096];
                // NGUID (type 2), UUID (type 3), CSI (type 4) = NVM.
                d[0] = 2;
                d[1] = 16;
                d[4..20].copy_from_slice(&ns.nguid);
                d[20] = 3;
                d[21] = 16;
                d[24..40].copy_from_slice(&ns.uuid);
                d[40] = 4;
                d[41] = 1;
                AdminOut::data(d)
            }
            None => AdminOut::err(Status::INVALID_NAMESPACE),
        },
        // I/O command set specific namespace / controller for NVM: no fields
        // beyond the base ones.
        0x05 | 0x06 if csi == 0 => AdminOut::data(vec![0; 4096]),
        _ => AdminOut::err(Status::INVALID_FIELD),
    }
}

fn identify_ctrl(ctrl: &Ctrl, facts: TransportFacts) -> Vec<u8> {
    let s = &ctrl.subsys;
    let mut d = vec![0u8; 4096];
    put16(&mut d, 0, 0x1d0f); // vid (left as SPDK's, what hosts expect of a soft target)
    put16(&mut d, 2, 0x1d0f);
    put_ascii(&mut d[4..24], &s.serial_number);
    put_ascii(&mut d[24..64], &s.model_number);
    put_ascii(&mut d[64..72], env!("CARGO_PKG_VERSION"));
    d[72] = 6; // rab
    d[76] = 0b011; // cmic: multiple controllers, multi-path capable
    d[77] = facts.mdts;
    put16(&mut d, 78, ctrl.cntlid);
    put32(&mut d, 80, VERSION);
    let discovery = ctrl.is_discovery();
    if !discovery {
        put32(&mut d, 92, 1 << 8); // oaes: namespace attribute notices
    }
    d[111] = if discovery { 2 } else { 1 }; // cntrltype
    d[258] = 3; // acl (0's based)
    d[259] = (MAX_AERS - 1) as u8; // aerl (0's based)
    d[260] = 0b11; // frmw: slot 1 read-only, 1 slot
    d[261] = 1 << 2; // lpa: extended data for Get Log Page
    d[262] = 127; // elpe
    put16(&mut d, 266, 0x157); // wctemp
    put16(&mut d, 268, 0x175); // cctemp
    put16(&mut d, 320, 10); // kas: 1 s granularity
    d[512] = 0x66; // sqes
    d[513] = 0x44; // cqes
    put16(&mut d, 514, MAX_IO_QUEUE_DEPTH); // maxcmd
    put32(&mut d, 516, s.max_namespaces); // nn
                                          // oncs: compare, DSM, write zeroes.
    put16(&mut d, 520, 1 | 1 << 2 | 1 << 3);
    // fuses: Compare and Write (on namespaces whose bdev does it natively;
    // others answer Invalid Field).
    if !discovery {
        put16(&mut d, 522, 1);
    }
    d[525] = 1; // vwc present
    put16(&mut d, 526, 0);
    // acwu (0's based): one block, the smallest native limit (librbd's).
    put16(&mut d, 532, 0);
    // sgls: supported (no alignment), SGL offset (in-capsule data).
    put32(&mut d, 536, 1 | 1 << 20);
    put32(&mut d, 540, s.max_namespaces); // mnan
    put_cstr(&mut d[768..1024], &s.nqn);
    // NVMe over Fabrics attributes.
    put32(&mut d, 1792, (64 + facts.in_capsule_data_size) / 16); // ioccsz
    put32(&mut d, 1796, 1); // iorcsz
    put16(&mut d, 1800, 0); // icdoff
    d[1802] = 0; // fcatt: dynamic controller model
    d[1803] = 1; // msdbd
                 // Power state 0: 25 W, so power management never asks for more.
    put16(&mut d, 2048, 2500);
    d
}

fn identify_ns(ns: &super::subsystem::Namespace) -> Vec<u8> {
    let mut d = vec![0u8; 4096];
    // The size now: after a resize the host re-reads this on the AEN.
    let num_blocks = ns.desc.num_blocks();
    put64(&mut d, 0, num_blocks); // nsze
    put64(&mut d, 8, num_blocks); // ncap
    put64(&mut d, 16, num_blocks); // nuse
    d[24] = 0; // nsfeat
    d[25] = 0; // nlbaf (0's based): one format
    d[26] = 0; // flbas: format 0
    d[30] = 1; // nmic: may be shared
               // dlfeat: Write Zeroes takes DEAC (bit 3; it always writes zeroes);
               // bits 2:0 = 001b (deallocated blocks read as 00h) only where the bdev
               // makes that true, else 000b (not reported): a host (Linux) relies
               // on it to zero by deallocating.
    let zeroes = ns.desc.info().unmap_reads_zero;
    d[33] = 1 << 3 | u8::from(zeroes);
    d[104..120].copy_from_slice(&ns.nguid);
    let lbads = ns.block_size.trailing_zeros() as u8;
    d[128 + 2] = lbads; // lbaf0: ms 0, lbads, rp 0
    d
}

fn get_log_page(ctrl: &Ctrl, sqe: &Sqe, disc: &dyn DiscoverySource) -> AdminOut {
    let cdw10 = sqe.cdw(10);
    let lid = cdw10 as u8;
    let rae = cdw10 & (1 << 15) != 0;
    let numd = u64::from(cdw10 >> 16) | u64::from(sqe.cdw(11) & 0xffff) << 16;
    let len = ((numd + 1) * 4) as usize;
    let offset = u64::from(sqe.cdw(12)) | u64::from(sqe.cdw(13)) << 32;
    if len > 1 << 20 {
        return AdminOut::err(Status::INVALID_FIELD);
    }
    let page: Vec<u8> = match lid {
        0x70 if ctrl.is_discovery() => discovery_log(disc, &ctrl.hostnqn),
        _ if ctrl.is_discovery() => return AdminOut::err(Status::INVALID_LOG_PAGE),
        0x00 => {
            let mut d = vec![0u8; 1024];
            for id in [0x00usize, 0x01, 0x02, 0x03, 0x04] {
                put32(&mut d, id * 4, 1);
            }
            d
        }
        0x01 => vec![0; 64 * 128],
        0x02 => smart_log(ctrl),
        0x03 => vec![0; 512],
        0x04 => changed_ns_log(ctrl, offset, len, rae),
        _ => return AdminOut::err(Status::INVALID_LOG_PAGE),
    };
    if offset > page.len() as u64 || offset % 4 != 0 {
        return AdminOut::err(Status::INVALID_FIELD);
    }
    let mut out = vec![0u8; len];
    let avail = &page[offset as usize..];
    let n = avail.len().min(len);
    out[..n].copy_from_slice(&avail[..n]);
    AdminOut::data(out)
}

/// Changed Namespace List (04h): up to 1024 NSIDs, or FFFFFFFFh first when
/// more changed. The list is cleared once a read has returned all of it
/// (from offset 0, long enough), whatever RAE says: NVMe lists the
/// namespaces changed "since the last time the log page was read", as SPDK
/// and Linux nvmet clear it; a host reading in pieces loses nothing. RAE =
/// 0 also clears the reported event, unmasking the next notice (NVMe 5.2).
fn changed_ns_log(ctrl: &Ctrl, offset: u64, len: usize, rae: bool) -> Vec<u8> {
    let mut a = ctrl.aer.lock().unwrap_or_else(|p| p.into_inner());
    let mut d = vec![0u8; 4096];
    let entries = if a.changed_ns.len() >= 1024 {
        put32(&mut d, 0, 0xffff_ffff);
        1
    } else {
        for (i, id) in a.changed_ns.iter().enumerate() {
            put32(&mut d, i * 4, *id);
        }
        a.changed_ns.len()
    };
    if offset == 0 && len >= entries * 4 {
        a.changed_ns.clear();
    }
    if !rae {
        a.ns_masked = false;
    }
    d
}

/// SMART / Health Information (02h), controller-wide: temperature and spare
/// as a healthy device reports them, and the host I/O counters (NVMe 1.4
/// Figure 194): data units in thousands of 512-byte units, rounded up, and
/// Read (with Compare) and Write commands completed.
fn smart_log(ctrl: &Ctrl) -> Vec<u8> {
    let mut d = vec![0u8; 512];
    put16(&mut d, 1, 273 + 25); // composite temperature, Kelvin
    d[3] = 100; // available spare
    d[4] = 10; // spare threshold
    let io = ctrl.host_io();
    // 128-bit little-endian fields; the upper halves stay zero.
    put64(&mut d, 32, io.read_bytes.div_ceil(512_000));
    put64(&mut d, 48, io.write_bytes.div_ceil(512_000));
    put64(&mut d, 64, io.read_cmds);
    put64(&mut d, 80, io.write_cmds);
    d
}

fn discovery_log(disc: &dyn DiscoverySource, hostnqn: &str) -> Vec<u8> {
    let entries = disc.entries(hostnqn);
    let mut d = vec![0u8; 1024 * (1 + entries.len())];
    put64(&mut d, 0, disc.genctr());
    put64(&mut d, 8, entries.len() as u64);
    put16(&mut d, 16, 0);
    for (i, (s, l)) in entries.iter().enumerate() {
        let e = &mut d[1024 * (i + 1)..1024 * (i + 2)];
        e[0] = 3; // trtype TCP
        e[1] = if l.traddr.contains(':') { 2 } else { 1 }; // adrfam
        e[2] = if s.subtype == SubType::Discovery {
            3
        } else {
            2
        };
        e[3] = 0; // treq: secure channel not specified
        put16(e, 4, 0); // portid
        put16(e, 6, 0xffff); // dynamic controllers
        put16(e, 8, super::ctrlr::MAX_AQ_DEPTH);
        put_cstr(&mut e[32..64], &l.trsvcid);
        put_cstr(&mut e[256..512], &s.nqn);
        put_cstr(&mut e[512..768], &l.traddr);
        e[768] = 0; // tsas: no security
    }
    d
}

const FID_ERROR_RECOVERY: u8 = 0x05;
const FID_VWC: u8 = 0x06;
const FID_WRITE_ATOMICITY: u8 = 0x0a;
/// Error Recovery DULBE: deallocated blocks as errors, which no bdev does.
const DULBE: u32 = 1 << 16;
const FID_NUM_QUEUES: u8 = 0x07;
const FID_ASYNC_EVENT: u8 = 0x0b;
const FID_KATO: u8 = 0x0f;
const FID_ARBITRATION: u8 = 0x01;
const FID_POWER: u8 = 0x02;
const FID_TEMP: u8 = 0x04;

fn set_features(ctrl: &Ctrl, sqe: &Sqe) -> AdminOut {
    let fid = sqe.cdw(10) as u8;
    let save = sqe.cdw(10) & (1 << 31) != 0;
    if save {
        return AdminOut::err(Status::FEATURE_NOT_SAVEABLE);
    }
    let v = sqe.cdw(11);
    let mut f = ctrl.features.lock().unwrap_or_else(|p| p.into_inner());
    match fid {
        // Only before any I/O queue exists (NVMe 1.4 5.21.1.7).
        FID_NUM_QUEUES if ctrl.io_queues_left() => AdminOut::err(Status::COMMAND_SEQUENCE),
        FID_NUM_QUEUES => {
            let nsq = (v & 0xffff) as u16;
            let ncq = (v >> 16) as u16;
            if nsq == 0xffff || ncq == 0xffff {
                return AdminOut::err(Status::INVALID_FIELD);
            }
            // Granted = min(asked, our limit); reported 0's based.
            let n = (nsq.max(ncq) + 1).min(ctrl.max_io_queues);
            f.num_io_queues = n;
            AdminOut {
                dw0: u32::from(n - 1) | u32::from(n - 1) << 16,
                ..Default::default()
            }
        }
        FID_ASYNC_EVENT => {
            f.aec = v;
            AdminOut::ok()
        }
        FID_KATO => {
            // Rounded up to the 1 s granularity (KAS).
            let ms = v.div_ceil(1000) * 1000;
            ctrl.kato_ms.store(ms, std::sync::atomic::Ordering::Relaxed);
            AdminOut::ok()
        }
        FID_VWC => {
            f.vwc = v & 1 != 0;
            AdminOut::ok()
        }
        FID_ERROR_RECOVERY if v & DULBE != 0 => AdminOut::err(Status::INVALID_FIELD),
        FID_ERROR_RECOVERY => {
            f.tler = v as u16;
            AdminOut::ok()
        }
        FID_WRITE_ATOMICITY => {
            f.write_atomicity_dn = v & 1 != 0;
            AdminOut::ok()
        }
        FID_ARBITRATION | FID_POWER | FID_TEMP => AdminOut::ok(),
        _ => AdminOut::err(Status::INVALID_FIELD),
    }
}

fn get_features(ctrl: &Ctrl, sqe: &Sqe) -> AdminOut {
    let fid = sqe.cdw(10) as u8;
    let f = ctrl.features.lock().unwrap_or_else(|p| p.into_inner());
    let dw0 = match fid {
        FID_NUM_QUEUES => {
            let n = u32::from(f.num_io_queues - 1);
            n | n << 16
        }
        FID_ASYNC_EVENT => f.aec,
        FID_KATO => ctrl.kato_ms.load(std::sync::atomic::Ordering::Relaxed),
        FID_VWC => f.vwc as u32,
        FID_ERROR_RECOVERY => u32::from(f.tler),
        FID_WRITE_ATOMICITY => f.write_atomicity_dn as u32,
        FID_ARBITRATION | FID_POWER => 0,
        FID_TEMP => 0x157,
        _ => return AdminOut::err(Status::INVALID_FIELD),
    };
    AdminOut {
        dw0,
        ..Default::default()
    }
}

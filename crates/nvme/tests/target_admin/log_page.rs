//! Get Log Page: supported pages, error information, SMART, changed namespace list; NUMD and offsets.

use super::*;

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

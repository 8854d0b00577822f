//! Reads at QD 64 with phase collapse: every status (in a read's last
//! Data-In, or a SCSI Response after it) carries the next StatSN in the
//! order the PDUs arrive, each read's Data-In PDUs come in DataSN order
//! with F on the last, and the data is what was written. Reads of 4 KiB
//! (one Data-In) and 32 KiB (four, MaxRecvDataSegmentLength 8192), with
//! and without header digests (the status is written into a Data-In
//! header already queued, so its digest is checked too) and data digests
//! (computed over the read's buffer, which is sent in place); reads of
//! several MiB (several of the core's chunks, each sent from its own
//! buffer). Raw-socket client.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::*;
use ustor_iscsi::wire::{build, encode_text, opcode, pad4, Bhs, BHS_LEN};

/// Blocks of 512 bytes written, then read back.
const BLOCKS: u32 = 2048;
const QD: u32 = 64;

struct Client {
    s: TcpStream,
    digest: bool,
    data_digest: bool,
    cmdsn: u32,
    itt: u32,
}

impl Client {
    fn login(port: u16, digest: bool, data_digest: bool) -> Client {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let text = encode_text(&[
            ("InitiatorName", "iqn.2026-11.io.ustor:collapse"),
            ("TargetName", NODE),
            ("SessionType", "Normal"),
            ("HeaderDigest", if digest { "CRC32C" } else { "None" }),
            ("DataDigest", if data_digest { "CRC32C" } else { "None" }),
            ("MaxRecvDataSegmentLength", "8192"),
        ]);
        let b = build::login([0x80, 0, 0, 0, 0, 7], 0, 1, 1, 0, 1, 3, true);
        let mut c = Client {
            s,
            digest: false,
            data_digest: false,
            cmdsn: 1,
            itt: 1,
        };
        c.send(b, &text);
        let (r, d) = c.recv();
        assert_eq!(r.opcode(), opcode::LOGIN_RESP);
        assert_eq!((r.u8_at(36), r.u8_at(37)), (0, 0), "login failed");
        let want = if digest {
            "HeaderDigest=CRC32C"
        } else {
            "HeaderDigest=None"
        };
        assert!(String::from_utf8_lossy(&d).contains(want), "login answer");
        let want = if data_digest {
            "DataDigest=CRC32C"
        } else {
            "DataDigest=None"
        };
        assert!(String::from_utf8_lossy(&d).contains(want), "login answer");
        c.digest = digest;
        c.data_digest = data_digest;
        c
    }

    fn pdu(&self, mut b: Bhs, data: &[u8]) -> Vec<u8> {
        b.set_data_len(data.len());
        let mut v = b.0.to_vec();
        if self.digest {
            v.extend_from_slice(&crc32c::crc32c(&b.0).to_le_bytes());
        }
        v.extend_from_slice(data);
        v.resize(v.len() + pad4(data.len()) - data.len(), 0);
        if self.data_digest && !data.is_empty() {
            let seg = &v[v.len() - pad4(data.len())..];
            v.extend_from_slice(&crc32c::crc32c(seg).to_le_bytes());
        }
        v
    }

    fn send(&mut self, b: Bhs, data: &[u8]) {
        let v = self.pdu(b, data);
        self.s.write_all(&v).unwrap();
    }

    /// One PDU; its header digest checked.
    fn recv(&mut self) -> (Bhs, Vec<u8>) {
        let mut h = [0u8; BHS_LEN];
        self.s.read_exact(&mut h).unwrap();
        let b = Bhs(h);
        if self.digest {
            let mut d = [0u8; 4];
            self.s.read_exact(&mut d).unwrap();
            assert_eq!(u32::from_le_bytes(d), crc32c::crc32c(&h), "header digest");
        }
        let mut d = vec![0u8; pad4(b.data_len())];
        self.s.read_exact(&mut d).unwrap();
        if self.data_digest && !d.is_empty() {
            let mut g = [0u8; 4];
            self.s.read_exact(&mut g).unwrap();
            assert_eq!(u32::from_le_bytes(g), crc32c::crc32c(&d), "data digest");
        }
        d.truncate(b.data_len());
        (b, d)
    }

    /// A READ(10) or WRITE(10) PDU of `blocks` at `lba`; its ITT.
    fn cmd(&mut self, write: bool, lba: u32, blocks: u16, data: &[u8]) -> (u32, Vec<u8>) {
        let mut c = [0u8; 10];
        c[0] = if write { 0x2a } else { 0x28 };
        c[2..6].copy_from_slice(&lba.to_be_bytes());
        c[7..9].copy_from_slice(&blocks.to_be_bytes());
        let len = u32::from(blocks) * 512;
        let (itt, cmdsn) = (self.itt, self.cmdsn);
        self.itt += 1;
        self.cmdsn += 1;
        let b = build::scsi_cmd([0; 8], itt, &c, !write, write, len, cmdsn, 0);
        (itt, self.pdu(b, data))
    }
}

/// What the responses to `itts` showed.
#[derive(Default)]
struct Seen {
    data: HashMap<u32, Vec<u8>>,
    /// Statuses that rode in a Data-In.
    collapsed: usize,
}

/// Reads until every ITT of `itts` has its status, checking StatSN order
/// (each status the next number), DataSN order and F on the last Data-In.
fn collect(c: &mut Client, itts: &[u32], statsn: &mut Option<u32>, seen: &mut Seen) {
    let mut open: HashMap<u32, (u32, bool)> = itts.iter().map(|&i| (i, (0, false))).collect();
    let mut next_status = |sn: u32| {
        if let Some(prev) = *statsn {
            assert_eq!(sn, prev.wrapping_add(1), "StatSN order");
        }
        *statsn = Some(sn);
    };
    while !open.is_empty() {
        let (b, d) = c.recv();
        let itt = b.itt();
        let st = open.get_mut(&itt).expect("PDU for an open command");
        match b.opcode() {
            opcode::DATA_IN => {
                assert_eq!(b.u32_at(36), st.0, "DataSN of {itt:#x}");
                st.0 += 1;
                st.1 = b.flags() & 0x80 != 0;
                let buf = seen.data.entry(itt).or_default();
                let off = b.u32_at(40) as usize;
                assert_eq!(off, buf.len(), "offset of {itt:#x}");
                buf.extend_from_slice(&d);
                if b.flags() & 0x01 != 0 {
                    assert!(st.1, "status without F");
                    assert_eq!(b.u8_at(3), 0, "status of {itt:#x}");
                    next_status(b.u32_at(24));
                    seen.collapsed += 1;
                    open.remove(&itt);
                }
            }
            opcode::SCSI_RESP => {
                // A write has no Data-In; a read's last one has F.
                assert!(st.0 == 0 || st.1, "last Data-In of {itt:#x} without F");
                assert_eq!(b.u8_at(3), 0, "status of {itt:#x}");
                next_status(b.u32_at(24));
                open.remove(&itt);
            }
            op => panic!("unexpected opcode {op:#x}"),
        }
    }
}

/// Writes `disk` from LBA 0 in 4 KiB commands, QD at a time.
fn write_disk(c: &mut Client, disk: &[u8], statsn: &mut Option<u32>, seen: &mut Seen) {
    let blocks = (disk.len() / 512) as u32;
    for chunk in (0..blocks / 8).collect::<Vec<_>>().chunks(QD as usize) {
        let mut burst = Vec::new();
        let mut itts = Vec::new();
        for &i in chunk {
            let at = i as usize * 4096;
            let (itt, v) = c.cmd(true, i * 8, 8, &disk[at..at + 4096]);
            burst.extend(v);
            itts.push(itt);
        }
        c.s.write_all(&burst).unwrap();
        collect(c, &itts, statsn, seen);
    }
}

fn reads_keep_order_and_data(digest: bool, data_digest: bool) {
    let f = start_with(BLOCKS as u64 * 512, 512, |p| {
        p.header_digest = digest;
        p.data_digest = data_digest;
    });
    let mut c = Client::login(f.port, digest, data_digest);
    let disk = pattern(19, BLOCKS as usize * 512);
    let mut statsn = None;
    let mut seen = Seen::default();
    write_disk(&mut c, &disk, &mut statsn, &mut seen);
    for round in 0..8u32 {
        // QD reads at once, 4 KiB and 32 KiB, at scattered places.
        let reads = (0..QD).map(|k| {
            let blocks: u16 = if (k + round) % 3 == 0 { 64 } else { 8 };
            let lba = (k * 37 + round * 101) * 8 % (BLOCKS - u32::from(blocks));
            (lba, blocks)
        });
        read_burst(&mut c, reads, &disk, &mut statsn, &mut seen);
    }
    // The path under test ran: most statuses rode in the last Data-In.
    assert!(
        seen.collapsed >= (8 * QD / 2) as usize,
        "{}",
        seen.collapsed
    );
}

#[test]
fn qd64_reads_keep_statsn_order_and_data() {
    reads_keep_order_and_data(false, false);
}

#[test]
fn qd64_reads_with_header_digest() {
    reads_keep_order_and_data(true, false);
}

#[test]
fn qd64_reads_with_data_digest() {
    reads_keep_order_and_data(true, true);
}

/// Reads of 3 MiB (three of the core's 1 MiB chunks, each sent from the
/// buffer it was read into; twelve bursts of MaxBurstLength), two at once
/// with a 4 KiB one, with both digests.
#[test]
fn multi_chunk_reads_with_digests() {
    const BIG: u32 = 8192;
    let f = start_with(BIG as u64 * 512, 512, |p| {
        p.header_digest = true;
        p.data_digest = true;
    });
    let mut c = Client::login(f.port, true, true);
    let disk = pattern(23, BIG as usize * 512);
    let (mut statsn, mut seen) = (None, Seen::default());
    write_disk(&mut c, &disk, &mut statsn, &mut seen);
    let reads = [(0u32, 6144u16), (8, 8), (2040, 6144)];
    read_burst(&mut c, reads.into_iter(), &disk, &mut statsn, &mut seen);
}

/// Sends the reads `(lba, blocks)` in one write, collects every answer
/// and checks each read's data against `disk`.
fn read_burst(
    c: &mut Client,
    reads: impl Iterator<Item = (u32, u16)>,
    disk: &[u8],
    statsn: &mut Option<u32>,
    seen: &mut Seen,
) {
    let mut burst = Vec::new();
    let mut want = HashMap::new();
    for (lba, blocks) in reads {
        let (itt, v) = c.cmd(false, lba, blocks, &[]);
        let at = lba as usize * 512;
        want.insert(itt, &disk[at..at + usize::from(blocks) * 512]);
        burst.extend(v);
    }
    c.s.write_all(&burst).unwrap();
    let itts: Vec<u32> = want.keys().copied().collect();
    collect(c, &itts, statsn, seen);
    for (itt, w) in want {
        assert!(seen.data.remove(&itt).unwrap() == w, "data of {itt:#x}");
    }
}

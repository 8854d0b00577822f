//! Commands of one session run at once: with a delay bdev (300 ms per
//! read and write) under the LUN, 16 commands sent together take about
//! one delay, not 16; an ORDERED command waits for the commands before it
//! and holds back the ones after it; ABORT TASK and ABORT TASK SET abort
//! running tasks (no response for them, the TMF answered once they have
//! ended); a client that stops reading is cut at the send timeout;
//! libiscsi's iscsi-perf at QD16 overlaps the delay.
//! Raw-socket clients, data checked against what was written.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use ustor_bdev::modules::{malloc, RamOpts};
use ustor_iscsi::wire::{build, encode_text, opcode, pad4, Bhs, BHS_LEN};
use ustor_iscsi_target::IscsiOptions;
use ustor_vbdev::delay::{self, DelayParams};

const DELAY: Duration = Duration::from_millis(300);
const SLOW: &str = "iqn.2016-06.io.spdk:slow";

/// A target whose node `slow` has a delay bdev over Malloc1 as LUN 0.
fn slow_target(setup: impl FnOnce(&ustor_iscsi_target::IscsiTarget)) -> Fixture {
    let f = start_full(16 << 20, 512, |_| {}, setup);
    let us = DELAY.as_micros() as u64;
    malloc::create(
        &f.registry,
        RamOpts {
            name: "Malloc1".into(),
            num_blocks: (64 << 20) / 512,
            block_size: 512,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .expect("malloc");
    delay::create(
        &f.registry,
        &Arc::downgrade(&f.registry),
        DelayParams {
            base_bdev_name: "Malloc1".into(),
            name: "Delay0".into(),
            avg_read_latency: us,
            p99_read_latency: us,
            avg_write_latency: us,
            p99_write_latency: us,
            uuid: None,
        },
    )
    .expect("delay bdev");
    f.target
        .create_target_node(&node_params("slow", "Delay0"))
        .expect("node");
    f
}

fn recv_pdu(s: &mut TcpStream) -> std::io::Result<(Bhs, Vec<u8>)> {
    let mut h = [0u8; BHS_LEN];
    s.read_exact(&mut h)?;
    let b = Bhs(h);
    let mut d = vec![0u8; pad4(b.data_len())];
    s.read_exact(&mut d)?;
    d.truncate(b.data_len());
    Ok((b, d))
}

fn pdu_bytes(mut b: Bhs, data: &[u8]) -> Vec<u8> {
    b.set_data_len(data.len());
    let mut v = b.0.to_vec();
    v.extend_from_slice(data);
    v.resize(BHS_LEN + pad4(data.len()), 0);
    v
}

/// A normal session on `slow`; its first CmdSN is 1.
fn login(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let text = encode_text(&[
        ("InitiatorName", "iqn.2026-11.io.ustor:qd"),
        ("TargetName", SLOW),
        ("SessionType", "Normal"),
    ]);
    let b = build::login([0x80, 0, 0, 0, 0, 9], 0, 1, 1, 0, 1, 3, true);
    s.write_all(&pdu_bytes(b, &text)).unwrap();
    let (r, _) = recv_pdu(&mut s).unwrap();
    assert_eq!(r.opcode(), opcode::LOGIN_RESP);
    assert_eq!((r.u8_at(36), r.u8_at(37)), (0, 0), "login failed");
    s
}

fn cdb10(op: u8, lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = op;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

/// A 4 KiB WRITE(10) at block `lba` with its data as immediate data.
fn write_cmd(itt: u32, cmdsn: u32, lba: u32, data: &[u8]) -> Vec<u8> {
    let b = build::scsi_cmd(
        [0; 8],
        itt,
        &cdb10(0x2a, lba, 8),
        false,
        true,
        4096,
        cmdsn,
        0,
    );
    pdu_bytes(b, data)
}

fn read_cmd(itt: u32, cmdsn: u32, lba: u32) -> Vec<u8> {
    let b = build::scsi_cmd(
        [0; 8],
        itt,
        &cdb10(0x28, lba, 8),
        true,
        false,
        4096,
        cmdsn,
        0,
    );
    pdu_bytes(b, &[])
}

/// With the task attribute `attr` (SAM: 1 SIMPLE, 2 ORDERED).
fn with_attr(mut pdu: Vec<u8>, attr: u8) -> Vec<u8> {
    pdu[1] = (pdu[1] & !0x07) | attr;
    pdu
}

/// Reads PDUs until every ITT of `itts` has its status: the order the
/// statuses came in, and each READ's data.
fn collect(s: &mut TcpStream, itts: &[u32]) -> (Vec<u32>, HashMap<u32, Vec<u8>>) {
    let mut order = Vec::new();
    let mut data: HashMap<u32, Vec<u8>> = HashMap::new();
    while order.len() < itts.len() {
        let (b, d) = recv_pdu(s).unwrap();
        assert!(itts.contains(&b.itt()), "unexpected PDU {:#x}", b.opcode());
        match b.opcode() {
            opcode::DATA_IN => {
                let buf = data.entry(b.itt()).or_default();
                let off = b.u32_at(40) as usize;
                buf.resize(off + d.len(), 0);
                buf[off..].copy_from_slice(&d);
                if b.flags() & 0x01 != 0 {
                    assert_eq!(b.u8_at(3), 0, "status of {:#x}", b.itt());
                    order.push(b.itt());
                }
            }
            opcode::SCSI_RESP => {
                assert_eq!(b.u8_at(3), 0, "status of {:#x}", b.itt());
                order.push(b.itt());
            }
            op => panic!("unexpected opcode {op:#x}"),
        }
    }
    (order, data)
}

#[test]
fn sixteen_commands_take_one_delay() {
    let f = slow_target(|_| {});
    let mut s = login(f.port);
    let itts: Vec<u32> = (1..=16).collect();
    let mut burst = Vec::new();
    for &i in &itts {
        burst.extend(write_cmd(i, i, i * 8, &pattern(i as u64, 4096)));
    }
    let t0 = Instant::now();
    s.write_all(&burst).unwrap();
    let (order, _) = collect(&mut s, &itts);
    let writes = t0.elapsed();
    assert_eq!(order.len(), 16);

    let mut burst = Vec::new();
    for &i in &itts {
        burst.extend(read_cmd(100 + i, 16 + i, i * 8));
    }
    let reads: Vec<u32> = itts.iter().map(|i| 100 + i).collect();
    let t0 = Instant::now();
    s.write_all(&burst).unwrap();
    let (_, data) = collect(&mut s, &reads);
    let read_time = t0.elapsed();
    for &i in &itts {
        assert!(
            data[&(100 + i)] == pattern(i as u64, 4096),
            "data of LBA {}",
            i * 8
        );
    }
    // One at a time would take 16 delays (4.8 s); at once about one.
    for t in [writes, read_time] {
        assert!(t >= DELAY && t < DELAY * 4, "16 commands took {t:?}");
    }
}

#[test]
fn ordered_command_waits_and_holds_back() {
    let f = slow_target(|_| {});
    let mut s = login(f.port);
    let mut burst = Vec::new();
    burst.extend(with_attr(write_cmd(1, 1, 0, &pattern(1, 4096)), 1));
    burst.extend(with_attr(write_cmd(2, 2, 8, &pattern(2, 4096)), 2));
    burst.extend(with_attr(write_cmd(3, 3, 16, &pattern(3, 4096)), 1));
    let t0 = Instant::now();
    s.write_all(&burst).unwrap();
    let (order, _) = collect(&mut s, &[1, 2, 3]);
    let t = t0.elapsed();
    assert_eq!(order, [1, 2, 3]);
    assert!(
        t >= DELAY * 3 - DELAY / 10,
        "ORDERED ran beside others: {t:?}"
    );
}

#[test]
fn abort_task_and_task_set_abort_running_commands() {
    let f = slow_target(|_| {});
    let mut s = login(f.port);
    // ABORT TASK for a running READ: the TMF answer comes, the READ's
    // never does.
    let mut burst = read_cmd(7, 1, 0);
    burst.extend(pdu_bytes(build::tmf(1, [0; 8], 8, 7, 2, 0, 1), &[]));
    burst.extend(pdu_bytes(build::nop_out([0; 8], 9, 0xffff_ffff, 2, 0), &[]));
    s.write_all(&burst).unwrap();
    let (r, _) = recv_pdu(&mut s).unwrap();
    assert_eq!((r.opcode(), r.itt(), r.u8_at(2)), (opcode::TMF_RESP, 8, 0));
    let (r, _) = recv_pdu(&mut s).unwrap();
    assert_eq!((r.opcode(), r.itt()), (opcode::NOP_IN, 9), "after the TMF");

    // ABORT TASK SET with four running commands: none of them answers.
    let mut burst = Vec::new();
    for i in 0..4u32 {
        burst.extend(write_cmd(20 + i, 2 + i, 64 + i * 8, &pattern(9, 4096)));
    }
    burst.extend(pdu_bytes(
        build::tmf(2, [0; 8], 30, 0xffff_ffff, 6, 0, 0),
        &[],
    ));
    burst.extend(pdu_bytes(
        build::nop_out([0; 8], 31, 0xffff_ffff, 6, 0),
        &[],
    ));
    s.write_all(&burst).unwrap();
    let (r, _) = recv_pdu(&mut s).unwrap();
    assert_eq!((r.opcode(), r.itt(), r.u8_at(2)), (opcode::TMF_RESP, 30, 0));
    let (r, _) = recv_pdu(&mut s).unwrap();
    assert_eq!((r.opcode(), r.itt()), (opcode::NOP_IN, 31));
    // The session goes on.
    s.write_all(&read_cmd(40, 6, 8 * 100)).unwrap();
    let (order, _) = collect(&mut s, &[40]);
    assert_eq!(order, [40]);
}

#[test]
fn client_that_stops_reading_is_cut() {
    let f = slow_target(|t| {
        t.set_options(IscsiOptions {
            nop_in_interval: 1,
            nop_timeout: 1,
            ..t.get_options()
        })
        .unwrap()
    });
    let mut s = login(f.port);
    testkit::wait_until("the session is listed", Duration::from_secs(5), || {
        f.target.get_connections().len() == 1
    });
    // A window of 512 KiB READs (32 MiB, beyond what the socket buffers
    // hold), and never a byte read back.
    let mut burst = Vec::new();
    for i in 1..=64u32 {
        let b = build::scsi_cmd(
            [0; 8],
            i,
            &cdb10(0x28, 0, 1024),
            true,
            false,
            512 << 10,
            i,
            0,
        );
        burst.extend(pdu_bytes(b, &[]));
    }
    s.write_all(&burst).unwrap();
    let t0 = Instant::now();
    testkit::wait_until(
        "the stalled connection ends",
        Duration::from_secs(15),
        || f.target.get_connections().is_empty(),
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t0.elapsed()
    );
    drop(s);
}

/// libiscsi's iscsi-perf at QD16 (a real initiator): far more than one
/// command per delay.
#[test]
fn iscsi_perf_at_qd16_overlaps_the_delay() {
    if !have("iscsi-perf") {
        return;
    }
    let f = slow_target(|_| {});
    let url = format!("iscsi://127.0.0.1:{}/{SLOW}/0", f.port);
    // iscsi-perf runs until interrupted; it prints its average as it goes.
    let out = std::process::Command::new("timeout")
        .args([
            "-s",
            "INT",
            "3",
            "iscsi-perf",
            "-m",
            "16",
            "-b",
            "8",
            "-r",
            &url,
        ])
        .output()
        .expect("iscsi-perf runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let avg: u64 = text
        .rsplit("iops average ")
        .next()
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no average in iscsi-perf's output: {text}"));
    // One at a time: 1 s / 300 ms = 3 IOPS; 16 at once: about 53.
    assert!(avg >= 20, "iscsi-perf at QD16 did {avg} IOPS: {text}");
}

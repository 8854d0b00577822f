//! `ustor bench` end to end: verified runs on malloc and a uring file pass,
//! and `--verify` catches blocks corrupted behind the stack's back.

mod common;

use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::*;
use serde_json::Value;

fn bench(args: &[&str]) -> (i32, Value, String) {
    let out = Command::new(BIN)
        .args(["bench", "--no-pin", "--json"])
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let v = serde_json::from_str(&text).unwrap_or(Value::Null);
    (
        out.status.code().unwrap_or(-1),
        v,
        format!("{text}{}", String::from_utf8_lossy(&out.stderr)),
    )
}

#[test]
fn verified_runs_pass_on_malloc_null_and_uring() {
    let (code, v, log) = bench(&[
        "-b",
        "malloc:64M",
        "-w",
        "randrw",
        "--qd",
        "8",
        "-t",
        "1",
        "--verify",
        "--cores",
        "0,1",
    ]);
    assert_eq!(code, 0, "{log}");
    assert!(v["total"]["ios"].as_u64().unwrap() > 1000, "{log}");
    assert_eq!(v["total"]["verify_errors"], 0);
    assert_eq!(v["per_core"].as_array().unwrap().len(), 2);
    assert!(
        v["total"]["lat_p99_us"].as_f64().unwrap() >= v["total"]["lat_p50_us"].as_f64().unwrap()
    );
    assert!(v["cpu_ns_per_io"].as_f64().unwrap() > 0.0);
    let (code, v, log) = bench(&["-b", "null:1G", "-w", "randread", "--qd", "64", "-t", "0.5"]);
    assert_eq!(code, 0, "{log}");
    assert!(v["total"]["iops"].as_f64().unwrap() > 10_000.0, "{log}");
    let dir = tmpdir("bench");
    let f = dir.join("disk.img");
    std::fs::File::create(&f)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    let spec = format!("uring:{}", f.display());
    for w in ["randwrite", "randread", "write", "read"] {
        let (code, v, log) = bench(&["-b", &spec, "-w", w, "--qd", "4", "-t", "0.5", "--verify"]);
        assert_eq!(code, 0, "{w}: {log}");
        assert!(v["total"]["ios"].as_u64().unwrap() > 0, "{w}: {log}");
    }
    let (code, _, log) = bench(&["-b", "malloc:1M", "--bs", "3000"]);
    assert_eq!(code, 2, "bad --bs accepted: {log}");
}

#[test]
fn verify_catches_corrupted_blocks() {
    let dir = tmpdir("corrupt");
    let f = dir.join("disk.img");
    std::fs::File::create(&f).unwrap().set_len(1 << 20).unwrap();
    // While the bench writes and reads back its blocks through O_DIRECT, a
    // second writer scribbles over the file: reads must come back wrong and
    // be reported, with exit status 1.
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let path = f.clone();
    let scribbler = std::thread::spawn(move || {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .unwrap();
        let mut buf = vec![0u8; 8192];
        let junk = unsafe {
            // SAFETY: 4096-aligned view into our own vector, 4096 bytes long.
            let p = buf.as_mut_ptr();
            let off = p.align_offset(4096);
            std::slice::from_raw_parts_mut(p.add(off), 4096)
        };
        junk.fill(0xEE);
        let mut i = 0u64;
        while !st.load(Ordering::Relaxed) {
            let _ = file.seek(SeekFrom::Start((i % 256) * 4096));
            let _ = file.write(junk);
            i += 7;
        }
    });
    let (code, v, log) = bench(&[
        "-b",
        &format!("uring:{}", f.display()),
        "-w",
        "randrw",
        "--qd",
        "2",
        "-t",
        "1.5",
        "--verify",
    ]);
    stop.store(true, Ordering::Relaxed);
    scribbler.join().unwrap();
    assert_eq!(code, 1, "corruption not reported: {log}");
    assert!(v["total"]["verify_errors"].as_u64().unwrap() > 0, "{log}");
    assert!(
        v["total"]["first_mismatch"]
            .as_str()
            .unwrap()
            .contains("LBA"),
        "{log}"
    );
}

#[test]
fn flush_and_unmap_workloads_check_their_blocks() {
    let dir = tmpdir("unmap");
    let f = dir.join("disk.img");
    std::fs::write(&f, vec![0xA5u8; 8 << 20]).unwrap();
    let spec = format!("uring:{}", f.display());
    // A file through io_uring punches holes: unmapped blocks read as zeroes,
    // which --verify reads back after every unmap; a flush leaves the
    // slot's self-checking blocks intact.
    for w in ["unmap", "flush"] {
        let (code, v, log) = bench(&[
            "-b", &spec, "-w", w, "--bs", "64K", "--qd", "2", "-t", "0.5", "--verify",
        ]);
        assert_eq!(code, 0, "{w}: {log}");
        assert_eq!(v["workload"], w, "{log}");
        assert!(v["total"]["ios"].as_u64().unwrap() > 0, "{w}: {log}");
        assert_eq!(v["total"]["errors"], 0, "{w}: {log}");
        assert_eq!(v["total"]["verify_errors"], 0, "{w}: {log}");
    }
    // Unmap the whole file once (one 8 MiB unit): the host reads zeroes.
    let (code, v, log) = bench(&[
        "-b", &spec, "-w", "unmap", "--bs", "8M", "--qd", "1", "-t", "0.2",
    ]);
    assert_eq!(code, 0, "{log}");
    assert!(v["total"]["ios"].as_u64().unwrap() > 0, "{log}");
    assert!(
        std::fs::read(&f).unwrap().iter().all(|b| *b == 0),
        "file not unmapped"
    );
    // The null bdev promises nothing about unmapped blocks: refused.
    let (code, _, log) = bench(&["-b", "null:64M", "-w", "unmap", "--verify"]);
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("unmap"), "{log}");
    let (code, _, log) = bench(&["-b", "null:64M", "-w", "trim"]);
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("flush, unmap"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A read pass with `--verify` needs known contents, so each slot writes
/// its region once before the timed run: a device sees WRITEs first, and
/// the reads the report counts are all of the timed I/O.
#[test]
fn verified_reads_write_their_region_first() {
    let dir = tmpdir("prefill");
    let f = dir.join("disk.img");
    std::fs::File::create(&f).unwrap().set_len(1 << 20).unwrap();
    let (code, v, log) = bench(&[
        "-b",
        &format!("uring:{}", f.display()),
        "-w",
        "read",
        "--bs",
        "4K",
        "--qd",
        "1",
        "-t",
        "0.2",
        "--seed",
        "77",
        "--verify",
    ]);
    assert_eq!(code, 0, "{log}");
    assert!(v["total"]["ios"].as_u64().unwrap() > 0, "{log}");
    assert_eq!(v["total"]["reads"], v["total"]["ios"], "{log}");
    // The whole file holds the prefill's blocks (generation 1).
    let mut want = vec![0u8; 1 << 20];
    ustor_bench::verify::fill(&mut want, 512, 0, 77, 1);
    assert!(std::fs::read(&f).unwrap() == want, "region not prefilled");
    let _ = std::fs::remove_dir_all(&dir);
}

//! The copy alone: what a malloc bdev's 4 KiB I/O cannot get below. Copies
//! 4 KiB between random 4 KiB-aligned offsets of a 1 GiB region, faulted in
//! with huge pages as a prefaulted malloc disk is, and a ring of 128 4 KiB
//! buffers (a QD128 bench's buffers), on one pinned core; prints ns per copy.
//! bench/RESULTS-spdk.md compares it with `ustor bench`'s CPU ns per malloc
//! I/O minus its ns per null I/O (the bdev path around the copy).
//!
//! `copy_cost [read|write] [CORE] [COPIES]` (defaults: read, 1, 20000000).
//! read copies region -> buffer (a malloc read), write buffer -> region.

use std::time::Instant;

const REGION: usize = 1 << 30;
const BS: usize = 4096;
const BUFS: usize = 128;
/// `MADV_POPULATE_WRITE` (Linux 5.14), not in every libc crate release.
const MADV_POPULATE_WRITE: libc::c_int = 23;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let write = args.get(1).map(String::as_str) == Some("write");
    let core: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1);
    let copies: u64 = args
        .get(3)
        .and_then(|a| a.parse().ok())
        .unwrap_or(20_000_000);
    pin(core);
    let region = map_region();
    let mut bufs = vec![0x5au8; BUFS * BS];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let blocks = (REGION / BS) as u64;
    let mut step = |i: u64, bufs: &mut [u8]| {
        // xorshift64: cheap, and the offsets do not repeat in a pattern the
        // prefetchers could follow.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let off = (x % blocks) as usize * BS;
        let b = (i as usize % BUFS) * BS;
        if write {
            region[off..off + BS].copy_from_slice(&bufs[b..b + BS]);
        } else {
            bufs[b..b + BS].copy_from_slice(&region[off..off + BS]);
        }
    };
    for i in 0..copies / 10 {
        step(i, &mut bufs);
    }
    let t = Instant::now();
    for i in 0..copies {
        step(i, &mut bufs);
    }
    let ns = t.elapsed().as_nanos() as f64 / copies as f64;
    std::hint::black_box(&bufs);
    println!(
        "copy_cost {} core={core} copies={copies} ns_per_copy={ns:.1}",
        if write { "write" } else { "read" }
    );
}

/// The 1 GiB region: anonymous, huge pages advised, every page faulted in.
fn map_region() -> &'static mut [u8] {
    // SAFETY: a fresh private anonymous mapping, checked below, never
    // unmapped (the process exits); advice only touches that mapping.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            REGION,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert!(p != libc::MAP_FAILED, "mmap of 1 GiB failed");
        libc::madvise(p, REGION, libc::MADV_HUGEPAGE);
        if libc::madvise(p, REGION, MADV_POPULATE_WRITE) != 0 {
            std::ptr::write_bytes(p.cast::<u8>(), 0, REGION);
        }
        std::slice::from_raw_parts_mut(p.cast(), REGION)
    }
}

fn pin(core: usize) {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET writes into it;
    // sched_setaffinity reads it with its true size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

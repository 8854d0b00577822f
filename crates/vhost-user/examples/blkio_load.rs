//! A vhost-user-blk load generator on libblkio (the `blkio` crate's
//! virtio-blk-vhost-user driver): one busy-polled queue, 4 KiB (or BS)
//! random reads or writes at a fixed queue depth for a number of seconds,
//! then one line `iops=N lat_us=MEAN ios=N errors=N`.
//!
//! bench/vhost.sh uses it (`FRONTEND=blkio`) as a frontend every backend
//! accepts: SPDK's bdevperf over virtio-user asks GET_CONFIG for 256 bytes,
//! which qemu-storage-daemon's export refuses, while libblkio is the
//! frontend qemu-storage-daemon is tested with.
//!
//! `cargo run --release -p ustor-vhost --example blkio_load -- SOCKET
//! randread|randwrite QD SECONDS [BS]`
use std::mem::MaybeUninit;
use std::time::{Duration, Instant};

use blkio::{Blkio, Completion, ReqFlags};

fn arg<T: std::str::FromStr>(args: &[String], i: usize, name: &str) -> T {
    args.get(i)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("usage: SOCKET randread|randwrite QD SECONDS [BS]: bad {name}"))
}

/// xorshift64*: a cheap random block number per request.
fn next_rand(s: &mut u64) -> u64 {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    s.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let socket: String = arg(&args, 1, "SOCKET");
    let write = match args.get(2).map(String::as_str) {
        Some("randread") => false,
        Some("randwrite") => true,
        _ => panic!("usage: SOCKET randread|randwrite QD SECONDS [BS]"),
    };
    let qd: usize = arg(&args, 3, "QD");
    let secs: f64 = arg(&args, 4, "SECONDS");
    let bs: usize = args.get(5).and_then(|s| s.parse().ok()).unwrap_or(4096);
    assert!(
        qd > 0 && bs > 0 && bs % 512 == 0,
        "QD > 0, BS a multiple of 512"
    );

    let mut b = Blkio::new("virtio-blk-vhost-user").expect("virtio-blk-vhost-user driver");
    b.set_str("path", &socket).expect("path");
    b.connect().expect("connect");
    let capacity = b.get_u64("capacity").expect("capacity");
    b.set_i32("num-queues", 0).expect("num-queues");
    b.set_i32("num-poll-queues", 1).expect("num-poll-queues");
    let mut out = b.start().expect("start");
    let mut q = out.poll_queues.pop().expect("one poll queue");
    let mem = b.alloc_mem_region(qd * bs).expect("memory region");
    b.map_mem_region(&mem).expect("map region");
    let blocks = capacity / bs as u64;
    assert!(blocks > 0, "device smaller than one block");

    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut started = vec![Instant::now(); qd];
    // A request is stamped with the clock reading of the completion batch
    // it is resubmitted from (one clock read per `do_io`, not one per
    // request: the frontend's own time per request is what bounds it
    // against a fast backend, and the resubmission follows the read by
    // nanoseconds).
    let mut submit = |q: &mut blkio::Blkioq, slot: usize, now: Instant, started: &mut [Instant]| {
        let at = (next_rand(&mut seed) % blocks) * bs as u64;
        let buf = (mem.addr + slot * bs) as *mut u8;
        started[slot] = now;
        if write {
            q.write(at, buf, bs, slot, ReqFlags::empty());
        } else {
            q.read(at, buf, bs, slot, ReqFlags::empty());
        }
    };
    let first = Instant::now();
    for slot in 0..qd {
        submit(&mut q, slot, first, &mut started);
    }
    let mut done: Vec<MaybeUninit<Completion>> = (0..qd).map(|_| MaybeUninit::uninit()).collect();
    let (mut ios, mut errors, mut lat_ns, mut inflight) = (0u64, 0u64, 0u128, qd);
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(secs);
    // Completions after `end` are drained, not counted.
    while inflight > 0 {
        let n = q.do_io(&mut done, 0, None, None).expect("do_io");
        let now = Instant::now();
        for c in &done[..n] {
            // SAFETY: do_io initialised the first n entries.
            let c = unsafe { c.assume_init_ref() };
            if now >= end {
                inflight -= 1;
                continue;
            }
            ios += 1;
            errors += u64::from(c.ret != 0);
            lat_ns += now.duration_since(started[c.user_data]).as_nanos();
            submit(&mut q, c.user_data, now, &mut started);
        }
    }
    let elapsed = end.duration_since(t0).as_secs_f64();
    println!(
        "iops={:.0} lat_us={:.2} ios={ios} errors={errors}",
        ios as f64 / elapsed,
        lat_ns as f64 / ios.max(1) as f64 / 1000.0
    );
    if errors > 0 {
        std::process::exit(1);
    }
}

//! vhost-user-blk served by `ustor serve` to a QEMU/TCG guest's
//! virtio-blk driver (one boot of a two-vCPU guest, two devices): a raw
//! disk with two queues (`num-queues=2`, each vCPU's requests on a queue
//! of its own: fio runs a job on each vCPU, and both queues must carry
//! requests) and an ext4 disk with one, both uring bdevs over host
//! files. The guest reads a region the host wrote, writes a region the
//! host reads back from the file, discards a region (zeroes in the file),
//! runs fio with crc32c verify over a region, and makes, fills, fscks and
//! re-reads an ext4 on the second disk, which the host fscks again.
//! During fio's writes ustor is killed with SIGKILL and started again on
//! the same sockets: QEMU (`reconnect=1`) reconnects, the new process
//! resubmits what the inflight region says was in flight, and fio's
//! verify must still pass. The raw disk's bdev is a delay bdev whose
//! latency is raised to minutes just before the kill, and the kill waits
//! for a request taken after that: requests are in flight at the kill
//! whatever the timing, and the new process must report them resubmitted.
//! A third disk (a null bdev) is grown by `bdev_null_resize` after the
//! restart: the guest must see the new size (config-change interrupt
//! through the backend channel) and read its new last MiB.
//!
//! Skips (`SKIPPED: reason`) only when no guest can run here.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use testvm::host::{ext4_file_md5, fsck_image, md5_bytes, md5_range, write_pattern};
use testvm::{guest_script, require_guest, GuestBuilder};

const MIB: u64 = 1 << 20;

fn image(dir: &std::path::Path, name: &str, mib: u64) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p)
        .unwrap()
        .set_len(mib * MIB)
        .unwrap();
    p
}

#[test]
fn guest_virtio_blk_on_ustor_vhost() {
    require_guest!();
    if !testkit::need("fio") {
        return;
    }
    let dir = tmpdir("vhost-guest");
    let sockets = dir.join("vhost");
    std::fs::create_dir_all(&sockets).unwrap();
    let raw = image(&dir, "raw.img", 64);
    let fs = image(&dir, "fs.img", 64);
    write_pattern(&raw, 8 * MIB, 4 * MIB as usize, 0x5eed).expect("pattern");
    write_pattern(&raw, 24 * MIB, 4 * MIB as usize, 0xd15c).expect("pattern");
    let host_read_md5 = md5_range(&raw, 8 * MIB, 4 * MIB as usize).expect("md5");
    let bdev = |f: &std::path::Path, n: &str| json!({"method": "bdev_uring_create", "params": {"filename": f.to_str().unwrap(), "name": n, "block_size": 512}});
    let ctrl = |c: &str, b: &str| json!({"method": "vhost_create_blk_controller", "params": {"ctrlr": c, "dev_name": b}});
    let delay = json!({"method": "bdev_delay_create", "params": {"base_bdev_name": "RawFile", "name": "Raw",
        "avg_read_latency": 50, "p99_read_latency": 50, "avg_write_latency": 50, "p99_write_latency": 50}});
    let nullb = json!({"method": "bdev_null_create", "params": {"name": "Null", "num_blocks": 64 * MIB / 512, "block_size": 512}});
    let config = json!({"subsystems": [
        {"subsystem": "bdev", "config": [bdev(&raw, "RawFile"), delay, bdev(&fs, "Fs"), nullb]},
        {"subsystem": "vhost_blk", "config": [ctrl("vraw", "Raw"), ctrl("vfs", "Fs"), ctrl("vnull", "Null")]},
    ]});
    let args = ["-S", sockets.to_str().unwrap(), "--cores", "0,1"];
    let s = Server::start(&dir, &config, &args);

    let started = Instant::now();
    let guest = GuestBuilder::new()
        .script_file(guest_script("vhost-user-blk.sh"))
        .binary("/usr/bin/fio")
        .cpus(2)
        .vhost_user_blk_queues(sockets.join("vraw"), 2)
        .vhost_user_blk(sockets.join("vfs"))
        .vhost_user_blk(sockets.join("vnull"))
        .vhost_user_reconnect()
        .env("VUB_READ_MIB", "8:4")
        .env("VUB_WRITE_MIB", "16:4")
        .env("VUB_DISCARD_MIB", "24:4")
        .env("VUB_FIO_MIB", "32:16")
        .env("VUB_FIO_SPLIT", "1")
        .env("VUB_FS_DEV", "/dev/vdb")
        .env("VUB_RESIZE_DEV", "/dev/vdc")
        .env("VUB_RESIZE_BYTES", (128 * MIB).to_string())
        .timeout(Duration::from_secs(300));
    let run = std::thread::spawn(move || guest.run());
    // SIGKILL in the middle of fio's writes (the raw round trip writes
    // 4 MiB first, fio 16 MiB), start again on the same sockets: QEMU
    // reconnects, the new process resubmits what was in flight.
    let written = |s: &Server| -> u64 {
        let st = s.ok("bdev_get_iostat", json!({"name": "Raw"}));
        st["bdevs"][0]["bytes_written"].as_u64().unwrap_or(0)
    };
    // Requests vraw's queues have taken, and of those not yet returned.
    let taken = |s: &Server| -> (u64, u64) {
        let c = s.ok("vhost_get_controllers", json!({"name": "vraw"}));
        let q = c[0]["queues"].as_array().cloned().unwrap_or_default();
        let sum = |k: &str| q.iter().filter_map(|q| q[k].as_u64()).sum::<u64>();
        (sum("requests"), sum("in_flight"))
    };
    // 1 MiB into fio's 16 MiB of writes (after the 4 MiB round trip): the
    // rest of fio (15 MiB written, 16 MiB verified) is the margin for the
    // latency raise below to land while fio still sends requests.
    let mid_fio = testkit::try_wait_for(Duration::from_secs(240), || {
        (written(&s) >= 5 * MIB || run.is_finished()).then_some(())
    });
    assert!(
        mid_fio.is_some() && !run.is_finished(),
        "fio never got going"
    );
    // Every request the delay bdev gets from now on waits 10 minutes: one
    // the ring takes after this is in flight at the kill.
    for t in ["avg_read", "p99_read", "avg_write", "p99_write"] {
        let p = json!({"delay_bdev_name": "Raw", "latency_type": t, "latency_us": 600_000_000u64});
        s.ok("bdev_delay_update_latency", p);
    }
    // Held: a request taken after the raise, or, when the guest filled
    // all its slots with held requests before `held` was read (a loaded
    // machine can delay this thread for that long), requests in flight
    // that nothing returns for a second (a request taken before the
    // raise waits 50 us on the host, not on the guest). The bound is the
    // guest's pace: its next request.
    let (held, _) = taken(&s);
    let mut still: Option<(u64, Instant)> = None;
    testkit::wait_until(
        "a request held at the kill",
        Duration::from_secs(180),
        || {
            let (n, in_flight) = taken(&s);
            let done = n - in_flight;
            if n > held {
                return true;
            }
            match still {
                Some((d, since)) if d == done && in_flight > 0 => {
                    since.elapsed() >= Duration::from_secs(1)
                }
                _ => {
                    still = Some((done, Instant::now()));
                    false
                }
            }
        },
    );
    let killed = Instant::now();
    s.kill();
    let s = Server::start(&dir, &config, &args);
    let up = killed.elapsed();
    // When QEMU came back (its reconnect period, 1 s at the least in
    // QEMU 7.2, runs from the kill): the split below says how much of
    // the pause is ustor's.
    let mut connected = None;
    let resumed = testkit::try_wait_for(Duration::from_secs(60), || {
        if connected.is_none() {
            let c = s.ok("vhost_get_controllers", json!({"name": "vraw"}));
            if c[0]["sessions"].as_array().is_some_and(|v| !v.is_empty()) {
                connected = Some(killed.elapsed());
            }
        }
        (written(&s) > 0).then_some(())
    });
    let restart = killed.elapsed();
    assert!(resumed.is_some(), "no I/O after the restart");
    eprintln!(
        "vhost-user-blk: SIGKILL to resumed guest writes: {restart:?} (new process serving \
         after {up:?}, QEMU connected after {connected:?})"
    );
    // Grow the null disk once the new process has the frontend's backend
    // channel and its rings run (QEMU reads the config again only then).
    testkit::wait_until("vnull reconnected", Duration::from_secs(60), || {
        let c = s.ok("vhost_get_controllers", json!({"name": "vnull"}));
        let ses = &c[0]["sessions"][0];
        ses["config_notify"] == true && ses["started"] == true
    });
    s.ok("bdev_null_resize", json!({"name": "Null", "new_size": 128}));
    let result = run.join().expect("guest thread");
    let elapsed = started.elapsed();
    let ctrls = s.ok("vhost_get_controllers", json!({"name": "vraw"}));
    let vnull = s.ok("vhost_get_controllers", json!({"name": "vnull"}));
    let (code, log) = s.stop();
    let out = result
        .and_then(|o| o.success())
        .unwrap_or_else(|e| panic!("guest failed: {e}\nustor log:\n{log}"));
    assert_eq!(code, 0, "ustor serve exit: {log}");
    eprintln!("vhost-user-blk on ustor: guest run {elapsed:?}; {ctrls}");
    let queues = ctrls[0]["queues"].as_array().expect("queues");
    let resubmitted: u64 = queues
        .iter()
        .filter_map(|q| q["resubmitted"].as_u64())
        .sum();
    assert!(
        resubmitted > 0,
        "nothing resubmitted after the kill: {ctrls}"
    );
    assert!(
        queues
            .iter()
            .all(|q| q["in_flight"] == 0 && q["errors"] == 0),
        "{ctrls}"
    );
    // fio's job on each vCPU: after the restart (these counters are the
    // new process's) both queues carried requests.
    assert_eq!(queues.len(), 2, "{ctrls}");
    assert!(
        queues.iter().all(|q| q["requests"].as_u64() > Some(0)),
        "a queue with no requests: {ctrls}"
    );
    assert_eq!(
        out.value("resize_before"),
        Some((64 * MIB).to_string().as_str())
    );
    assert_eq!(
        out.value("resize_after"),
        Some((128 * MIB).to_string().as_str())
    );
    assert_eq!(
        out.value("resize_read_ok"),
        Some("1"),
        "read past the old end"
    );
    assert_eq!(
        vnull[0]["backend_specific"]["block"]["capacity_sectors"],
        128 * MIB / 512,
        "{vnull}"
    );

    assert_eq!(out.value("vub_size"), Some((64 * MIB).to_string().as_str()));
    assert_eq!(
        out.value("read_md5"),
        Some(host_read_md5.as_str()),
        "guest read the host's pattern"
    );
    let written = md5_range(&raw, 16 * MIB, 4 * MIB as usize).expect("md5");
    assert_eq!(
        out.value("write_md5"),
        Some(written.as_str()),
        "host reads the guest's write"
    );
    let zeroes = md5_bytes(&vec![0u8; 4 * MIB as usize]).unwrap();
    assert_eq!(
        out.value("discard_md5"),
        Some(zeroes.as_str()),
        "guest reads zeroes after discard"
    );
    assert_eq!(
        md5_range(&raw, 24 * MIB, 4 * MIB as usize).unwrap(),
        zeroes,
        "discarded range in the file"
    );
    assert_eq!(out.value("fio_ok"), Some("1"), "fio verify");
    fsck_image(&fs).expect("host e2fsck of the image the guest wrote");
    let data = ext4_file_md5(&fs, "/data.bin").expect("data.bin from the image");
    assert_eq!(
        out.value("data_md5"),
        Some(data.as_str()),
        "data.bin in the file"
    );
    assert_eq!(out.value("files"), Some("21"), "file count");
    let _ = std::fs::remove_dir_all(&dir);
}

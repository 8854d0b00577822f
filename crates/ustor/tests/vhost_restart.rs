//! `ustor serve` restarted under a vhost-user frontend with requests in
//! flight. The frontend is the test one of the vhost crate
//! (`crates/vhost-user/tests/common`: rust-vmm's `vhost` crate for the
//! protocol, split rings in a shared memfd), which asks for the inflight
//! region as QEMU does and reconnects to the new process the way QEMU's
//! `reconnect=1` does (rings restarted at the used index, the region
//! handed back). Requests are held at a delay bdev so they are in flight
//! when the process goes, a state the tests wait for in the region itself.
//!
//! - vhost-user-scsi, SIGKILL: the new process serves the held writes
//!   again from the region; each is answered once, and the data is in
//!   the file.
//! - vhost-user-blk, SIGTERM: the process drains (the held writes are
//!   answered before it exits 0), the frontend reconnects and goes on;
//!   nothing is served twice.
//! - vhost-user-blk on packed rings, SIGKILL: the region's packed layout
//!   says where both sides of the ring were (the frontend's base is only
//!   its guess) and which chains to serve again, after the ring has
//!   wrapped; each held write is answered once, and the data is in the
//!   file.
//! - vhost-user-scsi on packed rings, SIGKILL: the same for a scsi
//!   controller's request ring (the region's packed layout).

mod common;
#[path = "../../vhost-user/tests/common/frontend.rs"]
mod frontend;
#[path = "../../vhost-user/tests/common/scsi.rs"]
mod scsi;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use frontend::{Fe, DATA_BASE};
use serde_json::{json, Value};

const MIB: u64 = 1 << 20;

/// A 16 MiB file served as `File`, with delay bdev `Held` over it.
fn disk(dir: &Path, vhost: Value) -> (PathBuf, Value) {
    let img = dir.join("disk.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(16 * MIB))
        .expect("image");
    let delay = json!({"method": "bdev_delay_create", "params": {"base_bdev_name": "File",
        "name": "Held", "avg_read_latency": 0, "p99_read_latency": 0,
        "avg_write_latency": 0, "p99_write_latency": 0}});
    let file = json!({"method": "bdev_uring_create", "params": {
        "filename": img.to_str().unwrap(), "name": "File", "block_size": 512}});
    let config = json!({"subsystems": [
        {"subsystem": "bdev", "config": [file, delay]},
        vhost,
    ]});
    (img, config)
}

fn hold_writes(s: &Server, us: u64) {
    for t in ["avg_write", "p99_write"] {
        let p = json!({"delay_bdev_name": "Held", "latency_type": t, "latency_us": us});
        s.ok("bdev_delay_update_latency", p);
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    pseudo_random(len, seed)
}

fn file_bytes(img: &Path, off: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    std::fs::File::open(img)
        .and_then(|f| f.read_exact_at(&mut b, off))
        .expect("read image");
    b
}

#[test]
fn vhost_scsi_sigkill_resubmits_from_the_inflight_region() {
    use scsi::*;
    let dir = tmpdir("vhost-restart-scsi");
    let sockets = dir.join("vhost");
    std::fs::create_dir_all(&sockets).unwrap();
    let vhost = json!({"subsystem": "vhost_scsi", "config": [
        {"method": "vhost_create_scsi_controller", "params": {"ctrlr": "vs"}},
        {"method": "vhost_scsi_controller_add_target",
         "params": {"ctrlr": "vs", "scsi_target_num": 0, "bdev_name": "Held"}},
    ]});
    let (img, config) = disk(&dir, vhost);
    let args = ["-S", sockets.to_str().unwrap(), "--cores", "0,1"];
    let s = Server::start(&dir, &config, &args);
    let sock = sockets.join("vs");
    let mut f = Fe::connect(&sock, 3, true);
    assert!(f.inflight.is_some(), "no inflight region offered");
    ready(&mut f, REQ0, 0);

    // Eight 4 KiB writes held at the bdev for ten minutes.
    const N: usize = 8;
    hold_writes(&s, 600_000_000);
    for k in 0..N {
        let buf = DATA_BASE + k as u64 * 4096;
        f.mem.write(buf, &pattern(k as u64, 4096));
        let c = rw10(true, 64 + 8 * k as u32, 8);
        cmd(&mut f, REQ0, 1 + k, 0, k as u64, &c, &[(buf, 4096)], &[]);
    }
    testkit::wait_until("writes marked in flight", Duration::from_secs(10), || {
        f.inflight_marked(REQ0) == N
    });
    // The listing's session is this frontend, from the device's state.
    let session = |s: &Server| s.ok("vhost_get_controllers", json!({"name": "vs"}));
    // Each ring's task reports itself running when it starts on its
    // reactor, which may be after the writes are in flight.
    testkit::wait_until(
        "the session counts the writes and three rings",
        Duration::from_secs(10),
        || {
            let c = session(&s);
            let ses = &c[0]["sessions"][0];
            ses["inflight_task_cnt"] == N as u64 && ses["max_queues"] == 3
        },
    );
    let c = session(&s);
    let ses = &c[0]["sessions"][0];
    assert_eq!(ses["frontend_pid"], std::process::id(), "{c}");
    assert_eq!(ses["started"], true, "{c}");
    assert_eq!(ses["max_queues"], 3, "three rings run: {c}");
    assert_eq!(ses["packed_rings"], 0, "{c}");
    s.kill();
    assert!(f.used(REQ0).is_empty(), "answered before the kill");

    // The new process (latencies from the config: none) serves them again.
    let s = Server::start(&dir, &config, &args);
    f.reconnect(&sock);
    let back = f.wait_n(REQ0, N);
    assert_eq!(back.len(), N);
    for k in 0..N {
        let r = resp(&f, REQ0, 1 + k);
        assert!(r.good(), "write {k} after the restart: {r:?}");
    }
    assert_eq!(f.inflight_marked(REQ0), 0);
    let c = session(&s);
    assert_eq!(c[0]["sessions"][0]["resubmitted"], N as u64, "{c}");
    // Through the frontend and in the file.
    for k in 0..N {
        let buf = DATA_BASE + (64 + k as u64) * 4096;
        let c = rw10(false, 64 + 8 * k as u32, 8);
        cmd(&mut f, REQ0, 1, 0, 100 + k as u64, &c, &[], &[(buf, 4096)]);
        f.wait_n(REQ0, 1);
        assert!(resp(&f, REQ0, 1).good());
        assert_eq!(f.mem.bytes(buf, 4096), pattern(k as u64, 4096), "read {k}");
        let at = (64 + 8 * k as u64) * 512;
        assert_eq!(
            file_bytes(&img, at, 4096),
            pattern(k as u64, 4096),
            "file {k}"
        );
    }
    drop(f);
    let (code, out) = s.stop();
    assert_eq!(code, 0, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// One virtio-blk write of `data` at `sector` from header slot `slot`.
fn blk_write(f: &mut Fe, slot: usize, sector: u64, data: u64, len: u32) -> u16 {
    let h = scsi::hdr(0, slot);
    let mut hdr = [0u8; 16];
    hdr[0..4].copy_from_slice(&1u32.to_le_bytes()); // VIRTIO_BLK_T_OUT
    hdr[8..16].copy_from_slice(&sector.to_le_bytes());
    f.mem.write(h, &hdr);
    f.mem.write(h + 16, &[0xff]);
    f.add(0, &[(h, 16, false), (data, len, false), (h + 16, 1, true)])
}

fn blk_status(f: &Fe, slot: usize) -> u8 {
    f.mem.bytes(scsi::hdr(0, slot) + 16, 1)[0]
}

#[test]
fn vhost_blk_sigterm_drains_then_the_frontend_reconnects() {
    let dir = tmpdir("vhost-restart-blk");
    let sockets = dir.join("vhost");
    std::fs::create_dir_all(&sockets).unwrap();
    let vhost = json!({"subsystem": "vhost_blk", "config": [
        {"method": "vhost_create_blk_controller", "params": {"ctrlr": "vb", "dev_name": "Held"}},
    ]});
    let (img, config) = disk(&dir, vhost);
    let args = ["-S", sockets.to_str().unwrap(), "--cores", "0,1"];
    let s = Server::start(&dir, &config, &args);
    let sock = sockets.join("vb");
    let mut f = Fe::connect(&sock, 1, true);
    assert!(f.inflight.is_some(), "no inflight region offered");

    // Eight writes held 300 ms each: in flight when SIGTERM comes.
    const N: usize = 8;
    hold_writes(&s, 300_000);
    for k in 0..N {
        let buf = DATA_BASE + k as u64 * 4096;
        f.mem.write(buf, &pattern(10 + k as u64, 4096));
        blk_write(&mut f, k, 8 * k as u64, buf, 4096);
    }
    testkit::wait_until("writes marked in flight", Duration::from_secs(10), || {
        f.inflight_marked(0) == N
    });
    let (code, out) = s.stop();
    assert_eq!(code, 0, "SIGTERM: {out}");
    // Drained: every write was answered before the process left.
    let back = f.used(0);
    assert_eq!(back.len(), N, "answered before exit");
    assert!((0..N).all(|k| blk_status(&f, k) == 0), "a write failed");
    assert_eq!(f.inflight_marked(0), 0);

    // The new process serves nothing twice and takes new requests.
    let s = Server::start(&dir, &config, &args);
    f.reconnect(&sock);
    for k in 0..N {
        let buf = DATA_BASE + (N + k) as u64 * 4096;
        f.mem.write(buf, &pattern(20 + k as u64, 4096));
        blk_write(&mut f, k, 8 * (N + k) as u64, buf, 4096);
    }
    let back = f.wait_n(0, N);
    assert_eq!(back.len(), N);
    assert!((0..N).all(|k| blk_status(&f, k) == 0), "a write failed");
    let c = s.ok("vhost_get_controllers", json!({"name": "vb"}));
    let q = &c[0]["queues"][0];
    assert_eq!(q["resubmitted"], 0, "{c}");
    assert_eq!(q["requests"], N as u64, "{c}");
    for k in 0..2 * N {
        let seed = if k < N { 10 + k } else { 20 + k - N } as u64;
        let got = file_bytes(&img, 8 * 512 * k as u64, 4096);
        assert_eq!(got, pattern(seed, 4096), "block {k} in the file");
    }
    drop(f);
    let (code, out) = s.stop();
    assert_eq!(code, 0, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn vhost_blk_packed_sigkill_resubmits_from_the_inflight_region() {
    let dir = tmpdir("vhost-restart-packed");
    let sockets = dir.join("vhost");
    std::fs::create_dir_all(&sockets).unwrap();
    let vhost = json!({"subsystem": "vhost_blk", "config": [
        {"method": "vhost_create_blk_controller",
         "params": {"ctrlr": "vb", "dev_name": "Held", "packed_ring": true}},
    ]});
    let (img, config) = disk(&dir, vhost);
    let args = ["-S", sockets.to_str().unwrap(), "--cores", "0,1"];
    let s = Server::start(&dir, &config, &args);
    let sock = sockets.join("vb");
    let mut f = Fe::connect_packed_tracked(&sock, 1);
    assert!(f.inflight.is_some(), "no inflight region offered");

    // 50 writes of three slots answered one by one: the 128-slot ring
    // wraps, so the sides are not where a fresh ring's are.
    const DONE: usize = 50;
    for k in 0..DONE {
        let buf = DATA_BASE + k as u64 * 4096;
        f.mem.write(buf, &pattern(100 + k as u64, 4096));
        blk_write(&mut f, k % 16, 8 * k as u64, buf, 4096);
        assert_eq!(f.wait_n(0, 1).len(), 1);
        assert_eq!(blk_status(&f, k % 16), 0, "write {k}");
    }
    // Eight more held at the bdev for ten minutes.
    const N: usize = 8;
    hold_writes(&s, 600_000_000);
    for k in 0..N {
        let buf = DATA_BASE + (DONE + k) as u64 * 4096;
        f.mem.write(buf, &pattern(200 + k as u64, 4096));
        blk_write(&mut f, 16 + k, 8 * (DONE + k) as u64, buf, 4096);
    }
    testkit::wait_until("writes marked in flight", Duration::from_secs(10), || {
        f.inflight_marked(0) == N
    });
    s.kill();
    assert!(f.used(0).is_empty(), "answered before the kill");

    // The new process (no latency in its config) serves them again.
    let s = Server::start(&dir, &config, &args);
    f.reconnect(&sock);
    let back = f.wait_n(0, N);
    assert_eq!(back.len(), N, "each held write answered once");
    assert!(
        (0..N).all(|k| blk_status(&f, 16 + k) == 0),
        "a write failed"
    );
    assert_eq!(f.inflight_marked(0), 0);
    // The ring goes on where it was: eight more writes.
    for k in 0..N {
        let at = DONE + N + k;
        let buf = DATA_BASE + at as u64 * 4096;
        f.mem.write(buf, &pattern(300 + k as u64, 4096));
        blk_write(&mut f, 32 + k, 8 * at as u64, buf, 4096);
    }
    assert_eq!(f.wait_n(0, N).len(), N);
    assert!(
        (0..N).all(|k| blk_status(&f, 32 + k) == 0),
        "a write failed"
    );
    assert!(f.used(0).is_empty(), "something answered twice");
    let c = s.ok("vhost_get_controllers", json!({"name": "vb"}));
    let q = &c[0]["queues"][0];
    assert_eq!(q["ring"], "packed", "{c}");
    assert_eq!(q["resubmitted"], N as u64, "{c}");
    assert_eq!(q["errors"], 0, "{c}");
    for k in 0..DONE + 2 * N {
        let seed = match k {
            k if k < DONE => 100 + k,
            k if k < DONE + N => 200 + k - DONE,
            k => 300 + k - DONE - N,
        } as u64;
        let got = file_bytes(&img, 8 * 512 * k as u64, 4096);
        assert_eq!(got, pattern(seed, 4096), "block {k} in the file");
    }
    drop(f);
    let (code, out) = s.stop();
    assert_eq!(code, 0, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn vhost_scsi_packed_sigkill_resubmits_from_the_inflight_region() {
    use scsi::*;
    let dir = tmpdir("vhost-restart-scsi-packed");
    let sockets = dir.join("vhost");
    std::fs::create_dir_all(&sockets).unwrap();
    let vhost = json!({"subsystem": "vhost_scsi", "config": [
        {"method": "vhost_create_scsi_controller", "params": {"ctrlr": "vs", "packed_ring": true}},
        {"method": "vhost_scsi_controller_add_target",
         "params": {"ctrlr": "vs", "scsi_target_num": 0, "bdev_name": "Held"}},
    ]});
    let (img, config) = disk(&dir, vhost);
    let args = ["-S", sockets.to_str().unwrap(), "--cores", "0,1"];
    let s = Server::start(&dir, &config, &args);
    let sock = sockets.join("vs");
    let mut f = Fe::connect_packed_tracked(&sock, 3);
    assert!(f.inflight.is_some(), "no inflight region offered");
    ready(&mut f, REQ0, 0);
    let write = |f: &mut Fe, slot: usize, k: usize, seed: u64| {
        let buf = DATA_BASE + k as u64 * 4096;
        f.mem.write(buf, &pattern(seed, 4096));
        let c = rw10(true, 8 * k as u32, 8);
        cmd(f, REQ0, slot, 0, k as u64, &c, &[(buf, 4096)], &[]);
    };

    // 50 writes of three slots answered one by one: the 128-slot ring
    // wraps, so the sides are not where a fresh ring's are.
    const DONE: usize = 50;
    for k in 0..DONE {
        write(&mut f, k % 16, k, 100 + k as u64);
        assert_eq!(f.wait_n(REQ0, 1).len(), 1);
        assert!(resp(&f, REQ0, k % 16).good(), "write {k}");
    }
    // Eight more held at the bdev for ten minutes.
    const N: usize = 8;
    hold_writes(&s, 600_000_000);
    for k in 0..N {
        write(&mut f, 16 + k, DONE + k, 200 + k as u64);
    }
    testkit::wait_until("writes marked in flight", Duration::from_secs(10), || {
        f.inflight_marked(REQ0) == N
    });
    s.kill();
    assert!(f.used(REQ0).is_empty(), "answered before the kill");

    // The new process (no latency in its config) serves them again.
    let s = Server::start(&dir, &config, &args);
    f.reconnect(&sock);
    assert_eq!(f.wait_n(REQ0, N).len(), N, "each held write answered once");
    for k in 0..N {
        let r = resp(&f, REQ0, 16 + k);
        assert!(r.good(), "write {k} after the restart: {r:?}");
    }
    assert_eq!(f.inflight_marked(REQ0), 0);
    // The ring goes on where it was: eight more writes.
    for k in 0..N {
        write(&mut f, 32 + k, DONE + N + k, 300 + k as u64);
    }
    assert_eq!(f.wait_n(REQ0, N).len(), N);
    assert!(
        (0..N).all(|k| resp(&f, REQ0, 32 + k).good()),
        "a write failed"
    );
    assert!(f.used(REQ0).is_empty(), "something answered twice");
    // Each ring's task reports itself when it starts on its reactor
    // (the event ring's may come after the request ring's work).
    let session = || s.ok("vhost_get_controllers", json!({"name": "vs"}))[0]["sessions"][0].clone();
    testkit::wait_until("three packed rings run", Duration::from_secs(10), || {
        session()["packed_rings"] == 3
    });
    assert_eq!(session()["resubmitted"], N as u64, "{}", session());
    for k in 0..DONE + 2 * N {
        let seed = match k {
            k if k < DONE => 100 + k,
            k if k < DONE + N => 200 + k - DONE,
            k => 300 + k - DONE - N,
        } as u64;
        let got = file_bytes(&img, 8 * 512 * k as u64, 4096);
        assert_eq!(got, pattern(seed, 4096), "block {k} in the file");
    }
    drop(f);
    let (code, out) = s.stop();
    assert_eq!(code, 0, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

//! The vhost target driven as an operator drives SPDK's: SPDK's own
//! command-line client (`spdk-rpc`) creates, lists, tunes and deletes
//! vhost-user-blk controllers in `ustor serve -S DIR`; save_config and a
//! restart from it recreate them; a real frontend (libblkio's
//! virtio-blk-vhost-user driver) writes through a controller and SIGTERM
//! drains it: every acknowledged write is in the backing file after exit.

mod common;
#[path = "../../vhost-user/tests/common/frontend.rs"]
mod frontend;

use std::mem::MaybeUninit;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use blkio::{Blkio, ReqFlags};
use common::*;
use serde_json::{json, Value};

fn rpc(s: &Server, args: &[&str]) -> (bool, String) {
    let out = Command::new("spdk-rpc")
        .arg("-s")
        .arg(&s.sock)
        .args(args)
        .output()
        .expect("run spdk-rpc");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn ok(s: &Server, args: &[&str]) -> String {
    let (good, text) = rpc(s, args);
    assert!(good, "spdk-rpc {args:?} failed: {text}");
    text
}

/// The call fails with SPDK's error code `errno` (negative in the reply).
fn fails(s: &Server, args: &[&str], errno: i32) {
    let (good, text) = rpc(s, args);
    assert!(!good, "spdk-rpc {args:?} succeeded: {text}");
    assert!(
        text.contains(&format!("\"code\": -{errno}")),
        "spdk-rpc {args:?}: expected -{errno}: {text}"
    );
}

fn controllers(s: &Server) -> Value {
    let t = ok(s, &["vhost_get_controllers"]);
    serde_json::from_str(&t).unwrap_or_else(|e| panic!("not JSON ({e}): {t}"))
}

fn claimed(s: &Server, bdev: &str) -> bool {
    let b = s.ok("bdev_get_bdevs", json!({"name": bdev}));
    b[0]["claimed"].as_bool().expect("claimed field")
}

/// Writes `data` at byte `off` through a vhost-user-blk frontend and reads
/// it back through the same frontend.
fn write_through_frontend(socket: &Path, off: u64, data: &[u8]) {
    let capacity = 16 << 20;
    let mut b = Blkio::new("virtio-blk-vhost-user").expect("driver");
    b.set_str("path", socket.to_str().unwrap()).unwrap();
    b.connect().expect("connect");
    b.set_i32("num-queues", 1).unwrap();
    let mut out = b.start().expect("start");
    let mem = b.alloc_mem_region(data.len() * 2).expect("mem region");
    b.map_mem_region(&mem).expect("map region");
    let q = &mut out.queues[0];
    let wait = |q: &mut blkio::Blkioq| {
        let mut c = [MaybeUninit::uninit()];
        let mut t = Duration::from_secs(10);
        let n = q.do_io(&mut c, 1, Some(&mut t), None).expect("do_io");
        assert_eq!(n, 1, "no completion within 10 s");
        // SAFETY: do_io initialised the first n entries.
        unsafe { c[0].assume_init_ref() }.ret
    };
    let (w, r) = (mem.addr as *mut u8, (mem.addr + data.len()) as *mut u8);
    // SAFETY: both halves lie inside the region libblkio allocated for us,
    // and no request is in flight while the test touches them.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), w, data.len()) };
    q.write(off, w, data.len(), 0, ReqFlags::empty());
    assert_eq!(wait(q), 0, "write");
    q.read(off, r, data.len(), 0, ReqFlags::empty());
    assert_eq!(wait(q), 0, "read");
    q.read(capacity, r, 4096, 0, ReqFlags::empty());
    assert_ne!(wait(q), 0, "read past the end");
    // SAFETY: as above; the read has completed.
    let back = unsafe { std::slice::from_raw_parts(r, data.len()) };
    assert!(back == data, "read back differs from what was written");
    // The frontend stays connected: the caller's SIGTERM must drain it.
    std::mem::forget(b);
}

#[test]
fn spdk_rpc_drives_vhost_controllers() {
    if !testkit::need("spdk-rpc") {
        return;
    }
    let dir = tmpdir("vhost");
    let sockets = dir.join("vhost");
    std::fs::create_dir_all(&sockets).unwrap();
    let file = dir.join("disk.img");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let s = Server::start(&dir, &empty_config(), &["-S", sockets.to_str().unwrap()]);
    ok(&s, &["bdev_malloc_create", "-b", "Malloc0", "8", "512"]);
    ok(
        &s,
        &["bdev_uring_create", file.to_str().unwrap(), "File0", "512"],
    );

    // Create: the socket appears in the -S directory and the bdev is claimed.
    ok(
        &s,
        &[
            "vhost_create_blk_controller",
            "vb0",
            "Malloc0",
            "--cpumask",
            "0x1",
            "-r",
        ],
    );
    ok(&s, &["vhost_create_blk_controller", "vb1", "File0", "-p"]);
    assert!(sockets.join("vb0").exists() && sockets.join("vb1").exists());
    assert!(claimed(&s, "Malloc0") && claimed(&s, "File0"));
    fails(
        &s,
        &["vhost_create_blk_controller", "vb0", "File0"],
        libc::EEXIST,
    );
    fails(
        &s,
        &["vhost_create_blk_controller", "vb2", "NoSuch"],
        libc::ENODEV,
    );
    fails(
        &s,
        &[
            "vhost_create_blk_controller",
            "vb2",
            "File0",
            "--cpumask",
            "0x100",
        ],
        libc::EINVAL,
    );
    fails(
        &s,
        &["vhost_create_blk_controller", "a/b", "File0"],
        libc::EINVAL,
    );
    let c = controllers(&s);
    assert_eq!(c.as_array().unwrap().len(), 2, "{c}");
    assert_eq!(c[0]["ctrlr"], "vb0");
    assert_eq!(c[0]["cpumask"], "0x1");
    assert_eq!(c[0]["socket"], sockets.join("vb0").to_str().unwrap());
    assert_eq!(c[0]["backend_specific"]["block"]["bdev"], "Malloc0");
    assert_eq!(c[0]["backend_specific"]["block"]["readonly"], true);
    assert_eq!(c[1]["backend_specific"]["block"]["readonly"], false);
    assert_eq!(c[1]["delay_base_us"], 0);
    let one = ok(&s, &["vhost_get_controllers", "-n", "vb1"]);
    assert!(
        one.contains("\"File0\"") && !one.contains("Malloc0"),
        "{one}"
    );
    fails(&s, &["vhost_get_controllers", "-n", "nope"], libc::ENODEV);

    // Coalescing.
    ok(
        &s,
        &["vhost_controller_set_coalescing", "vb1", "100", "50000"],
    );
    fails(
        &s,
        &["vhost_controller_set_coalescing", "vb1", "100", "0"],
        libc::EINVAL,
    );
    fails(
        &s,
        &["vhost_controller_set_coalescing", "nope", "1", "1"],
        libc::ENODEV,
    );
    let c = controllers(&s);
    assert_eq!(
        (
            c[1]["delay_base_us"].as_u64(),
            c[1]["iops_threshold"].as_u64()
        ),
        (Some(100), Some(50000))
    );

    // Delete: socket gone, bdev free again.
    ok(&s, &["vhost_delete_controller", "vb0"]);
    assert!(!sockets.join("vb0").exists());
    assert!(!claimed(&s, "Malloc0"));
    fails(&s, &["vhost_delete_controller", "vb0"], libc::ENODEV);

    // save_config holds what recreates vb1.
    let saved: Value = serde_json::from_str(&ok(&s, &["save_config"])).expect("save_config JSON");
    let vb: Vec<&Value> = saved["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["subsystem"] == "vhost_blk")
        .flat_map(|x| x["config"].as_array().unwrap())
        .collect();
    assert_eq!(vb.len(), 2, "{vb:?}");
    assert_eq!(vb[0]["method"], "vhost_create_blk_controller");
    assert_eq!(vb[0]["params"]["ctrlr"], "vb1");
    assert_eq!(vb[0]["params"]["dev_name"], "File0");
    assert_eq!(vb[1]["method"], "vhost_controller_set_coalescing");
    assert_eq!(vb[1]["params"]["delay_base_us"], 100);

    // A frontend writes; SIGTERM while it is connected drains the
    // controller, removes its socket and flushes the bdev.
    let data: Vec<u8> = (0..256 * 1024u32)
        .map(|i| (i * 7 + i / 4096) as u8)
        .collect();
    write_through_frontend(&sockets.join("vb1"), 1 << 20, &data);
    // The session is the connected frontend (this process); its queue
    // counted the write, the read and the failed read.
    let c = controllers(&s);
    let ses = &c[0]["sessions"][0];
    assert_eq!(ses["frontend_pid"], std::process::id(), "{c}");
    assert_eq!(
        (ses["started"].as_bool(), ses["max_queues"].as_u64()),
        (Some(true), Some(1)),
        "{c}"
    );
    assert_eq!(ses["inflight_task_cnt"], 0, "{c}");
    let q = &c[0]["queues"];
    assert_eq!(q.as_array().map(|a| a.len()), Some(1), "{c}");
    assert_eq!(
        (
            q[0]["index"].as_u64(),
            q[0]["requests"].as_u64(),
            q[0]["errors"].as_u64()
        ),
        (Some(0), Some(3), Some(1)),
        "{c}"
    );
    assert_eq!(q[0]["in_flight"], 0, "{c}");
    assert_eq!(
        c[0]["backend_specific"]["block"]["capacity_sectors"],
        16 << 11,
        "{c}"
    );
    let (code, out) = s.stop();
    assert_eq!(code, 0, "ustor serve exit: {out}");
    assert!(!sockets.join("vb1").exists(), "socket left after SIGTERM");
    let disk = std::fs::read(&file).unwrap();
    assert!(
        disk[1 << 20..(1 << 20) + data.len()] == data[..],
        "write not in the file"
    );

    // A restart from the saved config recreates the controller.
    let s = Server::start(&dir, &saved, &["-S", sockets.to_str().unwrap()]);
    let c = controllers(&s);
    assert_eq!(c.as_array().unwrap().len(), 1, "{c}");
    assert_eq!(c[0]["ctrlr"], "vb1");
    assert_eq!(c[0]["iops_threshold"], 50000);
    assert!(sockets.join("vb1").exists());
    ok(&s, &["vhost_delete_controller", "vb1"]);
    assert!(!claimed(&s, "File0"));
    let (code, out) = s.stop();
    assert_eq!(code, 0, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// vhost-user-scsi controllers through `spdk-rpc`: create, targets added
/// and removed (bdev claims follow), SPDK's error codes, the listing,
/// save_config, and delete sharing the name space with blk controllers.
#[test]
fn spdk_rpc_drives_vhost_scsi_controllers() {
    if !testkit::need("spdk-rpc") {
        return;
    }
    let dir = tmpdir("vhost-scsi-rpc");
    let sockets = dir.join("vhost");
    std::fs::create_dir_all(&sockets).unwrap();
    let s = Server::start(&dir, &empty_config(), &["-S", sockets.to_str().unwrap()]);
    ok(&s, &["bdev_malloc_create", "-b", "M0", "8", "512"]);
    ok(&s, &["bdev_malloc_create", "-b", "M1", "8", "4096"]);
    ok(
        &s,
        &["vhost_create_scsi_controller", "vs0", "--cpumask", "0x1"],
    );
    assert!(sockets.join("vs0").exists());
    fails(&s, &["vhost_create_scsi_controller", "vs0"], libc::EEXIST);
    fails(
        &s,
        &["vhost_create_blk_controller", "vs0", "M0"],
        libc::EEXIST,
    );
    // SPDK answers add_target with the target number.
    let n = ok(&s, &["vhost_scsi_controller_add_target", "vs0", "0", "M0"]);
    assert_eq!(n.trim(), "0");
    ok(&s, &["vhost_scsi_controller_add_target", "vs0", "3", "M1"]);
    assert!(claimed(&s, "M0") && claimed(&s, "M1"));
    fails(
        &s,
        &["vhost_scsi_controller_add_target", "vs0", "0", "M1"],
        libc::EEXIST,
    );
    fails(
        &s,
        &["vhost_scsi_controller_add_target", "vs0", "8", "M1"],
        libc::EINVAL,
    );
    fails(
        &s,
        &["vhost_scsi_controller_add_target", "vs0", "1", "Nope"],
        libc::ENODEV,
    );
    fails(
        &s,
        &["vhost_scsi_controller_add_target", "vsX", "1", "M1"],
        libc::ENODEV,
    );

    let c = controllers(&s);
    assert_eq!(c[0]["ctrlr"], "vs0", "{c}");
    assert_eq!(c[0]["cpumask"], "0x1");
    let t = &c[0]["backend_specific"]["scsi"];
    assert_eq!(t[0]["scsi_dev_num"], 0, "{c}");
    assert_eq!(t[0]["luns"][0]["bdev_name"], "M0");
    assert_eq!(t[1]["scsi_dev_num"], 3);
    assert_eq!(t[1]["luns"][0]["bdev_name"], "M1");

    let saved: Value = serde_json::from_str(&ok(&s, &["save_config"])).expect("save_config JSON");
    let vs: Vec<&Value> = saved["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["subsystem"] == "vhost_scsi")
        .flat_map(|x| x["config"].as_array().unwrap())
        .collect();
    assert_eq!(vs.len(), 3, "{vs:?}");
    assert_eq!(vs[0]["method"], "vhost_create_scsi_controller");
    assert!(vs[0]["params"].get("packed_ring").is_none(), "{vs:?}");
    assert_eq!(vs[1]["method"], "vhost_scsi_controller_add_target");
    assert_eq!(vs[2]["params"]["scsi_target_num"], 3);
    assert_eq!(vs[2]["params"]["bdev_name"], "M1");

    // `packed_ring` is ours for scsi (SPDK's method has none): the
    // controller offers packed rings, a frontend runs all three packed,
    // and save_config keeps the parameter.
    s.ok(
        "vhost_create_scsi_controller",
        json!({"ctrlr": "vsp", "packed_ring": true}),
    );
    let vsp = s.ok("vhost_get_controllers", json!({"name": "vsp"}));
    assert_eq!(vsp[0]["packed_ring"], true, "{vsp}");
    assert_eq!(
        s.ok("vhost_get_controllers", json!({"name": "vs0"}))[0]["packed_ring"],
        false
    );
    let f = frontend::Fe::connect_packed(&sockets.join("vsp"), 3);
    testkit::wait_until("three packed rings run", Duration::from_secs(10), || {
        let c = s.ok("vhost_get_controllers", json!({"name": "vsp"}));
        c[0]["sessions"][0]["packed_rings"] == 3
    });
    drop(f);
    let saved: Value = serde_json::from_str(&ok(&s, &["save_config"])).expect("save_config JSON");
    let created = saved["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["subsystem"] == "vhost_scsi")
        .flat_map(|x| x["config"].as_array().unwrap())
        .find(|c| c["params"]["ctrlr"] == "vsp")
        .cloned()
        .expect("vsp in save_config");
    assert_eq!(created["params"]["packed_ring"], true, "{created}");
    ok(&s, &["vhost_delete_controller", "vsp"]);

    ok(&s, &["vhost_scsi_controller_remove_target", "vs0", "3"]);
    assert!(!claimed(&s, "M1"));
    fails(
        &s,
        &["vhost_scsi_controller_remove_target", "vs0", "3"],
        libc::ENODEV,
    );
    ok(&s, &["vhost_delete_controller", "vs0"]);
    assert!(!sockets.join("vs0").exists());
    assert!(!claimed(&s, "M0"));
    assert_eq!(controllers(&s), json!([]));
    let (code, out) = s.stop();
    assert_eq!(code, 0, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

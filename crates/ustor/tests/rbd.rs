//! The rbd bdev against a real one-node Ceph cluster (one mon, one memstore
//! OSD, cephx) that this test binary starts once with
//! `scripts/ceph-cluster.sh` and stops at exit: `ustor bench --verify` on
//! RBD images (two images on two reactors at once, one per completion
//! mode: librbd's callback and its event socket); an image exported over
//! NBD, written by qemu-img, and one over NVMe/TCP, written by the Linux
//! kernel's nvme-tcp initiator in a QEMU guest (a pattern and fio verify),
//! both read back with `rbd export` (checksums);
//! resize, and a concat array growing with its last image; cluster info,
//! placement and save_config; compare-and-write not offered on 4 KiB
//! blocks; and bad cluster names,
//! pools, images and keys answered with clear errors and nothing
//! half-created.

mod common;
mod rbd_support;

use std::process::Command;
use std::time::Duration;

use common::*;
use rbd_support::*;
use serde_json::{json, Value};

#[test]
fn bench_verify_on_two_images_on_two_reactors() {
    let Some(c) = ceph() else { return };
    c.create_image("bench0", 32);
    c.create_image("bench1", 32);
    let dir = tmpdir("rbd-bench");
    let cfg = dir.join("cfg.json");
    let conf = bdev_config(vec![
        c.register("c1"),
        rbd_bdev("r0", "bench0"),
        // The other completion mode: librbd's event socket, polled by
        // both reactors.
        {
            let mut b = rbd_bdev("r1", "bench1");
            b["params"]["completion"] = json!("event");
            b
        },
    ]);
    std::fs::write(&cfg, conf.to_string()).unwrap();
    // Both images at once, each from its own reactor (two bench processes
    // would not share the connection; one process, two runs in parallel
    // threads of the test, each on two reactors).
    let runs: Vec<_> = ["r0", "r1"]
        .into_iter()
        .map(|b| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                bench(
                    &cfg,
                    &[
                        "-b", b, "-w", "randrw", "--qd", "8", "-t", "1.5", "--verify", "--cores",
                        "0,1",
                    ],
                )
            })
        })
        .collect();
    for r in runs {
        let (code, v, log) = r.join().unwrap();
        assert_eq!(code, 0, "{log}");
        assert_eq!(v["total"]["verify_errors"], 0, "{log}");
        assert_eq!(v["total"]["errors"], 0, "{log}");
        assert_eq!(v["per_core"].as_array().unwrap().len(), 2, "{log}");
        for pc in v["per_core"].as_array().unwrap() {
            assert!(pc["ios"].as_u64().unwrap() > 50, "{log}");
        }
    }
    // The processes closed their images at exit: no watcher or exclusive
    // lock is left to a dead client (the next writer would wait ~30 s).
    for img in ["rbd/bench0", "rbd/bench1"] {
        let st = String::from_utf8_lossy(&c.rbd(&["status", img])).to_string();
        assert!(!st.contains("watcher="), "{img}: {st}");
    }
}

#[test]
fn nbd_export_written_by_qemu_img_reads_back_with_rbd_export() {
    let Some(c) = ceph() else { return };
    if !have("qemu-img") {
        return;
    }
    c.create_image("nbd0", 16);
    let dir = tmpdir("rbd-nbd");
    let cfg = json!({"subsystems": [
        {"subsystem": "bdev", "config": [c.register("c1"), rbd_bdev("r0", "nbd0")]},
        {"subsystem": "nbd", "config": [
            {"method": "nbd_server_start", "params": {"listen_address": {"traddr": "127.0.0.1", "trsvcid": "0"}}},
            {"method": "nbd_export_create", "params": {"name": "r0", "bdev_name": "r0"}}
        ]}
    ]});
    let s = Server::start(&dir, &cfg, &[]);
    let data = pseudo_random(16 << 20, 0x5eed);
    let src = dir.join("src.img");
    std::fs::write(&src, &data).unwrap();
    let url = format!("nbd://127.0.0.1:{}/r0", s.nbd_port());
    let out = Command::new("timeout")
        .args(["60", "qemu-img", "convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(&url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // What Ceph holds, read by Ceph's own client.
    let exported = c.rbd(&["export", "rbd/nbd0", "-"]);
    assert_eq!(exported.len(), data.len());
    assert_eq!(sha256(&exported), sha256(&data));
    // And what ustor reads back through NBD.
    let back = dir.join("back.img");
    let out = Command::new("timeout")
        .args(["60", "qemu-img", "convert", "-f", "raw", "-O", "raw", &url])
        .arg(&back)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(sha256(&std::fs::read(&back).unwrap()), sha256(&data));
    // Resized, the export has the new size at the next connect.
    s.ok("bdev_rbd_resize", json!({"name": "r0", "new_size": 20}));
    let out = Command::new("timeout")
        .args(["30", "qemu-img", "info", "--output=json", &url])
        .output()
        .unwrap();
    let info: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    assert_eq!(info["virtual-size"], 20u64 << 20, "{info}");
    s.stop();
}

const NQN: &str = "nqn.2026-11.io.ustor:rbd";

/// The kernel's nvme-tcp initiator in a QEMU guest: connect, dd the host's
/// pattern (O_DIRECT) to the first 8 MiB, fio with crc32c verify over the
/// next 16 MiB, then the md5 of the whole namespace as read back through
/// the target, and disconnect.
const NVMF_SCRIPT: &str = r#". /ustor/lib.sh
set -u
run modprobe nvme-tcp
run nvme connect -t tcp -a 10.0.2.2 -s "$NVME_PORT" -n "$NVME_NQN"
dev=
n=200
while [ -z "$dev" ]; do
    for b in /sys/block/nvme*n1; do
        [ -e "$b" ] || continue
        case ${b##*/} in nvme*c*n*) continue ;; esac
        dev=${b##*/}
    done
    [ -n "$dev" ] && break
    n=$((n - 1)); [ $n -gt 0 ] || die "no namespace"
    sleep 0.1
done
wait_for "/dev/$dev"
kv ns_size "$(size_bytes "/dev/$dev")"
run dd if=/ustor/pattern.bin of="/dev/$dev" bs=1M oflag=direct conv=fsync 2>/dev/null
/ustor/bin/fio --name=verify --filename="/dev/$dev" --ioengine=libaio --direct=1 \
    --rw=randwrite --bs=4k --iodepth=16 --offset=8M --size=16M \
    --verify=crc32c --do_verify=1 --verify_fatal=1 > /tmp/fio.out 2>&1 \
    || { cat /tmp/fio.out; die "fio verify failed"; }
kv fio_verify_errors "$(grep -c 'verify: bad' /tmp/fio.out)"
kv fio_phases "$(grep -c -E '^ +(READ|WRITE): bw=' /tmp/fio.out)"
kv pattern_md5 "$(dd if="/dev/$dev" bs=1M count=8 iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1)"
kv whole_md5 "$(dd if="/dev/$dev" bs=1M iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1)"
run nvme disconnect -n "$NVME_NQN"
"#;

/// The TCP port `NQN`'s listener bound (the RPC server answers while `-c`
/// is still being applied: wait for it).
fn nvmf_port(s: &Server) -> u16 {
    let subs = || s.ok("nvmf_get_subsystems", Value::Null);
    testkit::try_wait_for(Duration::from_secs(20), || {
        subs()
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["nqn"] == NQN && x["namespaces"].as_array().is_some_and(|n| !n.is_empty()))
            .and_then(|x| x["listen_addresses"][0]["trsvcid"].as_str())
            .and_then(|p| p.parse().ok())
            .filter(|p| *p != 0)
    })
    .unwrap_or_else(|| panic!("no bound listener in {}", subs()))
}

#[test]
fn nvmf_export_written_by_kernel_initiator_reads_back_with_rbd_export() {
    testvm::require_guest!();
    let Some(c) = ceph() else { return };
    if !testkit::need("fio") {
        return;
    }
    c.create_image("nvmf0", 32);
    let dir = tmpdir("rbd-nvmf");
    let cfg = json!({"subsystems": [
        {"subsystem": "bdev", "config": [c.register("c1"), rbd_bdev("r0", "nvmf0")]},
        {"subsystem": "nvmf", "config": [
            {"method": "nvmf_create_transport", "params": {"trtype": "TCP"}},
            {"method": "nvmf_create_subsystem", "params": {"nqn": NQN, "allow_any_host": true}},
            {"method": "nvmf_subsystem_add_ns", "params": {"nqn": NQN, "namespace": {"bdev_name": "r0"}}},
            {"method": "nvmf_subsystem_add_listener", "params": {"nqn": NQN,
                "listen_address": {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": "0"}}}
        ]}
    ]});
    let s = Server::start(&dir, &cfg, &[]);
    let port = nvmf_port(&s);
    let pattern = pseudo_random(8 << 20, 0x2b0d);
    let out = testvm::GuestBuilder::new()
        .script(NVMF_SCRIPT)
        .binary("/usr/bin/fio")
        .file("pattern.bin", pattern.clone())
        .env("NVME_PORT", port.to_string())
        .env("NVME_NQN", NQN)
        .timeout(Duration::from_secs(300))
        .run();
    let (code, log) = s.stop();
    let out = out
        .and_then(|o| o.success())
        .unwrap_or_else(|e| panic!("guest failed: {e}\nustor log:\n{log}"));
    assert_eq!(code, 0, "{log}");
    assert_eq!(
        out.value("ns_size"),
        Some((32u64 << 20).to_string().as_str())
    );
    assert_eq!(out.value("fio_verify_errors"), Some("0"));
    assert_eq!(
        out.value("fio_phases"),
        Some("2"),
        "writes and verify reads"
    );
    // Ceph's own client reads what the kernel wrote through ustor: the
    // pattern, and the same bytes the guest read back.
    let exported = c.rbd(&["export", "rbd/nvmf0", "-"]);
    assert_eq!(exported.len(), 32 << 20);
    assert_eq!(sha256(&exported[..8 << 20]), sha256(&pattern));
    let md5 = |b: &[u8]| testvm::host::md5_bytes(b).unwrap();
    assert_eq!(out.value("pattern_md5"), Some(md5(&pattern).as_str()));
    assert_eq!(out.value("whole_md5"), Some(md5(&exported).as_str()));
}

/// Runs `qemu-io -c CMD` on an NBD url: (success, output, seconds).
fn qemu_io(url: &str, cmd: &str) -> (bool, String, f64) {
    let t = std::time::Instant::now();
    let out = Command::new("timeout")
        .args(["60", "qemu-io", "-f", "raw", "-c", cmd, url])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // qemu-io exits 0 even when the command failed: look at its words.
    let ok = out.status.success() && !text.contains("failed");
    (ok, text, t.elapsed().as_secs_f64())
}

#[test]
fn pool_deleted_while_exported_fails_io_and_the_bdev_says_so() {
    let Some(c) = ceph() else { return };
    if !testkit::need("qemu-io") {
        return;
    }
    // A pool of its own: the other tests' images live in `rbd`.
    let ceph_ = |args: &[&str]| {
        let out = Command::new("timeout")
            .args(["30", "ceph", "-c", &c.conf()])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "ceph {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    ceph_(&["osd", "pool", "create", "gone", "8"]);
    c.rbd(&["pool", "init", "gone"]);
    c.rbd(&["create", "--size", "8M", "gone/img"]);
    c.create_image("stays0", 8);
    let dir = tmpdir("rbd-gone");
    let op_timeout = 5.0;
    let cfg = json!({"subsystems": [
        {"subsystem": "bdev", "config": [
            {"method": "bdev_rbd_register_cluster", "params": {"name": "c1",
                "config_file": c.conf(), "config_param": {"rados_osd_op_timeout": "5"}}},
            {"method": "bdev_rbd_create", "params": {"name": "g", "cluster_name": "c1",
                "pool_name": "gone", "rbd_name": "img", "block_size": 4096}},
            rbd_bdev("s", "stays0"),
        ]},
        {"subsystem": "nbd", "config": [
            {"method": "nbd_server_start", "params": {"listen_address": {"traddr": "127.0.0.1", "trsvcid": "0"}}},
            {"method": "nbd_export_create", "params": {"name": "g", "bdev_name": "g"}},
            {"method": "nbd_export_create", "params": {"name": "s", "bdev_name": "s"}}
        ]}
    ]});
    let s = Server::start(&dir, &cfg, &[]);
    let url = |e: &str| format!("nbd://127.0.0.1:{}/{e}", s.nbd_port());
    let (ok, out, _) = qemu_io(&url("g"), "write -P 0x5a 0 1M");
    assert!(ok, "{out}");
    let health = |b: &str| {
        s.ok("bdev_get_bdevs", json!({"name": b}))[0]["driver_specific"]["rbd"]["health"].clone()
    };
    assert_eq!(health("g")["state"], "ok");
    // `rbd rm` refuses an image ustor has open (its watch).
    let out = Command::new("timeout")
        .args(["30", "rbd", "-c", &c.conf(), "rm", "gone/img"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("watchers"));
    ceph_(&[
        "osd",
        "pool",
        "delete",
        "gone",
        "gone",
        "--yes-i-really-really-mean-it",
    ]);
    // Reads and writes fail with an error, well within the op timeout.
    for cmd in ["read 0 4k", "write -P 0x11 0 4k"] {
        let (ok, out, secs) = qemu_io(&url("g"), cmd);
        assert!(!ok, "{cmd} after the pool went: {out}");
        assert!(secs < op_timeout + 10.0, "{cmd} took {secs} s");
    }
    let h = health("g");
    eprintln!("after the pool went: {h}");
    assert_eq!(h["state"], "pool deleted", "{h}");
    assert!(h["io_errors"].as_u64().unwrap() >= 2, "{h}");
    assert!(h["last_error"].is_string(), "{h}");
    // The other image, on the same connection, is untouched.
    let (ok, out, _) = qemu_io(&url("s"), "write -P 0x77 0 64k");
    assert!(ok, "{out}");
    let (ok, out, _) = qemu_io(&url("s"), "read -P 0x77 0 64k");
    assert!(ok, "{out}");
    assert_eq!(health("s")["state"], "ok");
    // The dead bdev goes away on request, promptly, and the process
    // exits cleanly (closing the image does not hang either).
    s.ok("nbd_export_delete", json!({"name": "g"}));
    assert_eq!(s.ok("bdev_rbd_delete", json!({"name": "g"})), json!(true));
    let (code, log) = s.stop();
    assert_eq!(code, 0, "{log}");
    assert!(log.contains("rbd I/O failing"), "{log}");
}

fn err_msg(r: Result<Value, ustor_rpc::RpcError>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v}"),
        Err(e) => format!("{e:?}"),
    }
}

#[test]
fn bad_cluster_pool_image_and_key_fail_cleanly() {
    let Some(c) = ceph() else { return };
    c.create_image("bad0", 8);
    let dir = tmpdir("rbd-bad");
    let s = Server::start(&dir, &empty_config(), &[]);
    let create = |cluster: &str, pool: &str, image: &str| {
        s.call(
            "bdev_rbd_create",
            json!({"name": "x", "cluster_name": cluster, "pool_name": pool,
                   "rbd_name": image, "block_size": 4096}),
        )
    };
    let e = err_msg(create("nope", "rbd", "bad0"));
    assert!(e.contains("cluster `nope` is not registered"), "{e}");
    // A key that is not client.admin's: cephx refuses the connection.
    let bad_key = dir.join("bad.keyring");
    std::fs::write(
        &bad_key,
        "[client.admin]\n\tkey = AQBHrjtnAAAAABAAeVPfpUVX8WwHFyZ3Ta8c5Q==\n",
    )
    .unwrap();
    let e = err_msg(s.call(
        "bdev_rbd_register_cluster",
        json!({"name": "k", "config_file": c.conf(), "key_file": bad_key}),
    ));
    assert!(e.contains("connecting to cluster `k`"), "{e}");
    let e = err_msg(s.call(
        "bdev_rbd_register_cluster",
        json!({"name": "f", "config_file": dir.join("missing.conf")}),
    ));
    assert!(e.contains("reading config file"), "{e}");
    let e = err_msg(s.call(
        "bdev_rbd_register_cluster",
        json!({"name": "m", "config_file": c.conf(), "core_mask": "0x10000000000"}),
    ));
    assert!(e.contains("core_mask"), "{e}");
    // None of them was registered.
    assert_eq!(s.ok("bdev_rbd_get_clusters_info", json!({})), json!([]));
    s.ok(
        "bdev_rbd_register_cluster",
        c.register("c1")["params"].clone(),
    );
    let e = err_msg(create("c1", "nopool", "bad0"));
    assert!(e.contains("pool `nopool` does not exist"), "{e}");
    let e = err_msg(create("c1", "rbd", "noimage"));
    assert!(e.contains("image `rbd/noimage` does not exist"), "{e}");
    let e = err_msg(s.call(
        "bdev_rbd_create",
        json!({"cluster_name": "c1", "pool_name": "rbd", "rbd_name": "bad0", "block_size": 1000}),
    ));
    assert!(e.contains("block_size"), "{e}");
    assert_eq!(s.ok("bdev_get_bdevs", json!({})), json!([]));
    // Nothing holds the cluster: it goes.
    assert_eq!(
        s.ok("bdev_rbd_unregister_cluster", json!({"name": "c1"})),
        json!(true)
    );
    s.stop();
}

#[test]
fn clusters_info_placement_resize_and_save_config() {
    let Some(c) = ceph() else { return };
    c.create_image("cfg0", 8);
    let dir = tmpdir("rbd-cfg");
    let cfg = bdev_config(vec![
        json!({"method": "bdev_rbd_register_cluster", "params": {"name": "c1",
            "config_file": c.conf(), "core_mask": "0x1",
            "config_param": {"rados_osd_op_timeout": "20"}}}),
        rbd_bdev("r0", "cfg0"),
    ]);
    let s = Server::start(&dir, &cfg, &[]);
    let info = s.ok("bdev_rbd_get_clusters_info", json!({"name": "c1"}));
    assert_eq!(info["cluster_name"], "c1", "{info}");
    assert_eq!(info["core_mask"], "0x1", "{info}");
    assert_eq!(info["cores"], json!([0]), "{info}");
    assert!(info["threads"].as_u64().unwrap() > 0, "{info}");
    // Every thread librados made runs on core 0 only, as SCHED_OTHER
    // (`sched_batch` and `batch_completions` are off by default).
    assert_eq!(info["sched_batch"], false, "{info}");
    assert_eq!(info["batch_completions"], false, "{info}");
    let pid = s.child.id();
    let pinned = ceph_threads(pid);
    assert!(!pinned.is_empty(), "no librados threads found");
    // librbd's update watchers' pool (started by the header watch) too.
    assert!(
        pinned.iter().any(|t| t.name == "tp_librbd"),
        "no tp_librbd thread"
    );
    assert!(
        pinned.iter().any(|t| t.name == "io_context_pool"),
        "no io_context_pool thread"
    );
    for t in &pinned {
        assert_eq!(t.cpus, "0", "thread {} runs on {}", t.name, t.cpus);
        assert_eq!(t.policy, 0, "thread {} has policy {}", t.name, t.policy);
    }
    let mut before: Vec<String> = pinned.into_iter().map(|t| t.tid).collect();
    // A second connection with `opt: true`: the threads it made.
    let register = |name: &str, opt: &str, before: &[String]| {
        let mut p = json!({"name": name, "config_file": c.conf(), "core_mask": "0x1"});
        p[opt] = json!(true);
        s.ok("bdev_rbd_register_cluster", p);
        let info = s.ok("bdev_rbd_get_clusters_info", json!({"name": name}));
        assert_eq!(info[opt], true, "{info}");
        let made: Vec<CephThread> = ceph_threads(pid)
            .into_iter()
            .filter(|t| !before.contains(&t.tid))
            .collect();
        assert!(!made.is_empty(), "{name} made no threads");
        made
    };
    // `batch_completions: true`: the completion thread SCHED_BATCH, the
    // messenger SCHED_OTHER (threads librbd starts from the completion
    // thread would inherit its policy).
    let c3 = register("c3", "batch_completions", &before);
    let policy = |name: &str| {
        c3.iter()
            .find(|t| t.name.starts_with(name))
            .map(|t| t.policy)
    };
    assert_eq!(policy("io_context_pool"), Some(3), "c3 completion thread");
    assert_eq!(policy("msgr-worker"), Some(0), "c3 messenger");
    before.extend(c3.iter().map(|t| t.tid.clone()));
    s.ok("bdev_rbd_unregister_cluster", json!({"name": "c3"}));
    // `sched_batch: true`: the new connection's threads run SCHED_BATCH.
    for t in &register("c2", "sched_batch", &before) {
        assert_eq!(t.policy, 3, "c2 thread {} has policy {}", t.name, t.policy);
    }
    s.ok("bdev_rbd_unregister_cluster", json!({"name": "c2"}));
    // In use: the cluster stays.
    let e = err_msg(s.call("bdev_rbd_unregister_cluster", json!({"name": "c1"})));
    assert!(e.contains("used by 1 bdev"), "{e}");
    // Resize: Ceph sees the new size, and so does the bdev's driver info.
    assert_eq!(
        s.ok("bdev_rbd_resize", json!({"name": "r0", "new_size": 16})),
        json!(true)
    );
    let i: Value =
        serde_json::from_slice(&c.rbd(&["info", "--format", "json", "rbd/cfg0"])).unwrap();
    assert_eq!(i["size"], 16u64 << 20, "{i}");
    let b = s.ok("bdev_get_bdevs", json!({"name": "r0"}));
    assert_eq!(
        b[0]["driver_specific"]["rbd"]["image_size"],
        16u64 << 20,
        "{b}"
    );
    assert_eq!(b[0]["product_name"], "Ceph Rbd Disk");
    // librbd compares within one 512-byte sector: not offered on 4 KiB
    // blocks (the rbd crate's compare_and_write test covers 512).
    assert_eq!(
        b[0]["supported_io_types"]["compare_and_write"], false,
        "{b}"
    );
    assert_eq!(b[0]["num_blocks"], (16u64 << 20) / 4096, "{b}");
    // A resize by another client (the rbd CLI) reaches the bdev through
    // librbd's update watch.
    c.rbd(&["resize", "--size", "24M", "rbd/cfg0"]);
    testkit::wait_until("the bdev sees rbd resize", Duration::from_secs(20), || {
        s.ok("bdev_get_bdevs", json!({"name": "r0"}))[0]["num_blocks"] == (24u64 << 20) / 4096
    });
    // Back to 16 MiB for the save_config check below.
    assert_eq!(
        s.ok("bdev_rbd_resize", json!({"name": "r0", "new_size": 16})),
        json!(true)
    );
    // save_config: the cluster first, then the bdev, with what was given.
    let saved = s.ok("framework_get_config", json!({"name": "bdev"}));
    let calls = saved.as_array().unwrap();
    let pos = |m: &str| calls.iter().position(|c| c["method"] == m).unwrap();
    assert!(
        pos("bdev_rbd_register_cluster") < pos("bdev_rbd_create"),
        "{saved}"
    );
    let reg = &calls[pos("bdev_rbd_register_cluster")]["params"];
    assert_eq!(reg["config_param"]["rados_osd_op_timeout"], "20", "{saved}");
    let cr = &calls[pos("bdev_rbd_create")]["params"];
    assert_eq!(cr["rbd_name"], "cfg0");
    assert!(cr["uuid"].is_string(), "{saved}");
    // The saved config brings the same bdev back in a new process.
    s.stop();
    let s2 = Server::start(
        &dir,
        &json!({"subsystems": [{"subsystem": "bdev", "config": saved}]}),
        &[],
    );
    let b2 = s2.ok("bdev_get_bdevs", json!({"name": "r0"}));
    assert_eq!(b2[0]["uuid"], b[0]["uuid"]);
    assert_eq!(b2[0]["num_blocks"], (16u64 << 20) / 4096);
    s2.ok("bdev_rbd_delete", json!({"name": "r0"}));
    s2.ok("bdev_rbd_unregister_cluster", json!({"name": "c1"}));
    s2.stop();
}

/// librbd/librados are loaded at run time: the binary builds and starts
/// on a host without them (one `cargo build`, no Ceph headers).
#[test]
fn ustor_binary_does_not_link_librbd() {
    let out = Command::new("ldd")
        .arg(env!("CARGO_BIN_EXE_ustor"))
        .output()
        .unwrap();
    assert!(out.status.success(), "ldd failed");
    let libs = String::from_utf8_lossy(&out.stdout);
    assert!(libs.contains("libc.so"), "ldd output: {libs}");
    for l in ["librbd", "librados", "libceph"] {
        assert!(!libs.contains(l), "ustor links {l}:\n{libs}");
    }
}

/// A concat array whose last member is an RBD image grows with it:
/// `bdev_rbd_resize` grows the array; data written over NBD across the
/// old end and past it reads back in a new process started from
/// save_config, and `rbd export` finds it at the member's offsets.
#[test]
fn concat_grows_with_its_last_rbd_member_and_keeps_data_past_the_old_end() {
    let Some(c) = ceph() else { return };
    if !have("qemu-io") {
        return;
    }
    c.create_image("cat0", 4);
    c.create_image("cat1", 4);
    let dir = tmpdir("rbd-concat");
    let nbd = json!({"subsystem": "nbd", "config": [
        {"method": "nbd_server_start", "params": {"listen_address": {"traddr": "127.0.0.1", "trsvcid": "0"}}},
        {"method": "nbd_export_create", "params": {"name": "cat", "bdev_name": "cat"}}
    ]});
    let cfg = json!({"subsystems": [
        {"subsystem": "bdev", "config": [c.register("c1"), rbd_bdev("a", "cat0"), rbd_bdev("b", "cat1"),
            {"method": "bdev_raid_create", "params": {"name": "cat", "raid_level": "concat",
                "base_bdevs": ["a", "b"], "strip_size_kb": 64}}]},
        nbd.clone(),
    ]});
    let s = Server::start(&dir, &cfg, &[]);
    let blocks = |s: &Server| {
        s.ok("bdev_get_bdevs", json!({"name": "cat"}))[0]["num_blocks"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(blocks(&s), (8 << 20) / 4096);
    assert_eq!(
        s.ok("bdev_rbd_resize", json!({"name": "b", "new_size": 12})),
        json!(true)
    );
    testkit::wait_until("the concat grows", Duration::from_secs(20), || {
        blocks(&s) == (16 << 20) / 4096
    });
    let raid = s.ok("bdev_raid_get_bdevs", json!({"category": "all"}));
    assert_eq!(
        raid[0]["base_bdevs_list"][1]["data_size"],
        (12u64 << 20) / 4096,
        "{raid}"
    );
    // Across the old end (8 MiB: b's old 4 MiB) and past it.
    let url = |s: &Server| format!("nbd://127.0.0.1:{}/cat", s.nbd_port());
    for cmd in ["write -P 0x3b 7M 2M", "write -P 0xc4 12M 2M"] {
        let (ok, out, _) = qemu_io(&url(&s), cmd);
        assert!(ok, "{cmd}: {out}");
    }
    let saved = s.ok("framework_get_config", json!({"name": "bdev"}));
    s.stop();
    // The saved config (the image is 12 MiB now) brings the grown array
    // back, data and all.
    let s2 = Server::start(
        &dir,
        &json!({"subsystems": [{"subsystem": "bdev", "config": saved}, nbd]}),
        &[],
    );
    assert_eq!(blocks(&s2), (16 << 20) / 4096);
    for cmd in [
        "read -P 0x3b 7M 2M",
        "read -P 0xc4 12M 2M",
        "read -P 0 14M 2M",
    ] {
        let (ok, out, _) = qemu_io(&url(&s2), cmd);
        assert!(ok, "{cmd}: {out}");
    }
    s2.stop();
    // Another client reads member b (the array's 4 MiB on).
    let img = dir.join("cat1.img");
    c.rbd(&["export", "rbd/cat1", img.to_str().unwrap()]);
    let b = std::fs::read(&img).unwrap();
    assert_eq!(b.len(), 12 << 20);
    assert!(b[3 << 20..5 << 20].iter().all(|&x| x == 0x3b));
    assert!(b[8 << 20..10 << 20].iter().all(|&x| x == 0xc4));
}

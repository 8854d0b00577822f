//! Virtual bdevs end to end: `ustor bench --verify` on raid0, concat, raid1, a
//! split part, a passthru, an error and a delay bdev made from a config file; a
//! raid0, concat, raid1 and a delay over a passthru over a split part
//! built over RPC (SPDK's methods), each written and read by a real NBD
//! peer (nbdcopy) and compared, and verified by fio over NBD; save_config recreates the stack; raid1
//! remove/add/rebuild over RPC; bad parameters come back as errors with
//! nothing created.

mod common;

use std::process::Command;

use common::*;
use serde_json::{json, Value};

fn vbdev_config() -> Value {
    let mut calls: Vec<Value> = (0..9)
        .map(|i| {
            json!({"method": "bdev_malloc_create",
                "params": {"name": format!("m{i}"), "num_blocks": (16 << 20) / 512, "block_size": 512}})
        })
        .collect();
    calls.extend([
        json!({"method": "bdev_raid_create", "params": {"name": "r0", "raid_level": "raid0",
            "base_bdevs": ["m0", "m1"], "strip_size_kb": 4}}),
        json!({"method": "bdev_raid_create", "params": {"name": "c0", "raid_level": "concat",
            "base_bdevs": ["m2", "m3"], "strip_size_kb": 64}}),
        json!({"method": "bdev_split_create", "params": {"base_bdev": "m4", "split_count": 2}}),
        json!({"method": "bdev_passthru_create", "params": {"base_bdev_name": "m4p0", "name": "pt"}}),
        json!({"method": "bdev_error_create", "params": {"base_name": "m5"}}),
        json!({"method": "bdev_raid_create", "params": {"name": "mir", "raid_level": "raid1",
            "base_bdevs": ["m7", "m8"]}}),
        json!({"method": "bdev_delay_create", "params": {"base_bdev_name": "m6", "name": "dl",
            "avg_read_latency": 100, "p99_read_latency": 300, "avg_write_latency": 50,
            "p99_write_latency": 200}}),
    ]);
    json!({"subsystems": [{"subsystem": "bdev", "config": calls}]})
}

#[test]
fn bench_verify_passes_on_every_vbdev() {
    let dir = tmpdir("vbdev-bench");
    let cfg = dir.join("vbdev.json");
    std::fs::write(&cfg, serde_json::to_vec(&vbdev_config()).unwrap()).unwrap();
    for b in ["r0", "c0", "m4p1", "pt", "EE_m5", "dl", "mir"] {
        let out = Command::new(BIN)
            .args(["bench", "--no-pin", "--json", "-c", cfg.to_str().unwrap()])
            .args([
                "-b", b, "-w", "randrw", "--qd", "8", "-t", "0.3", "--verify",
            ])
            .args(["--bs", "8K"])
            .output()
            .unwrap();
        let log = format!(
            "{b}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.code(), Some(0), "{log}");
        let v: Value = serde_json::from_slice(&out.stdout).expect(&log);
        assert!(v["total"]["ios"].as_u64().unwrap() > 100, "{log}");
        assert_eq!(v["total"]["verify_errors"], 0, "{log}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn run(c: &mut Command) -> String {
    let o = c.output().expect("spawn");
    let t = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{c:?}: {t}");
    t
}

#[test]
fn raid_over_rpc_round_trips_through_nbd_and_save_config() {
    if !testkit::need("nbdcopy") {
        return;
    }
    let dir = tmpdir("vbdev-nbd");
    let calls: Vec<Value> = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]
        .iter()
        .map(|n| {
            json!({"method": "bdev_malloc_create",
                "params": {"name": n, "num_blocks": (8 << 20) / 512, "block_size": 512}})
        })
        .collect();
    let s = Server::start(
        &dir,
        &json!({"subsystems": [{"subsystem": "bdev", "config": calls}]}),
        &[],
    );
    // Bad parameters: errors, nothing created.
    for p in [
        json!({"name": "r", "raid_level": "raid0", "base_bdevs": ["a", "zz"], "strip_size_kb": 64}),
        json!({"name": "r", "raid_level": "raid0", "base_bdevs": ["a", "b"], "strip_size_kb": 12}),
        json!({"name": "r", "raid_level": "raid0", "base_bdevs": ["a", "a"], "strip_size_kb": 64}),
    ] {
        assert!(s.call("bdev_raid_create", p.clone()).is_err(), "{p}");
    }
    assert!(s.call("bdev_get_bdevs", json!({"name": "r"})).is_err());
    let parts = s.ok(
        "bdev_split_create",
        json!({"base_bdev": "c", "split_count": 2}),
    );
    assert_eq!(parts, json!(["cp0", "cp1"]));
    s.ok(
        "bdev_raid_create",
        json!({"name": "r", "raid_level": "raid0",
        "base_bdevs": ["a", "b", "cp1"], "strip_size_kb": 64}),
    );
    let raids = s.ok("bdev_raid_get_bdevs", json!({"category": "online"}));
    assert_eq!(raids[0]["name"], "r", "{raids}");
    assert_eq!(raids[0]["num_base_bdevs"], 3, "{raids}");
    assert!(s.call("bdev_malloc_delete", json!({"name": "a"})).is_err());
    // 12 MiB: the raid uses 4 MiB (cp1's size) of each member.
    let info = s.ok("bdev_get_bdevs", json!({"name": "r"}));
    assert_eq!(info[0]["num_blocks"], (12 << 20) / 512, "{info}");
    let r = s.ok(
        "nbd_server_start",
        json!({"listen_address": {"traddr": "127.0.0.1", "trsvcid": "0"}}),
    );
    let port: u16 = r["trsvcid"].as_str().unwrap().parse().unwrap();
    s.ok("nbd_export_create", json!({"name": "r", "bdev_name": "r"}));
    let src = dir.join("src.img");
    let data: Vec<u8> = (0..12u64 << 20)
        .map(|i| (i.wrapping_mul(0x9E37_79B9) >> 13) as u8)
        .collect();
    std::fs::write(&src, &data).unwrap();
    let uri = format!("nbd://127.0.0.1:{port}/r");
    run(Command::new("nbdcopy").arg(&src).arg(&uri));
    let back = dir.join("back.img");
    run(Command::new("nbdcopy").arg(&uri).arg(&back));
    let got = std::fs::read(&back).unwrap();
    assert!(got == data, "data read back through raid0 over NBD differs");
    // The other kinds through the same peer: concat, raid1, passthru over
    // a split part, delay (4 MiB each, written and read back).
    s.ok(
        "bdev_raid_create",
        json!({"name": "cc", "raid_level": "concat",
        "base_bdevs": ["g", "h"], "strip_size_kb": 4}),
    );
    s.ok(
        "bdev_raid_create",
        json!({"name": "m1", "raid_level": "raid1", "base_bdevs": ["i", "j"]}),
    );
    s.ok(
        "bdev_passthru_create",
        json!({"base_bdev_name": "cp0", "name": "pt"}),
    );
    s.ok("bdev_delay_create", json!({"base_bdev_name": "pt", "name": "dl",
        "avg_read_latency": 20, "p99_read_latency": 50, "avg_write_latency": 20, "p99_write_latency": 50}));
    let small = dir.join("small.img");
    std::fs::write(&small, &data[..4 << 20]).unwrap();
    for b in ["cc", "m1", "dl"] {
        s.ok("nbd_export_create", json!({"name": b, "bdev_name": b}));
        let uri = format!("nbd://127.0.0.1:{port}/{b}");
        run(Command::new("nbdcopy").arg(&small).arg(&uri));
        run(Command::new("nbdcopy").arg(&uri).arg(&back));
        let got = std::fs::read(&back).unwrap();
        assert!(
            got[..4 << 20] == data[..4 << 20],
            "{b}: data read back over NBD differs"
        );
    }
    // fio's own verify through each kind, whole device, mixed sizes: I/Os
    // straddle strips (raid0) and members (concat).
    if testkit::need("fio") {
        for (b, size) in [("r", "12M"), ("cc", "16M"), ("m1", "8M"), ("dl", "4M")] {
            let out = Command::new("fio")
                // fio leaves verify state files in its working directory.
                .current_dir(&dir)
                .args([
                    "--name=verify",
                    "--ioengine=nbd",
                    &format!("--uri=nbd://127.0.0.1:{port}/{b}"),
                    "--rw=randwrite",
                    "--bsrange=4k-128k",
                    "--iodepth=16",
                    &format!("--size={size}"),
                    "--verify=crc32c",
                    "--do_verify=1",
                    "--verify_fatal=1",
                ])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "fio verify on {b}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    // save_config carries the split and the raids; a fresh server rebuilds
    // them (same members, sizes and UUIDs).
    let all = s.ok("bdev_raid_get_bdevs", json!({"category": "all"}));
    assert_eq!(all.as_array().unwrap().len(), 3, "{all}");
    let out = Command::new(BIN)
        .args(["save-config", "-s", s.sock.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success());
    let saved: Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = saved.to_string();
    assert!(
        text.contains("bdev_split_create") && text.contains("bdev_raid_create"),
        "{text}"
    );
    drop(s);
    let bdev_only: Vec<Value> = saved["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["subsystem"] == "bdev")
        .cloned()
        .collect();
    let t = Server::start(&dir, &json!({"subsystems": bdev_only}), &[]);
    let again = t.ok("bdev_raid_get_bdevs", json!({"category": "all"}));
    assert_eq!(again, all);
    // raid1 over RPC: a member removed, another added and rebuilt in the
    // background (progress in bdev_raid_get_bdevs until it is done).
    t.ok(
        "bdev_raid_create",
        json!({"name": "mr", "raid_level": "raid1", "base_bdevs": ["d", "e"]}),
    );
    t.ok("bdev_raid_remove_base_bdev", json!({"name": "e"}));
    t.ok(
        "bdev_raid_add_base_bdev",
        json!({"raid_bdev": "mr", "base_bdev": "f"}),
    );
    let mr = |t: &Server| {
        t.ok("bdev_raid_get_bdevs", json!({"category": "all"}))
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == "mr")
            .cloned()
            .unwrap()
    };
    testkit::wait_until("raid1 rebuild", std::time::Duration::from_secs(20), || {
        mr(&t)["num_base_bdevs_operational"] == 2
    });
    assert_eq!(mr(&t)["base_bdevs_list"][1]["name"], "f");
    t.ok("bdev_raid_delete", json!({"name": "mr"}));
    t.ok("bdev_raid_delete", json!({"name": "r"}));
    // Claims hold across the saved stack: the split goes after what is on it.
    assert!(t
        .call("bdev_split_delete", json!({"base_bdev": "c"}))
        .is_err());
    t.ok("bdev_delay_delete", json!({"name": "dl"}));
    t.ok("bdev_passthru_delete", json!({"name": "pt"}));
    t.ok("bdev_split_delete", json!({"base_bdev": "c"}));
    t.ok("bdev_malloc_delete", json!({"name": "a"}));
    let _ = t.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// `bdev_set_qos_limit` end to end: from a config file, `ustor bench` on
/// two reactors measures the limit (±10%); over RPC the limits show in
/// `bdev_get_bdevs`, bad ones are refused with nothing changed, save_config
/// carries them to a fresh server, and 0 removes them.
#[test]
fn qos_limit_from_config_and_rpc() {
    let dir = tmpdir("vbdev-qos");
    let cfg = dir.join("qos.json");
    let calls = json!({"subsystems": [{"subsystem": "bdev", "config": [
        {"method": "bdev_null_create", "params": {"name": "n0", "num_blocks": 1 << 20, "block_size": 512}},
        {"method": "bdev_set_qos_limit", "params": {"name": "n0", "rw_ios_per_sec": 5000}},
    ]}]});
    std::fs::write(&cfg, serde_json::to_vec(&calls).unwrap()).unwrap();
    let out = Command::new(BIN)
        .args(["bench", "--no-pin", "--json", "--cores", "0,1", "-c"])
        .arg(&cfg)
        .args(["-b", "n0", "-w", "randread", "--qd", "16", "-t", "1.5"])
        .output()
        .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0), "{log}");
    let v: Value = serde_json::from_slice(&out.stdout).expect(&log);
    let iops = v["total"]["iops"].as_f64().unwrap();
    assert!(
        (iops - 5000.0).abs() <= 500.0,
        "{iops} IOPS under a 5000 limit: {log}"
    );
    assert_eq!(v["per_core"].as_array().unwrap().len(), 2, "{log}");

    let s = Server::start(&dir, &calls, &[]);
    let limits = |s: &Server| {
        s.ok("bdev_get_bdevs", json!({"name": "n0"}))[0]["assigned_rate_limits"].clone()
    };
    assert_eq!(
        limits(&s),
        json!({"rw_ios_per_sec": 5000, "rw_mbytes_per_sec": 0, "r_mbytes_per_sec": 0, "w_mbytes_per_sec": 0})
    );
    for bad in [
        json!({"name": "n0", "rw_ios_per_sec": 1500}),
        json!({"name": "n0"}),
        json!({"name": "nx", "rw_ios_per_sec": 1000}),
        json!({"name": "n0", "iops": 1000}),
    ] {
        assert!(s.call("bdev_set_qos_limit", bad.clone()).is_err(), "{bad}");
    }
    s.ok(
        "bdev_set_qos_limit",
        json!({"name": "n0", "w_mbytes_per_sec": 10}),
    );
    let want = json!({"rw_ios_per_sec": 5000, "rw_mbytes_per_sec": 0, "r_mbytes_per_sec": 0, "w_mbytes_per_sec": 10});
    assert_eq!(limits(&s), want);
    let out = Command::new(BIN)
        .args(["save-config", "-s", s.sock.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success());
    let saved: Value = serde_json::from_slice(&out.stdout).unwrap();
    drop(s);
    let t = Server::start(&dir, &saved, &[]);
    assert_eq!(limits(&t), want);
    t.ok(
        "bdev_set_qos_limit",
        json!({"name": "n0", "rw_ios_per_sec": 0, "w_mbytes_per_sec": 0}),
    );
    assert_eq!(limits(&t)["rw_ios_per_sec"], 0);
    assert_eq!(limits(&t)["w_mbytes_per_sec"], 0);
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The raids on `s` by name.
fn raids(s: &Server) -> Vec<Value> {
    s.ok("bdev_raid_get_bdevs", json!({"category": "all"}))
        .as_array()
        .unwrap()
        .clone()
}

fn has_raid(s: &Server, name: &str) -> bool {
    raids(s).iter().any(|r| r["name"] == name)
}

/// Writes `data` to bdev `b` of `s` over NBD and reads it back.
fn nbd_round(
    s: &Server,
    port: u16,
    dir: &std::path::Path,
    b: &str,
    data: Option<&[u8]>,
) -> Vec<u8> {
    let _ = s.call("nbd_export_create", json!({"name": b, "bdev_name": b}));
    let uri = format!("nbd://127.0.0.1:{port}/{b}");
    if let Some(data) = data {
        let src = dir.join(format!("{b}.src"));
        std::fs::write(&src, data).unwrap();
        run(Command::new("nbdcopy").arg(&src).arg(&uri));
    }
    let back = dir.join(format!("{b}.back"));
    run(Command::new("nbdcopy").arg(&uri).arg(&back));
    std::fs::read(&back).unwrap()
}

/// `bdev_uring_create` of `u<i>` over an 8 MiB file in `dir` (made once).
fn uring_in(dir: &std::path::Path, i: usize) -> Value {
    let f = dir.join(format!("disk{i}.img"));
    if !f.exists() {
        std::fs::File::create(&f).unwrap().set_len(8 << 20).unwrap();
    }
    json!({"method": "bdev_uring_create", "params": {"name": format!("u{i}"),
        "filename": f.to_str().unwrap(), "block_size": 512, "direct": false}})
}

/// A config of only the base bdevs `u<i>` (i in `which`) and an NBD server.
fn bases_config(dir: &std::path::Path, which: &[usize]) -> Value {
    let mut calls: Vec<Value> = which.iter().map(|i| uring_in(dir, *i)).collect();
    calls.push(json!({"method": "nbd_server_start",
        "params": {"listen_address": {"traddr": "127.0.0.1", "trsvcid": "0"}}}));
    json!({"subsystems": [{"subsystem": "bdev", "config": calls}]})
}

/// `superblock: true`: the members carry the array, save_config leaves it
/// out (as SPDK), and a restart with a config of only the base bdevs finds
/// raid0 and raid1 again with their data (read back over NBD and
/// compared); an array whose member appears later (over RPC) is assembled
/// then; a deleted array's superblocks are wiped, so it does not come back.
#[test]
fn raid_superblock_reassembles_after_restart() {
    if !testkit::need("nbdcopy") {
        return;
    }
    let dir = tmpdir("vbdev-sb");
    let uring = |i: usize| uring_in(&dir, i);
    let config = |which: &[usize]| bases_config(&dir, which);
    let s = Server::start(&dir, &config(&[0, 1, 2, 3]), &[]);
    s.ok(
        "bdev_raid_create",
        json!({"name": "r0", "raid_level": "raid0",
        "base_bdevs": ["u0", "u1"], "strip_size_kb": 64, "superblock": true}),
    );
    s.ok(
        "bdev_raid_create",
        json!({"name": "m1", "raid_level": "raid1",
        "base_bdevs": ["u2", "u3"], "superblock": true}),
    );
    let before = raids(&s);
    for r in &before {
        assert_eq!(r["superblock"], true, "{r}");
        assert_eq!(r["base_bdevs_list"][0]["data_offset"], 2048, "{r}");
    }
    // 1 MiB of each member holds the superblock.
    let info = s.ok("bdev_get_bdevs", json!({"name": "r0"}));
    assert_eq!(info[0]["num_blocks"], (14 << 20) / 512, "{info}");
    let data: Vec<u8> = (0..14u64 << 20)
        .map(|i| (i.wrapping_mul(0x9E37_79B9) >> 11) as u8)
        .collect();
    let port = s.nbd_port();
    assert!(nbd_round(&s, port, &dir, "r0", Some(&data)) == data);
    let half = &data[3 << 20..10 << 20];
    assert!(nbd_round(&s, port, &dir, "m1", Some(half)) == half);
    let saved = s
        .ok("framework_get_config", json!({"name": "bdev"}))
        .to_string();
    assert!(!saved.contains("bdev_raid_create"), "{saved}");
    assert!(saved.contains("bdev_wait_for_examine"), "{saved}");
    let _ = s.stop();

    // Only the base bdevs: examine reassembles both, same UUIDs, same data.
    let t = Server::start(&dir, &config(&[0, 1, 2, 3]), &[]);
    // SPDK's method: returns once the examines started so far are done.
    t.ok("bdev_wait_for_examine", Value::Null);
    assert_eq!(raids(&t).len(), 2);
    // The same arrays (UUIDs, members, sizes); a file bdev's own UUID is
    // new at each start, so the members' are left out.
    let norm = |mut v: Vec<Value>| {
        v.sort_by_key(|r| r["name"].as_str().map(String::from));
        for r in &mut v {
            for m in r["base_bdevs_list"].as_array_mut().unwrap() {
                m.as_object_mut().unwrap().remove("uuid");
            }
        }
        v
    };
    assert_eq!(norm(raids(&t)), norm(before.clone()));
    let port = t.nbd_port();
    assert!(
        nbd_round(&t, port, &dir, "r0", None) == data,
        "r0 after restart"
    );
    assert!(
        nbd_round(&t, port, &dir, "m1", None) == half,
        "m1 after restart"
    );
    let _ = t.stop();

    // A member missing: no array until it appears.
    let t = Server::start(&dir, &config(&[0, 2, 3]), &[]);
    testkit::wait_until("m1 assembled", std::time::Duration::from_secs(10), || {
        has_raid(&t, "m1")
    });
    assert!(!has_raid(&t, "r0"));
    let u1 = uring(1);
    t.ok("bdev_uring_create", u1["params"].clone());
    testkit::wait_until("r0 assembled", std::time::Duration::from_secs(10), || {
        has_raid(&t, "r0")
    });
    let port = t.nbd_port();
    assert!(
        nbd_round(&t, port, &dir, "r0", None) == data,
        "r0 assembled late"
    );
    // Deleting wipes the superblocks: r0 stays gone after a restart.
    t.ok("nbd_export_delete", json!({"name": "r0"}));
    t.ok("bdev_raid_delete", json!({"name": "r0"}));
    let _ = t.stop();
    let t = Server::start(&dir, &config(&[0, 1, 2, 3]), &[]);
    testkit::wait_until("m1 assembled", std::time::Duration::from_secs(10), || {
        has_raid(&t, "m1")
    });
    assert!(!has_raid(&t, "r0"));
    let u0 = t.ok("bdev_get_bdevs", json!({"name": "u0"}));
    assert!(u0[0]["claimed"] == false, "{u0}");
    let _ = t.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// The raid1 `m` on `s`: (members operational, rebuild running).
fn mirror_state(s: &Server) -> (u64, bool) {
    let r = raids(s)
        .into_iter()
        .find(|r| r["name"] == "m")
        .expect("raid1 m");
    let n = r["num_base_bdevs_operational"].as_u64().unwrap();
    (n, r.get("process").is_some())
}

fn claimed(s: &Server, b: &str) -> bool {
    s.ok("bdev_get_bdevs", json!({"name": b}))[0]["claimed"] == true
}

/// A raid1 with superblocks follows its membership across restarts: a
/// member removed over RPC does not come back (its record is wiped, the
/// other's says its slot is out of sync); one added back is rebuilt and is
/// a member again after the next start; with a member missing at start the
/// array comes up degraded, the late member is left alone as stale (not
/// claimed, data not read from it), and once added back and rebuilt it
/// holds the data written while it was away. Data is read over NBD and
/// compared at every step.
#[test]
fn raid1_superblock_follows_membership_and_starts_degraded() {
    if !testkit::need("nbdcopy") {
        return;
    }
    let dir = tmpdir("vbdev-sb1");
    let data: Vec<u8> = (0..7u64 << 20)
        .map(|i| (i.wrapping_mul(0x2545_F491) >> 9) as u8)
        .collect();
    let s = Server::start(&dir, &bases_config(&dir, &[0, 1]), &[]);
    s.ok(
        "bdev_raid_create",
        json!({"name": "m", "raid_level": "raid1", "base_bdevs": ["u0", "u1"], "superblock": true}),
    );
    assert!(nbd_round(&s, s.nbd_port(), &dir, "m", Some(&data)) == data);
    s.ok("bdev_raid_remove_base_bdev", json!({"name": "u1"}));
    assert_eq!(mirror_state(&s), (1, false));
    let _ = s.stop();

    // The removed member stays out after a restart.
    let t = Server::start(&dir, &bases_config(&dir, &[0, 1]), &[]);
    assert_eq!(mirror_state(&t), (1, false));
    assert!(!claimed(&t, "u1"));
    assert!(nbd_round(&t, t.nbd_port(), &dir, "m", None) == data);
    // Added back: rebuilt, then a member at the next start.
    t.ok(
        "bdev_raid_add_base_bdev",
        json!({"raid_bdev": "m", "base_bdev": "u1"}),
    );
    testkit::wait_until("u1 rebuilt", std::time::Duration::from_secs(20), || {
        mirror_state(&t) == (2, false)
    });
    let _ = t.stop();
    let t = Server::start(&dir, &bases_config(&dir, &[0, 1]), &[]);
    assert_eq!(mirror_state(&t), (2, false));
    assert!(nbd_round(&t, t.nbd_port(), &dir, "m", None) == data);
    let _ = t.stop();

    // u1 missing at start: m comes up degraded on u0 and takes new data.
    let t = Server::start(&dir, &bases_config(&dir, &[0]), &[]);
    assert_eq!(mirror_state(&t), (1, false));
    let newer: Vec<u8> = data.iter().map(|b| b ^ 0x5a).collect();
    assert!(nbd_round(&t, t.nbd_port(), &dir, "m", Some(&newer)) == newer);
    // u1 shows up late: stale, left alone.
    t.ok("bdev_uring_create", uring_in(&dir, 1)["params"].clone());
    t.ok("bdev_wait_for_examine", Value::Null);
    assert_eq!(mirror_state(&t), (1, false));
    assert!(!claimed(&t, "u1"));
    t.ok(
        "bdev_raid_add_base_bdev",
        json!({"raid_bdev": "m", "base_bdev": "u1"}),
    );
    testkit::wait_until("u1 rebuilt", std::time::Duration::from_secs(20), || {
        mirror_state(&t) == (2, false)
    });
    let _ = t.stop();
    // Both members hold the newer data: read each alone (the other missing).
    for only in [0, 1] {
        let t = Server::start(&dir, &bases_config(&dir, &[only]), &[]);
        assert_eq!(mirror_state(&t), (1, false), "only u{only}");
        assert!(
            nbd_round(&t, t.nbd_port(), &dir, "m", None) == newer,
            "u{only} alone"
        );
        let _ = t.stop();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

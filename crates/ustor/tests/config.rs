//! Config files: save_config from a running server recreates the same
//! objects in a fresh one; a bad file is refused with file/entry/field and
//! leaves nothing half-created; signals stop the server cleanly.

mod common;

use common::*;
use serde_json::{json, Value};

fn objects(s: &Server) -> Value {
    let mut bdevs = s.ok("bdev_get_bdevs", Value::Null);
    for b in bdevs.as_array_mut().unwrap() {
        b.as_object_mut().unwrap().remove("driver_specific");
    }
    let mut subs = s.ok("nvmf_get_subsystems", Value::Null);
    for sub in subs.as_array_mut().unwrap() {
        // Listener ports were chosen by the kernel (port 0 in the config).
        sub.as_object_mut().unwrap().remove("listen_addresses");
    }
    json!({"bdevs": bdevs, "exports": s.ok("nbd_get_exports", Value::Null), "subsystems": subs})
}

#[test]
fn save_config_recreates_the_same_objects() {
    let dir = tmpdir("saveload");
    let a = Server::start(&dir, &exported_config(16), &[]);
    a.ok(
        "bdev_null_create",
        json!({"name": "n1", "num_blocks": 4096, "block_size": 4096}),
    );
    let file = dir.join("disk.img");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    a.ok(
        "bdev_uring_create",
        json!({"name": "u1", "filename": file.to_str().unwrap()}),
    );
    let out = std::process::Command::new(BIN)
        .args(["save-config", "-s", a.sock.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let saved: Value = serde_json::from_slice(&out.stdout).unwrap();
    let before = objects(&a);
    let (code, log) = a.stop();
    assert_eq!(code, 0, "{log}");
    // Ports in the saved file are the bound ones; reuse may race another
    // test, so give the new server free ports again.
    let mut cfg = saved.clone();
    for sub in cfg["subsystems"].as_array_mut().unwrap() {
        for c in sub["config"].as_array_mut().unwrap() {
            if let Some(p) = c["params"].get_mut("listen_address") {
                p["trsvcid"] = json!("0");
            }
        }
    }
    let b = Server::start(&dir, &cfg, &[]);
    assert_eq!(objects(&b), before, "recreated objects differ");
    let _ = b.stop();
}

#[test]
fn bad_config_names_file_entry_field_and_rolls_back() {
    let dir = tmpdir("badcfg");
    let bad = json!({"subsystems": [{"subsystem": "bdev", "config": [
        {"method": "bdev_malloc_create", "params": {"name": "ok0", "num_blocks": 64, "block_size": 512}},
        {"method": "bdev_null_create", "params": {"name": "ok1", "num_blocks": 64, "block_size": 512}},
        {"method": "bdev_malloc_create", "params": {"name": "bad", "num_blocks": 64, "block_sise": 512}}
    ]}]});
    // At start: the server refuses to run and says where.
    let path = dir.join("bad.json");
    std::fs::write(&path, serde_json::to_vec(&bad).unwrap()).unwrap();
    let out = std::process::Command::new(BIN)
        .args([
            "serve",
            "--no-pin",
            "-r",
            dir.join("x.sock").to_str().unwrap(),
            "-c",
            path.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("bad.json") && err.contains("entry 2") && err.contains("block_sise"),
        "{err}"
    );
    // On a running server: load-config fails the same way and undoes entries 0-1.
    let s = Server::start(&dir, &empty_config(), &[]);
    let out = std::process::Command::new(BIN)
        .args([
            "load-config",
            path.to_str().unwrap(),
            "-s",
            s.sock.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("bad.json") && err.contains("entry 2") && err.contains("block_sise"),
        "{err}"
    );
    assert_eq!(
        s.ok("bdev_get_bdevs", Value::Null),
        json!([]),
        "half-created objects left behind"
    );
    // Malformed JSON names the line.
    std::fs::write(
        &path,
        b"{\"subsystems\": [\n  {\"subsystem\": \"bdev\", \"config\": [}\n]}",
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args([
            "load-config",
            path.to_str().unwrap(),
            "-s",
            s.sock.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("bad.json") && err.contains("line 2"),
        "{err}"
    );
    let (code, _) = s.stop();
    assert_eq!(code, 0);
}

#[test]
fn sigterm_stops_cleanly_and_removes_the_socket() {
    let dir = tmpdir("sig");
    let s = Server::start(&dir, &exported_config(8), &[]);
    let sock = s.sock.clone();
    let (code, out) = s.stop();
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("stopped cleanly"), "{out}");
    assert!(!sock.exists(), "socket left behind");
}

#[test]
fn wait_init_answers_only_after_the_startup_config_is_applied() {
    let dir = tmpdir("wfi");
    let cfg = dir.join("wfi.json");
    std::fs::write(&cfg, serde_json::to_vec(&exported_config(8)).unwrap()).unwrap();
    let s = Server::start_with(&dir, &["--wait-for-rpc", "-c", cfg.to_str().unwrap()], &[]);
    let sock = s.sock.clone();
    // Asked before framework_start_init: the answer waits for init.
    let waiter = std::thread::spawn(move || {
        let t0 = std::time::Instant::now();
        let r = ustor_rpc::RpcClient::connect(&sock)
            .unwrap()
            .call("framework_wait_init", Value::Null);
        (r, t0.elapsed())
    });
    // A window in which an early answer would show, not a wait.
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        !waiter.is_finished(),
        "framework_wait_init answered before init"
    );
    s.ok("framework_start_init", Value::Null);
    let (r, _) = waiter.join().unwrap();
    assert_eq!(r.unwrap(), json!(true));
    // By then the config is in place: its bdev and NBD export exist.
    let b = s.ok("bdev_get_bdevs", json!({"name": "Malloc0"}));
    assert_eq!(b[0]["name"], "Malloc0", "{b}");
    assert!(s.nbd_port() > 0);
    // Once initialized it answers at once.
    assert_eq!(s.ok("framework_wait_init", Value::Null), json!(true));
    let _ = s.stop();
}

#[test]
fn wait_for_rpc_holds_config_until_start_init() {
    let dir = tmpdir("wfr");
    let s = Server::start_with(&dir, &["--wait-for-rpc"], &[]);
    let e = s
        .call(
            "bdev_malloc_create",
            json!({"name": "m", "num_blocks": 64, "block_size": 512}),
        )
        .unwrap_err();
    assert!(e.message.contains("framework_start_init"), "{e:?}");
    s.ok("framework_start_init", Value::Null);
    s.ok("framework_wait_init", Value::Null);
    assert_eq!(
        s.ok(
            "bdev_malloc_create",
            json!({"name": "m", "num_blocks": 64, "block_size": 512})
        ),
        json!("m")
    );
    let _ = s.stop();
}

fn save_config(s: &Server) -> Value {
    let out = std::process::Command::new(BIN)
        .args(["save-config", "-s", s.sock.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The NVMe/TCP state save_config must carry beyond bdevs: transport
/// options (the LANoT coalescer included), host lists, serial/model,
/// several namespaces with fixed NSIDs, listeners; and on the initiator
/// side the `bdev_nvme_attach_controller` call with its options.
#[test]
fn save_config_recreates_nvmf_target_and_initiator_state() {
    let dir = tmpdir("savenvmf");
    let nqn = "nqn.2026-11.io.ustor:saved";
    let host_a = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-0000-0000-000000000001";
    let host_b = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-0000-0000-000000000002";
    let port = free_port().to_string();
    let tgt_cfg = json!({"subsystems": [
        {"subsystem": "bdev", "config": [
            {"method": "bdev_malloc_create", "params": {"name": "M0", "num_blocks": 8192, "block_size": 512}},
            {"method": "bdev_malloc_create", "params": {"name": "M1", "num_blocks": 4096, "block_size": 4096}}
        ]},
        {"subsystem": "nvmf", "config": [
            {"method": "nvmf_create_transport", "params": {"trtype": "TCP", "in_capsule_data_size": 4096,
                "coalesce": {"mode": "fixed", "degree": 8, "timer_us": 30}}},
            {"method": "nvmf_create_subsystem", "params": {"nqn": nqn, "allow_any_host": false,
                "serial_number": "SAVED0001", "model_number": "saved model"}},
            {"method": "nvmf_subsystem_add_host", "params": {"nqn": nqn, "host": host_a}},
            {"method": "nvmf_subsystem_add_host", "params": {"nqn": nqn, "host": host_b}},
            {"method": "nvmf_subsystem_add_ns", "params": {"nqn": nqn, "namespace": {"bdev_name": "M0", "nsid": 3}}},
            {"method": "nvmf_subsystem_add_ns", "params": {"nqn": nqn, "namespace": {"bdev_name": "M1", "nsid": 7}}},
            {"method": "nvmf_subsystem_add_listener", "params": {"nqn": nqn,
                "listen_address": {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": port}}}
        ]}
    ]});
    let target_state = |s: &Server| {
        json!({
            "transports": s.ok("nvmf_get_transports", Value::Null),
            "subsystems": s.ok("nvmf_get_subsystems", Value::Null),
        })
    };
    let t = Server::start(&dir, &tgt_cfg, &[]);
    let before = target_state(&t);
    let tr = &before["transports"][0];
    assert_eq!(tr["coalesce"]["mode"], "fixed", "{tr}");
    assert_eq!(tr["coalesce"]["degree"], 8, "{tr}");
    assert_eq!(tr["in_capsule_data_size"], 4096, "{tr}");
    let saved = save_config(&t);
    let (code, log) = t.stop();
    assert_eq!(code, 0, "{log}");
    let t2 = Server::start(&dir, &saved, &[]);
    let after = target_state(&t2);
    assert_eq!(after, before, "target state differs after save/load");
    let sub = after["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["nqn"] == nqn)
        .unwrap()
        .clone();
    assert_eq!(sub["allow_any_host"], false);
    assert_eq!(sub["hosts"].as_array().map(Vec::len), Some(2), "{sub}");
    assert_eq!(sub["listen_addresses"][0]["trsvcid"], port.as_str());
    let nsids: Vec<u64> = sub["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["nsid"].as_u64().unwrap())
        .collect();
    assert_eq!(nsids, vec![3, 7]);

    // The initiator: an attach with digests and its own coalescing, saved
    // and recreated against the (restarted) target.
    let ini_cfg = json!({"subsystems": [{"subsystem": "bdev", "config": [
        {"method": "bdev_nvme_attach_controller", "params": {"name": "Remote", "trtype": "TCP",
            "traddr": "127.0.0.1", "trsvcid": port, "subnqn": nqn, "hostnqn": host_a,
            "hdgst": true, "ddgst": true, "ctrlr_loss_timeout_sec": 5, "reconnect_delay_sec": 1,
            "coalesce": {"mode": "adaptive", "degree": 2, "max_degree": 16, "window": 32}}}
    ]}]});
    let ini_state = |s: &Server| {
        let mut bdevs = s.ok("bdev_get_bdevs", Value::Null);
        for b in bdevs.as_array_mut().unwrap() {
            b.as_object_mut().unwrap().remove("driver_specific");
        }
        let mut ctrls = s.ok("bdev_nvme_get_controllers", Value::Null);
        for c in ctrls.as_array_mut().unwrap() {
            for p in c["ctrlrs"].as_array_mut().unwrap() {
                // The target hands out a new controller ID per connect.
                p.as_object_mut().unwrap().remove("cntlid");
            }
        }
        json!({"bdevs": bdevs, "controllers": ctrls})
    };
    let i = Server::start(&dir, &ini_cfg, &[]);
    let before = ini_state(&i);
    let names: Vec<&str> = before["bdevs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["Remoten3", "Remoten7"], "{before}");
    let saved = save_config(&i);
    let attach = saved["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["config"].as_array().cloned().unwrap_or_default())
        .find(|c| c["method"] == "bdev_nvme_attach_controller")
        .expect("attach call saved");
    let p = &attach["params"];
    assert_eq!(p["hostnqn"], host_a, "{p}");
    assert_eq!(
        (p["hdgst"].clone(), p["ddgst"].clone()),
        (json!(true), json!(true)),
        "{p}"
    );
    assert_eq!(p["ctrlr_loss_timeout_sec"], 5, "{p}");
    assert_eq!(p["reconnect_delay_sec"], 1, "{p}");
    assert_eq!(p["coalesce"]["mode"], "adaptive", "{p}");
    assert_eq!(p["coalesce"]["max_degree"], 16, "{p}");
    assert_eq!(p["coalesce"]["window"], 32, "{p}");
    let (code, log) = i.stop();
    assert_eq!(code, 0, "{log}");
    let i2 = Server::start(&dir, &saved, &[]);
    assert_eq!(
        ini_state(&i2),
        before,
        "initiator state differs after save/load"
    );
    let _ = i2.stop();
    let _ = t2.stop();
}

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

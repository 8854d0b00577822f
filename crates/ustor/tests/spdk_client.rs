//! SPDK's own command-line client (`spdk-rpc` from PyPI `spdk`) drives
//! ustor: every method both have, with SPDK's parameters, result fields its
//! commands use, errors, save_config and load_config.

mod common;

use std::process::Command;

use common::*;
use serde_json::Value;

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

fn json_of(s: &Server, args: &[&str]) -> Value {
    let t = ok(s, args);
    serde_json::from_str(&t).unwrap_or_else(|e| panic!("spdk-rpc {args:?}: not JSON ({e}): {t}"))
}

#[test]
fn spdk_rpc_cli_drives_ustor() {
    if !testkit::need("spdk-rpc") {
        return;
    }
    let dir = tmpdir("spdk");
    let s = Server::start(&dir, &empty_config(), &[]);
    assert!(ok(&s, &["spdk_get_version"]).contains("ustor"));
    let methods = json_of(&s, &["rpc_get_methods"]);
    for m in [
        "bdev_malloc_create",
        "bdev_get_bdevs",
        "nvmf_create_subsystem",
        "framework_get_reactors",
        "nbd_export_create",
    ] {
        assert!(
            methods.as_array().unwrap().iter().any(|x| x == m),
            "{m} missing from rpc_get_methods"
        );
    }
    // bdevs, as an operator would make them with rpc.py.
    assert_eq!(
        ok(&s, &["bdev_malloc_create", "-b", "Malloc0", "16", "512"]).trim(),
        "Malloc0"
    );
    assert_eq!(
        ok(&s, &["bdev_malloc_create", "8", "4096"]).trim(),
        "Malloc1",
        "auto-named like SPDK"
    );
    assert_eq!(
        ok(&s, &["bdev_null_create", "Null0", "32", "4096"]).trim(),
        "Null0"
    );
    let file = dir.join("u.img");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    assert_eq!(
        ok(
            &s,
            &[
                "bdev_uring_create",
                file.to_str().unwrap(),
                "Uring0",
                "4096"
            ]
        )
        .trim(),
        "Uring0"
    );
    let b = json_of(&s, &["bdev_get_bdevs", "-b", "Malloc0"]);
    assert_eq!(b[0]["name"], "Malloc0");
    assert_eq!(b[0]["num_blocks"], 32768);
    assert_eq!(b[0]["block_size"], 512);
    assert_eq!(b[0]["supported_io_types"]["read"], true);
    assert_eq!(
        json_of(&s, &["bdev_get_bdevs"]).as_array().unwrap().len(),
        4
    );
    let st = json_of(&s, &["bdev_get_iostat", "--names", "Null0"]);
    assert!(st["tick_rate"].as_u64().unwrap() > 0 && st["bdevs"][0]["name"] == "Null0");
    let r = json_of(&s, &["framework_get_reactors"]);
    assert!(!r["reactors"].as_array().unwrap().is_empty());
    let subs = json_of(&s, &["framework_get_subsystems"]);
    assert!(subs
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["subsystem"] == "bdev"));
    // NVMe-oF with SPDK's commands.
    let nqn = "nqn.2016-06.io.spdk:cnode1";
    ok(&s, &["nvmf_create_transport", "-t", "TCP"]);
    ok(
        &s,
        &[
            "nvmf_create_subsystem",
            nqn,
            "-a",
            "-s",
            "SPDK00000000000001",
            "-d",
            "ustor_test",
        ],
    );
    ok(&s, &["nvmf_subsystem_add_ns", nqn, "Malloc0"]);
    ok(
        &s,
        &[
            "nvmf_subsystem_add_listener",
            nqn,
            "-t",
            "tcp",
            "-a",
            "127.0.0.1",
            "-s",
            "0",
            "-f",
            "ipv4",
        ],
    );
    let subs = json_of(&s, &["nvmf_get_subsystems"]);
    let sub = subs
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["nqn"] == nqn)
        .expect("subsystem listed");
    assert_eq!(sub["namespaces"][0]["bdev_name"], "Malloc0");
    assert_eq!(sub["serial_number"], "SPDK00000000000001");
    assert!(json_of(&s, &["nvmf_get_transports"])
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["trtype"].as_str().unwrap().eq_ignore_ascii_case("tcp")));
    json_of(&s, &["nvmf_get_stats"]);
    // Errors come back as SPDK's: errno code and message, non-zero exit.
    let (good, text) = rpc(&s, &["bdev_get_bdevs", "-b", "nope"]);
    assert!(!good && text.contains("No such device"), "{text}");
    let (good, text) = rpc(&s, &["bdev_malloc_delete", "Malloc0"]);
    assert!(
        !good && text.contains("busy"),
        "claimed bdev deleted: {text}"
    );
    let (good, text) = rpc(&s, &["bdev_malloc_create", "-b", "Malloc0", "16", "512"]);
    assert!(!good && text.contains("exists"), "{text}");
    // save_config with SPDK's client, load it into a fresh server with SPDK's
    // load_config, compare.
    let saved = ok(&s, &["save_config"]);
    let before = json_of(&s, &["bdev_get_bdevs"]);
    let _ = s.stop();
    let s2 = Server::start(&dir, &empty_config(), &[]);
    // The listener was bound to a kernel-chosen port; ask for a free one again.
    let mut saved: Value = serde_json::from_str(&saved).unwrap();
    for sub in saved["subsystems"].as_array_mut().unwrap() {
        for c in sub["config"].as_array_mut().into_iter().flatten() {
            if let Some(l) = c["params"].get_mut("listen_address") {
                l["trsvcid"] = Value::from("0");
            }
        }
    }
    let cfg_path = dir.join("saved.json");
    std::fs::write(&cfg_path, saved.to_string()).unwrap();
    ok(&s2, &["load_config", "-j", cfg_path.to_str().unwrap()]);
    let mut after = json_of(&s2, &["bdev_get_bdevs"]);
    let mut before = before;
    for v in [&mut before, &mut after] {
        for b in v.as_array_mut().unwrap() {
            b.as_object_mut().unwrap().remove("driver_specific");
        }
    }
    assert_eq!(
        before, after,
        "SPDK's save_config/load_config did not round-trip"
    );
    ok(&s2, &["nvmf_delete_subsystem", nqn]);
    ok(&s2, &["bdev_malloc_delete", "Malloc0"]);
    ok(&s2, &["bdev_null_delete", "Null0"]);
    ok(&s2, &["bdev_uring_delete", "Uring0"]);
    assert_eq!(
        json_of(&s2, &["bdev_get_bdevs"]).as_array().unwrap().len(),
        1
    );
    let _ = s2.stop();
}

//! Interoperability with SPDK's real Python client (PyPI `spdk`,
//! `spdk.rpc.client.JSONRPCClient`), including its save_config/load_config
//! and batch mode. Skipped, with a printed reason, when python3 or the
//! `spdk` package is not installed; a failure under `CI=true` (scripts/test.sh
//! installs it from .ci/pip.txt).

mod common;
use common::*;
use serde_json::{json, Value};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn python_with_spdk() -> Result<(), String> {
    let out = Command::new("python3")
        .args(["-c", "import spdk.rpc.client, spdk.rpc.config"])
        .output()
        .map_err(|e| format!("python3 not runnable: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "python3 cannot import spdk (pip install spdk): {}",
            // The traceback's last line says what failed to import.
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ))
    }
}

#[test]
fn spdk_python_client_interop() {
    testkit::require!(python_with_spdk(), &testkit::install_hint("spdk-rpc"));
    let path = sock_path("spdkpy");
    let table = test_table();
    let created = Arc::new(Mutex::new(Vec::new()));
    let seen = created.clone();
    table
        .add_subsystem("bdev", &[], move |r| {
            let names = seen.lock().unwrap().clone();
            let cfg: Vec<Value> = names
                .iter()
                .map(|n| json!({"method": "create", "params": {"name": n, "block_size": 512}}))
                .collect();
            r.ok(Value::Array(cfg))
        })
        .unwrap();
    // load_config's calls land here.
    let rec = created.clone();
    table
        .register_sync("record", ustor_rpc::RPC_RUNTIME, move |p| {
            rec.lock()
                .unwrap()
                .push(p["name"].as_str().unwrap_or("").to_string());
            Ok(json!(true))
        })
        .unwrap();
    created.lock().unwrap().push("m_saved".into());
    let _srv = ustor_rpc::start(ustor_rpc::ServerConfig::with_path(&path), table).unwrap();

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/spdk_client.py");
    let mut child = Command::new("python3")
        .arg(script)
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if testkit::try_wait_for(Duration::from_secs(60), || child.try_wait().unwrap()).is_none() {
        let _ = child.kill();
        panic!("python client timed out");
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "python failed: {stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();

    assert_eq!(r["echo"], json!({"a": 1, "nested": {"b": [1, 2]}}));
    assert_eq!(r["echo_empty"], json!({}));
    assert!(r["methods"].as_array().unwrap().contains(&json!("create")));
    assert_eq!(r["create"], json!({"name": "m0", "bytes": 4096}));
    assert_eq!(r["slow"], json!("later"));
    let fail = r["fail"].as_str().unwrap();
    assert!(
        fail.contains("\"code\": -17") && fail.contains("File exists"),
        "{fail}"
    );
    let bad = r["bad_param"].as_str().unwrap();
    assert!(
        bad.contains("-32602") && bad.contains("unknown field `bogus`"),
        "{bad}"
    );
    assert!(r["not_found"]
        .as_str()
        .unwrap()
        .contains("Method not found"));
    assert_eq!(
        r["saved"],
        json!({"subsystems": [{"subsystem": "bdev", "config": [
            {"method": "create", "params": {"name": "m_saved", "block_size": 512}}]}]})
    );
    assert_eq!(r["batch"]["results"], json!([{"x": 1}]));
    assert_eq!(r["batch"]["errors"][0]["code"], json!(-32601));
    assert_eq!(*created.lock().unwrap(), ["m_saved", "from_config"]);
}

//! The iscsi_* RPC methods against a real `ustor serve` process: a node
//! created from a config file and one by RPC, seen by libiscsi's iscsi-ls
//! and iscsi-inq; the get methods; deleting a node; the iscsi subsystem's
//! config dump (what save_config writes) recreates the same objects.

mod common;

use common::*;
use serde_json::{json, Value};

fn iscsi_config() -> Value {
    json!({"subsystems": [
        {"subsystem": "bdev", "config": [
            {"method": "bdev_malloc_create", "params": {"name": "Malloc0", "num_blocks": 32768, "block_size": 512}},
            {"method": "bdev_malloc_create", "params": {"name": "Malloc1", "num_blocks": 4096, "block_size": 4096}}
        ]},
        {"subsystem": "iscsi", "config": [
            {"method": "iscsi_create_portal_group", "params": {"tag": 1, "portals": [{"host": "127.0.0.1", "port": "0"}]}},
            {"method": "iscsi_create_initiator_group", "params": {"tag": 1, "initiators": ["ANY"], "netmasks": ["ANY"]}},
            {"method": "iscsi_create_target_node", "params": {"name": "disk1", "alias_name": "first",
                "pg_ig_maps": [{"pg_tag": 1, "ig_tag": 1}], "luns": [{"bdev_name": "Malloc0", "lun_id": 0}],
                "queue_depth": 32}}
        ]}
    ]})
}

fn port(s: &Server) -> u16 {
    let pgs = s.ok("iscsi_get_portal_groups", Value::Null);
    pgs[0]["portals"][0]["port"]
        .as_str()
        .and_then(|p| p.parse().ok())
        .expect("a bound portal")
}

/// libiscsi's iscsi-perf reading disk1's LUN 0 at `depth` until killed.
fn iscsi_perf(port: u16, depth: &str) -> std::process::Child {
    std::process::Command::new("iscsi-perf")
        .args(["-i", "iqn.2026-11.io.ustor:perf", "-m", depth])
        .arg(format!(
            "iscsi://127.0.0.1:{port}/iqn.2016-06.io.spdk:disk1/0"
        ))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(cmd).args(args).output().unwrap();
    assert!(out.status.success(), "{cmd} {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn iscsi_methods_and_config_dump() {
    if !have("iscsi-ls") {
        return;
    }
    let dir = tmpdir("iscsi-rpc");
    let s = Server::start(&dir, &iscsi_config(), &[]);
    let p = port(&s);
    let portal = format!("iscsi://127.0.0.1:{p}");
    let out = run("iscsi-ls", &[&portal]);
    assert!(out.contains("Target:iqn.2016-06.io.spdk:disk1"), "{out}");

    s.ok(
        "iscsi_create_target_node",
        json!({"name": "iqn.2026-11.io.ustor:disk2", "pg_ig_maps": [{"pg_tag": 1, "ig_tag": 1}],
               "luns": [{"bdev_name": "Malloc1", "lun_id": 3}], "queue_depth": 16}),
    );
    let nodes = s.ok("iscsi_get_target_nodes", Value::Null);
    assert_eq!(nodes.as_array().unwrap().len(), 2, "{nodes}");
    assert_eq!(nodes[0]["alias_name"], "first", "{nodes}");
    let out = run(
        "iscsi-inq",
        &[&format!("{portal}/iqn.2026-11.io.ustor:disk2/3")],
    );
    assert!(
        out.contains("Peripheral Device Type:DIRECT_ACCESS"),
        "{out}"
    );
    let igs = s.ok("iscsi_get_initiator_groups", Value::Null);
    assert_eq!(igs[0]["initiators"][0], "ANY");
    let cfg = s.ok("framework_get_config", json!({"name": "iscsi"}));
    let methods: Vec<&str> = cfg
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["method"].as_str().unwrap())
        .collect();
    assert_eq!(
        methods,
        [
            "iscsi_create_portal_group",
            "iscsi_create_initiator_group",
            "iscsi_create_target_node",
            "iscsi_create_target_node"
        ],
        "{cfg}"
    );

    s.ok(
        "iscsi_delete_target_node",
        json!({"target_node_name": "iqn.2026-11.io.ustor:disk2"}),
    );
    let out = run("iscsi-ls", &[&portal]);
    assert!(!out.contains("disk2"), "{out}");
    // A portal group in use by a node is not deleted.
    assert!(s
        .call("iscsi_delete_portal_group", json!({"tag": 1}))
        .is_err());
    let (code, out) = s.stop();
    assert_eq!(code, 0, "{out}");
}

/// Polls `f` until it holds (a condition, not a sleep), for at most 10 s.
fn until(mut f: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::time::Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    false
}

#[test]
fn iscsi_options_and_stats() {
    if !have("iscsi-inq") {
        return;
    }
    let dir = tmpdir("iscsi-opts");
    let mut cfg = iscsi_config();
    // Options set from the config file, before the portal group.
    cfg["subsystems"][1]["config"]
        .as_array_mut()
        .unwrap()
        .insert(
            0,
            json!({"method": "iscsi_set_options",
                   "params": {"first_burst_length": 16384, "immediate_data": false,
                              "max_sessions": 64}}),
        );
    let s = Server::start(&dir, &cfg, &[]);
    let o = s.ok("iscsi_get_options", Value::Null);
    assert_eq!(o["first_burst_length"], 16384, "{o}");
    assert_eq!(o["immediate_data"], false, "{o}");
    assert_eq!(o["max_sessions"], 64, "{o}");
    assert_eq!(o["node_base"], "iqn.2016-06.io.spdk", "{o}");
    assert_eq!(o["max_connections_per_session"], 2, "{o}");
    // Out-of-range values are refused with EINVAL and change nothing.
    let e = s
        .call("iscsi_set_options", json!({"first_burst_length": 100}))
        .unwrap_err();
    assert_eq!(e.code, -libc::EINVAL, "{e:?}");
    assert!(s
        .call("iscsi_set_options", json!({"no_such_option": 1}))
        .is_err());
    assert_eq!(s.ok("iscsi_get_options", Value::Null), o);

    // A login under those options still serves the LUN.
    let p = port(&s);
    let out = run(
        "iscsi-inq",
        &[&format!(
            "iscsi://127.0.0.1:{p}/iqn.2016-06.io.spdk:disk1/0"
        )],
    );
    assert!(out.contains("DIRECT_ACCESS"), "{out}");

    // A connection open on the portal shows as running, and goes.
    let stats = || s.ok("iscsi_get_stats", Value::Null);
    assert!(until(|| stats()["running"] == 0), "{}", stats());
    let held = std::net::TcpStream::connect(("127.0.0.1", p)).unwrap();
    assert!(until(|| stats()["running"] == 1), "{}", stats());
    let st = stats();
    assert_eq!(
        (&st["invalid"], &st["exiting"], &st["exited"]),
        (&json!(0), &json!(0), &json!(0))
    );
    drop(held);
    assert!(until(|| stats()["running"] == 0), "{}", stats());
    let (code, out) = s.stop();
    assert_eq!(code, 0, "{out}");
}

/// A libiscsi session (iscsi-perf runs until killed) shows in
/// `iscsi_get_connections` with its addresses and names, and leaves it.
#[test]
fn iscsi_get_connections_lists_a_live_session() {
    if !have("iscsi-perf") {
        return;
    }
    let dir = tmpdir("iscsi-conns");
    let s = Server::start(&dir, &iscsi_config(), &[]);
    let p = port(&s);
    assert_eq!(s.ok("iscsi_get_connections", Value::Null), json!([]));
    let mut perf = iscsi_perf(p, "1");
    let conns = || s.ok("iscsi_get_connections", Value::Null);
    let seen = until(|| conns().as_array().is_some_and(|a| !a.is_empty()));
    // The connection's own command counters grow under iscsi-perf's reads.
    let busy = until(|| conns()[0]["ops"].as_u64() > Some(100));
    let c = conns();
    let top = std::process::Command::new(BIN)
        .args([
            "top",
            "-s",
            s.sock.to_str().unwrap(),
            "--once",
            "--json",
            "-d",
            "0.3",
        ])
        .output()
        .unwrap();
    perf.kill().unwrap();
    perf.wait().unwrap();
    assert!(seen, "{c}");
    let c = &c[0];
    assert_eq!(c["target_node_name"], "iqn.2016-06.io.spdk:disk1", "{c}");
    assert_eq!(c["initiator_name"], "iqn.2026-11.io.ustor:perf", "{c}");
    assert_eq!(c["initiator_addr"], "127.0.0.1", "{c}");
    assert_eq!(c["target_addr"], "127.0.0.1", "{c}");
    assert_ne!(c["tsih"], 0, "{c}");
    assert!(busy, "{c}");
    assert!(
        c["bytes_read"].as_u64() > Some(0) && c["bytes_written"] == 0,
        "{c}"
    );
    // `ustor top` shows it with its own rate.
    let v: Value = serde_json::from_slice(&top.stdout).unwrap();
    let row = v["connections"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["target"] == "iscsi")
        .unwrap_or_else(|| panic!("{v:#}"));
    assert!(row["iops"].as_f64() > Some(0.0), "{v:#}");
    assert_eq!(row["peer"], "127.0.0.1");
    assert!(until(|| conns() == json!([])), "{}", conns());
    let (code, out) = s.stop();
    assert_eq!(code, 0, "{out}");
}

/// Initiator-group netmasks: a login from 127.0.0.1 to a node whose group
/// admits only 10.0.0.0/8 is refused (status 0x0202, authorization
/// failure), one whose group admits 127.0.0.0/8 is served.
#[test]
fn iscsi_netmasks_refuse_and_admit() {
    if !have("iscsi-inq") {
        return;
    }
    let dir = tmpdir("iscsi-netmask");
    let s = Server::start(&dir, &iscsi_config(), &[]);
    let p = port(&s);
    s.ok(
        "bdev_malloc_create",
        json!({"name": "Malloc2", "num_blocks": 1024, "block_size": 512}),
    );
    let groups = [
        (2, "10.0.0.0/8", "outside", "Malloc2"),
        (3, "127.0.0.0/8", "inside", "Malloc1"),
    ];
    for (tag, mask, node, bdev) in groups {
        s.ok(
            "iscsi_create_initiator_group",
            json!({"tag": tag, "initiators": ["ANY"], "netmasks": [mask]}),
        );
        s.ok(
            "iscsi_create_target_node",
            json!({"name": node, "pg_ig_maps": [{"pg_tag": 1, "ig_tag": tag}],
                   "luns": [{"bdev_name": bdev, "lun_id": 0}],
                   "queue_depth": 8}),
        );
    }
    let url = |n: &str| format!("iscsi://127.0.0.1:{p}/iqn.2016-06.io.spdk:{n}/0");
    let out = std::process::Command::new("iscsi-inq")
        .arg(url("outside"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Authorization failure"), "{err}");
    let out = run("iscsi-inq", &[&url("inside")]);
    assert!(out.contains("DIRECT_ACCESS"), "{out}");
    let (code, out) = s.stop();
    assert_eq!(code, 0, "{out}");
}

/// The target reports its initiators' depth to the runtime
/// (`note_depth`, from ExpStatSN): libiscsi's iscsi-perf at QD32 makes the
/// adaptive reactor sleep at once between batches (`sleeps_batched` in
/// framework_get_reactors grows); at QD1 it does not.
#[test]
fn deep_iscsi_sessions_make_the_reactor_sleep_at_once() {
    if !have("iscsi-perf") {
        return;
    }
    let dir = tmpdir("iscsi-depth");
    let s = Server::start(&dir, &iscsi_config(), &[]);
    let p = port(&s);
    let batched = || {
        let r = s.ok("framework_get_reactors", Value::Null);
        r["reactors"]
            .as_array()
            .unwrap_or_else(|| panic!("{r}"))
            .iter()
            .map(|x| {
                x["sleeps_batched"]
                    .as_u64()
                    .unwrap_or_else(|| panic!("{x}"))
            })
            .sum::<u64>()
    };
    let ops = || {
        let c = s.ok("iscsi_get_connections", Value::Null);
        c[0]["ops"].as_u64().unwrap_or(0)
    };
    let mut deep = iscsi_perf(p, "32");
    let grew = until(|| batched() > 100);
    deep.kill().unwrap();
    deep.wait().unwrap();
    assert!(grew, "QD32: {} batched sleeps", batched());
    assert!(until(
        || s.ok("iscsi_get_connections", Value::Null) == json!([])
    ));

    let mut shallow = iscsi_perf(p, "1");
    // Past the first window of QD1 reports, which ends the verdict.
    let started = until(|| ops() > 500);
    let (b0, o0) = (batched(), ops());
    let ran = until(|| ops() > o0 + 2000);
    let b1 = batched();
    shallow.kill().unwrap();
    shallow.wait().unwrap();
    assert!(started && ran, "QD1 did not run: {} ops", ops());
    assert_eq!(b1, b0, "QD1 reads still batched");
    let (code, out) = s.stop();
    assert_eq!(code, 0, "{out}");
}

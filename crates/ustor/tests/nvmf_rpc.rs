//! The NVMe/TCP control plane through JSON-RPC between two real `ustor
//! serve` processes: a target and an initiator. Listener removal and
//! re-adding, the initiator's attach / get / detach methods, and
//! `nvmf_get_stats` with its per-queue LANoT state, all over the socket.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const NQN: &str = "nqn.2026-11.io.ustor:rpc";

fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string()
}

fn listen(port: &str) -> Value {
    json!({"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": port})
}

fn target(dir: &std::path::Path, port: &str) -> Server {
    Server::start(
        dir,
        &json!({"subsystems": [
            {"subsystem": "bdev", "config": [
                {"method": "bdev_malloc_create", "params": {"name": "M0", "num_blocks": 16384, "block_size": 512}}
            ]},
            {"subsystem": "nvmf", "config": [
                {"method": "nvmf_create_transport", "params": {"trtype": "TCP",
                    "coalesce": {"mode": "adaptive", "degree": 4, "max_degree": 16, "window": 16}}},
                {"method": "nvmf_create_subsystem", "params": {"nqn": NQN, "allow_any_host": true}},
                {"method": "nvmf_subsystem_add_ns", "params": {"nqn": NQN, "namespace": {"bdev_name": "M0"}}},
                {"method": "nvmf_subsystem_add_listener", "params": {"nqn": NQN, "listen_address": listen(port)}}
            ]}
        ]}),
        &[],
    )
}

fn connects(port: &str) -> bool {
    std::net::TcpStream::connect(format!("127.0.0.1:{port}")).is_ok()
}

/// Controller `name` as `bdev_nvme_get_controllers` reports it.
fn controller(s: &Server, name: &str) -> Value {
    s.ok("bdev_nvme_get_controllers", json!({"name": name}))[0].clone()
}

#[test]
fn listener_attach_detach_and_stats_over_rpc() {
    let dir = tmpdir("nvmfrpc");
    let port = free_port();
    let t = target(&dir, &port);
    assert!(connects(&port));

    // Initiator process: attach over RPC, one bdev per namespace.
    let i = Server::start(&dir, &empty_config(), &[]);
    let names = i.ok(
        "bdev_nvme_attach_controller",
        json!({"name": "R", "trtype": "TCP", "traddr": "127.0.0.1", "trsvcid": port, "subnqn": NQN,
               "ctrlr_loss_timeout_sec": 30, "reconnect_delay_sec": 1}),
    );
    assert_eq!(names, json!(["Rn1"]));
    let c = controller(&i, "R");
    assert_eq!(c["ctrlrs"][0]["state"], "enabled", "{c}");
    assert_eq!(c["ctrlrs"][0]["trid"]["subnqn"], NQN, "{c}");
    assert_eq!(c["ctrlrs"][0]["trid"]["trsvcid"], port.as_str(), "{c}");
    let b = i.ok("bdev_get_bdevs", json!({"name": "Rn1"}));
    assert_eq!(b[0]["num_blocks"], 16384, "{b}");
    assert_eq!(b[0]["module"], "nvme", "{b}");
    // A second attach under the same name is refused.
    let e = i
        .call(
            "bdev_nvme_attach_controller",
            json!({"name": "R", "trtype": "TCP", "traddr": "127.0.0.1", "trsvcid": port, "subnqn": NQN}),
        )
        .expect_err("duplicate attach");
    assert!(format!("{e:?}").contains("exists"), "{e:?}");

    // The target sees the host's queues, each with its own coalescer state.
    // The probe connection of `connects` above is listed (no subsystem yet)
    // until the target has taken its close, so wait for that.
    let qpairs = |st: &Value| -> Vec<Value> {
        st["poll_groups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["qpairs"].as_array().unwrap().iter().cloned())
            .collect()
    };
    let st = testkit::wait_for(
        "only the host's queues in nvmf_get_stats",
        Duration::from_secs(10),
        || {
            let st = t.ok("nvmf_get_stats", Value::Null);
            let qps = qpairs(&st);
            let host_only = qps.iter().all(|q| q["subnqn"] == NQN);
            (host_only && qps.iter().any(|q| q["qid"] == 0)).then_some(st)
        },
    );
    let qps = qpairs(&st);
    for q in &qps {
        let c = &q["coalesce"];
        assert!(c["degree"].as_u64().unwrap() >= 1, "{q}");
        assert!(
            c["groups"].as_u64().unwrap() <= c["pdus"].as_u64().unwrap(),
            "{q}"
        );
    }

    // Removing the listener: new connections are refused and the host's
    // controller goes into reconnect; adding it back brings it back.
    t.ok(
        "nvmf_subsystem_remove_listener",
        json!({"nqn": NQN, "listen_address": listen(&port)}),
    );
    assert!(!connects(&port), "listener still accepts");
    let subs = t.ok("nvmf_get_subsystems", Value::Null);
    let sub = subs
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["nqn"] == NQN)
        .unwrap();
    assert_eq!(sub["listen_addresses"], json!([]), "{sub}");
    t.ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": NQN, "listen_address": listen(&port)}),
    );
    assert!(connects(&port));
    let back = testkit::try_wait_for(Duration::from_secs(15), || {
        let c = controller(&i, "R");
        (c["ctrlrs"][0]["state"] == "enabled" && c["ctrlrs"][0]["resets"].as_u64() >= Some(1))
            .then_some(())
    });
    if back.is_none() {
        panic!("controller did not come back: {}", controller(&i, "R"));
    }

    // Detach over RPC: the controller and its bdev go, the target's queues
    // close; detaching again is an error that names it.
    i.ok("bdev_nvme_detach_controller", json!({"name": "R"}));
    assert_eq!(i.ok("bdev_nvme_get_controllers", Value::Null), json!([]));
    assert!(i.call("bdev_get_bdevs", json!({"name": "Rn1"})).is_err());
    let e = i
        .call("bdev_nvme_detach_controller", json!({"name": "R"}))
        .expect_err("second detach");
    assert!(format!("{e:?}").contains('R'), "{e:?}");
    let open = |st: &Value| -> u64 {
        st["poll_groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                g["current_io_qpairs"].as_u64().unwrap()
                    + g["current_admin_qpairs"].as_u64().unwrap()
            })
            .sum()
    };
    let closed = testkit::try_wait_for(Duration::from_secs(5), || {
        (open(&t.ok("nvmf_get_stats", Value::Null)) == 0).then_some(())
    });
    if closed.is_none() {
        panic!("queues left open: {}", t.ok("nvmf_get_stats", Value::Null));
    }
    let (code, log) = i.stop();
    assert_eq!(code, 0, "{log}");
    let (code, log) = t.stop();
    assert_eq!(code, 0, "{log}");
}

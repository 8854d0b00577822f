//! Server behaviour: socket lifecycle, concurrency, asynchronous replies,
//! bad clients, client limits, the Rust client, save_config.

mod common;
use common::*;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};
use ustor_rpc::{RpcClient, ServerConfig, ServerError};

#[test]
fn socket_lifecycle() {
    let (srv, path) = start("life");
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // A second server on the same path refuses to start.
    let second = ustor_rpc::start(ServerConfig::with_path(&path), test_table());
    assert!(
        matches!(second, Err(ServerError::AlreadyRunning(_))),
        "{second:?}"
    );
    let mut c = Raw::connect(&path);
    assert_eq!(
        c.call(req("echo", json!([1]), json!(1)))["result"],
        json!([1])
    );
    srv.shutdown();
    assert!(!path.exists(), "socket removed on shutdown");
    assert!(c.closed(), "clients closed on shutdown");
    assert!(UnixStream::connect(&path).is_err());
}

#[test]
fn stale_socket_is_replaced_but_other_files_are_not() {
    let path = sock_path("stale");
    // A socket file whose server is gone: bind and drop the listener.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let srv = ustor_rpc::start(ServerConfig::with_path(&path), test_table()).unwrap();
    let mut c = RpcClient::connect(&path).unwrap();
    assert_eq!(c.call("echo", json!({"a": 1})).unwrap(), json!({"a": 1}));
    drop(srv);

    // A live foreign server (no lock file) on the path is detected.
    let foreign = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let r = ustor_rpc::start(ServerConfig::with_path(&path), test_table());
    assert!(matches!(r, Err(ServerError::AlreadyRunning(_))), "{r:?}");
    drop(foreign);
    std::fs::remove_file(&path).unwrap();

    std::fs::write(&path, b"not a socket").unwrap();
    let r = ustor_rpc::start(ServerConfig::with_path(&path), test_table());
    assert!(matches!(r, Err(ServerError::NotASocket(_))), "{r:?}");
    assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn five_hundred_clients_at_once() {
    let (srv, path) = start("many");
    let clients: Vec<Raw> = (0..500).map(|_| Raw::connect(&path)).collect();
    let mut clients = clients;
    // Every client sends before any reads, so all 500 are open together.
    for (i, c) in clients.iter_mut().enumerate() {
        c.send_json(&req("echo", json!({"client": i}), json!(i)));
    }
    eventually("500 connections", || srv.stats().connections == 500);
    for (i, c) in clients.iter_mut().enumerate() {
        let r = c.recv().expect("reply");
        assert_eq!(r["id"], json!(i));
        assert_eq!(r["result"], json!({"client": i}));
    }
    drop(clients);
    eventually("connections closed", || srv.stats().connections == 0);
    assert_eq!(srv.stats().accepted, 500);
}

#[test]
fn async_handler_does_not_block_other_clients() {
    let (_srv, path) = start("async");
    let mut slow = Raw::connect(&path);
    let t0 = Instant::now();
    slow.send_json(&req(
        "slow",
        json!({"ms": 500, "value": "done"}),
        json!("s"),
    ));
    // While the slow call is pending, other clients (and the same one) are
    // served.
    for i in 0..20 {
        let mut c = Raw::connect(&path);
        assert_eq!(
            c.call(req("echo", json!([i]), json!(i)))["result"],
            json!([i])
        );
    }
    let r = slow.call(req("echo", json!("fast"), json!("f")));
    assert_eq!(r["id"], json!("f"), "completion order, not request order");
    // (No wall-clock assertion: the order above already shows the pending
    // slow call blocked neither this connection nor the 20 other clients.)
    let r = slow.recv().unwrap();
    assert_eq!(r, json!({"jsonrpc": "2.0", "id": "s", "result": "done"}));
    assert!(t0.elapsed() >= Duration::from_millis(500));
}

#[test]
fn half_sent_request_then_disconnect_is_cleaned_up() {
    let (srv, path) = start("half");
    for _ in 0..20 {
        let mut c = Raw::connect(&path);
        c.send(br#"{"jsonrpc": "2.0", "method": "echo", "params": {"a": "#);
        drop(c);
    }
    // Disconnect while a reply is still owed.
    let mut c = Raw::connect(&path);
    let orphan = json!("half_sent_request_then_disconnect");
    c.send_json(&req("slow", json!({"ms": 100, "value": orphan}), json!(1)));
    drop(c);
    eventually("connections closed", || srv.stats().connections == 0);
    eventually("the reply owed to the gone client", || {
        slow_replied(&orphan)
    });
    let mut c = Raw::connect(&path);
    assert_eq!(
        c.call(req("echo", json!([1]), json!(1)))["result"],
        json!([1])
    );
}

#[test]
fn half_closed_client_still_gets_its_reply() {
    let (_srv, path) = start("shutwr");
    // Like `echo '{...}' | socat - UNIX-CONNECT:sock`: send, shut down the
    // write side, then read.
    let mut c = Raw::connect(&path);
    c.send_json(&req("slow", json!({"ms": 50, "value": 1}), json!(1)));
    c.s.shutdown(std::net::Shutdown::Write).unwrap();
    assert_eq!(c.recv().unwrap()["result"], json!(1));
    assert!(c.closed());
}

#[test]
fn garbage_and_silent_clients_do_not_block_others() {
    let (_srv, path) = start("garbage");
    // One client trickles an endless string, another sends nothing, a third
    // floods requests without reading replies.
    let mut trickle = Raw::connect(&path);
    trickle.send(b"{\"a\": \"");
    let _silent = Raw::connect(&path);
    let mut flood = Raw::connect(&path);
    flood.s.set_nonblocking(true).unwrap();
    let one = req("echo", json!({"pad": "x".repeat(1000)}), json!(1)).to_string();
    let mut sent = 0usize;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(300) {
        use std::io::Write;
        match flood.s.write(one.as_bytes()) {
            Ok(n) => sent += n,
            // The flood's own pacing while the socket is full.
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
        trickle.send(b"xxxxxxxx");
    }
    assert!(sent > 0);
    let mut c = Raw::connect(&path);
    let t0 = Instant::now();
    assert_eq!(
        c.call(req("echo", json!([1]), json!(1)))["result"],
        json!([1])
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn client_limit_gives_clear_refusal() {
    let (srv, path) = start_with("limit", |c| c.max_clients = 3);
    let mut held: Vec<Raw> = (0..3).map(|_| Raw::connect(&path)).collect();
    for c in &mut held {
        assert!(c.call(req("echo", json!([]), json!(1)))["result"].is_array());
    }
    let mut extra = Raw::connect(&path);
    let r = extra.recv().expect("refusal message");
    assert_eq!(r["error"]["code"], json!(-libc::EBUSY));
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("Too many RPC clients"));
    assert!(extra.closed());
    assert_eq!(srv.stats().refused, 1);
    held.pop();
    eventually("slot freed", || srv.stats().connections == 2);
    let mut again = Raw::connect(&path);
    assert_eq!(
        again.call(req("echo", json!([2]), json!(2)))["result"],
        json!([2])
    );
}

#[test]
fn rust_client_and_pretty_printing() {
    let (_srv, path) = start("client");
    let mut c = RpcClient::connect(&path).unwrap();
    assert_eq!(c.call("echo", Value::Null).unwrap(), json!({}));
    let e = c.call("fail", json!({"errno": libc::ENODEV})).unwrap_err();
    assert_eq!((e.code, e.message.as_str()), (-19, "No such device"));
    assert_eq!(e.as_errno(), Some(libc::ENODEV));
    assert_eq!(
        ustor_rpc::to_pretty(&json!({"a": [1]})),
        "{\n  \"a\": [\n    1\n  ]\n}"
    );
    let text = ustor_rpc::format_error("fail", &json!({}), &e);
    assert!(text.contains("Got JSON-RPC error response") && text.contains("-19"));
    c.set_timeout(Duration::from_millis(100));
    let e = c.call("slow", json!({"ms": 2000})).unwrap_err();
    assert_eq!(e.code, -libc::ETIMEDOUT);

    let missing = sock_path("missing");
    let e = RpcClient::connect(&missing).unwrap_err();
    assert_eq!(e.code, -libc::ENOENT);
    assert!(e.message.contains("is the ustor server running"));
}

#[test]
fn save_config_assembles_subsystems() {
    let path = sock_path("save");
    let table = test_table();
    table
        .add_subsystem("bdev", &[], |r| {
            r.ok(json!([{"method": "bdev_malloc_create", "params": {"name": "m0"}}]))
        })
        .unwrap();
    table
        .add_subsystem("nbd", &["bdev"], |r| r.ok(json!([])))
        .unwrap();
    table
        .add_subsystem("iscsi", &["bdev"], |r| r.ok(json!([])))
        .unwrap();
    let _srv = ustor_rpc::start(ServerConfig::with_path(&path), table).unwrap();
    let mut c = RpcClient::connect(&path).unwrap();
    let cfg = ustor_rpc::save_config(&mut c, None).unwrap();
    assert_eq!(
        cfg,
        json!({"subsystems": [
            {"subsystem": "bdev", "config": [{"method": "bdev_malloc_create", "params": {"name": "m0"}}]},
            {"subsystem": "nbd", "config": []},
            {"subsystem": "iscsi", "config": []}
        ]})
    );
    let only = ustor_rpc::save_config(&mut c, Some(&["nbd"])).unwrap();
    let names: Vec<&str> = only["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["subsystem"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["bdev", "nbd"]);
}

//! JSON-RPC 2.0 semantics over a real socket: malformed input, typed params,
//! ids, batches, notifications, states, aliases, errno errors.

mod common;
use common::*;
use serde_json::{json, Value};

#[test]
fn malformed_json_gets_parse_error_and_close() {
    let (_srv, path) = start("parse");
    let mut c = Raw::connect(&path);
    c.send(b"{\"jsonrpc\": \"2.0\", \"method\": }");
    let r = c.recv().unwrap();
    assert_eq!(r["id"], Value::Null);
    assert_eq!(r["error"]["code"], json!(-32700));
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("Parse error"));
    assert!(c.closed(), "connection closed after a parse error");

    // Garbage that is not JSON at all, and invalid UTF-8 inside a string.
    // An unfinished object that is already wrong is answered at once,
    // without waiting for a closing brace.
    for bad in [
        &b"hello"[..],
        b"{\"a\":\"\xff\xfe\"}",
        b"}",
        b"{\"jsonrpc\" 2",
    ] {
        let mut c = Raw::connect(&path);
        c.send(bad);
        assert_eq!(c.recv().unwrap()["error"]["code"], json!(-32700), "{bad:?}");
        assert!(c.closed());
    }
}

#[test]
fn invalid_requests() {
    let (_srv, path) = start("invalid");
    let mut c = Raw::connect(&path);
    let cases = [
        (
            json!({"jsonrpc": "1.0", "method": "echo", "id": 1}),
            json!(1),
        ),
        (json!({"method": "echo", "id": 2}), json!(2)),
        (json!({"jsonrpc": "2.0", "method": 5, "id": 3}), json!(3)),
        (
            json!({"jsonrpc": "2.0", "method": "echo", "params": 7, "id": 4}),
            json!(4),
        ),
        (
            json!({"jsonrpc": "2.0", "method": "echo", "params": "x", "id": 5}),
            json!(5),
        ),
        (
            json!({"jsonrpc": "2.0", "method": "echo", "id": [1]}),
            Value::Null,
        ),
        (
            json!({"jsonrpc": "2.0", "method": "echo", "id": true}),
            Value::Null,
        ),
        (json!(42), Value::Null),
        (json!("str"), Value::Null),
        (json!([]), Value::Null),
        // An invalid request without id still gets an answer (id null).
        (json!({"jsonrpc": "2.0", "method": 1}), Value::Null),
    ];
    for (request, id) in cases {
        let r = c.call(request.clone());
        assert_eq!(r["error"]["code"], json!(-32600), "{request} -> {r}");
        assert_eq!(r["id"], id, "{request} -> {r}");
        assert_eq!(r["jsonrpc"], json!("2.0"));
    }
    // The connection survives invalid (but well-formed) requests.
    let r = c.call(req("echo", json!({"a": 1}), json!(9)));
    assert_eq!(r["result"], json!({"a": 1}));
}

#[test]
fn method_not_found_and_errno_errors() {
    let (_srv, path) = start("errors");
    let mut c = Raw::connect(&path);
    let r = c.call(req("no_such_method", json!({}), json!(1)));
    assert_eq!(r["error"]["code"], json!(-32601));
    assert_eq!(r["error"]["message"], json!("Method not found"));
    for (errno, code, msg) in [
        (libc::EEXIST, -17, "File exists"),
        (libc::ENODEV, -19, "No such device"),
        (libc::EINVAL, -22, "Invalid argument"),
        (libc::EBUSY, -16, "Device or resource busy"),
    ] {
        let r = c.call(req("fail", json!({"errno": errno}), json!(2)));
        assert_eq!(r["error"], json!({"code": code, "message": msg}));
    }
    let r = c.call(req(
        "create",
        json!({"name": "exists", "block_size": 512}),
        json!(3),
    ));
    assert_eq!(r["error"]["code"], json!(-17));
}

#[test]
fn params_missing_unknown_wrong_type() {
    let (_srv, path) = start("params");
    let mut c = Raw::connect(&path);
    let check = |c: &mut Raw, params: Value, needle: &str, field: &str| {
        let r = c.call(req("create", params.clone(), json!(1)));
        let e = &r["error"];
        assert_eq!(e["code"], json!(-32602), "{params} -> {r}");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{params} -> {msg}");
        assert_eq!(e["data"]["param"], json!(field), "{params} -> {r}");
    };
    check(
        &mut c,
        json!({"block_size": 512}),
        "missing field `name`",
        "name",
    );
    check(
        &mut c,
        json!({"name": "m", "block_size": 512, "foo": 1}),
        "unknown field `foo`",
        "foo",
    );
    check(
        &mut c,
        json!({"name": "m", "block_size": "4k"}),
        "invalid value for `block_size`",
        "block_size",
    );
    check(
        &mut c,
        json!({"name": "m", "block_size": -1}),
        "invalid value for `block_size`",
        "block_size",
    );
    check(
        &mut c,
        json!({"name": 7, "block_size": 512}),
        "invalid value for `name`",
        "name",
    );
    // Params omitted entirely are treated as {} (SPDK's client omits them).
    let r = c.call(json!({"jsonrpc": "2.0", "method": "create", "id": 2}));
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("missing field `name`"));
    let r = c.call(json!({"jsonrpc": "2.0", "method": "echo", "id": 3}));
    assert_eq!(r["result"], json!({}));
    let ok = c.call(req(
        "create",
        json!({"name": "m", "block_size": 512, "num_blocks": 8}),
        json!(4),
    ));
    assert_eq!(ok["result"], json!({"name": "m", "bytes": 4096}));
}

#[test]
fn ids_of_every_type_are_echoed() {
    let (_srv, path) = start("ids");
    let mut c = Raw::connect(&path);
    for id in [
        json!("abc"),
        json!(""),
        json!(0),
        json!(-7),
        json!(1.5),
        json!(-0.25),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(1e300),
        Value::Null,
    ] {
        let r = c.call(req("echo", json!([1]), id.clone()));
        assert_eq!(r["id"], id);
        assert_eq!(r["result"], json!([1]));
    }
    // Raw text ids keep their value exactly.
    c.send(br#"{"jsonrpc":"2.0","method":"echo","id":"\u00e9\n"}"#);
    assert_eq!(c.recv().unwrap()["id"], json!("\u{e9}\n"));
}

#[test]
fn batches_and_notifications() {
    let (_srv, path) = start("batch");
    let mut c = Raw::connect(&path);
    // Notification: no reply at all; the next request's reply comes first.
    c.send_json(&json!({"jsonrpc": "2.0", "method": "echo", "params": [0]}));
    c.send_json(&json!({"jsonrpc": "2.0", "method": "no_such", "params": [0]}));
    let r = c.call(req("echo", json!([1]), json!(1)));
    assert_eq!(r["id"], json!(1));

    let r = c.call(json!([
        {"jsonrpc": "2.0", "method": "echo", "params": [1], "id": 1},
        {"jsonrpc": "2.0", "method": "echo", "params": [2]},
        {"jsonrpc": "2.0", "method": "slow", "params": {"ms": 50, "value": "late"}, "id": "s"},
        {"jsonrpc": "2.0", "method": "nope", "id": 3},
        {"foo": "bar"},
        1
    ]));
    let arr = r.as_array().expect("batch reply is an array");
    assert_eq!(arr.len(), 5, "{r}");
    assert_eq!(arr[0], json!({"jsonrpc": "2.0", "id": 1, "result": [1]}));
    assert_eq!(
        arr[1],
        json!({"jsonrpc": "2.0", "id": "s", "result": "late"})
    );
    assert_eq!(arr[2]["error"]["code"], json!(-32601));
    assert_eq!(arr[3]["error"]["code"], json!(-32600));
    assert_eq!(arr[4]["error"]["code"], json!(-32600));

    // Empty batch: one error object, not an array.
    let r = c.call(json!([]));
    assert_eq!(r["error"]["code"], json!(-32600));
    // A batch of notifications only: no reply.
    c.send_json(&json!([
        {"jsonrpc": "2.0", "method": "echo"},
        {"jsonrpc": "2.0", "method": "echo", "params": {"x": 1}}
    ]));
    let r = c.call(req("echo", json!("after"), json!(7)));
    assert_eq!(
        r["id"],
        json!(7),
        "no reply for the notification batch: {r}"
    );
}

#[test]
fn back_to_back_and_split_requests() {
    let (_srv, path) = start("stream");
    let mut c = Raw::connect(&path);
    // Several requests in one write, then one request byte by byte.
    let mut many = String::new();
    for i in 0..5 {
        many.push_str(&req("echo", json!([i]), json!(i)).to_string());
    }
    c.send(many.as_bytes());
    let mut ids: Vec<i64> = (0..5)
        .map(|_| c.recv().unwrap()["id"].as_i64().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, vec![0, 1, 2, 3, 4]);
    let one = req("echo", json!({"s": "}{]["}), json!("x")).to_string();
    for b in one.as_bytes() {
        c.send(&[*b]);
    }
    assert_eq!(c.recv().unwrap()["result"], json!({"s": "}{]["}));
}

#[test]
fn startup_and_runtime_states() {
    let (srv, path) = start("state");
    let _ = &srv;
    let mut c = Raw::connect(&path);
    let r = c.call(req("startup_only", json!({}), json!(1)));
    assert_eq!(r["error"]["code"], json!(-1));
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("before framework is initialized"));
    let names = c.call(req("rpc_get_methods", json!({"current": true}), json!(2)));
    let names = names["result"].as_array().unwrap().clone();
    assert!(names.contains(&json!("create")) && !names.contains(&json!("startup_only")));
    assert!(!names.contains(&json!("create_old")));
    let all = c.call(req(
        "rpc_get_methods",
        json!({"include_aliases": true}),
        json!(3),
    ));
    assert!(all["result"]
        .as_array()
        .unwrap()
        .contains(&json!("create_old")));
    let bad = c.call(req("rpc_get_methods", json!({"current": "yes"}), json!(4)));
    assert_eq!(bad["error"]["data"]["param"], json!("current"));
    let r = c.call(req(
        "create_old",
        json!({"name": "a", "block_size": 1}),
        json!(5),
    ));
    assert_eq!(r["result"]["name"], json!("a"));
}

#[test]
fn startup_state_refuses_runtime_methods() {
    let path = sock_path("startup");
    let table = test_table();
    table.set_state(ustor_rpc::RPC_STARTUP);
    let _srv = ustor_rpc::start(ustor_rpc::ServerConfig::with_path(&path), table.clone()).unwrap();
    let mut c = Raw::connect(&path);
    let r = c.call(req(
        "create",
        json!({"name": "a", "block_size": 1}),
        json!(1),
    ));
    assert_eq!(
        r["error"],
        json!({"code": -1, "message": "Method may only be called after framework is initialized using framework_start_init RPC."})
    );
    assert_eq!(
        c.call(req("startup_only", json!({}), json!(2)))["result"],
        json!(true)
    );
    table.set_state(ustor_rpc::RPC_RUNTIME);
    let r = c.call(req(
        "create",
        json!({"name": "a", "block_size": 1}),
        json!(3),
    ));
    assert_eq!(r["result"]["name"], json!("a"));
}

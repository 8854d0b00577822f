//! Request size limits: a 100 MB request is refused with an error while the
//! server's memory stays bounded and other clients keep being served. Kept
//! in its own test binary so the RSS measurement sees no other test.

mod common;
use common::*;
use serde_json::json;
use std::io::Write;
use std::time::Duration;

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

#[test]
fn hundred_megabyte_request_is_refused_with_bounded_memory() {
    let (srv, path) = start_with("big", |c| c.max_request_bytes = 4 << 20);
    let rss_before = rss_bytes();
    let mut big = Raw::connect(&path);
    let mut writer = big.s.try_clone().unwrap();
    // Stream 100 MB from a small buffer so the test itself stays small.
    let sender = std::thread::spawn(move || {
        let chunk = vec![b'a'; 1 << 20];
        let mut sent = 0usize;
        if writer
            .write_all(br#"{"jsonrpc":"2.0","method":"echo","id":1,"params":{"blob":""#)
            .is_err()
        {
            return sent;
        }
        for _ in 0..100 {
            match writer.write_all(&chunk) {
                Ok(()) => sent += chunk.len(),
                // The server closes the connection once over the limit.
                Err(_) => return sent,
            }
        }
        let _ = writer.write_all(b"\"}}");
        sent
    });
    // Meanwhile another client is served.
    let mut other = Raw::connect(&path);
    assert_eq!(
        other.call(req("echo", json!([1]), json!(1)))["result"],
        json!([1])
    );

    let r = big
        .recv_within(Duration::from_secs(10))
        .expect("an error reply before close");
    assert_eq!(r["id"], json!(null));
    assert_eq!(r["error"]["code"], json!(-32600));
    let msg = r["error"]["message"].as_str().unwrap();
    assert!(msg.contains("exceeds the limit of 4194304 bytes"), "{msg}");
    assert!(big.closed());
    let sent = sender.join().unwrap();
    assert!(
        sent < 100 << 20,
        "server stopped reading early ({sent} bytes sent)"
    );

    let growth = rss_bytes().saturating_sub(rss_before);
    assert!(growth < 48 << 20, "server memory grew by {growth} bytes");
    assert_eq!(
        other.call(req("echo", json!([2]), json!(2)))["result"],
        json!([2])
    );
    eventually("big client gone", || srv.stats().connections == 1);

    // A request just under the limit is still served.
    let mut ok = Raw::connect(&path);
    let blob = "b".repeat((4 << 20) - 200);
    let r = ok.call(req("echo", json!({"blob": blob}), json!(3)));
    assert_eq!(r["result"]["blob"].as_str().map(str::len), Some(blob.len()));
}

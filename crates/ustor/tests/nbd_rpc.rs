//! The nbd_* RPC methods against a real `ustor serve` process: stopping and
//! restarting the listener, deleting exports (and releasing their bdevs),
//! exact `nbd_get_stats` counters after known I/O, the `max_connections`
//! limit, and a `save_config` round trip with non-default values. Data goes
//! through real NBD clients (qemu-io, nbdinfo) and a raw TCP client below.

mod common;

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Output};
use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use ustor_nbd::wire::{
    client_flags, cmd, opt, transmission_flags, IHAVEOPT, NBD_MAGIC, REQUEST_MAGIC,
    SIMPLE_REPLY_MAGIC,
};

/// NBD_EPERM (the protocol's errno values are Linux's).
const NBD_EPERM: u32 = 1;
const KIB4: usize = 4096;

// ---------------------------------------------------------------------------
// A raw NBD client: fixed newstyle, EXPORT_NAME, simple replies, QD1.

struct RawNbd {
    sock: TcpStream,
    size: u64,
    flags: u16,
    cookie: u64,
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

impl RawNbd {
    fn connect(port: u16, export: &str) -> io::Result<RawNbd> {
        let mut sock = TcpStream::connect(("127.0.0.1", port))?;
        sock.set_read_timeout(Some(Duration::from_secs(5)))?;
        sock.set_nodelay(true)?;
        let mut greeting = [0u8; 18];
        sock.read_exact(&mut greeting)?;
        assert_eq!(be64(&greeting), NBD_MAGIC);
        assert_eq!(be64(&greeting[8..]), IHAVEOPT);
        let cflags = client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES;
        sock.write_all(&cflags.to_be_bytes())?;
        let mut o = Vec::new();
        o.extend_from_slice(&IHAVEOPT.to_be_bytes());
        o.extend_from_slice(&opt::EXPORT_NAME.to_be_bytes());
        o.extend_from_slice(&(export.len() as u32).to_be_bytes());
        o.extend_from_slice(export.as_bytes());
        sock.write_all(&o)?;
        // An unknown name is answered by a disconnect (EOF here).
        let mut r = [0u8; 10];
        sock.read_exact(&mut r)?;
        Ok(RawNbd {
            sock,
            size: be64(&r),
            flags: u16::from_be_bytes([r[8], r[9]]),
            cookie: 0,
        })
    }

    /// Sends one request and waits for its simple reply: (error, read data).
    fn request(
        &mut self,
        ty: u16,
        offset: u64,
        len: u32,
        data: &[u8],
    ) -> io::Result<(u32, Vec<u8>)> {
        self.cookie += 1;
        let mut h = Vec::with_capacity(28 + data.len());
        h.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        h.extend_from_slice(&0u16.to_be_bytes());
        h.extend_from_slice(&ty.to_be_bytes());
        h.extend_from_slice(&self.cookie.to_be_bytes());
        h.extend_from_slice(&offset.to_be_bytes());
        h.extend_from_slice(&len.to_be_bytes());
        h.extend_from_slice(data);
        self.sock.write_all(&h)?;
        let mut r = [0u8; 16];
        self.sock.read_exact(&mut r)?;
        assert_eq!(
            u32::from_be_bytes(r[..4].try_into().unwrap()),
            SIMPLE_REPLY_MAGIC
        );
        let err = u32::from_be_bytes(r[4..8].try_into().unwrap());
        assert_eq!(be64(&r[8..]), self.cookie, "reply cookie");
        let mut out = Vec::new();
        if ty == cmd::READ && err == 0 {
            out.resize(len as usize, 0);
            self.sock.read_exact(&mut out)?;
        }
        Ok((err, out))
    }

    fn read(&mut self, offset: u64, len: usize) -> io::Result<(u32, Vec<u8>)> {
        self.request(cmd::READ, offset, len as u32, &[])
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<u32> {
        Ok(self.request(cmd::WRITE, offset, data.len() as u32, data)?.0)
    }

    /// NBD_CMD_DISC, then waits for the server to close its side.
    fn disconnect(mut self) {
        let mut h = Vec::new();
        h.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        h.extend_from_slice(&0u16.to_be_bytes());
        h.extend_from_slice(&cmd::DISC.to_be_bytes());
        h.extend_from_slice(&[0u8; 20]);
        self.sock.write_all(&h).unwrap();
        let mut b = [0u8; 1];
        assert_eq!(self.sock.read(&mut b).unwrap_or(0), 0, "data after DISC");
    }
}

/// Connects and reads the greeting: `Ok` when the server greeted, `Err`
/// (refused, reset or EOF) otherwise.
fn greeted(port: u16) -> io::Result<()> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut g = [0u8; 18];
    s.read_exact(&mut g)?;
    assert_eq!(be64(&g), NBD_MAGIC);
    Ok(())
}

// ---------------------------------------------------------------------------
// Helpers around the server and the peer tools.

fn tools() -> bool {
    ["qemu-io", "nbdinfo"].into_iter().all(testkit::need)
}

fn malloc_config(names: &[&str], mib: u64) -> Value {
    let calls: Vec<Value> = names
        .iter()
        .map(|n| {
            json!({"method": "bdev_malloc_create",
                   "params": {"name": n, "num_blocks": (mib << 20) / 512, "block_size": 512}})
        })
        .collect();
    json!({"subsystems": [{"subsystem": "bdev", "config": calls}]})
}

/// `nbd_server_start` on 127.0.0.1 with a kernel-chosen port; the port.
fn nbd_start(s: &Server, max_connections: Option<usize>) -> u16 {
    let mut p = json!({"listen_address": {"traddr": "127.0.0.1", "trsvcid": "0"}});
    if let Some(m) = max_connections {
        p["max_connections"] = json!(m);
    }
    let r = s.ok("nbd_server_start", p);
    assert_eq!(r["traddr"], "127.0.0.1", "{r}");
    r["trsvcid"].as_str().unwrap().parse().unwrap()
}

fn export(s: &Server, name: &str, bdev: &str) {
    let r = s.ok(
        "nbd_export_create",
        json!({"name": name, "bdev_name": bdev}),
    );
    assert_eq!(r, json!(true));
}

fn stats(s: &Server) -> Value {
    s.ok("nbd_get_stats", Value::Null)
}

fn stat(s: &Server, k: &str) -> u64 {
    stats(s)[k]
        .as_u64()
        .unwrap_or_else(|| panic!("nbd_get_stats has no counter {k}"))
}

/// Polls `nbd_get_stats` until `cond` holds (connection teardown is async).
fn wait_stats(s: &Server, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    testkit::try_wait_for(Duration::from_secs(5), || Some(stats(s)).filter(&cond))
        .unwrap_or_else(|| panic!("timed out waiting for {what}: {}", stats(s)))
}

fn export_names(s: &Server) -> Vec<String> {
    s.ok("nbd_get_exports", Value::Null)
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap().to_string())
        .collect()
}

fn uri(port: u16, name: &str) -> String {
    format!("nbd://127.0.0.1:{port}/{name}")
}

fn text(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// qemu-io on a raw NBD image; `-r` when `read_only`.
fn qemu_io(port: u16, name: &str, read_only: bool, cmds: &[String]) -> Output {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    if read_only {
        c.arg("-r");
    }
    for x in cmds {
        c.arg("-c").arg(x);
    }
    c.arg(uri(port, name)).output().expect("run qemu-io")
}

/// Whether qemu-io ran every command cleanly (it exits 0 even when a
/// command fails on some versions, so the output is checked too).
fn qemu_io_ok(o: &Output) -> bool {
    let all = text(o);
    o.status.success() && !all.contains("error") && !all.contains("failed")
}

/// `nbdinfo --json --list`: (name, description) of every export.
fn nbdinfo_list(port: u16) -> Vec<(String, String)> {
    let o = Command::new("nbdinfo")
        .args(["--json", "--list", &format!("nbd://127.0.0.1:{port}")])
        .output()
        .expect("run nbdinfo");
    assert!(o.status.success(), "nbdinfo --list: {}", text(&o));
    let v: Value = serde_json::from_slice(&o.stdout).expect("nbdinfo JSON");
    v["exports"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| {
                    (
                        e["export-name"].as_str().unwrap_or("").to_string(),
                        e["description"].as_str().unwrap_or("").to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn save_config(s: &Server) -> Value {
    let out = Command::new(BIN)
        .args(["save-config", "-s", s.sock.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "save-config: {}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn nbd_config(s: &Server) -> Vec<Value> {
    s.ok("framework_get_config", json!({"name": "nbd"}))
        .as_array()
        .unwrap()
        .clone()
}

// ---------------------------------------------------------------------------

/// nbd_server_stop closes the listener (new connections refused) but keeps
/// the exports and lets established connections run on; starting again on
/// the same address serves the same exports, data included.
#[test]
fn server_stop_refuses_connections_and_restart_serves_exports_again() {
    if !tools() {
        return;
    }
    let dir = tmpdir("nbdstop");
    let s = Server::start(&dir, &malloc_config(&["Malloc0"], 4), &[]);
    let port = nbd_start(&s, None);
    export(&s, "disk", "Malloc0");
    let o = qemu_io(port, "disk", false, &["write -P 0x11 0 64k".into()]);
    assert!(qemu_io_ok(&o), "{}", text(&o));
    let mut held = RawNbd::connect(port, "disk").unwrap();

    assert_eq!(s.ok("nbd_server_stop", Value::Null), json!(true));
    let e = TcpStream::connect(("127.0.0.1", port))
        .map(|_| ())
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
    let o = qemu_io(port, "disk", true, &["read 0 4k".into()]);
    assert!(
        !o.status.success(),
        "qemu-io connected to a stopped server: {}",
        text(&o)
    );
    // Established connections run on until they close.
    let (err, data) = held.read(0, KIB4).unwrap();
    assert_eq!(err, 0);
    assert!(data.iter().all(|&b| b == 0x11));
    // The exports stay (only the listener is gone) and the config dump
    // says so: exports without a server start.
    assert_eq!(export_names(&s), ["disk"]);
    let cfg = nbd_config(&s);
    assert!(
        !cfg.iter().any(|c| c["method"] == "nbd_server_start"),
        "{cfg:?}"
    );
    assert!(cfg
        .iter()
        .any(|c| c["method"] == "nbd_export_create" && c["params"]["name"] == "disk"));
    // A second stop: not started.
    let e = s.call("nbd_server_stop", Value::Null).unwrap_err();
    assert_eq!(e.code, -libc::ENODEV, "{e:?}");
    assert!(e.message.contains("not started"), "{e:?}");
    // Stats still answer while stopped.
    assert!(stat(&s, "connections_accepted") >= 2);

    // Start again on the very same address.
    let r = s.ok(
        "nbd_server_start",
        json!({"listen_address": {"traddr": "127.0.0.1", "trsvcid": port.to_string()}}),
    );
    assert_eq!(
        r,
        json!({"traddr": "127.0.0.1", "trsvcid": port.to_string()})
    );
    assert_eq!(s.nbd_port(), port);
    assert_eq!(nbdinfo_list(port), [("disk".to_string(), String::new())]);
    let o = qemu_io(port, "disk", true, &["read -P 0x11 0 64k".into()]);
    assert!(qemu_io_ok(&o), "{}", text(&o));
    // The connection from before the stop still works too.
    assert_eq!(held.write(4096, &[0x22; KIB4]).unwrap(), 0);
    held.disconnect();
    let o = qemu_io(port, "disk", true, &["read -P 0x22 4k 4k".into()]);
    assert!(qemu_io_ok(&o), "{}", text(&o));
    // Already running: refused.
    let e = s
        .call(
            "nbd_server_start",
            json!({"listen_address": {"traddr": "127.0.0.1", "trsvcid": "0"}}),
        )
        .unwrap_err();
    assert_eq!(e.code, -libc::EEXIST, "{e:?}");
    assert!(e.message.contains("already started"), "{e:?}");
    let (code, log) = s.stop();
    assert_eq!(code, 0, "{log}");
}

/// nbd_export_delete hides the export from the RPC and from NBD clients,
/// errors clearly on unknown names, and releases the bdev's claim once the
/// last connection to the export has closed (docs/nbd.md).
#[test]
fn export_delete_hides_export_and_releases_bdev() {
    if !tools() {
        return;
    }
    let dir = tmpdir("nbddel");
    let s = Server::start(&dir, &malloc_config(&["Malloc0", "Malloc1"], 4), &[]);
    let port = nbd_start(&s, None);
    export(&s, "a", "Malloc0");
    export(&s, "b", "Malloc1");
    assert_eq!(export_names(&s), ["a", "b"]);
    let listed: Vec<String> = nbdinfo_list(port).into_iter().map(|e| e.0).collect();
    assert_eq!(listed, ["a", "b"]);
    // Claimed by the export: the bdev cannot be deleted.
    let e = s
        .call("bdev_malloc_delete", json!({"name": "Malloc0"}))
        .unwrap_err();
    assert!(e.message.contains("claimed"), "{e:?}");

    let mut held = RawNbd::connect(port, "a").unwrap();
    assert_eq!(held.write(0, &[0x33; KIB4]).unwrap(), 0);
    assert_eq!(s.ok("nbd_export_delete", json!({"name": "a"})), json!(true));
    assert_eq!(export_names(&s), ["b"]);
    let listed: Vec<String> = nbdinfo_list(port).into_iter().map(|e| e.0).collect();
    assert_eq!(listed, ["b"]);
    // New connections no longer find it.
    assert!(
        RawNbd::connect(port, "a").is_err(),
        "deleted export still served"
    );
    let o = qemu_io(port, "a", true, &["read 0 4k".into()]);
    assert!(!o.status.success(), "{}", text(&o));
    // The connection already on it keeps its channel, and the claim.
    let (err, data) = held.read(0, KIB4).unwrap();
    assert_eq!((err, data), (0, vec![0x33; KIB4]));
    let e = s
        .call("bdev_malloc_delete", json!({"name": "Malloc0"}))
        .unwrap_err();
    assert!(e.message.contains("claimed"), "{e:?}");
    held.disconnect();
    // Released once that connection is gone.
    let deleted = testkit::try_wait_for(Duration::from_secs(5), || {
        s.call("bdev_malloc_delete", json!({"name": "Malloc0"}))
            .ok()
    });
    match deleted {
        Some(v) => assert_eq!(v, json!(true)),
        None => {
            let e = s.call("bdev_malloc_delete", json!({"name": "Malloc0"}));
            panic!("bdev never released after export delete: {e:?}")
        }
    }
    let bdevs = s.ok("bdev_get_bdevs", Value::Null);
    let names: Vec<&str> = bdevs
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["Malloc1"]);

    // Unknown (and already deleted) exports: ENODEV with the name.
    for name in ["nope", "a"] {
        let e = s
            .call("nbd_export_delete", json!({"name": name}))
            .unwrap_err();
        assert_eq!(e.code, -libc::ENODEV, "{e:?}");
        assert!(
            e.message.contains(&format!("no export named {name}")),
            "{e:?}"
        );
    }
    // Missing name: invalid params.
    let e = s.call("nbd_export_delete", json!({})).unwrap_err();
    assert_eq!(e.code, -32602, "{e:?}");
    assert!(e.message.contains("name"), "{e:?}");
    // Export b is untouched and serves I/O; deleting it leaves nothing.
    let o = qemu_io(
        port,
        "b",
        false,
        &["write -P 0x44 0 4k".into(), "read -P 0x44 0 4k".into()],
    );
    assert!(qemu_io_ok(&o), "{}", text(&o));
    assert_eq!(s.ok("nbd_export_delete", json!({"name": "b"})), json!(true));
    assert!(export_names(&s).is_empty());
    assert!(RawNbd::connect(port, "b").is_err());
    assert_eq!(
        s.ok("bdev_malloc_delete", json!({"name": "Malloc1"})),
        json!(true)
    );
    let (code, log) = s.stop();
    assert_eq!(code, 0, "{log}");
}

/// After N 4 KiB writes and M 4 KiB reads from qemu-io on one connection,
/// the request and byte counters are exact.
#[test]
fn stats_count_known_io_exactly() {
    if !tools() {
        return;
    }
    const N: u64 = 7;
    const M: u64 = 5;
    let dir = tmpdir("nbdstats");
    let s = Server::start(&dir, &malloc_config(&["Malloc0"], 4), &[]);
    let port = nbd_start(&s, None);
    export(&s, "disk", "Malloc0");
    let st = stats(&s);
    for (k, v) in st.as_object().unwrap() {
        assert_eq!(v, &json!(0), "{k} not zero before any connection: {st}");
    }
    let mut cmds = Vec::new();
    for i in 0..N {
        cmds.push(format!("write -P 0x{:02x} {} 4k", 0x40 + i, i * 4096));
    }
    for i in 0..M {
        cmds.push(format!("read -P 0x{:02x} {} 4k", 0x40 + i, i * 4096));
    }
    let o = qemu_io(port, "disk", false, &cmds);
    assert!(qemu_io_ok(&o), "{}", text(&o));
    let st = wait_stats(&s, "the connection to close", |st| {
        st["connections_closed"] == 1
    });
    eprintln!("after qemu-io: {st}");
    let n = |k: &str| st[k].as_u64().unwrap();
    assert_eq!(n("connections_accepted"), 1, "{st}");
    assert_eq!(n("connections_rejected"), 0, "{st}");
    assert_eq!(n("handshakes_failed"), 0, "{st}");
    assert_eq!(n("protocol_errors"), 0, "{st}");
    assert_eq!(n("writes"), N, "{st}");
    assert_eq!(n("bytes_written"), N * 4096, "{st}");
    assert_eq!(n("reads"), M, "{st}");
    assert_eq!(n("bytes_read"), M * 4096, "{st}");
    for k in [
        "trims",
        "write_zeroes",
        "caches",
        "block_status",
        "refused",
        "io_errors",
        "bytes_discarded",
    ] {
        assert_eq!(n(k), 0, "{k}: {st}");
    }
    // Malloc has no volatile cache: SEND_FLUSH is not advertised, so qemu
    // sends no flush. Every request got exactly one reply, and at QD1 each
    // reply left in a send of its own and each request (and the closing
    // DISC) needed at least one receive.
    assert_eq!(n("flushes"), 0, "{st}");
    let requests = N + M;
    assert_eq!(n("replies_sent"), requests, "{st}");
    assert_eq!(n("send_calls"), requests, "{st}");
    assert!(n("recv_calls") > requests, "{st}");
    // Small writes are copied out of staging, never more than once per
    // payload byte (how much depends on TCP segmentation); reads never.
    assert!(n("payload_copies") <= N * 2, "{st}");
    assert!(n("payload_copied_bytes") <= N * 4096, "{st}");

    // A raw client adds exactly its own requests, and a refused write on
    // top: counted as refused, its payload as discarded.
    let mut c = RawNbd::connect(port, "disk").unwrap();
    assert_eq!(c.size, 4 << 20);
    assert_eq!(
        c.flags & transmission_flags::SEND_FLUSH,
        0,
        "flags {:#x}",
        c.flags
    );
    assert_eq!(c.write(0, &[1; KIB4]).unwrap(), 0);
    assert_eq!(c.read(0, 2 * KIB4).unwrap().0, 0);
    // Past the end: refused (ENOSPC for writes), payload drained.
    assert_ne!(c.write(c.size, &[2; 512]).unwrap(), 0);
    c.disconnect();
    let st2 = wait_stats(&s, "the raw connection to close", |st| {
        st["connections_closed"] == 2
    });
    let d = |k: &str| st2[k].as_u64().unwrap() - st[k].as_u64().unwrap();
    assert_eq!(d("connections_accepted"), 1, "{st2}");
    assert_eq!(d("writes"), 1, "{st2}");
    assert_eq!(d("bytes_written"), 4096, "{st2}");
    assert_eq!(d("reads"), 1, "{st2}");
    assert_eq!(d("bytes_read"), 8192, "{st2}");
    assert_eq!(d("refused"), 1, "{st2}");
    assert_eq!(d("bytes_discarded"), 512, "{st2}");
    assert_eq!(d("replies_sent"), 3, "{st2}");
    let (code, log) = s.stop();
    assert_eq!(code, 0, "{log}");
}

/// max_connections=1: while one connection is open a second is accepted by
/// the kernel and closed by the server before the greeting (counted as
/// rejected); once the first has closed a new one is served.
#[test]
fn max_connections_limits_open_connections() {
    if !tools() {
        return;
    }
    let dir = tmpdir("nbdmax");
    let s = Server::start(&dir, &malloc_config(&["Malloc0"], 4), &[]);
    let port = nbd_start(&s, Some(1));
    export(&s, "disk", "Malloc0");
    let mut first = RawNbd::connect(port, "disk").unwrap();
    assert_eq!(first.write(0, &[0x55; KIB4]).unwrap(), 0);

    assert!(
        greeted(port).is_err(),
        "second connection greeted past max_connections=1"
    );
    wait_stats(&s, "a rejected connection", |st| {
        st["connections_rejected"] == 1
    });
    let o = qemu_io(port, "disk", true, &["read 0 4k".into()]);
    assert!(
        !o.status.success(),
        "qemu-io served past the limit: {}",
        text(&o)
    );
    let st = wait_stats(&s, "two rejected connections", |st| {
        st["connections_rejected"] == 2
    });
    assert_eq!(st["connections_accepted"], 1, "{st}");
    // The first connection is unaffected.
    assert_eq!(first.read(0, KIB4).unwrap(), (0, vec![0x55; KIB4]));
    first.disconnect();
    wait_stats(&s, "the first connection to close", |st| {
        st["connections_closed"] == 1
    });

    let mut next = RawNbd::connect(port, "disk").unwrap();
    assert_eq!(next.read(0, KIB4).unwrap(), (0, vec![0x55; KIB4]));
    next.disconnect();
    wait_stats(&s, "the second connection to close", |st| {
        st["connections_closed"] == 2
    });
    let o = qemu_io(port, "disk", true, &["read -P 0x55 0 4k".into()]);
    assert!(qemu_io_ok(&o), "{}", text(&o));
    let st = wait_stats(&s, "qemu-io to close", |st| st["connections_closed"] == 3);
    assert_eq!(st["connections_accepted"], 3, "{st}");
    assert_eq!(st["connections_rejected"], 2, "{st}");
    assert_eq!(
        nbd_config(&s)[0]["params"]["max_connections"],
        json!(1),
        "config dump"
    );
    let (code, log) = s.stop();
    assert_eq!(code, 0, "{log}");
}

/// save_config keeps max_connections, read_only and description; a fresh
/// server from that file has the same exports, enforces the same limit,
/// refuses writes on the read-only export and serves its reads.
#[test]
fn save_config_round_trips_non_default_nbd_settings() {
    if !tools() {
        return;
    }
    const DESC: &str = "golden image (read-only)";
    let dir = tmpdir("nbdsave");
    let a = Server::start(&dir, &malloc_config(&["Malloc0", "Malloc1"], 4), &[]);
    let port = nbd_start(&a, Some(3));
    a.ok(
        "nbd_export_create",
        json!({"name": "golden", "bdev_name": "Malloc0", "read_only": true, "description": DESC}),
    );
    export(&a, "scratch", "Malloc1");
    let before = a.ok("nbd_get_exports", Value::Null);
    assert_eq!(
        before,
        json!([
            {"name": "golden", "bdev_name": "Malloc0", "read_only": true, "description": DESC,
             "size_bytes": 4 << 20, "block_size": 512},
            {"name": "scratch", "bdev_name": "Malloc1", "read_only": false, "description": "",
             "size_bytes": 4 << 20, "block_size": 512}
        ])
    );
    let saved = save_config(&a);
    let (code, log) = a.stop();
    assert_eq!(code, 0, "{log}");

    let nbd = saved["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["subsystem"] == "nbd")
        .expect("nbd subsystem saved");
    let start = &nbd["config"][0];
    assert_eq!(start["method"], "nbd_server_start", "{nbd}");
    assert_eq!(start["params"]["max_connections"], json!(3), "{nbd}");
    assert_eq!(
        start["params"]["listen_address"]["trsvcid"],
        json!(port.to_string())
    );
    let mut cfg = saved.clone();
    for sub in cfg["subsystems"].as_array_mut().unwrap() {
        for c in sub["config"].as_array_mut().unwrap() {
            if let Some(p) = c["params"].get_mut("listen_address") {
                p["trsvcid"] = json!("0");
            }
        }
    }
    let b = Server::start(&dir, &cfg, &[]);
    assert_eq!(b.ok("nbd_get_exports", Value::Null), before);
    let port = b.nbd_port();
    assert_eq!(nbd_config(&b)[0]["params"]["max_connections"], json!(3));

    // nbdinfo sees both exports and the description.
    let mut listed = nbdinfo_list(port);
    listed.sort();
    assert_eq!(
        listed,
        [
            ("golden".to_string(), DESC.to_string()),
            ("scratch".to_string(), String::new())
        ]
    );
    let o = Command::new("nbdinfo")
        .arg(uri(port, "golden"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let info = String::from_utf8_lossy(&o.stdout);
    assert!(info.contains(DESC), "{info}");
    assert!(info.contains("is_read_only: true"), "{info}");

    // Read-only: qemu-io cannot write (it refuses to open the export
    // read-write), the server refuses a raw write with EPERM, reads work.
    let o = qemu_io(port, "golden", false, &["write -P 0x66 0 4k".into()]);
    assert!(
        !qemu_io_ok(&o),
        "write to a read-only export succeeded: {}",
        text(&o)
    );
    let o = qemu_io(port, "golden", true, &["read -P 0 0 64k".into()]);
    assert!(qemu_io_ok(&o), "{}", text(&o));
    let mut ro = RawNbd::connect(port, "golden").unwrap();
    assert_ne!(
        ro.flags & transmission_flags::READ_ONLY,
        0,
        "flags {:#x}",
        ro.flags
    );
    let refused0 = stat(&b, "refused");
    assert_eq!(ro.write(0, &[0x66; KIB4]).unwrap(), NBD_EPERM);
    assert_eq!(ro.read(0, KIB4).unwrap(), (0, vec![0; KIB4]));
    assert_eq!(stat(&b, "refused"), refused0 + 1);
    // The writable one stays writable.
    let o = qemu_io(
        port,
        "scratch",
        false,
        &["write -P 0x77 0 4k".into(), "read -P 0x77 0 4k".into()],
    );
    assert!(qemu_io_ok(&o), "{}", text(&o));

    // max_connections=3 by behaviour: with `ro` and two more open, a fourth
    // is refused.
    let c2 = RawNbd::connect(port, "scratch").unwrap();
    let c3 = RawNbd::connect(port, "golden").unwrap();
    let rejected0 = stat(&b, "connections_rejected");
    assert!(
        greeted(port).is_err(),
        "fourth connection greeted past max_connections=3"
    );
    wait_stats(&b, "the fourth connection's rejection", |st| {
        st["connections_rejected"] == rejected0 + 1
    });
    for c in [ro, c2, c3] {
        c.disconnect();
    }
    let closed = |st: &Value| st["connections_closed"] == st["connections_accepted"];
    wait_stats(&b, "all connections to close", closed);
    assert!(greeted(port).is_ok());
    let (code, log) = b.stop();
    assert_eq!(code, 0, "{log}");
}

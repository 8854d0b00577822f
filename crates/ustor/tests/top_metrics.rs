//! Operating views of a running server, used as an operator would:
//! `ustor top` in a real terminal (tmux at 80x24: keys sent, screen
//! captured), `ustor top --once --json` against known I/O counts, and
//! `serve --metrics` checked by `promtool check metrics` and scraped by a
//! real Prometheus server whose query API must report the I/O done.
//! Load and known I/O come from qemu-io / qemu-img bench over NBD and from
//! `ustor bench` through ustor's NVMe/TCP initiator in another process.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{free_port, Server, BIN};
use serde_json::{json, Value};

const NQN: &str = "nqn.2026-11.io.ustor:cold";

/// Two malloc bdevs exported by NBD: `hot` gets load, `cold` none (or,
/// with `nvmf`, load through NVMe/TCP, where it is also exported).
fn two_bdevs(nvmf: bool) -> Value {
    let malloc = |n: &str| json!({"method": "bdev_malloc_create", "params": {"name": n, "num_blocks": 8192, "block_size": 512}});
    let export =
        |n: &str| json!({"method": "nbd_export_create", "params": {"name": n, "bdev_name": n}});
    let mut subsystems = vec![
        json!({"subsystem": "bdev", "config": [malloc("hot"), malloc("cold")]}),
        json!({"subsystem": "nbd", "config": [
            {"method": "nbd_server_start", "params": {"listen_address": {"traddr": "127.0.0.1", "trsvcid": "0"}}},
            export("hot"), export("cold")
        ]}),
    ];
    if nvmf {
        subsystems.push(json!({"subsystem": "nvmf", "config": [
            {"method": "nvmf_create_transport", "params": {"trtype": "TCP"}},
            {"method": "nvmf_create_subsystem", "params": {"nqn": NQN, "allow_any_host": true}},
            {"method": "nvmf_subsystem_add_ns", "params": {"nqn": NQN, "namespace": {"bdev_name": "cold"}}},
            {"method": "nvmf_subsystem_add_listener", "params": {"nqn": NQN,
                "listen_address": {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": "0"}}}
        ]}));
    }
    json!({ "subsystems": subsystems })
}

/// `ustor bench` reading `cold` through ustor's NVMe/TCP initiator (a
/// second process) until dropped.
fn nvmf_load(s: &Server, dir: &Path) -> Proc {
    let subs = s.ok("nvmf_get_subsystems", json!({"nqn": NQN}));
    let port = subs[0]["listen_addresses"][0]["trsvcid"]
        .as_str()
        .unwrap()
        .to_string();
    let cfg = json!({"subsystems": [{"subsystem": "bdev", "config": [
        {"method": "bdev_nvme_attach_controller", "params": {"name": "Nvme0", "trtype": "TCP",
            "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": port, "subnqn": NQN}}
    ]}]});
    let path = dir.join("initiator.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let child = Command::new(BIN)
        .args([
            "bench", "--no-pin", "--cores", "0", "-b", "Nvme0n1", "-q", "4", "-t", "60", "-c",
        ])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Proc(child)
}

/// Runs qemu-io commands against an NBD export and checks they succeeded.
fn qemu_io(port: u16, export: &str, cmds: &[&str]) {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    for x in cmds {
        c.args(["-c", x]);
    }
    let out = c
        .arg(format!("nbd://127.0.0.1:{port}/{export}"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("failed"),
        "qemu-io: {text}"
    );
}

/// A process stopped by PID when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            // SAFETY: kill(2) on our own child's PID.
            unsafe { libc::kill(self.0.id() as i32, libc::SIGKILL) };
            let _ = self.0.wait();
        }
    }
}

/// Endless 4 KiB random reads on an NBD export (qemu-img bench).
fn load(port: u16, export: &str) -> Proc {
    let child = Command::new("qemu-img")
        .args([
            "bench",
            "-f",
            "raw",
            "-c",
            "100000000",
            "-d",
            "4",
            "-s",
            "4096",
        ])
        .arg(format!("nbd://127.0.0.1:{port}/{export}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Proc(child)
}

#[test]
fn top_once_json_reports_known_io() {
    if !common::have("qemu-io") {
        return;
    }
    let dir = common::tmpdir("top-json");
    let s = Server::start(&dir, &two_bdevs(true), &[]);
    let port = s.nbd_port();
    // Latency percentiles come from hot's histograms (cold has none).
    s.ok(
        "bdev_enable_histogram",
        json!({"name": "hot", "enable": true}),
    );
    qemu_io(
        port,
        "hot",
        &[
            "write -P 0x5a 0 64k",
            "write -P 0x5b 64k 64k",
            "read -P 0x5a 0 4k",
            "read -P 0x5b 64k 4k",
            "read 128k 4k",
        ],
    );
    // NVMe/TCP load on `cold` from another process, its queues connected.
    let _load = nvmf_load(&s, &dir);
    testkit::wait_until(
        "the initiator's queues and reads on cold",
        Duration::from_secs(20),
        || {
            let st = s.ok("nvmf_get_stats", Value::Null);
            let io = s.ok("bdev_get_iostat", json!({"name": "cold"}));
            st["connections"]["open"].as_u64() >= Some(2)
                && io["bdevs"][0]["num_read_ops"].as_u64() > Some(0)
        },
    );
    let out = Command::new(BIN)
        .args([
            "top",
            "-s",
            s.sock.to_str().unwrap(),
            "--once",
            "--json",
            "-d",
            "0.5",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let find = |k: &str, n: &str| {
        v[k].as_array()
            .unwrap()
            .iter()
            .find(|b| b["name"] == n)
            .cloned()
            .unwrap()
    };
    let hot = find("bdevs", "hot");
    assert_eq!(hot["num_write_ops"], 2, "{v:#}");
    assert_eq!(hot["bytes_written"], 128 << 10);
    assert_eq!(hot["num_read_ops"], 3);
    assert_eq!(hot["bytes_read"], 12 << 10);
    // Nothing ran on hot in the interval: its rates are zero, not garbage.
    assert_eq!(hot["iops"], 0.0);
    // p50/p99 from its histograms (cumulative since they were turned on).
    let us = |k: &str| hot[k].as_f64().unwrap_or_else(|| panic!("{k}: {hot}"));
    assert!(
        us("read_p50_us") > 0.0 && us("read_p99_us") >= us("read_p50_us"),
        "{hot}"
    );
    assert!(
        us("write_p50_us") > 0.0 && us("write_p99_us") >= us("write_p50_us"),
        "{hot}"
    );
    let cold = find("bdevs", "cold");
    assert!(cold["read_iops"].as_f64().unwrap() > 0.0, "{v:#}");
    assert_eq!(cold["num_write_ops"], 0);
    assert!(cold["read_p99_us"].is_null(), "histograms off: {cold}");
    assert!(v["interval_s"].as_f64().unwrap() >= 0.5);
    assert_eq!(v["reactors"].as_array().unwrap().len(), 1);
    assert_eq!(
        find("targets", "nbd")["connections"],
        0,
        "qemu-io has disconnected: {v:#}"
    );
    let nvmf = find("targets", "nvmf");
    assert!(
        nvmf["connections"].as_u64() >= Some(2) && nvmf["iops"].as_f64() > Some(0.0),
        "{v:#}"
    );
    // The initiator's I/O queue is listed, its traffic counted.
    let conns = v["connections"].as_array().unwrap();
    let io_q = conns
        .iter()
        .find(|c| c["target"] == "nvmf" && c["pdus_per_s"].as_f64() > Some(0.0))
        .unwrap_or_else(|| panic!("no busy NVMe-oF queue: {v:#}"));
    assert!(io_q["peer"].as_str().unwrap().starts_with("nqn."), "{io_q}");
    // Bad arguments are refused with a message, not a hang.
    let bad = Command::new(BIN)
        .args(["top", "-s", s.sock.to_str().unwrap(), "--once", "-d", "0"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let _ = s.stop();
}

/// A private tmux server (its own socket), killed when dropped.
struct Tmux {
    sock: std::path::PathBuf,
}

impl Tmux {
    fn run(&self, args: &[&str]) -> std::process::Output {
        Command::new("tmux")
            .arg("-S")
            .arg(&self.sock)
            .args(args)
            .env("TERM", "xterm-256color")
            .output()
            .unwrap()
    }
    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.run(&["capture-pane", "-p", "-t", "top"]).stdout).into_owned()
    }
    fn alive(&self) -> bool {
        self.run(&["has-session", "-t", "top"]).status.success()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

/// The screen row of bdev `name` (its first word), split into columns.
fn row(screen: &str, name: &str) -> Option<Vec<String>> {
    screen
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .map(|l| l.split_whitespace().map(String::from).collect())
}

fn line_of(screen: &str, name: &str) -> usize {
    screen
        .lines()
        .position(|l| l.split_whitespace().next() == Some(name))
        .unwrap_or(usize::MAX)
}

#[test]
fn top_in_tmux_shows_load_sorts_and_quits() {
    if !(common::have("tmux") && common::have("qemu-img")) {
        return;
    }
    let dir = common::tmpdir("top-tmux");
    let s = Server::start(&dir, &two_bdevs(false), &[]);
    let _load = load(s.nbd_port(), "hot");
    let tmux = Tmux {
        sock: dir.join("tmux.sock"),
    };
    let cmd = format!("{BIN} top -s {} -d 0.5", s.sock.display());
    let r = tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "top",
        "-x",
        "80",
        "-y",
        "24",
        &cmd,
    ]);
    assert!(
        r.status.success(),
        "tmux: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    // The loaded bdev shows non-zero IOPS, and by IOPS (the default sort)
    // it comes before the idle one. tmux may capture a screen mid-draw, so
    // the wait is for a whole one: the NBD target row and the key line.
    let screen = testkit::wait_for(
        "hot's IOPS above zero and the NBD target on the screen",
        Duration::from_secs(20),
        || {
            let sc = tmux.screen();
            let iops: f64 = row(&sc, "hot")?.get(1)?.parse().ok()?;
            let whole = sc.contains("nbd") && sc.contains("q quit");
            (iops > 0.0 && whole).then_some(sc)
        },
    );
    assert!(screen.lines().count() <= 24 && screen.lines().all(|l| l.chars().count() <= 80));
    assert!(
        line_of(&screen, "hot") < line_of(&screen, "cold"),
        "{screen}"
    );
    assert!(screen.contains("IOPS*"), "sorted column marked: {screen}");
    assert!(
        screen.contains("reactors (1)") && screen.contains("nbd"),
        "{screen}"
    );
    // `n` sorts by name: cold before hot.
    tmux.run(&["send-keys", "-t", "top", "n"]);
    let screen = testkit::wait_for("sort by name", Duration::from_secs(10), || {
        let sc = tmux.screen();
        (line_of(&sc, "cold") < line_of(&sc, "hot") && sc.contains("bdev*")).then_some(sc)
    });
    assert!(screen.contains("sort: name"), "{screen}");
    // `r` reverses it.
    tmux.run(&["send-keys", "-t", "top", "r"]);
    testkit::wait_until("reversed name sort", Duration::from_secs(10), || {
        let sc = tmux.screen();
        line_of(&sc, "hot") < line_of(&sc, "cold") && sc.contains("reversed")
    });
    // `q` quits, leaving no process behind.
    tmux.run(&["send-keys", "-t", "top", "q"]);
    testkit::wait_until("ustor top exits on q", Duration::from_secs(10), || {
        !tmux.alive()
    });
    let _ = s.stop();
}

/// One HTTP/1.0 request; returns the status code and the body.
fn http(addr: &str, req: &str) -> (u16, String) {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, body.to_string())
}

fn get(addr: &str, path: &str) -> (u16, String) {
    http(
        addr,
        &format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n"),
    )
}

/// The metrics address from the banner of a server started with `--metrics`.
fn metrics_addr(s: &mut Server) -> String {
    let out = s.child.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    loop {
        let l = lines
            .next()
            .expect("banner ended without the metrics line")
            .unwrap();
        if let Some(rest) = l.trim().strip_prefix("Prometheus metrics on http://") {
            let addr = rest.split('/').next().unwrap().to_string();
            // Keep draining stdout so the server never blocks on it.
            std::thread::spawn(move || lines.for_each(drop));
            return addr;
        }
    }
}

/// A free port on 127.0.0.1 for a peer that cannot report the one it bound.
fn start_prometheus(dir: &Path, target: &str) -> (Proc, String) {
    let cfg = dir.join("prometheus.yml");
    let yml = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: ustor\n    static_configs:\n      - targets: ['{target}']\n"
    );
    std::fs::write(&cfg, yml).unwrap();
    let web = format!("127.0.0.1:{}", free_port());
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", cfg.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={web}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
        .spawn()
        .unwrap();
    (Proc(child), web)
}

#[test]
fn metrics_pass_promtool_and_a_real_prometheus_scrapes_them() {
    for p in ["qemu-io", "promtool", "prometheus"] {
        if !common::have(p) {
            return;
        }
    }
    let dir = common::tmpdir("metrics");
    let mut s = Server::start(&dir, &two_bdevs(false), &["--metrics", "127.0.0.1:0"]);
    let addr = metrics_addr(&mut s);
    s.ok(
        "bdev_enable_histogram",
        json!({"name": "hot", "enable": true}),
    );
    let port = s.nbd_port();
    qemu_io(
        port,
        "hot",
        &[
            "read 0 4k",
            "read 4k 4k",
            "read 8k 8k",
            "read 16k 4k",
            "read 20k 4k",
            "write 0 4k",
        ],
    );
    let (prom, web) = start_prometheus(&dir, &addr);

    let (code, text) = get(&addr, "/metrics");
    assert_eq!(code, 200);
    assert!(
        text.contains("ustor_bdev_read_ops_total{bdev=\"hot\"} 5\n"),
        "{text}"
    );
    assert!(text.contains("ustor_bdev_read_bytes_total{bdev=\"hot\"} 24576\n"));
    assert!(text.contains("ustor_bdev_write_ops_total{bdev=\"hot\"} 1\n"));
    assert!(
        text.contains("ustor_bdev_read_latency_seconds_count{bdev=\"hot\"} 5\n"),
        "{text}"
    );
    assert!(text.contains("ustor_bdev_read_latency_seconds_bucket{bdev=\"hot\",le=\"+Inf\"} 5\n"));
    assert!(text.contains("ustor_reactor_busy_seconds_total{lcore="));
    assert!(
        text.contains("ustor_target_connections_accepted_total{target=\"nbd\"} 1\n"),
        "{text}"
    );
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // Bad requests get HTTP's own answers.
    assert_eq!(
        http(
            &addr,
            "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
        )
        .0,
        405
    );
    assert_eq!(http(&addr, "\x16\x03\x01\x00\x05hello\r\n\r\n").0, 400);
    assert_eq!(get(&addr, "/nope").0, 404);

    // Prometheus scrapes it; its query API reports the reads done.
    let q = "/api/v1/query?query=ustor_bdev_read_ops_total%7Bbdev%3D%22hot%22%7D";
    let v = testkit::wait_for(
        "Prometheus to have scraped ustor",
        Duration::from_secs(40),
        || {
            let mut c = TcpStream::connect(&web).ok()?;
            c.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
            c.write_all(format!("GET {q} HTTP/1.0\r\nHost: {web}\r\n\r\n").as_bytes())
                .ok()?;
            let mut out = String::new();
            c.read_to_string(&mut out).ok()?;
            let body: Value = serde_json::from_str(out.split_once("\r\n\r\n")?.1).ok()?;
            let r = body["data"]["result"].as_array()?.first()?.clone();
            Some(r)
        },
    );
    assert_eq!(v["metric"]["job"], "ustor", "{v}");
    assert_eq!(v["value"][1], "5", "{v}");
    drop(prom);
    let (code, _) = s.stop();
    assert_eq!(code, 0);
}

/// Per-connection counters of the NBD target: an interactive qemu-io
/// (connected, idle after known I/O) and a qemu-img bench load on the
/// other export are two rows in `nbd_get_connections` and in `ustor top
/// --once --json`, each with its own counts and rate.
#[test]
fn nbd_connections_have_their_own_iops() {
    if !common::have("qemu-io") {
        return;
    }
    let dir = common::tmpdir("top-conns");
    let s = Server::start(&dir, &two_bdevs(false), &[]);
    let port = s.nbd_port();
    let mut qio = Command::new("qemu-io")
        .args(["-f", "raw"])
        .arg(format!("nbd://127.0.0.1:{port}/hot"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = qio.stdin.take().unwrap();
    let qio = Proc(qio);
    let conns = |s: &Server| s.ok("nbd_get_connections", Value::Null);
    let hot_row = |s: &Server| {
        let c = conns(s);
        c.as_array()?.iter().find(|c| c["export"] == "hot").cloned()
    };
    // One command at a time: qemu-io takes one line per stdin wakeup.
    writeln!(stdin, "write -P 0x5c 0 64k").unwrap();
    testkit::wait_until("qemu-io's write counted", Duration::from_secs(20), || {
        hot_row(&s).is_some_and(|c| c["bytes_written"] == 64 << 10)
    });
    writeln!(stdin, "read -P 0x5c 0 32k").unwrap();
    let hot = testkit::wait_for("qemu-io's read counted", Duration::from_secs(20), || {
        hot_row(&s).filter(|c| c["bytes_read"] == 32 << 10)
    });
    assert_eq!(hot["bytes_written"], 64 << 10, "{hot}");
    assert_eq!(hot["ops"], 2, "{hot}");
    assert_eq!(hot["bdev_name"], "hot");
    assert!(
        hot["peer"].as_str().unwrap().starts_with("127.0.0.1:"),
        "{hot}"
    );

    let _load = load(port, "cold");
    testkit::wait_until("the load's connection", Duration::from_secs(20), || {
        conns(&s)
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["export"] == "cold" && c["ops"].as_u64() > Some(0))
    });
    let out = Command::new(BIN)
        .args([
            "top",
            "-s",
            s.sock.to_str().unwrap(),
            "--once",
            "--json",
            "-d",
            "0.5",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows: Vec<&Value> = v["connections"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["target"] == "nbd")
        .collect();
    assert_eq!(rows.len(), 2, "{v:#}");
    let row = |export: &str| {
        *rows
            .iter()
            .find(|c| c["queue"] == export)
            .unwrap_or_else(|| panic!("{v:#}"))
    };
    assert!(row("cold")["iops"].as_f64() > Some(0.0), "{v:#}");
    assert!(row("cold")["mib_s"].as_f64() > Some(0.0), "{v:#}");
    // qemu-io is connected and idle: its own rate is zero.
    assert_eq!(row("hot")["iops"], 0.0, "{v:#}");
    assert_eq!(row("hot")["peer"], hot["peer"]);

    // Its row leaves with it.
    drop(stdin);
    drop(qio);
    testkit::wait_until("qemu-io's row gone", Duration::from_secs(20), || {
        conns(&s)
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["export"] != "hot")
    });
    let _ = std::fs::remove_dir_all(&dir);
}

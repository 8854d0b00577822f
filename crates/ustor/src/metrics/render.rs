//! The Prometheus text exposition format (version 0.0.4) of what the stats
//! RPCs answer: reactors, bdevs (with latency histograms where
//! `bdev_enable_histogram` turned them on), targets, and the NVMe-oF
//! target's LANoT coalescer. Pure: answers in, text out.

use std::fmt::Write;

use hdrhistogram::Histogram;
use serde_json::Value;

/// Latency bucket bounds, in seconds (1 µs to 10 s).
pub const BUCKETS: [f64; 22] = [
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
    5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A bdev's latency histograms (ns), present when recording is on.
pub struct BdevHists {
    pub name: String,
    pub read: Histogram<u64>,
    pub write: Histogram<u64>,
}

/// Metric families in the order first added; each family's samples stay
/// together, as the format requires.
#[derive(Default)]
pub struct Families {
    fams: Vec<(String, &'static str, String, String)>,
}

/// A label value with `\`, `"` and newlines escaped.
fn esc(v: &str) -> String {
    v.replace('\\', r"\\")
        .replace('"', "\\\"")
        .replace('\n', r"\n")
}

fn labels(l: &[(&str, &str)]) -> String {
    if l.is_empty() {
        return String::new();
    }
    let inner: Vec<String> = l
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", esc(v)))
        .collect();
    format!("{{{}}}", inner.join(","))
}

impl Families {
    fn family(&mut self, name: &str, kind: &'static str, help: &str) -> &mut String {
        let i = match self.fams.iter().position(|f| f.0 == name) {
            Some(i) => i,
            None => {
                self.fams
                    .push((name.into(), kind, help.into(), String::new()));
                self.fams.len() - 1
            }
        };
        &mut self.fams[i].3
    }

    /// One sample of a counter or gauge.
    pub fn add(&mut self, name: &str, kind: &'static str, help: &str, l: &[(&str, &str)], v: f64) {
        let body = self.family(name, kind, help);
        let _ = writeln!(body, "{name}{} {v}", labels(l));
    }

    /// A histogram from an HDR histogram of nanoseconds.
    pub fn histogram(&mut self, name: &str, help: &str, l: &[(&str, &str)], h: &Histogram<u64>) {
        let body = self.family(name, "histogram", help);
        let bucket = |body: &mut String, le: &str, n: u64| {
            let mut with_le = l.to_vec();
            with_le.push(("le", le));
            let _ = writeln!(body, "{name}_bucket{} {n}", labels(&with_le));
        };
        for le in BUCKETS {
            bucket(
                body,
                &format!("{le}"),
                h.count_between(0, (le * 1e9) as u64),
            );
        }
        bucket(body, "+Inf", h.len());
        let sum_s = h.mean() * h.len() as f64 / 1e9;
        let _ = writeln!(body, "{name}_sum{} {sum_s}", labels(l));
        let _ = writeln!(body, "{name}_count{} {}", labels(l), h.len());
    }

    pub fn text(&self) -> String {
        let mut out = String::new();
        for (name, kind, help, body) in &self.fams {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            out.push_str(body);
        }
        out
    }
}

fn u(v: &Value, k: &str) -> f64 {
    v[k].as_u64().unwrap_or(0) as f64
}

fn list(v: &Value) -> &[Value] {
    v.as_array().map(|a| a.as_slice()).unwrap_or(&[])
}

const C: &str = "counter";
const G: &str = "gauge";

/// The whole exposition: `call` answers a stats method (`None` when the
/// server does not, e.g. a target not started), `hists` the bdevs whose
/// histograms are on.
pub fn render(mut call: impl FnMut(&str) -> Option<Value>, hists: &[BdevHists]) -> String {
    let mut f = Families::default();
    if let Some(r) = call("framework_get_reactors") {
        reactors(&mut f, &r);
    }
    if let Some(io) = call("bdev_get_iostat") {
        bdevs(&mut f, &io);
    }
    for h in hists {
        let l = [("bdev", h.name.as_str())];
        let help = "Latency of completed I/O (recorded while bdev_enable_histogram is on).";
        f.histogram("ustor_bdev_read_latency_seconds", help, &l, &h.read);
        f.histogram("ustor_bdev_write_latency_seconds", help, &l, &h.write);
    }
    if let Some(n) = call("nbd_get_stats") {
        nbd(&mut f, &n);
        if let Some(c) = call("nbd_get_connections") {
            conns(&mut f, "nbd", &c);
        }
    }
    if let Some(n) = call("nvmf_get_stats") {
        nvmf(&mut f, &n);
    }
    if let Some(c) = call("iscsi_get_connections") {
        let help = "Connections open now.";
        let n = list(&c).len() as f64;
        f.add(
            "ustor_target_connections",
            G,
            help,
            &[("target", "iscsi")],
            n,
        );
        conns(&mut f, "iscsi", &c);
    }
    f.text()
}

/// Per-connection command and byte counters (NBD's `nbd_get_connections`,
/// iSCSI's `iscsi_get_connections`); a series ends with its connection.
fn conns(f: &mut Families, target: &str, c: &Value) {
    for x in list(c) {
        if x.get("ops").is_none() {
            continue;
        }
        let id = x["id"].as_u64().unwrap_or(0).to_string();
        let peer = x["peer"]
            .as_str()
            .or(x["initiator_addr"].as_str())
            .unwrap_or("");
        let l = [("target", target), ("conn", id.as_str()), ("peer", peer)];
        let help = "Commands answered on one connection.";
        f.add("ustor_connection_ops_total", C, help, &l, u(x, "ops"));
        let help = "Payload bytes read by one connection's commands.";
        f.add(
            "ustor_connection_read_bytes_total",
            C,
            help,
            &l,
            u(x, "bytes_read"),
        );
        let help = "Payload bytes written by one connection's commands.";
        let w = u(x, "bytes_written");
        f.add("ustor_connection_written_bytes_total", C, help, &l, w);
    }
}

fn reactors(f: &mut Families, r: &Value) {
    let hz = u(r, "tick_rate").max(1.0);
    for x in list(&r["reactors"]) {
        let lcore = x["lcore"].as_u64().unwrap_or(0).to_string();
        let l = [("lcore", lcore.as_str())];
        let secs = |k| u(x, k) / hz;
        f.add(
            "ustor_reactor_busy_seconds_total",
            C,
            "Time a reactor spent in passes that found work.",
            &l,
            secs("busy"),
        );
        f.add(
            "ustor_reactor_idle_seconds_total",
            C,
            "Time a reactor spent in passes that found none (spinning or asleep).",
            &l,
            secs("idle"),
        );
        f.add(
            "ustor_reactor_busy_ticks_total",
            C,
            "Busy time in TSC ticks (framework_get_reactors' busy).",
            &l,
            u(x, "busy"),
        );
        f.add(
            "ustor_reactor_idle_ticks_total",
            C,
            "Idle time in TSC ticks (framework_get_reactors' idle).",
            &l,
            u(x, "idle"),
        );
        f.add(
            "ustor_reactor_loops_total",
            C,
            "Reactor loop passes.",
            &l,
            u(x, "loops"),
        );
        f.add(
            "ustor_reactor_sleeps_total",
            C,
            "Times a reactor went to sleep.",
            &l,
            u(x, "sleeps"),
        );
        f.add(
            "ustor_reactor_wakeups_total",
            C,
            "Times a sleeping reactor was woken.",
            &l,
            u(x, "wakeups"),
        );
        f.add(
            "ustor_reactor_messages_total",
            C,
            "Cross-reactor messages handled.",
            &l,
            u(x, "messages"),
        );
        f.add(
            "ustor_reactor_tasks",
            G,
            "Tasks on a reactor now.",
            &l,
            u(x, "tasks"),
        );
    }
}

fn bdevs(f: &mut Families, io: &Value) {
    let hz = u(io, "tick_rate").max(1.0);
    for b in list(&io["bdevs"]) {
        let name = b["name"].as_str().unwrap_or("");
        let l = [("bdev", name)];
        for (op, ops, bytes, lat) in [
            (
                "read",
                "num_read_ops",
                "bytes_read",
                Some("read_latency_ticks"),
            ),
            (
                "write",
                "num_write_ops",
                "bytes_written",
                Some("write_latency_ticks"),
            ),
            (
                "unmap",
                "num_unmap_ops",
                "bytes_unmapped",
                Some("unmap_latency_ticks"),
            ),
            (
                "write_zeroes",
                "num_write_zeroes_ops",
                "bytes_write_zeroes",
                None,
            ),
        ] {
            let n = format!("ustor_bdev_{op}_ops_total");
            f.add(&n, C, "Completed I/O of this kind.", &l, u(b, ops));
            let n = format!("ustor_bdev_{op}_bytes_total");
            f.add(
                &n,
                C,
                "Bytes of completed I/O of this kind.",
                &l,
                u(b, bytes),
            );
            if let Some(lat) = lat {
                let n = format!("ustor_bdev_{op}_latency_seconds_total");
                let help = "Sum of the latencies of completed I/O of this kind (divide by ops for the mean).";
                f.add(&n, C, help, &l, u(b, lat) / hz);
            }
        }
        f.add(
            "ustor_bdev_flush_ops_total",
            C,
            "Completed flushes.",
            &l,
            u(b, "num_flush_ops"),
        );
        f.add(
            "ustor_bdev_reset_ops_total",
            C,
            "Completed resets.",
            &l,
            u(b, "num_reset_ops"),
        );
        f.add(
            "ustor_bdev_errors_total",
            C,
            "I/O that completed with an error.",
            &l,
            u(b, "errors"),
        );
        f.add(
            "ustor_bdev_bounce_ops_total",
            C,
            "I/O whose payload was copied through a bounce buffer.",
            &l,
            u(b, "bounce_ops"),
        );
        f.add(
            "ustor_bdev_split_ops_total",
            C,
            "I/O split into children.",
            &l,
            u(b, "split_ops"),
        );
    }
}

fn nbd(f: &mut Families, n: &Value) {
    let l = [("target", "nbd")];
    let open = u(n, "connections_accepted") - u(n, "connections_closed");
    f.add(
        "ustor_target_connections",
        G,
        "Connections open now.",
        &l,
        open.max(0.0),
    );
    f.add(
        "ustor_target_connections_accepted_total",
        C,
        "Connections accepted.",
        &l,
        u(n, "connections_accepted"),
    );
    f.add(
        "ustor_target_connections_rejected_total",
        C,
        "Connections refused (cap, handshake).",
        &l,
        u(n, "connections_rejected") + u(n, "refused"),
    );
    let ops = ["reads", "writes", "flushes", "trims", "write_zeroes"];
    f.add(
        "ustor_target_commands_total",
        C,
        "Commands completed.",
        &l,
        ops.iter().map(|k| u(n, k)).sum(),
    );
    f.add(
        "ustor_target_read_bytes_total",
        C,
        "Bytes read by the target's clients.",
        &l,
        u(n, "bytes_read"),
    );
    f.add(
        "ustor_target_write_bytes_total",
        C,
        "Bytes written by the target's clients.",
        &l,
        u(n, "bytes_written"),
    );
    f.add(
        "ustor_target_errors_total",
        C,
        "I/O and protocol errors.",
        &l,
        u(n, "io_errors") + u(n, "protocol_errors") + u(n, "handshakes_failed"),
    );
}

fn nvmf(f: &mut Families, n: &Value) {
    let l = [("target", "nvmf")];
    let c = &n["connections"];
    let groups = list(&n["poll_groups"]);
    let sum = |k: &str| groups.iter().map(|g| u(g, k)).sum::<f64>();
    f.add(
        "ustor_target_connections",
        G,
        "Connections open now.",
        &l,
        u(c, "open"),
    );
    f.add(
        "ustor_target_connections_accepted_total",
        C,
        "Connections accepted.",
        &l,
        u(c, "accepted"),
    );
    f.add(
        "ustor_target_connections_rejected_total",
        C,
        "Connections refused (cap, handshake).",
        &l,
        u(c, "rejected") + u(c, "handshake_timeouts"),
    );
    f.add(
        "ustor_target_commands_total",
        C,
        "Commands completed.",
        &l,
        sum("commands"),
    );
    f.add(
        "ustor_target_read_bytes_total",
        C,
        "Bytes read by the target's clients.",
        &l,
        sum("bytes_read"),
    );
    f.add(
        "ustor_target_write_bytes_total",
        C,
        "Bytes written by the target's clients.",
        &l,
        sum("bytes_written"),
    );
    f.add(
        "ustor_target_errors_total",
        C,
        "I/O and protocol errors.",
        &l,
        sum("errors") + sum("digest_errors"),
    );
    for g in groups {
        let pg = g["name"].as_str().unwrap_or("");
        let l = [("poll_group", pg)];
        f.add(
            "ustor_nvmf_io_qpairs",
            G,
            "NVMe-oF I/O queue pairs open now.",
            &l,
            u(g, "current_io_qpairs"),
        );
        let co = &g["coalesce"];
        for (k, help) in [
            ("pdus", "PDUs the LANoT coalescer sent."),
            ("groups", "Groups (one sendmsg each) the coalescer sent."),
            ("full_groups", "Groups sent because they were full."),
            ("small_groups", "Groups sent before they were full."),
            (
                "timer_expiries",
                "Groups sent when the coalescing timer expired.",
            ),
            ("raises", "Times the coalescing degree was raised."),
            ("lowers", "Times the coalescing degree was lowered."),
        ] {
            f.add(
                &format!("ustor_nvmf_coalesce_{k}_total"),
                C,
                help,
                &l,
                u(co, k),
            );
        }
        f.add(
            "ustor_nvmf_coalesce_degree",
            G,
            "PDUs the coalescer waits for now.",
            &l,
            u(co, "degree"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_labels_and_histogram_buckets() {
        let answers = json!({
            "framework_get_reactors": {"tick_rate": 1000, "reactors": [{"lcore": 0, "busy": 500, "idle": 1500}]},
            "bdev_get_iostat": {"tick_rate": 1000, "bdevs": [{"name": "Mal\"loc0", "num_read_ops": 7, "bytes_read": 7 * 4096, "read_latency_ticks": 14}]},
            "nbd_get_stats": {"reads": 7},
            "nbd_get_connections": [{"id": 3, "peer": "127.0.0.1:5000", "ops": 9, "bytes_read": 4096, "bytes_written": 512}],
        });
        let mut h = Histogram::new_with_bounds(1, 60_000_000_000, 3).unwrap();
        h.record(3_000).unwrap(); // 3 µs
        h.record(2_000_000).unwrap(); // 2 ms
        let hists = [BdevHists {
            name: "Malloc0".into(),
            read: h.clone(),
            write: Histogram::new(3).unwrap(),
        }];
        let t = render(|m| answers.get(m).cloned(), &hists);
        assert!(
            t.contains("# TYPE ustor_bdev_read_ops_total counter\n"),
            "{t}"
        );
        assert!(
            t.contains("ustor_bdev_read_ops_total{bdev=\"Mal\\\"loc0\"} 7\n"),
            "{t}"
        );
        assert!(t.contains("ustor_bdev_read_bytes_total{bdev=\"Mal\\\"loc0\"} 28672\n"));
        assert!(t.contains("ustor_bdev_read_latency_seconds_total{bdev=\"Mal\\\"loc0\"} 0.014\n"));
        assert!(t.contains("ustor_reactor_busy_seconds_total{lcore=\"0\"} 0.5\n"));
        let l = "{target=\"nbd\",conn=\"3\",peer=\"127.0.0.1:5000\"}";
        assert!(
            t.contains(&format!("ustor_connection_ops_total{l} 9\n")),
            "{t}"
        );
        assert!(t.contains(&format!("ustor_connection_written_bytes_total{l} 512\n")));
        assert!(
            t.contains(
                "ustor_bdev_read_latency_seconds_bucket{bdev=\"Malloc0\",le=\"0.000001\"} 0\n"
            ) || t.contains(
                "ustor_bdev_read_latency_seconds_bucket{bdev=\"Malloc0\",le=\"1e-6\"} 0\n"
            ),
            "{t}"
        );
        assert!(
            t.contains("ustor_bdev_read_latency_seconds_bucket{bdev=\"Malloc0\",le=\"0.005\"} 2\n"),
            "{t}"
        );
        assert!(
            t.contains("ustor_bdev_read_latency_seconds_bucket{bdev=\"Malloc0\",le=\"0.001\"} 1\n"),
            "{t}"
        );
        assert!(
            t.contains("ustor_bdev_read_latency_seconds_bucket{bdev=\"Malloc0\",le=\"+Inf\"} 2\n")
        );
        assert!(t.contains("ustor_bdev_read_latency_seconds_count{bdev=\"Malloc0\"} 2\n"));
        // Each family's TYPE line appears once.
        assert_eq!(
            t.matches("# TYPE ustor_bdev_read_latency_seconds histogram")
                .count(),
            1
        );
    }

    #[test]
    fn garbage_answers_render_nothing_not_panic() {
        let t = render(|_| Some(json!("garbage")), &[]);
        assert!(!t.contains("ustor_bdev"));
        assert!(
            t.contains("ustor_target_connections{target=\"nbd\"} 0\n"),
            "{t}"
        );
        assert_eq!(render(|_| None, &[]), "");
    }
}

//! `ustor top`'s data model: one [`Sample`] is what the server's stats RPCs
//! answered at one moment (cumulative counters); a [`View`] is the rates
//! between two samples. No terminal here, so it is unit-tested on its own.

use serde::Serialize;
use serde_json::Value;

/// A reactor's cumulative counters.
#[derive(Clone, Debug, Default)]
pub struct ReactorRaw {
    pub lcore: u64,
    pub poll_mode: String,
    pub busy: u64,
    pub idle: u64,
    pub loops: u64,
    pub sleeps: u64,
    pub wakeups: u64,
    pub tasks: u64,
}

/// A bdev's cumulative counters (`bdev_get_iostat`).
#[derive(Clone, Debug, Default)]
pub struct BdevRaw {
    pub name: String,
    pub read_ops: u64,
    pub write_ops: u64,
    pub other_ops: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Sum of every completed I/O's latency, in ticks.
    pub lat_ticks: u64,
    pub errors: u64,
    /// Latency percentiles in ns from the bdev's histograms (`[read p50,
    /// read p99, write p50, write p99]`), 0 when histograms are off.
    pub pct_ns: [u64; 4],
}

/// A target's cumulative counters.
#[derive(Clone, Debug, Default)]
pub struct TargetRaw {
    pub name: String,
    pub connections: u64,
    /// Commands (reads, writes, flushes...), when the target counts them.
    pub ops: Option<u64>,
    pub bytes: Option<u64>,
    pub errors: u64,
}

/// One live connection (an NVMe-oF queue pair or an iSCSI connection).
#[derive(Clone, Debug, Default)]
pub struct ConnRaw {
    pub target: String,
    /// Stable identity across samples (for the rate).
    pub key: String,
    pub peer: String,
    pub queue: String,
    pub outstanding: Option<u64>,
    /// PDUs sent, when the target counts them per connection.
    pub pdus: Option<u64>,
    /// Commands answered and their payload bytes, when the target counts
    /// them per connection (NBD, iSCSI).
    pub ops: Option<u64>,
    pub bytes: Option<u64>,
}

/// What the stats RPCs answered at one moment.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    /// Seconds on the client's monotonic clock.
    pub at: f64,
    pub tick_rate: u64,
    pub reactors: Vec<ReactorRaw>,
    pub bdevs: Vec<BdevRaw>,
    pub targets: Vec<TargetRaw>,
    pub conns: Vec<ConnRaw>,
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or(0)
}

fn list(v: &Value) -> &[Value] {
    v.as_array().map(|a| a.as_slice()).unwrap_or(&[])
}

impl Sample {
    /// Builds a sample from the RPC answers; `call` returns `None` for a
    /// method the server does not answer (a target that is not running).
    pub fn from_rpc(at: f64, mut call: impl FnMut(&str) -> Option<Value>) -> Sample {
        let r = call("framework_get_reactors").unwrap_or_default();
        let io = call("bdev_get_iostat").unwrap_or_default();
        let mut s = Sample {
            at,
            tick_rate: u(&r, "tick_rate").max(u(&io, "tick_rate")).max(1),
            ..Default::default()
        };
        s.reactors = list(&r["reactors"]).iter().map(reactor).collect();
        s.bdevs = list(&io["bdevs"]).iter().map(bdev).collect();
        if let Some(n) = call("nbd_get_stats") {
            s.targets.push(nbd(&n));
            if let Some(c) = call("nbd_get_connections") {
                nbd_conns(&c, &mut s.conns);
            }
        }
        if let Some(n) = call("nvmf_get_stats") {
            s.targets.push(nvmf(&n, &mut s.conns));
        }
        if let Some(c) = call("iscsi_get_connections") {
            s.targets.push(iscsi(&c, &mut s.conns));
        }
        s
    }
}

fn reactor(v: &Value) -> ReactorRaw {
    ReactorRaw {
        lcore: u(v, "lcore"),
        poll_mode: v["poll_mode"].as_str().unwrap_or("").to_string(),
        busy: u(v, "busy"),
        idle: u(v, "idle"),
        loops: u(v, "loops"),
        sleeps: u(v, "sleeps"),
        wakeups: u(v, "wakeups"),
        tasks: u(v, "tasks"),
    }
}

/// `bdev_get_iostat`'s percentiles (from the histograms that
/// `bdev_enable_histogram` turns on), in [`BdevRaw::pct_ns`] order.
const PCT_KEYS: [&str; 4] = [
    "read_latency_ns_p50",
    "read_latency_ns_p99",
    "write_latency_ns_p50",
    "write_latency_ns_p99",
];

fn bdev(v: &Value) -> BdevRaw {
    let other = ["num_unmap_ops", "num_flush_ops", "num_write_zeroes_ops"];
    let lat = [
        "read_latency_ticks",
        "write_latency_ticks",
        "unmap_latency_ticks",
    ];
    BdevRaw {
        name: v["name"].as_str().unwrap_or("").to_string(),
        read_ops: u(v, "num_read_ops"),
        write_ops: u(v, "num_write_ops"),
        other_ops: other.iter().map(|k| u(v, k)).sum(),
        bytes_read: u(v, "bytes_read"),
        bytes_written: u(v, "bytes_written"),
        lat_ticks: lat.iter().map(|k| u(v, k)).sum(),
        errors: u(v, "errors"),
        pct_ns: PCT_KEYS.map(|k| u(v, k)),
    }
}

fn nbd(v: &Value) -> TargetRaw {
    let ops = ["reads", "writes", "flushes", "trims", "write_zeroes"];
    TargetRaw {
        name: "nbd".into(),
        connections: u(v, "connections_accepted").saturating_sub(u(v, "connections_closed")),
        ops: Some(ops.iter().map(|k| u(v, k)).sum()),
        bytes: Some(u(v, "bytes_read") + u(v, "bytes_written")),
        errors: u(v, "io_errors") + u(v, "protocol_errors"),
    }
}

fn opt_u(v: &Value, k: &str) -> Option<u64> {
    v.get(k).and_then(Value::as_u64)
}

fn nbd_conns(v: &Value, conns: &mut Vec<ConnRaw>) {
    for c in list(v) {
        conns.push(ConnRaw {
            target: "nbd".into(),
            key: format!("nbd/{}", u(c, "id")),
            peer: c["peer"].as_str().unwrap_or("").to_string(),
            queue: c["export"].as_str().unwrap_or("").to_string(),
            outstanding: None,
            pdus: None,
            ops: opt_u(c, "ops"),
            bytes: opt_u(c, "bytes_read").map(|r| r + u(c, "bytes_written")),
        });
    }
}

fn nvmf(v: &Value, conns: &mut Vec<ConnRaw>) -> TargetRaw {
    let groups = list(&v["poll_groups"]);
    let sum = |k: &str| groups.iter().map(|g| u(g, k)).sum::<u64>();
    for g in groups {
        for q in list(&g["qpairs"]) {
            let (cntlid, qid) = (u(q, "cntlid"), u(q, "qid"));
            conns.push(ConnRaw {
                target: "nvmf".into(),
                key: format!(
                    "nvmf/{}/{cntlid}/{qid}",
                    q["hostnqn"].as_str().unwrap_or("")
                ),
                peer: q["hostnqn"].as_str().unwrap_or("").to_string(),
                queue: format!("ctrlr {cntlid} q{qid}"),
                outstanding: Some(u(q, "outstanding")),
                pdus: Some(u(&q["coalesce"], "pdus")),
                ops: None,
                bytes: None,
            });
        }
    }
    TargetRaw {
        name: "nvmf".into(),
        connections: u(&v["connections"], "open"),
        ops: Some(sum("reads") + sum("writes")),
        bytes: Some(sum("bytes_read") + sum("bytes_written")),
        errors: sum("errors") + sum("digest_errors"),
    }
}

fn iscsi(v: &Value, conns: &mut Vec<ConnRaw>) -> TargetRaw {
    let cs = list(v);
    for c in cs {
        conns.push(ConnRaw {
            target: "iscsi".into(),
            key: format!("iscsi/{}", u(c, "id")),
            peer: c["initiator_addr"].as_str().unwrap_or("").to_string(),
            queue: format!("cid {} tsih {}", u(c, "cid"), u(c, "tsih")),
            outstanding: None,
            pdus: None,
            ops: opt_u(c, "ops"),
            bytes: opt_u(c, "bytes_read").map(|r| r + u(c, "bytes_written")),
        });
    }
    // The target's commands: those of its open connections (a closing
    // connection takes its count with it; the rate then reads 0 once).
    let sum = |k: &str| cs.iter().map(|c| opt_u(c, k)).sum::<Option<u64>>();
    TargetRaw {
        name: "iscsi".into(),
        connections: cs.len() as u64,
        ops: sum("ops"),
        bytes: sum("bytes_read")
            .zip(sum("bytes_written"))
            .map(|(r, w)| r + w),
        errors: 0,
    }
}

/// A reactor's rates.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ReactorRow {
    pub lcore: u64,
    pub poll_mode: String,
    pub busy_pct: f64,
    pub loops_per_s: f64,
    pub sleeps_per_s: f64,
    pub wakeups_per_s: f64,
    pub tasks: u64,
}

/// A bdev's rates, with its cumulative counts (for scripts).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct BdevRow {
    pub name: String,
    pub read_iops: f64,
    pub write_iops: f64,
    pub iops: f64,
    pub read_mib_s: f64,
    pub write_mib_s: f64,
    /// Mean latency of the I/O completed in the interval.
    pub avg_lat_us: f64,
    /// Mean number of I/O in flight (Little's law: latency time / elapsed).
    pub queue_depth: f64,
    pub num_read_ops: u64,
    pub num_write_ops: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub errors: u64,
    /// Latency percentiles in µs since the bdev's histograms were turned
    /// on (`bdev_enable_histogram`; cumulative, not per interval); `None`
    /// while they are off or nothing was recorded.
    pub read_p50_us: Option<f64>,
    pub read_p99_us: Option<f64>,
    pub write_p50_us: Option<f64>,
    pub write_p99_us: Option<f64>,
}

/// A target's rates.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TargetRow {
    pub name: String,
    pub connections: u64,
    pub iops: Option<f64>,
    pub mib_s: Option<f64>,
    pub errors: u64,
}

/// A connection's rates.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ConnRow {
    pub target: String,
    pub peer: String,
    pub queue: String,
    pub outstanding: Option<u64>,
    /// PDUs sent per second (responses and data: the queue's traffic).
    pub pdus_per_s: Option<f64>,
    /// Commands answered per second, and their payload MiB/s (NBD, iSCSI).
    pub iops: Option<f64>,
    pub mib_s: Option<f64>,
}

/// The rates between two samples.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct View {
    pub interval_s: f64,
    pub reactors: Vec<ReactorRow>,
    pub bdevs: Vec<BdevRow>,
    pub targets: Vec<TargetRow>,
    pub connections: Vec<ConnRow>,
}

/// `(b - a) / secs`, 0 when a counter went back (object recreated).
fn rate(a: u64, b: u64, secs: f64) -> f64 {
    if secs <= 0.0 {
        return 0.0;
    }
    b.saturating_sub(a) as f64 / secs
}

const MIB: f64 = 1048576.0;

impl View {
    /// Rates from `prev` to `cur`; objects new in `cur` count from zero.
    pub fn between(prev: &Sample, cur: &Sample) -> View {
        let secs = cur.at - prev.at;
        let reactors = cur
            .reactors
            .iter()
            .map(|r| {
                let p = prev.reactors.iter().find(|p| p.lcore == r.lcore);
                let p = p.cloned().unwrap_or_default();
                let busy = r.busy.saturating_sub(p.busy) as f64;
                let total = busy + r.idle.saturating_sub(p.idle) as f64;
                ReactorRow {
                    lcore: r.lcore,
                    poll_mode: r.poll_mode.clone(),
                    busy_pct: if total > 0.0 {
                        100.0 * busy / total
                    } else {
                        0.0
                    },
                    loops_per_s: rate(p.loops, r.loops, secs),
                    sleeps_per_s: rate(p.sleeps, r.sleeps, secs),
                    wakeups_per_s: rate(p.wakeups, r.wakeups, secs),
                    tasks: r.tasks,
                }
            })
            .collect();
        let bdevs = cur
            .bdevs
            .iter()
            .map(|b| bdev_row(prev, b, secs, cur.tick_rate))
            .collect();
        let targets = cur
            .targets
            .iter()
            .map(|t| {
                let p = prev.targets.iter().find(|p| p.name == t.name);
                let p = p.cloned().unwrap_or_default();
                let r = |a: Option<u64>, b: Option<u64>| b.map(|b| rate(a.unwrap_or(0), b, secs));
                TargetRow {
                    name: t.name.clone(),
                    connections: t.connections,
                    iops: r(p.ops, t.ops),
                    mib_s: r(p.bytes, t.bytes).map(|x| x / MIB),
                    errors: t.errors,
                }
            })
            .collect();
        let connections = cur
            .conns
            .iter()
            .map(|c| {
                let p = prev.conns.iter().find(|p| p.key == c.key);
                let before = |f: fn(&ConnRaw) -> Option<u64>| p.and_then(f).unwrap_or(0);
                ConnRow {
                    target: c.target.clone(),
                    peer: c.peer.clone(),
                    queue: c.queue.clone(),
                    outstanding: c.outstanding,
                    pdus_per_s: c.pdus.map(|n| rate(before(|p| p.pdus), n, secs)),
                    iops: c.ops.map(|n| rate(before(|p| p.ops), n, secs)),
                    mib_s: c.bytes.map(|n| rate(before(|p| p.bytes), n, secs) / MIB),
                }
            })
            .collect();
        View {
            interval_s: secs,
            reactors,
            bdevs,
            targets,
            connections,
        }
    }
}

fn bdev_row(prev: &Sample, b: &BdevRaw, secs: f64, tick_rate: u64) -> BdevRow {
    let p = prev.bdevs.iter().find(|p| p.name == b.name);
    let p = p.cloned().unwrap_or_default();
    let ops = |x: &BdevRaw| x.read_ops + x.write_ops + x.other_ops;
    let dops = ops(b).saturating_sub(ops(&p));
    let lat_s = b.lat_ticks.saturating_sub(p.lat_ticks) as f64 / tick_rate.max(1) as f64;
    BdevRow {
        name: b.name.clone(),
        read_iops: rate(p.read_ops, b.read_ops, secs),
        write_iops: rate(p.write_ops, b.write_ops, secs),
        iops: rate(ops(&p), ops(b), secs),
        read_mib_s: rate(p.bytes_read, b.bytes_read, secs) / MIB,
        write_mib_s: rate(p.bytes_written, b.bytes_written, secs) / MIB,
        avg_lat_us: if dops > 0 {
            lat_s * 1e6 / dops as f64
        } else {
            0.0
        },
        queue_depth: if secs > 0.0 { lat_s / secs } else { 0.0 },
        num_read_ops: b.read_ops,
        num_write_ops: b.write_ops,
        bytes_read: b.bytes_read,
        bytes_written: b.bytes_written,
        errors: b.errors,
        read_p50_us: us(b.pct_ns[0]),
        read_p99_us: us(b.pct_ns[1]),
        write_p50_us: us(b.pct_ns[2]),
        write_p99_us: us(b.pct_ns[3]),
    }
}

fn us(ns: u64) -> Option<f64> {
    (ns > 0).then(|| ns as f64 / 1000.0)
}

impl BdevRow {
    /// The worse of the read and write percentile (`p50` or `p99`).
    pub fn worst(&self, p99: bool) -> Option<f64> {
        let (r, w) = if p99 {
            (self.read_p99_us, self.write_p99_us)
        } else {
            (self.read_p50_us, self.write_p50_us)
        };
        match (r, w) {
            (Some(r), Some(w)) => Some(r.max(w)),
            (r, w) => r.or(w),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample(at: f64, reads: u64, busy: u64, pdus: u64) -> Sample {
        let answers = json!({
            "framework_get_reactors": {"tick_rate": 1000, "reactors": [
                {"lcore": 0, "poll_mode": "adaptive", "busy": busy, "idle": 1000 * at as u64 - busy,
                 "loops": 100 * at as u64, "sleeps": 10, "wakeups": 10, "tasks": 3}]},
            "bdev_get_iostat": {"tick_rate": 1000, "bdevs": [
                {"name": "Malloc0", "num_read_ops": reads, "bytes_read": reads * 4096,
                 "num_write_ops": 0, "bytes_written": 0, "read_latency_ticks": reads * 2,
                 "read_latency_ns_p50": 1500, "read_latency_ns_p99": 9000}]},
            "nbd_get_stats": {"connections_accepted": 3, "connections_closed": 1, "reads": reads,
                 "bytes_read": reads * 4096},
            "nbd_get_connections": [{"id": 7, "export": "Malloc0", "peer": "127.0.0.1:5000",
                 "reactor": 0, "ops": reads, "bytes_read": reads * 4096, "bytes_written": 0}],
            "iscsi_get_connections": [{"id": 2, "cid": 0, "tsih": 1, "initiator_addr": "127.0.0.1",
                 "ops": reads / 2, "bytes_read": reads * 2048, "bytes_written": 0}],
            "nvmf_get_stats": {"connections": {"open": 1}, "poll_groups": [{"reads": 0, "qpairs": [
                 {"hostnqn": "h", "cntlid": 1, "qid": 1, "outstanding": 4, "coalesce": {"pdus": pdus}}]}]},
        });
        Sample::from_rpc(at, |m| answers.get(m).cloned())
    }

    #[test]
    fn rates_come_from_two_samples() {
        let a = sample(1.0, 1000, 100, 10);
        let b = sample(3.0, 5000, 1100, 210);
        let v = View::between(&a, &b);
        assert_eq!(v.interval_s, 2.0);
        let r = &v.reactors[0];
        assert_eq!(r.busy_pct, 50.0); // 1000 busy ticks of 2000
        assert_eq!(r.loops_per_s, 100.0);
        let d = &v.bdevs[0];
        assert_eq!(d.read_iops, 2000.0);
        assert_eq!(d.iops, 2000.0);
        assert_eq!(d.read_mib_s, 2000.0 * 4096.0 / MIB);
        // 4000 reads of 2 ticks at 1000 ticks/s: 2 ms each, 8 s of I/O in 2 s.
        assert_eq!(d.avg_lat_us, 2000.0);
        assert_eq!(d.queue_depth, 4.0);
        assert_eq!(d.num_read_ops, 5000);
        assert_eq!((d.read_p50_us, d.read_p99_us), (Some(1.5), Some(9.0)));
        assert_eq!((d.write_p99_us, d.worst(true)), (None, Some(9.0)));
        let nbd = v.targets.iter().find(|t| t.name == "nbd").unwrap();
        assert_eq!((nbd.connections, nbd.iops), (2, Some(2000.0)));
        let conn = |t: &str| v.connections.iter().find(|c| c.target == t).unwrap();
        assert_eq!(conn("nvmf").pdus_per_s, Some(100.0));
        assert_eq!(conn("nvmf").outstanding, Some(4));
        assert_eq!(conn("nvmf").iops, None);
        // Per-connection command rates of NBD and iSCSI.
        assert_eq!(conn("nbd").iops, Some(2000.0));
        assert_eq!(conn("nbd").mib_s, Some(2000.0 * 4096.0 / MIB));
        assert_eq!(
            (conn("nbd").peer.as_str(), conn("nbd").queue.as_str()),
            ("127.0.0.1:5000", "Malloc0")
        );
        assert_eq!(conn("iscsi").iops, Some(1000.0));
        let iscsi = v.targets.iter().find(|t| t.name == "iscsi").unwrap();
        assert_eq!((iscsi.connections, iscsi.iops), (1, Some(1000.0)));
    }

    #[test]
    fn counters_that_go_back_or_new_objects_do_not_go_negative() {
        let a = sample(1.0, 5000, 900, 500);
        let b = sample(2.0, 10, 950, 5);
        let v = View::between(&a, &b);
        assert_eq!(v.bdevs[0].read_iops, 0.0);
        assert!(v
            .connections
            .iter()
            .all(|c| c.pdus_per_s.unwrap_or(0.0) == 0.0));
        assert!(v.connections.iter().all(|c| c.iops.unwrap_or(0.0) == 0.0));
        let empty = Sample::default();
        let v = View::between(&empty, &b);
        assert_eq!(v.bdevs[0].num_read_ops, 10);
        // Same instant: no division by zero.
        let v = View::between(&b, &b);
        assert_eq!(v.bdevs[0].iops, 0.0);
    }

    #[test]
    fn malformed_answers_give_empty_rows_not_panics() {
        let s = Sample::from_rpc(0.0, |_| Some(json!("garbage")));
        assert!(s.reactors.is_empty() && s.bdevs.is_empty());
        assert_eq!(s.targets.len(), 3);
        let s = Sample::from_rpc(0.0, |_| None);
        assert!(s.targets.is_empty());
    }
}

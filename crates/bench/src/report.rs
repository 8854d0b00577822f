//! Results: per core and total IOPS, MiB/s, latency avg/p50/p99/p99.9/max,
//! CPU time per I/O; printed as a table or JSON.

use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::json;
use ustor_runtime::ticks;

use crate::workload::BenchConfig;

/// One reactor's results.
#[derive(Clone, Debug, Serialize)]
pub struct CoreResult {
    pub reactor: usize,
    pub ios: u64,
    pub reads: u64,
    pub errors: u64,
    pub verify_errors: u64,
    pub first_mismatch: Option<String>,
    pub iops: f64,
    pub mib_s: f64,
    pub lat_avg_us: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub lat_p999_us: f64,
    pub lat_max_us: f64,
    #[serde(skip)]
    hist: Option<Histogram<u64>>,
    #[serde(skip)]
    lat_sum_ticks: u64,
    pub failure: Option<String>,
}

fn us(ticks_: u64) -> f64 {
    ticks::to_ns(ticks_) as f64 / 1000.0
}

impl CoreResult {
    pub(crate) fn failed(reactor: usize, why: String) -> CoreResult {
        let mut r = CoreResult::from_parts(
            reactor,
            0,
            0,
            0,
            0,
            None,
            0,
            Histogram::new(3).expect("valid"),
        );
        r.failure = Some(why);
        r
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn from_parts(
        reactor: usize,
        ios: u64,
        reads: u64,
        errors: u64,
        verify_errors: u64,
        first_mismatch: Option<String>,
        lat_sum_ticks: u64,
        hist: Histogram<u64>,
    ) -> CoreResult {
        let q = |p: f64| {
            if ios == 0 {
                0.0
            } else {
                us(hist.value_at_quantile(p))
            }
        };
        CoreResult {
            reactor,
            ios,
            reads,
            errors,
            verify_errors,
            first_mismatch,
            iops: 0.0,
            mib_s: 0.0,
            lat_avg_us: if ios == 0 {
                0.0
            } else {
                us(lat_sum_ticks) / ios as f64
            },
            lat_p50_us: q(0.5),
            lat_p99_us: q(0.99),
            lat_p999_us: q(0.999),
            lat_max_us: if ios == 0 { 0.0 } else { us(hist.max()) },
            hist: Some(hist),
            lat_sum_ticks,
            failure: None,
        }
    }

    fn rate(&mut self, elapsed_ns: u64, bs: usize) {
        let s = elapsed_ns as f64 / 1e9;
        self.iops = self.ios as f64 / s;
        self.mib_s = self.iops * bs as f64 / (1 << 20) as f64;
    }
}

/// The whole run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub bdev: String,
    pub workload: String,
    pub rwmixread: u32,
    pub bs: usize,
    pub qd: usize,
    pub cores: usize,
    pub verify: bool,
    pub elapsed_s: f64,
    pub per_core: Vec<CoreResult>,
    pub total: CoreResult,
    /// Process CPU time (user + system) divided by I/Os.
    pub cpu_ns_per_io: f64,
    pub cpu_s: f64,
}

impl Report {
    pub(crate) fn new(
        cfg: BenchConfig,
        mut per_core: Vec<CoreResult>,
        cpu_ns: u64,
        elapsed_ns: u64,
        bdev: &str,
    ) -> Report {
        let mut hist: Option<Histogram<u64>> = None;
        let (mut ios, mut reads, mut errs, mut verrs, mut sum) = (0, 0, 0, 0, 0);
        let mut mismatch = None;
        let mut failure = None;
        for c in per_core.iter_mut() {
            c.rate(elapsed_ns, cfg.bs);
            ios += c.ios;
            reads += c.reads;
            errs += c.errors;
            verrs += c.verify_errors;
            sum += c.lat_sum_ticks;
            mismatch = mismatch.or(c.first_mismatch.clone());
            failure = failure.or(c.failure.clone());
            if let Some(h) = &c.hist {
                match hist.as_mut() {
                    Some(t) => {
                        let _ = t.add(h);
                    }
                    None => hist = Some(h.clone()),
                }
            }
        }
        let mut total = CoreResult::from_parts(
            usize::MAX,
            ios,
            reads,
            errs,
            verrs,
            mismatch,
            sum,
            hist.unwrap_or_else(|| Histogram::new(3).expect("valid")),
        );
        total.failure = failure;
        total.rate(elapsed_ns, cfg.bs);
        Report {
            bdev: bdev.to_string(),
            workload: cfg.pattern.name().to_string(),
            rwmixread: cfg.rwmixread,
            bs: cfg.bs,
            qd: cfg.qd,
            cores: per_core.len(),
            verify: cfg.verify,
            elapsed_s: elapsed_ns as f64 / 1e9,
            cpu_ns_per_io: if ios == 0 {
                0.0
            } else {
                cpu_ns as f64 / ios as f64
            },
            cpu_s: cpu_ns as f64 / 1e9,
            per_core,
            total,
        }
    }

    /// Whether the run saw no I/O error and no verify mismatch.
    pub fn clean(&self) -> bool {
        self.total.errors == 0
            && self.total.verify_errors == 0
            && self.total.failure.is_none()
            && self.total.ios > 0
    }

    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or_else(|e| json!({"error": e.to_string()}));
        if let Some(t) = v.get_mut("total").and_then(|t| t.as_object_mut()) {
            t.remove("reactor");
        }
        v
    }

    /// The summary table.
    pub fn table(&self) -> String {
        let mut s = format!(
            "bdev {} | {} bs={} qd={}/core cores={} verify={} | {:.2} s\n",
            self.bdev, self.workload, self.bs, self.qd, self.cores, self.verify, self.elapsed_s
        );
        s += &format!(
            "{:>6} {:>12} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8}\n",
            "core", "IOPS", "MiB/s", "avg us", "p50 us", "p99 us", "p99.9 us", "max us", "errors"
        );
        let row = |name: String, c: &CoreResult| {
            format!(
                "{:>6} {:>12.0} {:>10.1} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10.1} {:>8}\n",
                name,
                c.iops,
                c.mib_s,
                c.lat_avg_us,
                c.lat_p50_us,
                c.lat_p99_us,
                c.lat_p999_us,
                c.lat_max_us,
                c.errors + c.verify_errors
            )
        };
        for c in &self.per_core {
            s += &row(c.reactor.to_string(), c);
        }
        s += &row("total".into(), &self.total);
        s += &format!(
            "CPU {:.2} s for {} I/Os: {:.0} ns CPU per I/O ({:.0} ns per I/O per core at this IOPS)\n",
            self.cpu_s,
            self.total.ios,
            self.cpu_ns_per_io,
            if self.total.iops > 0.0 { 1e9 * self.cores as f64 / self.total.iops } else { 0.0 }
        );
        if let Some(m) = &self.total.first_mismatch {
            s += &format!(
                "VERIFY FAILED: {} mismatching reads; first: {m}\n",
                self.total.verify_errors
            );
        }
        if let Some(f) = &self.total.failure {
            s += &format!("FAILED: {f}\n");
        }
        s
    }
}

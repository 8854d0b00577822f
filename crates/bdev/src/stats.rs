//! I/O statistics: per-channel counters kept in `Cell`s on the reactor (no
//! atomics), merged across reactors by a message when someone asks.

use std::cell::{Cell, RefCell};

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::types::IoType;

const N: usize = IoType::ALL.len();
/// Histograms hold latencies in ns up to 60 s, 3 significant digits.
const HIST_MAX_NS: u64 = 60_000_000_000;

#[derive(Clone, Copy)]
struct TypeStat {
    ops: u64,
    bytes: u64,
    lat_sum: u64,
    /// `u64::MAX` until the first I/O (one `min` per I/O, no test of
    /// `ops`); reported as 0 while `ops` is 0.
    lat_min: u64,
    lat_max: u64,
    errors: u64,
}

impl Default for TypeStat {
    fn default() -> TypeStat {
        TypeStat {
            ops: 0,
            bytes: 0,
            lat_sum: 0,
            lat_min: u64::MAX,
            lat_max: 0,
            errors: 0,
        }
    }
}

/// One channel's counters.
pub(crate) struct ChannelStats {
    by_type: [Cell<TypeStat>; N],
    hist: [RefCell<Histogram<u64>>; 2],
    pub(crate) bounce_ops: Cell<u64>,
    pub(crate) bounce_bytes: Cell<u64>,
    pub(crate) split_ops: Cell<u64>,
}

fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_NS, 3).expect("static histogram bounds are valid")
}

impl ChannelStats {
    pub(crate) fn new() -> ChannelStats {
        ChannelStats {
            by_type: Default::default(),
            hist: [RefCell::new(new_hist()), RefCell::new(new_hist())],
            bounce_ops: Cell::new(0),
            bounce_bytes: Cell::new(0),
            split_ops: Cell::new(0),
        }
    }

    /// Records one completed I/O: `ticks` of latency. Inlined into the
    /// completion (it was a call of its own on every I/O).
    #[inline(always)]
    pub(crate) fn record(&self, t: IoType, bytes: u64, ticks: u64, ok: bool, hist: bool) {
        let c = &self.by_type[t.index()];
        let mut s = c.get();
        if !ok {
            s.errors += 1;
            c.set(s);
            return;
        }
        s.ops += 1;
        s.bytes += bytes;
        s.lat_sum += ticks;
        s.lat_max = s.lat_max.max(ticks);
        s.lat_min = s.lat_min.min(ticks);
        c.set(s);
        // Histograms cost a few ns per I/O: on only when asked
        // (SPDK's bdev_enable_histogram).
        if hist {
            self.record_hist(t, ticks);
        }
    }

    /// Out of line: the rare case should not make every I/O's caller save
    /// registers for it.
    #[cold]
    #[inline(never)]
    fn record_hist(&self, t: IoType, ticks: u64) {
        let h = match t {
            IoType::Read => 0,
            IoType::Write => 1,
            _ => return,
        };
        let ns = ustor_runtime::ticks::to_ns(ticks).clamp(1, HIST_MAX_NS);
        self.hist[h].borrow_mut().saturating_record(ns);
    }

    pub(crate) fn snapshot(&self) -> IoStat {
        let mut out = IoStat::default();
        for t in IoType::ALL {
            let s = self.by_type[t.index()].get();
            out.by_type[t.index()] = TypeSnapshot {
                ops: s.ops,
                bytes: s.bytes,
                lat_sum_ticks: s.lat_sum,
                lat_min_ticks: if s.ops == 0 { 0 } else { s.lat_min },
                lat_max_ticks: s.lat_max,
                errors: s.errors,
            };
        }
        out.read_hist = Some(self.hist[0].borrow().clone());
        out.write_hist = Some(self.hist[1].borrow().clone());
        out.bounce_ops = self.bounce_ops.get();
        out.bounce_bytes = self.bounce_bytes.get();
        out.split_ops = self.split_ops.get();
        out
    }
}

#[derive(Default, Clone, Copy, Debug, Serialize)]
pub struct TypeSnapshot {
    pub ops: u64,
    pub bytes: u64,
    pub lat_sum_ticks: u64,
    pub lat_min_ticks: u64,
    pub lat_max_ticks: u64,
    pub errors: u64,
}

/// Merged statistics of a bdev (or one channel).
#[derive(Default, Clone, Debug)]
pub struct IoStat {
    pub by_type: [TypeSnapshot; N],
    pub read_hist: Option<Histogram<u64>>,
    pub write_hist: Option<Histogram<u64>>,
    /// Payload copies the stack made (bounce buffers), counted as ops and bytes.
    pub bounce_ops: u64,
    pub bounce_bytes: u64,
    pub split_ops: u64,
}

impl IoStat {
    pub fn get(&self, t: IoType) -> &TypeSnapshot {
        &self.by_type[t.index()]
    }

    pub fn merge(&mut self, o: &IoStat) {
        for i in 0..N {
            let (a, b) = (&mut self.by_type[i], &o.by_type[i]);
            let had = a.ops > 0;
            a.ops += b.ops;
            a.bytes += b.bytes;
            a.lat_sum_ticks += b.lat_sum_ticks;
            a.lat_max_ticks = a.lat_max_ticks.max(b.lat_max_ticks);
            a.lat_min_ticks = match (had, b.ops > 0) {
                (true, true) => a.lat_min_ticks.min(b.lat_min_ticks),
                (false, _) => b.lat_min_ticks,
                (true, false) => a.lat_min_ticks,
            };
            a.errors += b.errors;
        }
        for (mine, theirs) in [
            (&mut self.read_hist, &o.read_hist),
            (&mut self.write_hist, &o.write_hist),
        ] {
            match (mine.as_mut(), theirs) {
                (Some(m), Some(t)) => {
                    let _ = m.add(t);
                }
                (None, Some(t)) => *mine = Some(t.clone()),
                _ => {}
            }
        }
        self.bounce_ops += o.bounce_ops;
        self.bounce_bytes += o.bounce_bytes;
        self.split_ops += o.split_ops;
    }

    /// SPDK's `bdev_get_iostat` entry for one bdev.
    pub fn to_spdk_json(&self, name: &str) -> serde_json::Value {
        let g = |t: IoType| self.get(t);
        let pct = |h: &Option<Histogram<u64>>, q: f64| {
            h.as_ref().map(|h| h.value_at_quantile(q)).unwrap_or(0)
        };
        serde_json::json!({
            "name": name,
            "bytes_read": g(IoType::Read).bytes,
            "num_read_ops": g(IoType::Read).ops,
            "bytes_written": g(IoType::Write).bytes,
            "num_write_ops": g(IoType::Write).ops,
            "bytes_unmapped": g(IoType::Unmap).bytes,
            "num_unmap_ops": g(IoType::Unmap).ops,
            "bytes_copied": 0,
            "num_copy_ops": 0,
            "read_latency_ticks": g(IoType::Read).lat_sum_ticks,
            "max_read_latency_ticks": g(IoType::Read).lat_max_ticks,
            "min_read_latency_ticks": g(IoType::Read).lat_min_ticks,
            "write_latency_ticks": g(IoType::Write).lat_sum_ticks,
            "max_write_latency_ticks": g(IoType::Write).lat_max_ticks,
            "min_write_latency_ticks": g(IoType::Write).lat_min_ticks,
            "unmap_latency_ticks": g(IoType::Unmap).lat_sum_ticks,
            "max_unmap_latency_ticks": g(IoType::Unmap).lat_max_ticks,
            "min_unmap_latency_ticks": g(IoType::Unmap).lat_min_ticks,
            "copy_latency_ticks": 0,
            "max_copy_latency_ticks": 0,
            "min_copy_latency_ticks": 0,
            "io_error": {},
            "num_flush_ops": g(IoType::Flush).ops,
            "num_write_zeroes_ops": g(IoType::WriteZeroes).ops,
            "bytes_write_zeroes": g(IoType::WriteZeroes).bytes,
            "num_reset_ops": g(IoType::Reset).ops,
            // ustor's own: compare-and-writes that matched (and wrote),
            // and those that failed (a miscompare is a failure).
            "num_compare_and_write_ops": g(IoType::CompareAndWrite).ops,
            "compare_and_write_errors": g(IoType::CompareAndWrite).errors,
            "errors": IoType::ALL.iter().map(|t| g(*t).errors).sum::<u64>(),
            "bounce_ops": self.bounce_ops,
            "bounce_bytes": self.bounce_bytes,
            "split_ops": self.split_ops,
            "read_latency_ns_p50": pct(&self.read_hist, 0.5),
            "read_latency_ns_p99": pct(&self.read_hist, 0.99),
            "write_latency_ns_p50": pct(&self.write_hist, 0.5),
            "write_latency_ns_p99": pct(&self.write_hist, 0.99),
        })
    }
}

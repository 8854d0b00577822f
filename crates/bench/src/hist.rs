//! The per-reactor latency histogram of the I/O loop: log-linear buckets
//! (values below 256 ticks exact, above that 128 buckets per power of two,
//! so a bucket is within 0.8% of its values) in a flat array of `Cell`s.
//!
//! Recording is a leading-zero count, two shifts and an increment: a
//! fraction of `hdrhistogram`'s `record` (bounds and min/max/total
//! bookkeeping behind a `RefCell` borrow), which was ~6% of a null bdev's
//! whole I/O. The report still works on an `hdrhistogram::Histogram`:
//! [`LogHist::to_hdr`] converts once, after the run.

use std::cell::Cell;

use hdrhistogram::Histogram;

/// Sub-bucket bits: 2^(SUB-1) buckets per power of two above 2^SUB.
const SUB: u32 = 8;
/// Values are clamped to 2^MAX_BITS - 1 ticks (~6 minutes at 3 GHz).
const MAX_BITS: u32 = 40;
const BUCKETS: usize = (((MAX_BITS - SUB) as usize) << (SUB - 1)) + (1 << SUB);

pub(crate) struct LogHist {
    counts: Box<[Cell<u64>]>,
    max: Cell<u64>,
}

impl LogHist {
    pub(crate) fn new() -> LogHist {
        LogHist {
            counts: (0..BUCKETS).map(|_| Cell::new(0)).collect(),
            max: Cell::new(0),
        }
    }

    #[inline]
    fn index(v: u64) -> usize {
        if v < 1 << SUB {
            return v as usize;
        }
        let top = 63 - v.leading_zeros(); // >= SUB
        let shift = top + 1 - SUB;
        ((shift as usize) << (SUB - 1)) + (v >> shift) as usize
    }

    /// The range of values bucket `i` holds.
    fn range(i: usize) -> (u64, u64) {
        if i < 1 << SUB {
            return (i as u64, i as u64);
        }
        let half = 1usize << (SUB - 1);
        let shift = (i / half - 1) as u32;
        let m = (i % half + half) as u64;
        (m << shift, ((m + 1) << shift) - 1)
    }

    #[inline]
    pub(crate) fn record(&self, v: u64) {
        let v = v.min((1 << MAX_BITS) - 1);
        if v > self.max.get() {
            self.max.set(v);
        }
        // The clamp keeps the index in bounds; `get` keeps a bad index from
        // ever writing out of the array (it is never taken).
        if let Some(c) = self.counts.get(Self::index(v)) {
            c.set(c.get() + 1);
        }
    }

    /// An `hdrhistogram` with each bucket's count at the bucket's midpoint
    /// (within 0.4% of each value) and the exact maximum.
    pub(crate) fn to_hdr(&self, highest: u64) -> Histogram<u64> {
        let max = self.max.get();
        let mut h =
            Histogram::new_with_bounds(1, highest.max(max).max(2), 3).expect("valid bounds");
        for (i, c) in self.counts.iter().enumerate() {
            let mut n = c.get();
            if n == 0 {
                continue;
            }
            let (lo, hi) = Self::range(i);
            if (lo..=hi).contains(&max) {
                h.saturating_record(max.max(1));
                n -= 1;
            }
            let mid = (lo + (hi - lo) / 2).min(max).max(1);
            h.saturating_record_n(mid, n);
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_cover_their_values() {
        let mut next = 0u64;
        for i in 0..BUCKETS {
            let (lo, hi) = LogHist::range(i);
            assert_eq!(lo, next, "bucket {i}");
            assert!(hi >= lo);
            assert_eq!(LogHist::index(lo), i);
            assert_eq!(LogHist::index(hi), i);
            // Within 0.8% of every value it holds.
            assert!(
                (hi - lo) as f64 <= lo as f64 / 127.0,
                "bucket {i}: {lo}..{hi}"
            );
            next = hi + 1;
        }
        assert_eq!(next, 1 << MAX_BITS);
    }

    #[test]
    fn percentiles_match_an_exact_histogram() {
        let h = LogHist::new();
        let mut exact = Histogram::<u64>::new_with_bounds(1, 1 << 40, 3).unwrap();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Latency-like: mostly a few hundred ticks, a tail to millions.
            let v = 200
                + (x % 1000)
                + if x.is_multiple_of(97) {
                    x % 5_000_000
                } else {
                    0
                };
            h.record(v);
            exact.record(v).unwrap();
        }
        h.record(u64::MAX); // clamped, not out of bounds
        exact.record((1 << 40) - 1).unwrap();
        let got = h.to_hdr(1 << 40);
        assert_eq!(got.len(), exact.len());
        assert_eq!(got.max(), exact.max());
        for q in [0.5, 0.9, 0.99, 0.999] {
            let (a, b) = (
                got.value_at_quantile(q) as f64,
                exact.value_at_quantile(q) as f64,
            );
            assert!((a - b).abs() <= b * 0.01, "q {q}: {a} vs {b}");
        }
    }
}

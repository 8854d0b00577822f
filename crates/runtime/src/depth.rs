//! Adaptive mode's batch sleep: a reactor whose clients keep many requests
//! in flight sleeps as soon as a pass finds no work, as in interrupt mode,
//! instead of spinning through the short gaps between their requests.
//!
//! Spinning is what gives a lone request (QD1) its latency, and it is
//! wasted where the client has a deep pipeline: there a spinner catches
//! each request alone as it arrives and answers it alone, so the reactor
//! does a receive and a send per request and the client a wake-up and a
//! read per response, while a reactor that sleeps wakes to several
//! requests at once and answers them in one send. The wake-up's latency
//! (an interrupt to the reactor's halted vCPU, 10-80 µs on this VM) hides
//! behind the others in flight. Measured before this existed (iSCSI,
//! iscsi-perf, four sessions at QD32 on the other core, the client the
//! limit): interrupt mode did 90 K IOPS at 8.2 µs of target CPU per I/O,
//! adaptive mode 83 K at 10.3 µs (bench/RESULTS-iscsi.md).
//!
//! Only the protocol can see the depth: a spinning reactor sees one
//! arrival per pass at QD1 and at QD32 alike. So targets report it with
//! [`crate::note_depth`], per request: how many requests its client had in
//! flight when it sent this one (iSCSI: the responses it had not yet seen,
//! from its ExpStatSN, and this one). A reactor that hears nothing never
//! batches.
//!
//! The judge looks at windows of [`WINDOW`] reports: when at least
//! [`DEEP_SHARE_NUM`]/[`DEEP_SHARE_DEN`] of one came from clients with
//! [`DEEP`] or more in flight, the reactor sleeps at once until a window
//! says otherwise. Mixed loads where most requests come from shallow
//! clients keep spinning (their latency is what the clients wait on). A
//! verdict expires [`EXPIRY_NS`] after its window closed, so a reactor
//! whose deep clients went away does not go on sleeping at once for other
//! work.

/// A client with this many requests in flight counts as deep.
pub(crate) const DEEP: u32 = 8;
/// Reports per verdict.
pub(crate) const WINDOW: u32 = 64;
/// The share of deep reports in a window that makes it batch.
const DEEP_SHARE_NUM: u32 = 3;
const DEEP_SHARE_DEN: u32 = 4;
/// A verdict older than this (since its window closed) no longer holds.
pub(crate) const EXPIRY_NS: u64 = 20_000_000;

/// Per-reactor judge of whether the load is deep enough to sleep at once.
#[derive(Debug)]
pub(crate) struct DepthJudge {
    seen: u32,
    deep: u32,
    /// The last verdict, and the tick its window closed.
    batch: bool,
    decided_at: u64,
    expiry: u64,
}

impl DepthJudge {
    /// `expiry_ticks`: how long a verdict holds.
    pub(crate) fn new(expiry_ticks: u64) -> DepthJudge {
        DepthJudge {
            seen: 0,
            deep: 0,
            batch: false,
            decided_at: 0,
            expiry: expiry_ticks,
        }
    }

    /// A request arrived from a client with `depth` requests in flight, at
    /// tick `now`.
    #[inline]
    pub(crate) fn note(&mut self, depth: u32, now: u64) {
        self.seen += 1;
        self.deep += (depth >= DEEP) as u32;
        if self.seen >= WINDOW {
            self.batch = self.deep * DEEP_SHARE_DEN >= WINDOW * DEEP_SHARE_NUM;
            self.decided_at = now;
            self.seen = 0;
            self.deep = 0;
        }
    }

    /// Whether the reactor should sleep as soon as it finds no work.
    #[inline]
    pub(crate) fn batch(&self, now: u64) -> bool {
        self.batch && now.saturating_sub(self.decided_at) < self.expiry
    }
}

#[cfg(test)]
mod tests {
    use super::{DepthJudge, DEEP, WINDOW};

    const EXPIRY: u64 = 1_000_000;

    fn feed(j: &mut DepthJudge, depths: impl Iterator<Item = u32>, now: u64) {
        depths.for_each(|d| j.note(d, now));
    }

    #[test]
    fn shallow_clients_never_batch() {
        let mut j = DepthJudge::new(EXPIRY);
        feed(&mut j, std::iter::repeat_n(1, 10 * WINDOW as usize), 10);
        assert!(!j.batch(10));
        // Four QD1 clients on one reactor are four shallow ones.
        feed(&mut j, std::iter::repeat_n(1, WINDOW as usize), 20);
        assert!(!j.batch(20));
    }

    #[test]
    fn a_deep_window_batches_until_a_shallow_one() {
        let mut j = DepthJudge::new(EXPIRY);
        feed(
            &mut j,
            std::iter::repeat_n(DEEP - 1, WINDOW as usize - 1),
            10,
        );
        assert!(!j.batch(10), "no verdict before the window closes");
        j.note(DEEP - 1, 10);
        assert!(!j.batch(10), "just below deep");
        feed(&mut j, std::iter::repeat_n(32, WINDOW as usize), 20);
        assert!(j.batch(20));
        feed(&mut j, std::iter::repeat_n(1, WINDOW as usize), 30);
        assert!(!j.batch(30));
    }

    #[test]
    fn mostly_shallow_mixes_keep_spinning() {
        let mut j = DepthJudge::new(EXPIRY);
        // Half the requests from a deep client, half from shallow ones.
        feed(
            &mut j,
            (0..WINDOW).map(|i| if i % 2 == 0 { 32 } else { 1 }),
            10,
        );
        assert!(!j.batch(10));
        // Three in four deep: batch.
        feed(
            &mut j,
            (0..WINDOW).map(|i| if i % 4 == 0 { 1 } else { 32 }),
            20,
        );
        assert!(j.batch(20));
    }

    #[test]
    fn a_verdict_expires_when_reports_stop() {
        let mut j = DepthJudge::new(EXPIRY);
        feed(&mut j, std::iter::repeat_n(32, WINDOW as usize), 100);
        assert!(j.batch(100 + EXPIRY - 1));
        assert!(!j.batch(100 + EXPIRY));
    }
}

//! LANoT: load-aware PDU coalescing, for any protocol that sends through a
//! [`PduGroup`] (every NVMe/TCP queue on both sides uses it).
//!
//! Outgoing PDUs collect in a [`PduGroup`] (an iovec list over a header arena
//! and the payload buffers, owned by value) that leaves with one `sendmsg`.
//! The [`Coalescer`] decides when: at once when the group reaches its
//! aggregation *degree* or byte limit, at once when nothing else is in flight
//! (so QD1 never waits), else when its *timer* fires. In adaptive mode the
//! counters of the last window of groups steer degree and timer: mostly full
//! groups mean the queue is throughput-bound (raise both); mostly timer
//! expiries on thin groups ("doorbell rings" that found too little to send)
//! of a shallow queue mean it is latency-bound (lower both); mostly
//! expiries on thick groups, or on a queue whose outstanding commands take
//! many timers to turn over, mean the wait pays or costs nothing and the
//! PDUs just come slowly (lower the degree only).

use serde::{Deserialize, Serialize};
use std::time::Duration;

use ustor_runtime::ticks;

use crate::group::PduGroup;

/// PDUs per timer-expired group, on average over a window, from which the
/// wait counts as worth it (see [`Coalescer::on_flush`]).
const THICK_EXPIRY: u32 = 2;

/// Groups an adaptive queue keeps in flight at least (see
/// [`Coalescer::decide`]).
const PIPELINE_GROUPS: u32 = 8;

/// `others_in_flight` for a side that cannot count the queue's outstanding
/// commands (the target sees only what it is executing, not what the host
/// has in flight): deep enough that the pipeline bound never applies.
pub const BACKLOG_UNKNOWN: u32 = u32::MAX / 16;

/// Coalescing mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// No waiting: each pass of the sender sends everything queued so far
    /// in one `sendmsg` (SPDK's behaviour: one flush per poll).
    Off,
    /// Fixed degree and timer.
    Fixed,
    /// Degree and timer follow the load.
    #[default]
    Adaptive,
}

/// Coalescer settings (per queue; the same for every queue of a transport).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CoalesceConfig {
    pub mode: Mode,
    /// Fixed mode, and the starting point of adaptive mode.
    pub degree: u32,
    pub timer_us: u32,
    /// Flush once the group holds this many bytes.
    pub max_bytes: u32,
    pub min_degree: u32,
    pub max_degree: u32,
    pub min_timer_us: u32,
    pub max_timer_us: u32,
    /// Groups per adaptive decision.
    pub window: u32,
}

impl Default for CoalesceConfig {
    fn default() -> Self {
        CoalesceConfig {
            mode: Mode::Adaptive,
            degree: 4,
            timer_us: 20,
            max_bytes: 256 << 10,
            min_degree: 1,
            max_degree: 32,
            min_timer_us: 5,
            max_timer_us: 200,
            window: 64,
        }
    }
}

/// Why a group was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flush {
    /// Reached its degree or byte limit.
    Full,
    /// Nothing else in flight (or mode off, or an urgent PDU): sent at once.
    Small,
    /// The timer fired first.
    Timer,
}

/// What the sender does with the group it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Now(Flush),
    /// Wait for more PDUs for at most this long.
    Wait {
        timer_us: u32,
    },
}

/// Counters and current setting, as `nvmf_get_stats` shows them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoalesceStats {
    pub groups: u64,
    pub pdus: u64,
    pub full_groups: u64,
    pub small_groups: u64,
    pub timer_expiries: u64,
    pub raises: u64,
    pub lowers: u64,
    pub degree: u32,
    pub timer_us: u32,
}

impl CoalesceStats {
    /// All zero (the `Default`, usable in `const` contexts).
    pub const ZERO: CoalesceStats = CoalesceStats {
        groups: 0,
        pdus: 0,
        full_groups: 0,
        small_groups: 0,
        timer_expiries: 0,
        raises: 0,
        lowers: 0,
        degree: 0,
        timer_us: 0,
    };

    pub fn add(&mut self, o: &CoalesceStats) {
        self.groups += o.groups;
        self.pdus += o.pdus;
        self.full_groups += o.full_groups;
        self.small_groups += o.small_groups;
        self.timer_expiries += o.timer_expiries;
        self.raises += o.raises;
        self.lowers += o.lowers;
        self.degree = self.degree.max(o.degree);
        self.timer_us = self.timer_us.max(o.timer_us);
    }
}

/// One queue's coalescing policy state.
#[derive(Clone, Debug)]
pub struct Coalescer {
    cfg: CoalesceConfig,
    degree: u32,
    timer_us: u32,
    win: [u32; 3],
    win_n: u32,
    win_timer_pdus: u32,
    win_timer_depth: u64,
    win_pdus: u64,
    win_start: u64,
    stats: CoalesceStats,
}

impl Coalescer {
    pub fn new(cfg: CoalesceConfig) -> Coalescer {
        let cfg = CoalesceConfig {
            min_degree: cfg.min_degree.max(1),
            max_degree: cfg.max_degree.max(cfg.min_degree.max(1)),
            window: cfg.window.max(1),
            ..cfg
        };
        // The bounds are the adaptive policy's: a fixed degree is used as
        // configured (`fixed` with degree 64 must not quietly run at 32).
        let degree = match cfg.mode {
            Mode::Adaptive => cfg.degree.clamp(cfg.min_degree, cfg.max_degree),
            _ => cfg.degree.max(1),
        };
        let timer_us = match cfg.mode {
            Mode::Adaptive => cfg
                .timer_us
                .clamp(cfg.min_timer_us, cfg.max_timer_us.max(cfg.min_timer_us)),
            _ => cfg.timer_us,
        };
        Coalescer {
            cfg,
            degree,
            timer_us,
            win: [0; 3],
            win_n: 0,
            win_timer_pdus: 0,
            win_timer_depth: 0,
            win_pdus: 0,
            win_start: 0,
            stats: CoalesceStats {
                degree,
                timer_us,
                ..Default::default()
            },
        }
    }

    pub fn mode(&self) -> Mode {
        self.cfg.mode
    }

    pub fn degree(&self) -> u32 {
        self.degree
    }

    pub fn timer_us(&self) -> u32 {
        self.timer_us
    }

    pub fn stats(&self) -> CoalesceStats {
        self.stats
    }

    /// What to do with a group of `pdus` PDUs (`bytes` long) while
    /// `others_in_flight` other commands of the queue are outstanding (and
    /// may add to it); `urgent` when the group holds a PDU that must not
    /// wait whatever else is in flight (a termination request; the
    /// initiator's H2CData). The target's R2Ts are not urgent: its sender
    /// counts the writes awaiting data as in flight, so an R2T waits only
    /// while other commands can join its group.
    pub fn decide(&self, pdus: u32, bytes: usize, others_in_flight: u32, urgent: bool) -> Decision {
        debug_assert!(pdus > 0);
        if self.cfg.mode == Mode::Off {
            return Decision::Now(Flush::Small);
        }
        if pdus >= self.degree || bytes >= self.cfg.max_bytes as usize {
            return Decision::Now(Flush::Full);
        }
        if others_in_flight == 0 || urgent || self.timer_us == 0 {
            return Decision::Now(Flush::Small);
        }
        // Adaptive: hold a group only while it is under 1/PIPELINE_GROUPS
        // of the queue's outstanding commands, so the peer always has most
        // of the queue to work on. Without this bound, full groups keep
        // raising the degree until one group is the whole queue: at QD32
        // the two sides then took turns (randwrite 256 K against `off`'s
        // 376 K in bench/nvmf.sh).
        if self.cfg.mode == Mode::Adaptive && pdus * PIPELINE_GROUPS >= pdus + others_in_flight {
            return Decision::Now(Flush::Full);
        }
        Decision::Wait {
            timer_us: self.timer_us,
        }
    }

    /// The sender's decision for a non-empty `group` after one fill pass,
    /// shared by the target and the initiator: send now (and why), or keep
    /// collecting, arming `deadline` for the group's timer if it is not yet
    /// armed. `full` when the group could take no more (iovecs or arena),
    /// `timer_fired` when the sender woke for the armed deadline.
    pub fn flush_reason(
        &self,
        group: &PduGroup,
        full: bool,
        timer_fired: bool,
        others_in_flight: u32,
        urgent: bool,
        deadline: &mut Option<u64>,
    ) -> Option<Flush> {
        let why = if self.cfg.mode == Mode::Off {
            Flush::Small
        } else if full {
            Flush::Full
        } else if timer_fired {
            Flush::Timer
        } else {
            match self.decide(group.pdus(), group.bytes(), others_in_flight, urgent) {
                Decision::Now(w) => w,
                Decision::Wait { timer_us } => {
                    if deadline.is_none() {
                        *deadline = Some(
                            ticks::now()
                                + ticks::from_duration(Duration::from_micros(u64::from(timer_us))),
                        );
                    }
                    return None;
                }
            }
        };
        *deadline = None;
        Some(why)
    }

    /// Records a sent group of `pdus` PDUs, sent while `depth` other
    /// commands of the queue were outstanding (those the sender can see);
    /// in adaptive mode, adjusts degree and timer at the end of each window.
    pub fn on_flush(&mut self, why: Flush, pdus: u32, depth: u32) {
        let s = &mut self.stats;
        s.groups += 1;
        s.pdus += u64::from(pdus);
        let i = match why {
            Flush::Full => {
                s.full_groups += 1;
                0
            }
            Flush::Small => {
                s.small_groups += 1;
                1
            }
            Flush::Timer => {
                s.timer_expiries += 1;
                self.win_timer_pdus += pdus;
                self.win_timer_depth += u64::from(depth);
                2
            }
        };
        if self.cfg.mode != Mode::Adaptive {
            return;
        }
        self.win[i] += 1;
        self.win_n += 1;
        self.win_pdus += u64::from(pdus);
        if self.win_n == 1 {
            self.win_start = ticks::now();
        }
        if self.win_n < self.cfg.window {
            return;
        }
        self.end_window();
    }

    /// Adjusts degree and timer from the window of groups just closed (see
    /// the module comment), then opens the next window.
    fn end_window(&mut self) {
        let [full, _small, timer] = self.win;
        let c = &self.cfg;
        if full > timer && full * 2 >= self.win_n {
            // Throughput-bound: groups fill before the timer; batch more.
            self.degree = (self.degree * 2).min(c.max_degree);
            self.timer_us = (self.timer_us * 2).clamp(c.min_timer_us, c.max_timer_us);
            self.stats.raises += 1;
        } else if timer > full && timer * 4 >= self.win_n {
            let thick = self.win_timer_pdus >= THICK_EXPIRY * timer;
            // Deep: the commands outstanding at the expiries take, at this
            // window's PDU rate, PIPELINE_GROUPS timers or more to turn
            // over, so a wait stalls nothing (Little's law, with PDUs
            // standing in for commands).
            let window_ns = ticks::to_ns(ticks::now().saturating_sub(self.win_start));
            let deep = deep_queue(
                self.win_timer_depth / u64::from(timer),
                window_ns,
                self.win_pdus,
                self.timer_us,
            );
            if !thick && !deep {
                // Latency-bound: the timer keeps firing on thin groups, the
                // wait gathers next to nothing.
                self.degree = (self.degree / 2).max(c.min_degree);
                self.timer_us = (self.timer_us / 2).clamp(c.min_timer_us, c.max_timer_us);
                self.stats.lowers += 1;
            } else {
                // The timer fires on thick groups (the wait does gather, the
                // PDUs just come slower than the degree needs: many queues
                // per core, R2T round trips), or on a deep queue (its
                // outstanding commands take 8 timers or more to turn over,
                // so the wait stalls nothing).
                // Lower only the degree, toward what a group gathers
                // anyway; once groups reach it, full groups raise degree
                // and timer again. Halving the timer here too (the plain
                // rule) made the next groups thinner, and it fell to degree
                // 1 where fixed (16, 50 us) sent half the `sendmsg`s
                // (docs/nvmf.md, runs J and L).
                self.degree = (self.degree / 2).max(c.min_degree);
                self.stats.lowers += 1;
            }
        }
        self.stats.degree = self.degree;
        self.stats.timer_us = self.timer_us;
        self.win = [0; 3];
        self.win_n = 0;
        self.win_timer_pdus = 0;
        self.win_timer_depth = 0;
        self.win_pdus = 0;
    }
}

/// Whether `depth` outstanding commands, at the rate of `pdus` PDUs in
/// `window_ns`, take `PIPELINE_GROUPS` timers or more to turn over.
fn deep_queue(depth: u64, window_ns: u64, pdus: u64, timer_us: u32) -> bool {
    let turnaround_ns = u128::from(depth) * u128::from(window_ns) / u128::from(pdus.max(1));
    turnaround_ns >= u128::from(PIPELINE_GROUPS) * u128::from(timer_us) * 1000
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records `n` groups of `pdus` PDUs sent for `why` at `depth`.
    fn flushes(c: &mut Coalescer, n: usize, why: Flush, pdus: u32, depth: u32) {
        for _ in 0..n {
            c.on_flush(why, pdus, depth);
        }
    }

    fn cfg(mode: Mode) -> CoalesceConfig {
        CoalesceConfig {
            mode,
            window: 8,
            ..Default::default()
        }
    }

    #[test]
    fn fixed_degree_is_not_capped_by_the_adaptive_bounds() {
        let c = Coalescer::new(CoalesceConfig {
            degree: 64,
            timer_us: 500,
            ..cfg(Mode::Fixed)
        });
        assert_eq!((c.degree(), c.timer_us()), (64, 500));
        assert_eq!(
            c.decide(63, 4096, 100, false),
            Decision::Wait { timer_us: 500 }
        );
        assert_eq!(c.decide(64, 4096, 100, false), Decision::Now(Flush::Full));
        // Adaptive starts inside its bounds.
        let a = Coalescer::new(CoalesceConfig {
            degree: 64,
            ..cfg(Mode::Adaptive)
        });
        assert_eq!(a.degree(), 32);
    }

    #[test]
    fn qd1_never_waits() {
        for m in [Mode::Fixed, Mode::Adaptive, Mode::Off] {
            let c = Coalescer::new(cfg(m));
            assert!(matches!(c.decide(1, 4096, 0, false), Decision::Now(_)));
        }
        let c = Coalescer::new(cfg(Mode::Fixed));
        assert_eq!(c.decide(1, 100, 8, false), Decision::Wait { timer_us: 20 });
        assert_eq!(c.decide(1, 100, 8, true), Decision::Now(Flush::Small));
        assert_eq!(c.decide(4, 100, 8, false), Decision::Now(Flush::Full));
        assert_eq!(c.decide(1, 1 << 20, 8, false), Decision::Now(Flush::Full));
    }

    #[test]
    fn adaptive_keeps_the_pipeline_full() {
        let mut c = Coalescer::new(cfg(Mode::Adaptive));
        flushes(&mut c, 24, Flush::Full, 32, 0);
        assert_eq!(c.degree(), 32);
        // 2 of 32 outstanding: under 1/8 of the queue, keep collecting.
        assert!(matches!(c.decide(2, 100, 30, false), Decision::Wait { .. }));
        // 4 of 32: the peer still has 28 to work on; send now.
        assert_eq!(c.decide(4, 100, 28, false), Decision::Now(Flush::Full));
        // Fixed mode keeps its configured degree (the PGIC baseline).
        let f = Coalescer::new(CoalesceConfig {
            degree: 16,
            ..cfg(Mode::Fixed)
        });
        assert!(matches!(f.decide(4, 100, 28, false), Decision::Wait { .. }));
    }

    #[test]
    fn adaptive_raises_and_lowers() {
        let mut c = Coalescer::new(cfg(Mode::Adaptive));
        flushes(&mut c, 8, Flush::Full, 4, 0);
        assert_eq!((c.degree(), c.timer_us()), (8, 40));
        flushes(&mut c, 24, Flush::Full, 8, 0);
        assert_eq!(c.degree(), 32);
        assert_eq!(c.stats().raises, 4);
        flushes(&mut c, 8, Flush::Timer, 1, 0);
        assert_eq!((c.degree(), c.timer_us()), (16, 100));
        flushes(&mut c, 80, Flush::Timer, 1, 0);
        assert_eq!((c.degree(), c.timer_us()), (1, 5));
        // Small groups (idle flushes) leave it alone.
        flushes(&mut c, 16, Flush::Small, 1, 0);
        assert_eq!((c.degree(), c.timer_us()), (1, 5));
        let mut f = Coalescer::new(cfg(Mode::Fixed));
        flushes(&mut f, 16, Flush::Full, 4, 0);
        assert_eq!(f.degree(), 4);
    }

    #[test]
    fn thick_expiries_lower_the_degree_thin_ones_both() {
        let mut c = Coalescer::new(cfg(Mode::Adaptive));
        flushes(&mut c, 16, Flush::Full, 4, 0);
        assert_eq!((c.degree(), c.timer_us()), (16, 80));
        // Expired groups of 3 PDUs: the wait gathers, the degree is out of
        // reach. The degree halves, the timer stays.
        flushes(&mut c, 8, Flush::Timer, 3, 0);
        assert_eq!((c.degree(), c.timer_us()), (8, 80));
        // Exactly two PDUs per expiry still count as thick.
        flushes(&mut c, 8, Flush::Timer, 2, 0);
        assert_eq!((c.degree(), c.timer_us()), (4, 80));
        // Groups now reach the degree: full groups raise both again.
        flushes(&mut c, 8, Flush::Full, 4, 0);
        assert_eq!((c.degree(), c.timer_us()), (8, 160));
        // One of two and two of two (1.5 on average) is thin: both halve.
        for i in 0..8 {
            c.on_flush(Flush::Timer, 1 + (i % 2), 0);
        }
        assert_eq!((c.degree(), c.timer_us()), (4, 80));
        assert_eq!((c.stats().raises, c.stats().lowers), (3, 3));
        // Thick expiries mixed with as many full groups: neither
        // dominates (full 3, timer 3 of 8), nothing moves.
        for i in 0..8 {
            let why = [Flush::Full, Flush::Timer, Flush::Small][i % 3];
            c.on_flush(why, 3, 0);
        }
        assert_eq!((c.degree(), c.timer_us()), (4, 80));
    }

    #[test]
    fn thin_expiries_on_a_deep_queue_lower_only_the_degree() {
        let mut c = Coalescer::new(cfg(Mode::Adaptive));
        flushes(&mut c, 16, Flush::Full, 4, 0);
        assert_eq!((c.degree(), c.timer_us()), (16, 80));
        // One PDU per expiry, a group every ~200 us, 100 commands
        // outstanding: they take ~20 ms to turn over, far more than 8
        // timers (640 us). The wait stalls nothing and is kept; the degree
        // comes down.
        for _ in 0..8 {
            std::thread::sleep(std::time::Duration::from_micros(200));
            c.on_flush(Flush::Timer, 1, 100);
        }
        assert_eq!((c.degree(), c.timer_us()), (8, 80));
        // Nothing else outstanding: shallow however slow, both halve.
        for _ in 0..8 {
            std::thread::sleep(std::time::Duration::from_micros(200));
            c.on_flush(Flush::Timer, 1, 0);
        }
        assert_eq!((c.degree(), c.timer_us()), (4, 40));
    }

    #[test]
    fn deep_means_many_timers_to_turn_over() {
        // 100 commands, 8 PDUs in 1.6 ms: 20 ms to turn over, over 8 x 80 us.
        assert!(deep_queue(100, 1_600_000, 8, 80));
        // The same PDUs back to back in 16 us: 200 us, under 640 us.
        assert!(!deep_queue(100, 16_000, 8, 80));
        // Exactly 8 timers counts; nothing outstanding never does.
        assert!(deep_queue(1, 80_000, 1, 10));
        assert!(!deep_queue(1, 79_999, 1, 10));
        assert!(!deep_queue(0, u64::MAX / 2, 1, 5));
    }
}

//! Per-reactor counters. Kept in `Cell`s on the reactor (no atomics) and
//! read by a message to the reactor ([`crate::RuntimeHandle::stats`]).

use std::cell::Cell;

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) loops: Cell<u64>,
    pub(crate) busy_ticks: Cell<u64>,
    pub(crate) idle_ticks: Cell<u64>,
    pub(crate) messages: Cell<u64>,
    pub(crate) sleeps: Cell<u64>,
    pub(crate) wakeups: Cell<u64>,
    /// Adaptive mode's sleeps taken at once because other threads wanted
    /// the CPUs (`spin::Contention`).
    pub(crate) contended: Cell<u64>,
    /// Adaptive mode's sleeps taken at once because the clients were deep
    /// (`depth::DepthJudge`).
    pub(crate) batched: Cell<u64>,
}

/// A snapshot of one reactor's counters.
#[derive(Clone, Debug, Default)]
pub struct ReactorStats {
    pub reactor: usize,
    pub core: usize,
    pub loops: u64,
    pub busy_ns: u64,
    pub idle_ns: u64,
    pub messages: u64,
    pub sleeps: u64,
    pub wakeups: u64,
    /// Adaptive mode: sleeps taken at once because other threads wanted
    /// the reactor's CPUs (no spin).
    pub sleeps_contended: u64,
    /// Adaptive mode: sleeps taken at once because the reactor's clients
    /// kept many requests in flight (no spin).
    pub sleeps_batched: u64,
    /// Adaptive mode: timed naps taken, and those that work cut short.
    pub naps: u64,
    pub naps_early: u64,
    pub tasks: usize,
    pub tasks_polled: u64,
    pub submits: u64,
    pub completions: u64,
    pub ops_in_flight: u64,
    /// Timer heap entries: armed timers and cancelled ones not yet purged
    /// (bounded by about twice the armed ones).
    pub timers: usize,
    pub pollers: Vec<(String, bool)>,
    pub poll_mode: String,
}

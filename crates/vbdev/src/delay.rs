//! The delay bdev (`bdev_delay_create` / `_delete`,
//! `bdev_delay_update_latency`): reads and writes reach the base after a
//! set latency (one I/O in 100 after the p99 latency instead of the
//! average), held on the reactor by a timed poller, no thread. Other
//! kinds pass through at once.
//!
//! Each channel keeps four FIFO queues (avg/p99 × read/write): within one
//! queue every I/O waits the same latency, so the head is always the next
//! due. The latencies are shared by every reactor (relaxed loads per I/O)
//! so `bdev_delay_update_latency` applies to new I/O at once.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use ustor_bdev::modules::parse_params;
use ustor_bdev::{
    Bdev, BdevChannel, BdevEntry, BdevError, BdevInfo, BdevModule, ControlError, Desc, IoChannel,
    IoHandle, IoType, Registry,
};
use ustor_runtime::{ticks, PollStatus, PollerId};

use crate::base;

/// `bdev_delay_create`'s parameters (latencies in microseconds).
#[derive(Deserialize, Serialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct DelayParams {
    pub base_bdev_name: String,
    pub name: String,
    pub avg_read_latency: u64,
    pub p99_read_latency: u64,
    pub avg_write_latency: u64,
    pub p99_write_latency: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<uuid::Uuid>,
}

/// The four latencies in microseconds, in queue order.
struct Latencies([AtomicU64; 4]);

const NAMES: [&str; 4] = ["avg_read", "p99_read", "avg_write", "p99_write"];

struct DelayBdev {
    info: BdevInfo,
    base: [Desc; 1],
    lat: Arc<Latencies>,
    params: DelayParams,
    /// How often channels look at their queues.
    period: Duration,
}

/// What the channel and its poller share.
struct Queues {
    base: IoChannel,
    q: [RefCell<VecDeque<(u64, IoHandle)>>; 4],
}

impl Queues {
    fn pass(&self, io: IoHandle) {
        let d = io.desc();
        let kids = io.into_children();
        let off = if d.kind == IoType::Reset {
            0
        } else {
            d.offset_blocks
        };
        kids.submit(&self.base, d.kind, off, d.num_blocks, 0);
    }

    /// Sends every queued I/O whose time has come.
    fn poll(&self) -> PollStatus {
        let now = ticks::now();
        let mut busy = PollStatus::Idle;
        for q in &self.q {
            loop {
                let io = {
                    let mut q = q.borrow_mut();
                    match q.front() {
                        Some((due, _)) if *due <= now => q.pop_front().map(|(_, io)| io),
                        _ => None,
                    }
                };
                let Some(io) = io else { break };
                busy = PollStatus::Busy;
                self.pass(io);
            }
        }
        busy
    }
}

struct DelayChannel {
    qs: Rc<Queues>,
    lat: Arc<Latencies>,
    /// One in 100 I/Os takes the p99 latency.
    count: Cell<u32>,
    /// Ticks per microsecond times 1024, for the conversion per I/O.
    tick_per_us_1k: u64,
    poller: Option<PollerId>,
}

impl BdevChannel for DelayChannel {
    fn submit(&self, io: IoHandle) {
        let kind = io.desc().kind;
        let w = match kind {
            IoType::Read => 0,
            IoType::Write => 2,
            _ => return self.qs.pass(io),
        };
        let c = self.count.get().wrapping_add(1);
        self.count.set(c);
        let i = w + c.is_multiple_of(100) as usize;
        let us = self.lat.0[i].load(Ordering::Relaxed);
        if us == 0 {
            return self.qs.pass(io);
        }
        let due = ticks::now() + ((us * self.tick_per_us_1k) >> 10);
        self.qs.q[i].borrow_mut().push_back((due, io));
    }
    fn outstanding(&self) -> usize {
        self.qs.q.iter().map(|q| q.borrow().len()).sum()
    }
}

impl Drop for DelayChannel {
    fn drop(&mut self) {
        if let Some(p) = self.poller {
            ustor_runtime::unregister_poller(p);
        }
    }
}

impl Bdev for DelayBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, t: IoType) -> bool {
        base::all_support(&self.base, t)
    }
    fn fua_supported(&self, t: IoType) -> bool {
        base::all_fua(&self.base, t)
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        let qs = Rc::new(Queues {
            base: self.base[0].channel()?,
            q: std::array::from_fn(|_| RefCell::new(VecDeque::with_capacity(256))),
        });
        let poller = ustor_runtime::is_reactor_thread().then(|| {
            let qs = qs.clone();
            ustor_runtime::register_timed_poller("delay", self.period, move || qs.poll())
        });
        Ok(Box::new(DelayChannel {
            qs,
            lat: self.lat.clone(),
            count: Cell::new(0),
            tick_per_us_1k: (ticks::hz() as u128 * 1024 / 1_000_000) as u64,
            poller,
        }))
    }
    fn config_json(&self) -> Value {
        let mut p = serde_json::to_value(&self.params).unwrap_or(Value::Null);
        for (i, k) in NAMES.iter().enumerate() {
            p[format!("{k}_latency")] = json!(self.lat.0[i].load(Ordering::Relaxed));
        }
        json!({"method": "bdev_delay_create", "params": p})
    }
    fn driver_info(&self) -> Value {
        let mut v = json!({"name": self.info.name, "base_bdev_name": self.base[0].name()});
        for (i, k) in NAMES.iter().enumerate() {
            v[format!("{k}_latency")] = json!(self.lat.0[i].load(Ordering::Relaxed));
        }
        json!({ "delay": v })
    }
}

/// Creates delay bdev `p.name` over `p.base_bdev_name`.
pub fn create(
    reg: &Registry,
    weak: &Weak<Registry>,
    p: DelayParams,
) -> Result<Arc<BdevEntry>, ControlError> {
    let l = [
        p.avg_read_latency,
        p.p99_read_latency,
        p.avg_write_latency,
        p.p99_write_latency,
    ];
    for (i, name) in ["avg_read_latency", "avg_write_latency"].iter().enumerate() {
        if l[2 * i + 1] < l[2 * i] {
            return Err(ControlError::invalid(
                name,
                "the p99 latency is less than the average",
            ));
        }
    }
    base::check_free(reg, &p.name)?;
    let base = [base::open(
        reg,
        weak,
        &p.base_bdev_name,
        &p.name,
        base::OnResize::Follow,
    )?];
    let n = base[0].num_blocks();
    let info = base::info(&p.name, p.uuid, "delay", "delay", &base, n)?;
    // A sixteenth of the shortest latency, within 2..=100 µs.
    let min = l.iter().copied().filter(|v| *v > 0).min().unwrap_or(1000);
    let period = Duration::from_micros((min / 16).clamp(2, 100));
    let lat = Arc::new(Latencies(l.map(AtomicU64::new)));
    let e = reg.register(Arc::new(DelayBdev {
        info,
        base,
        lat: lat.clone(),
        params: p,
        period,
    }))?;
    LIVE.add(&e, &lat);
    Ok(e)
}

/// Live delay bdevs' latencies, for [`update_latency`].
static LIVE: base::Live<Latencies> = base::Live::new();

/// `bdev_delay_update_latency`'s parameters.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateParams {
    pub delay_bdev_name: String,
    pub latency_type: String,
    pub latency_us: u64,
}

/// Sets one latency of a delay bdev; new I/O uses it at once.
pub fn update_latency(reg: &Registry, p: UpdateParams) -> Result<(), ControlError> {
    let i = NAMES
        .iter()
        .position(|n| *n == p.latency_type)
        .ok_or_else(|| {
            ControlError::invalid(
                "latency_type",
                format!("`{}` is not one of {}", p.latency_type, NAMES.join(", ")),
            )
        })?;
    let lat = LIVE.find(reg, &p.delay_bdev_name, "delay")?;
    lat.0[i].store(p.latency_us, Ordering::Relaxed);
    Ok(())
}

/// The delay module.
pub struct DelayModule(pub Weak<Registry>);

impl BdevModule for DelayModule {
    fn name(&self) -> &'static str {
        "delay"
    }
    fn create(&self, reg: &Registry, params: Value) -> Result<Arc<BdevEntry>, ControlError> {
        create(reg, &self.0, parse_params(params)?)
    }
}

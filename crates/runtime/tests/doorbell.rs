//! `Doorbell` on real reactors: a burst of rings costs one message, a ring
//! after the consumer disarmed sends again, and a ring that cannot be sent
//! (inbox full) is not lost: the bell says so and the consumer's untimed
//! poller, woken by `notify` even from an interrupt-mode sleep, drains.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use ustor_runtime::{Doorbell, PollMode, PollStatus, Runtime, RuntimeConfig};

fn rt(mode: PollMode) -> Runtime {
    let cfg = RuntimeConfig {
        cores: vec![0],
        pin: false,
        poll_mode: mode,
        inbox_capacity: 16,
        bufs: ustor_runtime::BufPoolConfig {
            mem_bytes: 1 << 20,
            classes: vec![4096],
        },
        ..Default::default()
    };
    Runtime::start(cfg).expect("runtime starts")
}

/// Holds reactor 0 inside a message until the returned sender is dropped
/// or sent to; returns once the reactor is inside it.
fn block_reactor(r: &Runtime) -> mpsc::Sender<()> {
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (in_tx, in_rx) = mpsc::channel::<()>();
    r.handle()
        .send(0, move || {
            in_tx.send(()).unwrap();
            let _ = go_rx.recv();
        })
        .unwrap();
    in_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    go_tx
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < Duration::from_secs(10), "timed out: {what}");
        std::thread::yield_now();
    }
}

struct Bell {
    bell: Doorbell,
    drains: AtomicU64,
}

fn ring(b: &Arc<Bell>) {
    let b2 = b.clone();
    b.bell.ring(move || {
        b2.bell.disarm();
        b2.drains.fetch_add(1, Ordering::SeqCst);
    });
}

#[test]
fn a_burst_costs_one_message_and_a_ring_after_disarm_sends_again() {
    let r = rt(PollMode::Adaptive);
    let b = Arc::new(Bell {
        bell: Doorbell::new(r.handle(), 0),
        drains: AtomicU64::new(0),
    });
    let go = block_reactor(&r);
    for _ in 0..1000 {
        ring(&b);
    }
    drop(go);
    // `call` runs after every message queued before it (one FIFO inbox).
    r.handle().call(0, || ()).unwrap();
    assert_eq!(b.drains.load(Ordering::SeqCst), 1, "1000 rings, one drain");
    ring(&b);
    r.handle().call(0, || ()).unwrap();
    assert_eq!(
        b.drains.load(Ordering::SeqCst),
        2,
        "disarmed bell rings again"
    );
    assert!(!b.bell.take_lost(), "nothing was lost");
}

#[test]
fn a_ring_into_a_full_inbox_is_reported_lost_once() {
    let r = rt(PollMode::Adaptive);
    let b = Arc::new(Bell {
        bell: Doorbell::new(r.handle(), 0),
        drains: AtomicU64::new(0),
    });
    let go = block_reactor(&r);
    let mut queued = 0;
    while r.handle().send(0, || ()).is_ok() {
        queued += 1;
        assert!(queued <= 4096, "the inbox never filled");
    }
    ring(&b);
    assert!(
        b.bell.take_lost(),
        "a doorbell that could not be sent is lost"
    );
    assert!(!b.bell.take_lost(), "lost is reported once");
    // The bell was left disarmed, so the next ring tries again (and fails
    // again while the inbox is full).
    ring(&b);
    assert!(b.bell.take_lost());
    drop(go);
    // The reactor drains its inbox; until then a call may find it full.
    wait_for("inbox has room", || r.handle().call(0, || ()).is_ok());
    assert_eq!(
        b.drains.load(Ordering::SeqCst),
        0,
        "no drain message was queued"
    );
    ring(&b);
    r.handle().call(0, || ()).unwrap();
    assert_eq!(
        b.drains.load(Ordering::SeqCst),
        1,
        "the inbox has room again"
    );
}

/// The consumer side: an untimed poller looks at `take_lost`. A reactor in
/// interrupt mode with no timers sleeps until something wakes it, so this
/// passes only if `notify` wakes a sleeping reactor.
#[test]
fn notify_wakes_a_sleeping_reactor_for_its_untimed_poller() {
    let r = rt(PollMode::Interrupt);
    let flag = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(AtomicU64::new(0));
    let passes = Arc::new(AtomicU64::new(0));
    let (f2, s2, p2) = (flag.clone(), seen.clone(), passes.clone());
    r.handle()
        .call(0, move || {
            ustor_runtime::register_poller("doorbell-test", move || {
                p2.fetch_add(1, Ordering::SeqCst);
                if f2.swap(false, Ordering::SeqCst) {
                    s2.fetch_add(1, Ordering::SeqCst);
                    return PollStatus::Busy;
                }
                PollStatus::Idle
            });
        })
        .unwrap();
    for round in 1..=3 {
        // Asleep: the poller has stopped running (an awake reactor runs it
        // every pass). Without this the flag could be seen by a pass that
        // was running anyway and a broken `notify` would go unnoticed.
        let (mut last, mut since) = (passes.load(Ordering::SeqCst), Instant::now());
        wait_for("reactor asleep", || {
            let now = passes.load(Ordering::SeqCst);
            if now != last {
                (last, since) = (now, Instant::now());
            }
            since.elapsed() > Duration::from_millis(50)
        });
        flag.store(true, Ordering::SeqCst);
        r.handle().notify(0);
        wait_for("poller saw the flag", || {
            seen.load(Ordering::SeqCst) == round
        });
    }
}

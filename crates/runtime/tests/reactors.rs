//! Reactor behaviour on real threads: messages, for_each, pollers, timers,
//! sleep/wake in every poll mode, idle CPU, io_uring ops and buffer pools.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use ustor_runtime::{ops, IoBuf, PollMode, PollStatus, Runtime, RuntimeConfig};

fn rt(cores: usize, mode: PollMode) -> Runtime {
    let cfg = RuntimeConfig {
        cores: (0..cores).collect(),
        pin: false,
        poll_mode: mode,
        bufs: ustor_runtime::BufPoolConfig {
            mem_bytes: 8 << 20,
            classes: vec![4096, 65536],
        },
        ..Default::default()
    };
    Runtime::start(cfg).expect("runtime starts")
}

#[test]
fn messages_reach_each_reactor_in_every_mode() {
    for mode in [PollMode::Poll, PollMode::Interrupt, PollMode::Adaptive] {
        let r = rt(2, mode);
        let h = r.handle();
        for i in 0..2 {
            let id = h.call(i, ustor_runtime::reactor_id).unwrap();
            assert_eq!(id, i, "mode {mode}");
        }
        // A ping-pong between reactors: each hop is a message.
        let (tx, rx) = mpsc::channel();
        let h2 = h.clone();
        h.send(0, move || {
            let h3 = h2.clone();
            h2.send(1, move || {
                h3.send(0, move || tx.send(ustor_runtime::reactor_id()).unwrap())
                    .unwrap();
            })
            .unwrap();
        })
        .unwrap();
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)).unwrap(),
            0,
            "mode {mode}"
        );
    }
}

#[test]
fn for_each_reactor_visits_all_then_completes() {
    let r = rt(2, PollMode::Adaptive);
    let h = r.handle();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let (tx, rx) = mpsc::channel();
    let s3 = seen.clone();
    h.for_each_reactor(
        Arc::new(move || s2.lock().unwrap().push(ustor_runtime::reactor_id())),
        move || tx.send(s3.lock().unwrap().clone()).unwrap(),
    )
    .unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), vec![0, 1]);
    assert_eq!(h.call_all(|i| i * 10).unwrap(), vec![0, 10]);
}

#[test]
fn pollers_and_timed_pollers_run() {
    let r = rt(1, PollMode::Adaptive);
    let h = r.handle();
    let active = Arc::new(AtomicU64::new(0));
    let stamps = Arc::new(std::sync::Mutex::new(Vec::<Instant>::new()));
    let (a, t) = (active.clone(), stamps.clone());
    let ids = h
        .call(0, move || {
            let p1 = ustor_runtime::register_poller("count", move || {
                a.fetch_add(1, Ordering::Relaxed);
                PollStatus::Idle
            });
            let p2 = ustor_runtime::register_timed_poller(
                "tick",
                Duration::from_millis(10),
                move || {
                    t.lock().unwrap().push(Instant::now());
                    PollStatus::Busy
                },
            );
            (p1, p2)
        })
        .unwrap();
    // How soon ten ticks arrive depends on the machine's load; that they
    // arrive, and never closer together than the period, does not.
    testkit::wait_until(
        "ten ticks of the 10 ms poller",
        Duration::from_secs(10),
        || stamps.lock().unwrap().len() >= 10,
    );
    assert!(active.load(Ordering::Relaxed) > 0);
    {
        let s = stamps.lock().unwrap();
        for w in s.windows(2) {
            // 0.5 ms of slack: the reactor's tick clock and Instant differ.
            assert!(
                w[1] - w[0] >= Duration::from_micros(9_500),
                "10 ms poller ran again after {:?}",
                w[1] - w[0]
            );
        }
    }
    assert!(h
        .call(0, move || ustor_runtime::unregister_poller(ids.1))
        .unwrap());
    let before = stamps.lock().unwrap().len();
    // A workload window, not a wait: three periods in which it must not run.
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(
        stamps.lock().unwrap().len(),
        before,
        "unregistered poller still runs"
    );
}

#[test]
fn timers_wake_sleeping_tasks_in_every_mode() {
    for mode in [PollMode::Poll, PollMode::Interrupt, PollMode::Adaptive] {
        let r = rt(1, mode);
        let h = r.handle();
        let t0 = Instant::now();
        let order = h
            .block_on(0, || async {
                let log = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
                let mut js = Vec::new();
                for (i, ms) in [(0, 30u64), (1, 10), (2, 20)] {
                    let l = log.clone();
                    js.push(ustor_runtime::spawn(async move {
                        ustor_runtime::sleep(Duration::from_millis(ms)).await;
                        l.borrow_mut().push(i);
                    }));
                }
                for j in js {
                    j.await;
                }
                let v = log.borrow().clone();
                v
            })
            .unwrap();
        let el = t0.elapsed();
        assert_eq!(order, vec![1, 2, 0], "mode {mode}");
        assert!(
            el >= Duration::from_millis(30) && el < Duration::from_millis(500),
            "mode {mode}: {el:?}"
        );
    }
}

/// CPU time (user+sys, clock ticks) of the given threads of this process.
fn cpu_ticks(tids: &[i32]) -> u64 {
    tids.iter()
        .map(|t| {
            let s = std::fs::read_to_string(format!("/proc/self/task/{t}/stat")).unwrap();
            let rest = &s[s.rfind(')').unwrap() + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
        })
        .sum()
}

#[test]
fn idle_adaptive_reactor_uses_under_one_percent() {
    let r = rt(2, PollMode::Adaptive);
    let tids = r.thread_ids();
    assert_eq!(tids.len(), 2);
    let h = r.handle();
    testkit::wait_until(
        "both idle reactors to go to sleep once",
        Duration::from_secs(10),
        || h.stats().unwrap().iter().all(|s| s.sleeps > 0),
    );
    let c0 = cpu_ticks(&tids);
    let t0 = Instant::now();
    // The workload: 5 s of idling whose CPU time is measured.
    std::thread::sleep(Duration::from_secs(5));
    let used = cpu_ticks(&tids) - c0;
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let pct = used as f64 / hz / t0.elapsed().as_secs_f64() * 100.0 / 2.0;
    assert!(
        pct < 1.0,
        "idle adaptive reactors used {pct:.2}% of a core each"
    );
    let st = r.handle().stats().unwrap();
    assert!(
        st.iter().all(|s| s.sleeps > 0),
        "reactors never slept: {st:?}"
    );
}

#[test]
fn sleeps_are_counted_without_a_message() {
    let r = rt(2, PollMode::Adaptive);
    let h = r.handle();
    for i in 0..2 {
        let s0 = h.sleeps(i).unwrap();
        testkit::wait_until(
            format_args!("reactor {i} to go to sleep twice more"),
            Duration::from_secs(10),
            || {
                h.wake(i);
                h.sleeps(i).unwrap() >= s0 + 2
            },
        );
    }
    assert_eq!(h.sleeps(2), None);
    let st = h.stats().unwrap();
    assert!(st.iter().all(|s| s.sleeps >= 2), "{st:?}");
    let p = rt(1, PollMode::Poll);
    assert_eq!(p.handle().sleeps(0), Some(0));
}

#[test]
fn poll_mode_spins_and_counts_loops() {
    let r = rt(1, PollMode::Poll);
    let h = r.handle();
    testkit::wait_until(
        "the polling reactor to run 1000 loops",
        Duration::from_secs(10),
        || h.stats().unwrap()[0].loops > 1000,
    );
    let st = h.stats().unwrap();
    assert!(
        st[0].loops > 1000,
        "poll mode ran only {} loops",
        st[0].loops
    );
    assert_eq!(st[0].sleeps, 0);
}

#[test]
fn file_io_and_buffer_pool_round_trip() {
    let dir = std::env::temp_dir().join(format!("ustor-rt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("f");
    std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
    let r = rt(1, PollMode::Adaptive);
    let p = path.clone();
    let ok = r
        .handle()
        .block_on(0, move || async move {
            use std::os::fd::AsRawFd;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&p)
                .unwrap();
            let fd = f.as_raw_fd();
            let mut w = IoBuf::try_alloc(4096).expect("pool buffer");
            assert!(w.is_pooled());
            for (i, b) in w.iter_mut().enumerate() {
                *b = (i * 7) as u8;
            }
            let (res, w) = ops::write_at(fd, w, 8192).await;
            assert_eq!(res.unwrap(), 4096);
            let rbuf = IoBuf::alloc(4096).await;
            let (res, rbuf) = ops::read_at(fd, rbuf, 8192).await;
            assert_eq!(res.unwrap(), 4096);
            let (res, _) = ops::fsync(fd, true).await;
            assert_eq!(res, 0);
            let (res, _) = ops::nop().await;
            assert_eq!(res, 0);
            rbuf[..] == w[..]
        })
        .unwrap();
    assert!(ok);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn pool_exhaustion_waits_instead_of_failing() {
    let r = rt(1, PollMode::Adaptive);
    let got = r
        .handle()
        .block_on(0, || async {
            // Drain the 64 KiB class and the 4 KiB class (which a 64 KiB
            // request cannot use), then free one buffer from a timer task.
            let mut held = Vec::new();
            while let Some(b) = IoBuf::try_alloc(65536) {
                held.push(b);
            }
            assert!(IoBuf::try_alloc(65536).is_none());
            let last = held.pop().unwrap();
            ustor_runtime::spawn(async move {
                ustor_runtime::sleep(Duration::from_millis(20)).await;
                drop(last);
            });
            let t0 = Instant::now();
            let b = IoBuf::alloc(65536).await;
            (b.len(), t0.elapsed())
        })
        .unwrap();
    assert_eq!(got.0, 65536);
    assert!(
        got.1 >= Duration::from_millis(15),
        "alloc did not wait: {:?}",
        got.1
    );
}

#[test]
fn dropped_op_keeps_buffer_until_completion() {
    let r = rt(1, PollMode::Adaptive);
    let ok = r
        .handle()
        .block_on(0, || async {
            use std::os::fd::AsRawFd;
            let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
            let buf = IoBuf::try_alloc(4096).unwrap();
            // A recv that never completes, polled once, then dropped.
            let mut op = Box::pin(ops::recv(a.as_raw_fd(), buf, 0, 4096));
            let w = futures_noop_waker();
            let mut cx = std::task::Context::from_waker(&w);
            assert!(op.as_mut().poll(&mut cx).is_pending());
            drop(op);
            // Closing the peer completes the orphaned recv; the reactor then
            // returns the buffer to the pool.
            drop(_b);
            let all_free = || {
                let (classes, _) = ustor_runtime::buf::pool_usage().unwrap();
                classes.iter().all(|(_, free, total)| free == total)
            };
            testkit::wait_until_async(
                "the dropped recv's buffer to come back to the pool",
                Duration::from_secs(5),
                all_free,
                ustor_runtime::sleep,
            )
            .await;
            all_free()
        })
        .unwrap();
    assert!(ok, "buffer of a dropped op never came back");
}

fn futures_noop_waker() -> std::task::Waker {
    std::task::Waker::noop().clone()
}

use std::future::Future;

/// A socket ping-pong with a thread, in each mode that sleeps: the echo's
/// recv and send are queued by a pass of task work alone, which an
/// interrupt or contended adaptive reactor submits with its sleep and an
/// adaptive one with its nap. A wake-up lost there would stall a round
/// (the thread's read times out). Every 16th round the echo first sleeps
/// on a timer, whose deadline must bound the same folded sleep.
#[test]
fn round_trips_wake_a_sleeping_reactor_in_every_mode() {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    for mode in [PollMode::Interrupt, PollMode::Adaptive] {
        let r = rt(1, mode);
        let (mut mine, theirs) = UnixStream::pair().unwrap();
        mine.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        const ROUNDS: usize = 1000;
        let (tx, rx) = mpsc::channel();
        r.handle()
            .spawn_on(0, move || async move {
                let fd = theirs.as_raw_fd();
                let mut buf = IoBuf::alloc(4096).await;
                for round in 0..ROUNDS {
                    let (res, b) = ops::recv(fd, buf, 0, 8).await;
                    assert_eq!(res.unwrap(), 8, "round {round}");
                    if round % 16 == 15 {
                        ustor_runtime::sleep(Duration::from_micros(200)).await;
                    }
                    let (res, b) = ops::send(fd, b, 0, 8).await;
                    assert_eq!(res.unwrap(), 8);
                    buf = b;
                }
                tx.send(()).unwrap();
            })
            .unwrap();
        let mut got = [0u8; 8];
        for round in 0..ROUNDS as u64 {
            mine.write_all(&round.to_le_bytes()).unwrap();
            mine.read_exact(&mut got)
                .unwrap_or_else(|e| panic!("mode {mode}, round {round}: {e}"));
            assert_eq!(u64::from_le_bytes(got), round, "mode {mode}");
        }
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
    }
}

/// Timeouts that end before their deadline (a request answered in time)
/// give their timer back: 50,000 of them leave the heap at the purge bound,
/// not 50,000 entries waiting a minute each, and the timers kept armed
/// through the purges still fire.
#[test]
fn dropped_timeouts_give_their_timers_back() {
    use std::future::Future;
    use std::pin::pin;
    use std::task::Poll;
    let r = rt(1, PollMode::Adaptive);
    let h = r.handle();
    let (tx, rx) = mpsc::channel();
    h.spawn_on(0, move || async move {
        let t0 = Instant::now();
        let kept = [300u64, 100, 200].map(|ms| ustor_runtime::sleep(Duration::from_millis(ms)));
        let mut kept = kept.map(Box::pin);
        // Armed before the churn (a first poll arms a Sleep).
        std::future::poll_fn(|cx| {
            for k in kept.iter_mut() {
                assert!(k.as_mut().poll(cx).is_pending());
            }
            Poll::Ready(())
        })
        .await;
        tx.send(None).unwrap();
        for k in kept {
            k.await;
        }
        tx.send(Some(t0.elapsed())).unwrap();
    })
    .unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), None);
    h.block_on(0, || async {
        for _ in 0..50_000 {
            let mut s = pin!(ustor_runtime::sleep(Duration::from_secs(60)));
            std::future::poll_fn(|cx| {
                assert!(s.as_mut().poll(cx).is_pending());
                Poll::Ready(())
            })
            .await;
        }
    })
    .unwrap();
    let st = h.stats().unwrap();
    assert!(st[0].timers <= 3 + 65, "{} timer entries", st[0].timers);
    let el = rx.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
    assert!(el >= Duration::from_millis(300), "{el:?}");
    testkit::wait_until("every timer entry gone", Duration::from_secs(5), || {
        h.stats().unwrap()[0].timers == 0
    });
}

/// `yield_while_busy` lets every other ready task run first (and run on:
/// one that yields stays ready), at most `max` times; `yield_now` once.
#[test]
fn yield_while_busy_waits_for_the_other_ready_tasks() {
    let r = rt(1, PollMode::Adaptive);
    let h = r.handle();
    for (max, want) in [(8, "a0 b1 b2 b3 a1"), (1, "a0 b1 a1 b2 b3")] {
        let (tx, rx) = mpsc::channel();
        h.send(0, move || {
            let log = std::rc::Rc::new(std::cell::RefCell::new(Vec::<&str>::new()));
            let (la, lb) = (log.clone(), log.clone());
            ustor_runtime::spawn(async move {
                la.borrow_mut().push("a0");
                ustor_runtime::yield_while_busy(max).await;
                la.borrow_mut().push("a1");
            });
            let b = ustor_runtime::spawn(async move {
                for s in ["b1", "b2", "b3"] {
                    lb.borrow_mut().push(s);
                    ustor_runtime::yield_now().await;
                }
            });
            ustor_runtime::spawn(async move {
                b.await;
                // A ends before the log is read (it is ready or done).
                ustor_runtime::yield_while_busy(8).await;
                tx.send(log.borrow().join(" ")).unwrap();
            });
        })
        .unwrap();
        let got = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(got, want, "max {max}");
    }
}

/// A send to a socket with room completes inside the enter that submits
/// it, so a wait folded into that enter would return at once: a pass that
/// queued a send submits and reaps it without waiting. A task that sends
/// and sends again therefore never makes the reactor sleep, even in
/// interrupt mode (each send used to cost one such instant sleep).
#[test]
fn a_pass_that_queues_a_send_does_not_fold_a_wait_into_it() {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    const SENDS: usize = 100;
    let r = rt(1, PollMode::Interrupt);
    let h = r.handle();
    let (mut mine, theirs) = UnixStream::pair().unwrap();
    let (tx, rx) = mpsc::channel();
    r.handle()
        .spawn_on(0, move || async move {
            let fd = theirs.as_raw_fd();
            let mut buf = IoBuf::alloc(4096).await;
            let before = h.sleeps(0).unwrap();
            for _ in 0..SENDS {
                let (res, b) = ops::send(fd, buf, 0, 8).await;
                assert_eq!(res.unwrap(), 8);
                buf = b;
            }
            tx.send(h.sleeps(0).unwrap() - before).unwrap();
            drop(theirs);
        })
        .unwrap();
    let slept = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(slept, 0, "sleeps while {SENDS} sends went out");
    let mut got = Vec::new();
    mine.read_to_end(&mut got).unwrap();
    assert_eq!(got.len(), SENDS * 8);
}

/// Adaptive mode's batch sleep: a ping-pong whose requests are reported
/// deep (`note_depth`) makes the reactor sleep at once between them
/// (counted as batched, whether or not other threads want the CPUs);
/// reported shallow, it stops within one window. Every round trip
/// completes either way (no lost wake-up).
#[test]
fn deep_clients_make_an_adaptive_reactor_sleep_at_once() {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    const ROUNDS: u64 = 600;
    let r = rt(1, PollMode::Adaptive);
    let h = r.handle();
    let (mut mine, theirs) = UnixStream::pair().unwrap();
    mine.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let depth = Arc::new(AtomicU64::new(32));
    let d = depth.clone();
    h.spawn_on(0, move || async move {
        let fd = theirs.as_raw_fd();
        let mut buf = IoBuf::alloc(4096).await;
        loop {
            let (res, b) = ops::recv(fd, buf, 0, 8).await;
            if res.unwrap_or(0) != 8 {
                return;
            }
            ustor_runtime::note_depth(d.load(Ordering::Relaxed) as u32);
            let (res, b) = ops::send(fd, b, 0, 8).await;
            assert_eq!(res.unwrap(), 8);
            buf = b;
        }
    })
    .unwrap();
    let mut got = [0u8; 8];
    let mut phase = |label: &str| {
        let s0 = h.stats().unwrap()[0].clone();
        for round in 0..ROUNDS {
            mine.write_all(&round.to_le_bytes()).unwrap();
            mine.read_exact(&mut got)
                .unwrap_or_else(|e| panic!("{label}, round {round}: {e}"));
            assert_eq!(u64::from_le_bytes(got), round, "{label}");
        }
        let s1 = h.stats().unwrap()[0].clone();
        s1.sleeps_batched - s0.sleeps_batched
    };
    let batched = phase("deep");
    assert!(
        batched >= (ROUNDS - 64) / 2,
        "deep: {batched} batched sleeps in {ROUNDS} rounds"
    );
    depth.store(1, Ordering::Relaxed);
    let _ = phase("turning shallow");
    let batched = phase("shallow");
    assert_eq!(batched, 0, "shallow clients still batched");
}

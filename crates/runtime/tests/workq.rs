//! `WorkQueue`: jobs that complete inline run in one worker (one wake per
//! batch, not per job); jobs that wait get a worker each, all started in
//! the same pass; the pool never grows past its maximum; closing ends
//! every worker.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::mpsc;
use std::time::Duration;

use ustor_runtime::{Runtime, WorkQueue};

mod common;

fn rt() -> Runtime {
    common::one_reactor(8 << 20)
}

/// A job: its number, and whether it waits (on a timer) before it ends.
struct Job(u32, bool);

struct Ctx {
    q: WorkQueue<Job>,
    log: RefCell<Vec<String>>,
    exits: Cell<usize>,
}

fn spawn_worker(c: Rc<Ctx>, id: usize) {
    ustor_runtime::spawn(worker(c, id));
}

async fn worker(c: Rc<Ctx>, id: usize) {
    loop {
        let Some(Job(n, waits)) = c.q.next(id).await else {
            break;
        };
        let body = std::pin::pin!(async {
            c.log.borrow_mut().push(format!("s{n}"));
            if waits {
                ustor_runtime::sleep(Duration::from_millis(2)).await;
            }
            c.log.borrow_mut().push(format!("e{n}"));
        });
        c.q.run(id, body, |i| spawn_worker(c.clone(), i)).await;
    }
    c.exits.set(c.exits.get() + 1);
}

/// Runs `f` on the reactor with a fresh queue of `max` workers (`None`:
/// unbounded); returns
/// what it sends back once `done` says the jobs are over.
fn on_reactor<T: Send + 'static>(
    max: Option<usize>,
    f: impl FnOnce(Rc<Ctx>, mpsc::Sender<T>) + Send + 'static,
) -> T {
    let r = rt();
    let (tx, rx) = mpsc::channel();
    r.handle()
        .send(0, move || {
            let c = Rc::new(Ctx {
                q: max.map_or_else(|| WorkQueue::unbounded(2), WorkQueue::new),
                log: RefCell::new(Vec::new()),
                exits: Cell::new(0),
            });
            f(c, tx)
        })
        .unwrap();
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the jobs end")
}

fn push_all(c: &Rc<Ctx>, jobs: impl IntoIterator<Item = Job>) {
    for j in jobs {
        let c2 = c.clone();
        c.q.push(j, |i| spawn_worker(c2, i));
    }
}

/// Waits (yielding) until `n` jobs have ended.
async fn ended(c: &Ctx, n: usize) {
    while c.log.borrow().iter().filter(|s| s.starts_with('e')).count() < n {
        ustor_runtime::yield_now().await;
    }
}

#[test]
fn inline_jobs_run_in_one_worker() {
    let (spawned, log) = on_reactor(Some(32), |c, tx| {
        push_all(&c, (0..32).map(|n| Job(n, false)));
        ustor_runtime::spawn(async move {
            ended(&c, 32).await;
            // A second batch reuses the parked worker.
            push_all(&c, (32..64).map(|n| Job(n, false)));
            ended(&c, 64).await;
            tx.send((c.q.spawned(), c.log.borrow().join(" "))).unwrap();
        });
    });
    assert_eq!(spawned, 1, "one worker ran every inline job");
    let want: Vec<String> = (0..64).map(|n| format!("s{n} e{n}")).collect();
    assert_eq!(log, want.join(" "), "in order, each to its end");
}

#[test]
fn waiting_jobs_get_a_worker_each_started_together() {
    let (spawned, log) = on_reactor(Some(32), |c, tx| {
        push_all(&c, (0..8).map(|n| Job(n, true)));
        ustor_runtime::spawn(async move {
            ended(&c, 8).await;
            tx.send((c.q.spawned(), c.log.borrow().clone())).unwrap();
        });
    });
    assert_eq!(spawned, 8, "one worker per job in flight");
    let first_end = log.iter().position(|s| s.starts_with('e')).unwrap();
    assert_eq!(first_end, 8, "every job started before any ended: {log:?}");
}

#[test]
fn the_pool_stays_within_its_maximum_and_drains() {
    let (spawned, ends) = on_reactor(Some(3), |c, tx| {
        push_all(&c, (0..10).map(|n| Job(n, n % 2 == 0)));
        ustor_runtime::spawn(async move {
            ended(&c, 10).await;
            let ends = c.log.borrow().iter().filter(|s| s.starts_with('e')).count();
            tx.send((c.q.spawned(), ends)).unwrap();
        });
    });
    assert_eq!(spawned, 3);
    assert_eq!(ends, 10);
}

#[test]
fn closing_ends_every_worker() {
    let (spawned, exits) = on_reactor(Some(8), |c, tx| {
        push_all(&c, (0..4).map(|n| Job(n, true)));
        ustor_runtime::spawn(async move {
            ended(&c, 4).await;
            c.q.close();
            while c.exits.get() < c.q.spawned() {
                ustor_runtime::yield_now().await;
            }
            tx.send((c.q.spawned(), c.exits.get())).unwrap();
        });
    });
    assert_eq!(spawned, 4);
    assert_eq!(exits, 4);
}

#[test]
fn an_unbounded_pool_grows_past_its_first_room() {
    let (spawned, log) = on_reactor(None, |c, tx| {
        push_all(&c, (0..40).map(|n| Job(n, true)));
        ustor_runtime::spawn(async move {
            ended(&c, 40).await;
            tx.send((c.q.spawned(), c.log.borrow().clone())).unwrap();
        });
    });
    assert_eq!(spawned, 40, "one worker per job in flight");
    let first_end = log.iter().position(|s| s.starts_with('e')).unwrap();
    assert_eq!(first_end, 40, "every job started before any ended: {log:?}");
}

//! The driver's workers, on the runtime's [`WorkQueue`]: at most
//! `DriverConfig::max_workers` (the first `prespawn_workers` at start),
//! each taking jobs from the connection's queue, running
//! [`Protocol::execute`] and queueing the reply. Requests therefore
//! complete and are answered out of order. A job pushed while a worker is
//! awake wakes nobody: jobs a device completes inline run as a batch in
//! one worker (see [`WorkQueue`]).

use std::pin::pin;
use std::rc::Rc;

use ustor_runtime::WorkQueue;

use super::{Conn, Protocol};

/// The connection's job queue and its workers.
pub(super) type Pool<J> = WorkQueue<(J, u64)>;

/// Queues `job` for a worker.
pub(super) fn queue_job<P: Protocol>(conn: &Rc<Conn<P>>, job: P::Job, charge: u64) {
    conn.workers
        .push((job, charge), |id| spawn_worker(conn.clone(), id));
}

/// Spawns the configured workers before the first unit; they park at once.
pub(super) fn prespawn<P: Protocol>(conn: &Rc<Conn<P>>) {
    conn.workers.prespawn(conn.cfg.prespawn_workers, |id| {
        spawn_worker(conn.clone(), id)
    });
}

fn spawn_worker<P: Protocol>(conn: Rc<Conn<P>>, id: usize) {
    ustor_runtime::spawn(worker(conn, id));
}

async fn worker<P: Protocol>(conn: Rc<Conn<P>>, id: usize) {
    // Budget: one job per round; ends when the connection closes.
    while let Some((job, charge)) = conn.workers.next(id).await {
        let reply = match conn.proto.aborted(&job) {
            Some(r) => r,
            None => {
                let run = pin!(conn.proto.execute(job));
                conn.workers
                    .run(id, run, |i| spawn_worker(conn.clone(), i))
                    .await
            }
        };
        conn.queue_reply(reply, charge, true);
    }
}

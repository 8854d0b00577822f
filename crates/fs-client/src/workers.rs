//! The mount's worker threads. fuser reads kernel requests on one session
//! thread; a read or write is sent from there (a write straight from the
//! kernel's buffer) and the wait for its reply, with the answer to the
//! kernel (fuser's reply objects are `Send`), runs on a worker, so the
//! session thread reads the next request meanwhile and several requests
//! are in flight on the connection at once.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send>;

/// A fixed set of threads running jobs in the order they were handed in.
pub(crate) struct Workers {
    tx: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl Workers {
    /// Starts `n` threads (at least one).
    pub fn new(n: usize) -> Self {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let threads = (0..n.max(1))
            .filter_map(|i| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("ustor-fs-w{i}"))
                    .spawn(move || work(&rx))
                    .ok()
            })
            .collect();
        Self {
            tx: Some(tx),
            threads,
        }
    }

    /// Runs `f` on a worker; on the caller's thread when no worker runs
    /// (none could be started), so a reply is never lost.
    pub fn run(&self, f: impl FnOnce() + Send + 'static) {
        let job: Job = Box::new(f);
        let job = match &self.tx {
            Some(tx) if !self.threads.is_empty() => match tx.send(job) {
                Ok(()) => return,
                Err(e) => e.0,
            },
            _ => job,
        };
        job()
    }
}

fn work(rx: &Mutex<Receiver<Job>>) {
    loop {
        // The lock is held only while taking a job, not while running it.
        let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
        match job {
            Ok(job) => job(),
            Err(_) => return,
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        // Closing the channel ends each thread once the queued jobs ran
        // (each answers its kernel request).
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

//! Blocking work off the reactors: the file system's transactions persist
//! with `msync`, which may sleep on a disk-backed region, so a connection
//! runs its metadata requests and write commits on this small pool of
//! threads and awaits the result; its reactor meanwhile serves other
//! connections (and this one's reads). The result comes back through a
//! slot the pool thread fills before waking the awaiting task (a wake from
//! another thread is forwarded to the reactor by the runtime).

use std::future::Future;
use std::pin::Pin;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};

/// Threads of the pool: enough for a few transactions persisting at once
/// (they serialise on a volume's lock; several volumes run in parallel).
const THREADS: usize = 4;

type Task = Box<dyn FnOnce() + Send>;

fn pool() -> Option<&'static Mutex<Sender<Task>>> {
    static P: OnceLock<Option<Mutex<Sender<Task>>>> = OnceLock::new();
    P.get_or_init(|| {
        let (tx, rx) = channel::<Task>();
        let rx = Arc::new(Mutex::new(rx));
        let mut started = 0;
        for i in 0..THREADS {
            let rx = rx.clone();
            let t = std::thread::Builder::new()
                .name(format!("ustor-fs-sync{i}"))
                .spawn(move || loop {
                    let task = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                    match task {
                        Ok(t) => t(),
                        Err(_) => return,
                    }
                });
            started += t.is_ok() as usize;
        }
        (started > 0).then(|| Mutex::new(tx))
    })
    .as_ref()
}

struct Slot<T> {
    val: Option<T>,
    waker: Option<Waker>,
}

/// The result of [`offload`], awaited on the reactor.
pub(crate) struct Offload<T> {
    slot: Arc<Mutex<Slot<T>>>,
}

/// Runs `f` on the pool; runs it here when the pool could not start.
pub(crate) fn offload<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Offload<T> {
    let slot = Arc::new(Mutex::new(Slot {
        val: None,
        waker: None,
    }));
    let s = slot.clone();
    let task: Task = Box::new(move || {
        let v = f();
        let w = {
            let mut g = s.lock().unwrap_or_else(|e| e.into_inner());
            g.val = Some(v);
            g.waker.take()
        };
        if let Some(w) = w {
            w.wake();
        }
    });
    let task = match pool() {
        Some(p) => match p.lock().unwrap_or_else(|e| e.into_inner()).send(task) {
            Ok(()) => None,
            Err(e) => Some(e.0),
        },
        None => Some(task),
    };
    if let Some(t) = task {
        t();
    }
    Offload { slot }
}

impl<T> Future for Offload<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut g = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        match g.val.take() {
            Some(v) => Poll::Ready(v),
            None => {
                g.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

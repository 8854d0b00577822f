//! The control thread: RPC methods run here, one at a time and in arrival
//! order (like SPDK's app thread), so the RPC server thread never blocks on
//! a method and a slow method never stalls the reactors' I/O.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use serde_json::Value;
use ustor_rpc::{MethodTable, RegisterError, Replier, RpcError};

type Job = Box<dyn FnOnce() + Send>;

/// Queue of control jobs and the thread that runs them.
pub struct Control {
    tx: mpsc::Sender<Job>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Control {
    pub fn start() -> std::io::Result<Control> {
        let (tx, rx) = mpsc::channel::<Job>();
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ustor_ctl".into())
            .spawn(move || {
                // Method closures in the table hold senders, so the channel never
                // disconnects by itself: a stop flag ends the loop.
                while let Ok(job) = rx.recv() {
                    job();
                    if st.load(Ordering::Acquire) {
                        break;
                    }
                }
            })?;
        Ok(Control {
            tx,
            stop,
            thread: Some(thread),
        })
    }

    pub fn sender(&self) -> ControlSender {
        ControlSender {
            tx: self.tx.clone(),
        }
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.tx.send(Box::new(|| {}));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A cloneable handle that registers methods running on the control thread.
#[derive(Clone)]
pub struct ControlSender {
    tx: mpsc::Sender<Job>,
}

impl ControlSender {
    /// Registers `f` as `name`; the reply goes back when `f` returns.
    pub fn method(
        &self,
        table: &MethodTable,
        name: &str,
        mask: u32,
        f: impl Fn(Value) -> Result<Value, RpcError> + Send + Sync + 'static,
    ) -> Result<(), RegisterError> {
        let f = Arc::new(f);
        let tx = self.tx.clone();
        table.register(name, mask, move |params, reply: Replier| {
            let f = f.clone();
            let job: Job = Box::new(move || reply.send(f(params)));
            if let Err(mpsc::SendError(job)) = tx.send(job) {
                drop(job);
            }
        })
    }
}

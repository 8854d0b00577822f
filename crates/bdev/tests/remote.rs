//! Foreign-thread completion (`ustor_bdev::remote`): a bdev whose driver
//! hands every I/O to a plain `std::thread` (as librbd runs its callbacks
//! on its own threads), which copies the data and completes from there.
//! Data is verified by pattern on two reactors at once, and once warmed up
//! the whole round trip allocates nothing (a counting global allocator):
//! no allocation and no lock per I/O, only the ring's atomics.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::Thread;

use common::*;
use crossbeam_queue::ArrayQueue;
use ustor_bdev::remote::{Completer, RemoteCompletions, RemoteIo};
use ustor_bdev::{Bdev, BdevChannel, BdevError, BdevInfo, IoHandle, IoType, Registry};
use ustor_runtime::IoBuf;

#[global_allocator]
static ALLOC: testkit::CountingAlloc = testkit::CountingAlloc::new();

const BS: usize = 512;
const BLOCKS: u64 = 4096;
const DEPTH: usize = 32;

/// The medium, written only by the worker threads.
struct Mem(*mut u8);
// SAFETY: a leaked allocation that lives for the test; the workers copy
// to and from disjoint or test-ordered ranges with raw copies.
unsafe impl Send for Mem {}
unsafe impl Sync for Mem {}

/// One I/O as the worker sees it: plain data and the remote token.
struct Job {
    io: RemoteIo,
    write: bool,
    off: usize,
    iov: *const libc::iovec,
    iovcnt: usize,
}
// SAFETY: the iovecs and their buffers stay in the submitting reactor's
// I/O slot until the completion is reaped there; only the worker touches
// them in between.
unsafe impl Send for Job {}

struct ThreadBdev {
    info: BdevInfo,
    mem: Arc<Mem>,
}

struct ThreadChannel {
    jobs: Arc<ArrayQueue<Job>>,
    worker: Thread,
    stop: Arc<AtomicBool>,
    done: RemoteCompletions,
}

fn work(mem: Arc<Mem>, jobs: Arc<ArrayQueue<Job>>, c: Completer, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Acquire) {
        while let Some(j) = jobs.pop() {
            let mut off = j.off;
            // SAFETY: see `Job`; each iovec is iov_len bytes, and the range
            // was checked by the generic layer.
            for v in unsafe { std::slice::from_raw_parts(j.iov, j.iovcnt) } {
                let b = v.iov_base as *mut u8;
                // SAFETY: off + iov_len stays inside the medium (checked
                // range); the buffer is iov_len bytes (see `Job`).
                unsafe {
                    let m = mem.0.add(off);
                    if j.write {
                        std::ptr::copy_nonoverlapping(b, m, v.iov_len)
                    } else {
                        std::ptr::copy_nonoverlapping(m, b, v.iov_len)
                    }
                };
                off += v.iov_len;
            }
            c.complete(j.io, Ok(()));
        }
        std::thread::park_timeout(std::time::Duration::from_millis(1));
    }
}

impl BdevChannel for ThreadChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        if !matches!(d.kind, IoType::Read | IoType::Write) {
            io.complete(Ok(()));
            return;
        }
        let io = match self.done.send_off(io) {
            Ok(r) => r,
            Err(io) => return io.complete(Err(BdevError::Io(libc::EAGAIN))),
        };
        let job = Job {
            io,
            write: d.kind == IoType::Write,
            off: d.offset_blocks as usize * BS,
            iov: d.iov,
            iovcnt: d.iovcnt,
        };
        assert!(self.jobs.push(job).is_ok(), "job ring sized for every I/O");
        self.worker.unpark();
    }

    fn outstanding(&self) -> usize {
        self.done.outstanding()
    }
}

impl Drop for ThreadChannel {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.worker.unpark();
    }
}

/// The reactor's runtime handle, for the channel's completions.
static RT: std::sync::OnceLock<ustor_runtime::RuntimeHandle> = std::sync::OnceLock::new();

impl Bdev for ThreadBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, t: IoType) -> bool {
        matches!(t, IoType::Read | IoType::Write)
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        let done = RemoteCompletions::new(RT.get().unwrap().clone(), ustor_bdev::io::TABLE_SLOTS);
        let jobs = Arc::new(ArrayQueue::new(ustor_bdev::io::TABLE_SLOTS));
        let stop = Arc::new(AtomicBool::new(false));
        let (m, j, c, s) = (
            self.mem.clone(),
            jobs.clone(),
            done.completer(),
            stop.clone(),
        );
        let worker = std::thread::Builder::new()
            .name("foreign-io".into())
            .spawn(move || work(m, j, c, s))
            .unwrap()
            .thread()
            .clone();
        Ok(Box::new(ThreadChannel {
            jobs,
            worker,
            stop,
            done,
        }))
    }
    fn config_json(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

fn create(reg: &Registry) {
    let mem = Box::leak(vec![0u8; BLOCKS as usize * BS].into_boxed_slice());
    let b = ThreadBdev {
        info: BdevInfo {
            name: "foreign".into(),
            uuid: uuid::Uuid::nil(),
            product_name: "foreign-thread test bdev".into(),
            module: "test",
            block_size: BS as u32,
            num_blocks: BLOCKS,
            required_alignment: 1,
            max_transfer_blocks: 0,
            optimal_boundary_blocks: 0,
            write_cache: false,
            unmap_reads_zero: false,
            memory_resident: true,
        },
        mem: Arc::new(Mem(mem.as_mut_ptr())),
    };
    reg.register(Arc::new(b)).unwrap();
}

/// On `reactor`: `rounds` of DEPTH concurrent 8-block writes then reads of
/// its own region, each read checked against the pattern.
fn burst(
    rt: &ustor_runtime::Runtime,
    reg: &Arc<Registry>,
    reactor: usize,
    rounds: u64,
    seed: u64,
) -> Result<(), String> {
    let desc = Arc::new(reg.open("foreign", true, |_| {}).unwrap());
    rt.handle()
        .block_on(reactor, move || async move {
            let ch = desc.channel().map_err(|e| e.to_string())?;
            let mut tasks = Vec::new();
            for t in 0..DEPTH as u64 {
                let ch = ch.clone();
                tasks.push(ustor_runtime::spawn(async move {
                    let lba = (reactor as u64 * DEPTH as u64 + t) * 8;
                    let mut w = IoBuf::alloc(8 * BS).await;
                    let mut r = IoBuf::alloc(8 * BS).await;
                    let mut want = vec![0u8; 8 * BS];
                    for round in 0..rounds {
                        pattern(&mut w, lba, seed ^ round);
                        want.copy_from_slice(&w);
                        let (res, b) = ch.write(lba, 8, w).await;
                        w = b;
                        res.map_err(|e| e.to_string())?;
                        let (res, b) = ch.read(lba, 8, r).await;
                        r = b;
                        res.map_err(|e| e.to_string())?;
                        if r[..] != want[..] {
                            return Err(format!("lba {lba} round {round}: data differs"));
                        }
                    }
                    Ok::<(), String>(())
                }));
            }
            for t in tasks {
                t.await?;
            }
            Ok(())
        })
        .unwrap()
}

#[test]
fn foreign_thread_completions_verified_and_allocation_free() {
    let rt = runtime(2);
    RT.set(rt.handle()).ok();
    let reg = registry(&rt);
    create(&reg);
    // Warm up both reactors: channels, worker threads, pool buffers.
    burst(&rt, &reg, 0, 20, 1).unwrap();
    burst(&rt, &reg, 1, 20, 2).unwrap();
    let rt0 = std::thread::scope(|s| {
        let a = s.spawn(|| burst(&rt, &reg, 0, 200, 3));
        let b = s.spawn(|| burst(&rt, &reg, 1, 200, 4));
        (a.join().unwrap(), b.join().unwrap())
    });
    rt0.0.unwrap();
    rt0.1.unwrap();
    // The allocation window: only the reactors' and workers' I/O runs. The
    // test thread waits on a channel built before the window opens.
    let (tx, rx) = std::sync::mpsc::sync_channel::<Result<(), String>>(1);
    let desc = Arc::new(reg.open("foreign", true, |_| {}).unwrap());
    let h = rt.handle();
    h.send(0, move || {
        ustor_runtime::spawn(async move {
            let ch = desc.channel().unwrap();
            let mut w = IoBuf::alloc(8 * BS).await;
            let mut r = IoBuf::alloc(8 * BS).await;
            let mut want = [0u8; 8 * BS];
            // Warm this task's own path with the very loop it then counts
            // (one write was not enough: a rare first pass, such as the
            // reactor's first nap while the worker runs, allocated once in
            // 30 runs), then count.
            for round in 0..500u64 {
                pattern(&mut w, 0, round);
                let (_, b) = ch.write(0, 8, w).await;
                w = b;
                let (_, b) = ch.read(0, 8, r).await;
                r = b;
            }
            ALLOC.set_window(true);
            let mut res = Ok(());
            for round in 0..2000u64 {
                pattern(&mut w, 0, round);
                want.copy_from_slice(&w);
                let (e, b) = ch.write(0, 8, w).await;
                w = b;
                let (e2, b) = ch.read(0, 8, r).await;
                r = b;
                if e.is_err() || e2.is_err() || r[..] != want[..] {
                    res = Err(format!("round {round} failed"));
                    break;
                }
            }
            ALLOC.set_window(false);
            let _ = tx.try_send(res);
        });
    })
    .unwrap();
    rx.recv().unwrap().unwrap();
    assert_eq!(
        ALLOC.allocations(),
        0,
        "foreign-thread completion allocated on the I/O path"
    );
}

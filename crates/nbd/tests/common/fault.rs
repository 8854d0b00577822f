//! A test bdev: a passthru over a malloc bdev that adds what malloc cannot
//! do, so the server's production path (`BdevSource`) meets it: reads or
//! writes of chosen blocks fail with EIO, reads of chosen blocks complete
//! late, a volatile write cache (flushes are counted), and no native
//! write-zeroes (the bdev layer then zeroes with writes). It is built on the
//! bdev crate's public seams (`Bdev`, `BdevChannel`, `Registry::register`),
//! as a bdev module outside that crate would be.

use std::ops::Range;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use ustor_bdev::{Bdev, BdevChannel, BdevError, BdevInfo, IoHandle, IoType, Registry};

/// What the passthru does differently from the malloc bdev under it.
#[derive(Clone, Default)]
pub struct FaultOpts {
    /// Reads touching these blocks fail with EIO.
    pub fail_reads: Option<Range<u64>>,
    /// Writes touching these blocks fail with EIO.
    pub fail_writes: Option<Range<u64>>,
    /// Reads touching these blocks complete after this delay.
    pub slow_reads: Option<(Range<u64>, Duration)>,
    /// Claim a volatile write cache (so NBD advertises FLUSH).
    pub write_cache: bool,
    /// Offer native write-zeroes (else the bdev layer emulates it and NBD
    /// answers FAST_ZERO with ENOTSUP).
    pub native_write_zeroes: bool,
}

/// Operations that reached the device, for tests to assert on.
#[derive(Default)]
pub struct Probe {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub flushes: AtomicU64,
    pub write_zeroes: AtomicU64,
}

impl Probe {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::SeqCst)
    }
}

struct FaultBdev {
    info: BdevInfo,
    inner: Arc<dyn Bdev>,
    opts: FaultOpts,
    probe: Arc<Probe>,
}

struct FaultChannel {
    inner: Rc<Box<dyn BdevChannel>>,
    opts: FaultOpts,
    probe: Arc<Probe>,
}

fn touches(r: Option<&Range<u64>>, start: u64, n: u64) -> bool {
    r.is_some_and(|r| start < r.end && r.start < start + n)
}

impl BdevChannel for FaultChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        let (start, n) = (d.offset_blocks, d.num_blocks);
        let count = |c: &AtomicU64| {
            c.fetch_add(1, Ordering::SeqCst);
        };
        match d.kind {
            IoType::Read => {
                count(&self.probe.reads);
                if touches(self.opts.fail_reads.as_ref(), start, n) {
                    return io.complete(Err(BdevError::Io(libc::EIO)));
                }
                if let Some((slow, delay)) = &self.opts.slow_reads {
                    if touches(Some(slow), start, n) {
                        let (inner, delay) = (self.inner.clone(), *delay);
                        ustor_runtime::spawn(async move {
                            ustor_runtime::sleep(delay).await;
                            inner.submit(io);
                        });
                        return;
                    }
                }
            }
            IoType::Write => {
                count(&self.probe.writes);
                if touches(self.opts.fail_writes.as_ref(), start, n) {
                    return io.complete(Err(BdevError::Io(libc::EIO)));
                }
            }
            IoType::Flush => count(&self.probe.flushes),
            IoType::WriteZeroes => count(&self.probe.write_zeroes),
            IoType::Unmap | IoType::Reset | IoType::CompareAndWrite => {}
        }
        self.inner.submit(io);
    }
}

impl Bdev for FaultBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, t: IoType) -> bool {
        match t {
            IoType::WriteZeroes => self.opts.native_write_zeroes,
            t => self.inner.io_type_supported(t),
        }
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        Ok(Box::new(FaultChannel {
            inner: Rc::new(self.inner.create_channel()?),
            opts: self.opts.clone(),
            probe: self.probe.clone(),
        }))
    }
    fn config_json(&self) -> Value {
        json!({"method": "test_fault_create", "params": {"name": self.info.name}})
    }
}

/// Registers `name` as a fault passthru over the registered bdev `base`.
pub fn create(registry: &Registry, base: &str, name: &str, opts: FaultOpts) -> Arc<Probe> {
    let inner = registry.get(base).expect("base bdev").bdev().clone();
    let mut info = inner.info().clone();
    info.name = name.into();
    info.module = "fault_test";
    // It stands for a device (latency, failures), not for memory.
    info.memory_resident = false;
    info.product_name = "Fault injection passthru".into();
    info.write_cache = opts.write_cache;
    // A UUID of its own (the registry refuses duplicates).
    info.uuid = serde_json::from_value(json!("0c9e1d7a-55aa-4bde-9b1f-1e2d3c4b5a69")).unwrap();
    let probe = Arc::new(Probe::default());
    registry
        .register(Arc::new(FaultBdev {
            info,
            inner,
            opts,
            probe: probe.clone(),
        }))
        .expect("register fault bdev");
    probe
}

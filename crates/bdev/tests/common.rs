//! Shared helpers for the bdev integration tests.
#![allow(dead_code)]

use std::sync::Arc;

use ustor_bdev::Registry;
use ustor_runtime::{PollMode, Runtime, RuntimeConfig};

pub fn runtime(cores: usize) -> Runtime {
    Runtime::start(RuntimeConfig {
        cores: (0..cores).collect(),
        pin: false,
        poll_mode: PollMode::Adaptive,
        bufs: ustor_runtime::BufPoolConfig {
            mem_bytes: 32 << 20,
            classes: vec![4096, 65536, 1 << 20],
        },
        ..Default::default()
    })
    .expect("runtime")
}

pub fn registry(rt: &Runtime) -> Arc<Registry> {
    Registry::new(Some(rt.handle()))
}

/// A pattern that differs per block and per seed.
pub fn pattern(buf: &mut [u8], lba: u64, seed: u64) {
    for (i, c) in buf.chunks_mut(8).enumerate() {
        let v = (lba.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed ^ i as u64).to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
}

pub fn temp_file(name: &str, len: u64) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ustor-bdev-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("disk.img");
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(len).unwrap();
    p
}

/// What a [`TraceBdev`] saw: (kind, offset_blocks, num_blocks, FUA).
pub type Ops = Arc<std::sync::Mutex<Vec<(ustor_bdev::IoType, u64, u64, bool)>>>;

/// A RAM bdev for tests that records every I/O its driver receives and
/// has no native FUA, with or without a volatile write cache.
pub struct TraceBdev {
    info: ustor_bdev::BdevInfo,
    mem: Arc<std::sync::Mutex<Vec<u8>>>,
    pub ops: Ops,
}

impl TraceBdev {
    pub fn create(
        reg: &Registry,
        name: &str,
        num_blocks: u64,
        write_cache: bool,
        max_transfer_blocks: u32,
    ) -> Ops {
        let info = ustor_bdev::BdevInfo {
            name: name.into(),
            uuid: uuid::Uuid::new_v4(),
            product_name: "Trace disk".into(),
            module: "trace",
            block_size: 512,
            num_blocks,
            required_alignment: 1,
            max_transfer_blocks,
            optimal_boundary_blocks: 0,
            write_cache,
            unmap_reads_zero: true,
            memory_resident: true,
        };
        let ops = Ops::default();
        let b = TraceBdev {
            info,
            mem: Arc::new(std::sync::Mutex::new(vec![0; num_blocks as usize * 512])),
            ops: ops.clone(),
        };
        reg.register(Arc::new(b)).unwrap();
        ops
    }
}

struct TraceChannel {
    mem: Arc<std::sync::Mutex<Vec<u8>>>,
    ops: Ops,
}

impl ustor_bdev::BdevChannel for TraceChannel {
    fn submit(&self, io: ustor_bdev::IoHandle) {
        use ustor_bdev::IoType;
        let d = io.desc();
        self.ops
            .lock()
            .unwrap()
            .push((d.kind, d.offset_blocks, d.num_blocks, io.flags().fua()));
        let mut mem = self.mem.lock().unwrap();
        let mut pos = d.offset_blocks as usize * 512;
        let len = d.num_blocks as usize * 512;
        match d.kind {
            IoType::Read | IoType::Write => {
                // SAFETY: the iovecs are valid until the completion below.
                for v in unsafe { d.iovecs() } {
                    // SAFETY: as above; each iovec is iov_len bytes.
                    let s =
                        unsafe { std::slice::from_raw_parts_mut(v.iov_base as *mut u8, v.iov_len) };
                    if d.kind == IoType::Read {
                        s.copy_from_slice(&mem[pos..pos + v.iov_len]);
                    } else {
                        mem[pos..pos + v.iov_len].copy_from_slice(s);
                    }
                    pos += v.iov_len;
                }
            }
            IoType::Unmap | IoType::WriteZeroes => mem[pos..pos + len].fill(0),
            IoType::Flush | IoType::Reset => {}
            IoType::CompareAndWrite => {
                // Atomic: compare and write under the one lock.
                // SAFETY: the iovecs are valid until the completion below.
                let r = match unsafe { d.compare_and_write_halves(len) } {
                    Some((cmp, new)) => {
                        // SAFETY: each half is `len` bytes (checked above).
                        let (cmp, new) = unsafe {
                            (
                                std::slice::from_raw_parts(cmp, len),
                                std::slice::from_raw_parts(new, len),
                            )
                        };
                        let at = mem[pos..pos + len]
                            .iter()
                            .zip(cmp)
                            .position(|(a, b)| a != b);
                        match at {
                            Some(at) => Err(ustor_bdev::BdevError::Miscompare {
                                offset: Some(at as u64),
                            }),
                            None => {
                                mem[pos..pos + len].copy_from_slice(new);
                                Ok(())
                            }
                        }
                    }
                    None => Err(ustor_bdev::BdevError::Io(libc::EINVAL)),
                };
                drop(mem);
                return io.complete(r);
            }
        }
        drop(mem);
        io.complete(Ok(()));
    }
}

impl ustor_bdev::Bdev for TraceBdev {
    fn info(&self) -> &ustor_bdev::BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, _t: ustor_bdev::IoType) -> bool {
        true
    }
    fn create_channel(&self) -> Result<Box<dyn ustor_bdev::BdevChannel>, ustor_bdev::BdevError> {
        Ok(Box::new(TraceChannel {
            mem: self.mem.clone(),
            ops: self.ops.clone(),
        }))
    }
    fn config_json(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

//! The error bdev (`bdev_error_create` / `_delete`,
//! `bdev_error_inject_error`): `EE_{base}` passes I/O through to its base
//! until errors are injected: the next `num` I/Os of a kind fail
//! (`failure`), are held until a reset (`pending`), or, for writes, land
//! with one byte changed (`corrupt_data`).
//!
//! The injection state is shared by every reactor's channel; an I/O with
//! nothing injected reads one atomic (a load, no read-modify-write).

use std::cell::RefCell;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Weak};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use ustor_bdev::modules::parse_params;
use ustor_bdev::{
    Bdev, BdevChannel, BdevEntry, BdevError, BdevInfo, BdevModule, ControlError, Desc, IoChannel,
    IoHandle, IoType, Registry,
};

use crate::base;

/// What happens to an I/O an injection hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ErrorType {
    Failure = 1,
    Pending = 2,
    CorruptData = 3,
}

/// One I/O kind's injection: how many I/Os are left to hit, and how.
#[derive(Default)]
struct Injection {
    left: AtomicU32,
    kind: AtomicU8,
    /// corrupt_offset << 8 | corrupt_value.
    corrupt: AtomicU64,
}

#[derive(Default)]
struct Shared {
    by_type: [Injection; IoType::ALL.len()],
}

impl Shared {
    /// Takes one hit of `t`'s injection, if any is left.
    #[inline]
    fn hit(&self, t: IoType) -> Option<(ErrorType, u64)> {
        let inj = &self.by_type[t.index()];
        if inj.left.load(Ordering::Relaxed) == 0 {
            return None;
        }
        inj.left
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| n.checked_sub(1))
            .ok()?;
        let kind = match inj.kind.load(Ordering::Acquire) {
            1 => ErrorType::Failure,
            2 => ErrorType::Pending,
            3 => ErrorType::CorruptData,
            _ => return None,
        };
        Some((kind, inj.corrupt.load(Ordering::Relaxed)))
    }
}

/// Live error bdevs' injection state, for [`inject`].
static LIVE: base::Live<Shared> = base::Live::new();

/// `bdev_error_create`'s parameters.
#[derive(Deserialize, Serialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct ErrorParams {
    pub base_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<uuid::Uuid>,
}

struct ErrorBdev {
    info: BdevInfo,
    base: [Desc; 1],
    shared: Arc<Shared>,
    params: ErrorParams,
}

struct ErrorChannel {
    base: IoChannel,
    shared: Arc<Shared>,
    bs: u64,
    /// I/Os held by a `pending` injection, until a reset.
    held: RefCell<Vec<IoHandle>>,
}

impl ErrorChannel {
    fn inject(&self, io: IoHandle, kind: ErrorType, corrupt: u64) -> Option<IoHandle> {
        match kind {
            ErrorType::Failure => io.complete(Err(BdevError::Io(libc::EIO))),
            ErrorType::Pending => self.held.borrow_mut().push(io),
            ErrorType::CorruptData => {
                let d = io.desc();
                let len = d.num_blocks * self.bs;
                corrupt_byte(&d, (corrupt >> 8) % len.max(1), (corrupt as u8).max(1));
                return Some(io);
            }
        }
        None
    }
}

/// XORs byte `off` of a write's data with `val` before it is sent.
fn corrupt_byte(d: &ustor_bdev::IoDesc, off: u64, val: u8) {
    let mut pos = 0u64;
    // SAFETY: the iovecs are the I/O's own, valid until it completes (it
    // has not been sent yet); a write's buffer is ours to read and, as
    // SPDK's error bdev does, to corrupt; the byte written lies inside its
    // segment (checked by the `if`).
    unsafe {
        for v in d.iovecs() {
            if off < pos + v.iov_len as u64 {
                *(v.iov_base as *mut u8).add((off - pos) as usize) ^= val;
                return;
            }
            pos += v.iov_len as u64;
        }
    }
}

impl BdevChannel for ErrorChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        let io = match self.shared.hit(d.kind) {
            Some((kind, c)) => match self.inject(io, kind, c) {
                Some(io) => io,
                None => return,
            },
            None => io,
        };
        if d.kind == IoType::Reset {
            for h in self.held.borrow_mut().drain(..) {
                h.complete(Err(BdevError::Aborted));
            }
        }
        let kids = io.into_children();
        let off = if d.kind == IoType::Reset {
            0
        } else {
            d.offset_blocks
        };
        kids.submit(&self.base, d.kind, off, d.num_blocks, 0);
    }
    fn outstanding(&self) -> usize {
        self.held.borrow().len()
    }
}

impl Bdev for ErrorBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, t: IoType) -> bool {
        base::all_support(&self.base, t)
    }
    fn fua_supported(&self, t: IoType) -> bool {
        base::all_fua(&self.base, t)
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        Ok(Box::new(ErrorChannel {
            base: self.base[0].channel()?,
            shared: self.shared.clone(),
            bs: self.info.block_size as u64,
            held: RefCell::new(Vec::with_capacity(64)),
        }))
    }
    fn config_json(&self) -> Value {
        json!({"method": "bdev_error_create", "params": self.params})
    }
}

/// Creates `EE_{base_name}` over `base_name`.
pub fn create(
    reg: &Registry,
    weak: &Weak<Registry>,
    p: ErrorParams,
) -> Result<Arc<BdevEntry>, ControlError> {
    let name = format!("EE_{}", p.base_name);
    base::check_free(reg, &name)?;
    let base = [base::open(
        reg,
        weak,
        &p.base_name,
        &name,
        base::OnResize::Follow,
    )?];
    let n = base[0].num_blocks();
    let info = base::info(&name, p.uuid, "Error Injection Disk", "error", &base, n)?;
    let shared = Arc::new(Shared::default());
    let e = reg.register(Arc::new(ErrorBdev {
        info,
        base,
        shared: shared.clone(),
        params: p,
    }))?;
    LIVE.add(&e, &shared);
    Ok(e)
}

/// `bdev_error_inject_error`'s parameters (SPDK's names).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InjectParams {
    pub name: String,
    pub io_type: String,
    pub error_type: String,
    #[serde(default = "one")]
    pub num: u32,
    /// SPDK's: fail only at this queue depth (0: any); accepted as 0 only.
    #[serde(default)]
    pub queue_depth: u64,
    #[serde(default)]
    pub corrupt_offset: u64,
    #[serde(default)]
    pub corrupt_value: u8,
}

fn one() -> u32 {
    1
}

/// Arms (or, with io_type `clear`, disarms) injections on error bdev
/// `p.name`.
pub fn inject(reg: &Registry, p: InjectParams) -> Result<(), ControlError> {
    let shared = LIVE.find(reg, &p.name, "error")?;
    let kinds: Vec<IoType> = match p.io_type.as_str() {
        "all" | "clear" => IoType::ALL.to_vec(),
        t => vec![*IoType::ALL.iter().find(|k| k.name() == t).ok_or_else(|| {
            ControlError::invalid("io_type", format!("`{t}` is not an I/O type, all or clear"))
        })?],
    };
    let et = match p.error_type.as_str() {
        "failure" => ErrorType::Failure,
        "pending" => ErrorType::Pending,
        "corrupt_data" => ErrorType::CorruptData,
        t => {
            return Err(ControlError::invalid(
                "error_type",
                format!("`{t}` is not failure, pending or corrupt_data"),
            ))
        }
    };
    if et == ErrorType::CorruptData && kinds.iter().any(|k| *k != IoType::Write) {
        return Err(ControlError::invalid(
            "io_type",
            "corrupt_data is supported on writes only",
        ));
    }
    if p.queue_depth != 0 {
        return Err(ControlError::invalid(
            "queue_depth",
            "only 0 (any depth) is supported",
        ));
    }
    let num = if p.io_type == "clear" { 0 } else { p.num };
    for k in kinds {
        let inj = &shared.by_type[k.index()];
        inj.corrupt.store(
            (p.corrupt_offset << 8) | p.corrupt_value as u64,
            Ordering::Relaxed,
        );
        inj.kind.store(et as u8, Ordering::Release);
        inj.left.store(num, Ordering::Release);
    }
    Ok(())
}

/// The error module.
pub struct ErrorModule(pub Weak<Registry>);

impl BdevModule for ErrorModule {
    fn name(&self) -> &'static str {
        "error"
    }
    fn create(&self, reg: &Registry, params: Value) -> Result<Arc<BdevEntry>, ControlError> {
        create(reg, &self.0, parse_params(params)?)
    }
}

//! The `rbd` bdev: one open librbd image per bdev, shared by the channels of
//! every reactor, with I/O through `rbd_aio_*`.
//!
//! Completions: librbd calls back on its own finisher thread; the callback
//! hands the result to the owning reactor through [`ustor_bdev::remote`]
//! (a lock-free ring and at most one message per burst), so the reactor
//! never takes a lock per I/O and never blocks on librbd. One image handle
//! per bdev rather than per reactor: several handles of one image would
//! pass its exclusive lock back and forth on every write.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::{Arc, Mutex, Weak};

use libc::c_void;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use ustor_bdev::io::TABLE_SLOTS;
use ustor_bdev::remote::{Completer, RemoteCompletions, RemoteIo};
use ustor_bdev::{
    Bdev, BdevChannel, BdevEntry, BdevError, BdevInfo, BdevModule, ControlError, IoDesc, IoHandle,
    IoType, Registry,
};
use ustor_runtime::{PollStatus, PollerId, RuntimeHandle};

use crate::cluster::{Cluster, ClusterOpts, Clusters};
use crate::direct;
use crate::events::{self, CompletionMode};
use crate::image::{close_at_exit, Image};
use crate::{ffi, RbdError};

/// `bdev_rbd_create` parameters (SPDK's).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RbdOpts {
    /// Default: the first free `Ceph{i}` (SPDK's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub pool_name: String,
    pub rbd_name: String,
    pub block_size: u32,
    /// With `config`, a connection of this bdev's own (no `cluster_name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<BTreeMap<String, String>>,
    /// A cluster from `bdev_rbd_register_cluster`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<uuid::Uuid>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    /// ustor's own (not SPDK's): how completions reach the reactors.
    #[serde(default, skip_serializing_if = "CompletionMode::is_default")]
    pub completion: CompletionMode,
    /// ustor's own: data I/O straight over librados where that is correct
    /// for the image (see [`crate::direct`]); `false`: always librbd.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub rbd_direct: bool,
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

pub struct RbdBdev {
    info: BdevInfo,
    opts: RbdOpts,
    image: Arc<Image>,
    rt: RuntimeHandle,
}

impl Bdev for RbdBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, t: IoType) -> bool {
        match t {
            IoType::Reset => false,
            // librbd compares within one 512-byte sector only.
            IoType::CompareAndWrite => self.info.block_size == CAW_SECTOR,
            _ => true,
        }
    }
    fn max_compare_and_write_blocks(&self) -> u64 {
        1
    }
    /// Without the client cache (ustor's default) a write completes once
    /// the OSDs have it on stable storage.
    fn fua_supported(&self, _t: IoType) -> bool {
        !self.info.write_cache
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        let rc = Rc::new(RemoteCompletions::new(self.rt.clone(), TABLE_SLOTS));
        let stop = Rc::new(Cell::new(false));
        if self.image.event_fd().is_some() {
            ustor_runtime::spawn(events::reap(self.image.clone(), rc.clone(), stop.clone()));
        }
        let reqs = direct::Reqs::new(rc.completer(), self.image.cluster.op_timeout_s);
        // The direct path's deadlines (librbd's path has Ceph's timeout).
        let expiry = reqs.period().map(|every| {
            let r = reqs.clone();
            ustor_runtime::register_timed_poller("rbd-deadline", every, move || {
                if r.expire() > 0 {
                    tracing::warn!("rbd: I/O past its {} s deadline cancelled", r.timeout_s());
                }
                PollStatus::Idle
            })
        });
        Ok(Box::new(RbdChannel {
            image: self.image.clone(),
            completer: rc.completer(),
            reqs,
            expiry,
            rc,
            bs: self.info.block_size as u64,
            stop,
        }))
    }
    fn config_json(&self) -> Value {
        json!({"method": "bdev_rbd_create", "params": self.opts})
    }
    fn driver_info(&self) -> Value {
        json!({"rbd": {
            "pool_name": self.opts.pool_name,
            "rbd_name": self.opts.rbd_name,
            "cluster_name": self.opts.cluster_name,
            "image_size": self.image.size().ok(),
            "read_only": self.opts.read_only,
            "data_path": if self.image.direct().is_some() { "direct" } else { "librbd" },
            "health": self.image.health_json(),
        }})
    }
}

/// The one size librbd (16.2) compares and writes: a request must lie in
/// one 512-byte sector of the image.
const CAW_SECTOR: u32 = 512;

/// What the librbd callback needs: where to complete, and what.
pub(crate) struct Pending {
    completer: Completer,
    io: RemoteIo,
    /// Bytes a read must return (0 for other kinds).
    want: u64,
    /// A compare-and-write's image byte offset, and where librbd writes
    /// the image offset of the first difference (this box does not move
    /// while librbd holds it).
    caw: Option<u64>,
    mismatch: u64,
    /// The image (its health), valid while the I/O is in flight: the
    /// channel holds an `Arc` of it and outlives its I/O.
    image: *const Image,
}

/// librbd's completion callback (its finisher thread).
unsafe extern "C" fn on_complete(c: ffi::rbd_completion_t, arg: *mut c_void) {
    // SAFETY: `arg` is the Box leaked in `submit` for this completion,
    // which librbd calls back exactly once; `c` is that completion.
    let p = unsafe { Box::from_raw(arg.cast::<Pending>()) };
    let r = unsafe { ffi::rbd_aio_get_return_value(c) };
    unsafe { ffi::rbd_aio_release(c) };
    finish(*p, r, None);
}

/// Completes a finished librbd I/O (`r`: its return value): right here
/// when `here` (the current reactor's end) owns it, else through its ring.
pub(crate) fn finish(p: Pending, r: isize, here: Option<&RemoteCompletions>) {
    // SAFETY: see `Pending::image`.
    let img = unsafe { &*p.image };
    let status = if let (Some(off), true) = (p.caw, r == -libc::EILSEQ as isize) {
        // The data differed: the image is fine, nothing was written.
        img.health.succeeded(&img.name);
        Err(BdevError::Miscompare {
            offset: Some(mismatch_in_request(p.mismatch, off)),
        })
    } else if r < 0 {
        img.health.failed(-r as i32, &img.name);
        Err(errno_err(-r as i32))
    } else if p.want != 0 && r as u64 != p.want {
        img.health.failed(libc::EIO, &img.name);
        Err(BdevError::Io(libc::EIO))
    } else {
        img.health.succeeded(&img.name);
        Ok(())
    };
    match here {
        Some(rc) if rc.owns(&p.completer) => rc.complete_here(p.io, status),
        _ => p.completer.complete(p.io, status),
    }
}

/// Where in a compare-and-write at image byte `off` the first difference
/// is, from what librbd wrote to `mismatch_off`. librbd 17 and later write
/// the difference's image offset. librbd 16 adds the OSD's index (from the
/// request's start) to the start of the request's *object* instead
/// (measured here: a request 4608 bytes into object 1 that differs at
/// byte 100 gets object 1's start + 100). The request lies in one
/// 512-byte sector and object starts are sector multiples, so outside the
/// request the index is the remainder.
fn mismatch_in_request(mismatch_off: u64, off: u64) -> u64 {
    let sector = CAW_SECTOR as u64;
    match mismatch_off.checked_sub(off) {
        Some(d) if d < sector => d,
        _ => mismatch_off % sector,
    }
}

pub(crate) fn errno_err(e: i32) -> BdevError {
    match e {
        libc::EOPNOTSUPP => BdevError::NotSupported,
        libc::EROFS | libc::EPERM => BdevError::ReadOnly,
        e => BdevError::Io(e),
    }
}

struct RbdChannel {
    image: Arc<Image>,
    rc: Rc<RemoteCompletions>,
    completer: Completer,
    /// The direct path's requests, reused.
    reqs: Arc<direct::Reqs>,
    /// The poller that fails its direct I/O past the deadline.
    expiry: Option<PollerId>,
    bs: u64,
    /// Event mode: tells this channel's reaper task to end.
    stop: Rc<Cell<bool>>,
}

impl Drop for RbdChannel {
    fn drop(&mut self) {
        self.stop.set(true);
        if let Some(p) = self.expiry.take() {
            ustor_runtime::unregister_poller(p);
        }
        self.reqs.drain();
        if let Some(fd) = self.image.event_fd() {
            events::kick(fd);
        }
    }
}

impl RbdChannel {
    /// Starts the librbd call for `d`; a negative errno if librbd refused.
    ///
    /// # Safety
    /// `c` is a fresh completion; `d`'s segments stay valid until the I/O
    /// completes, and so does `mismatch`.
    unsafe fn start(
        &self,
        d: &IoDesc,
        off: u64,
        len: u64,
        c: ffi::rbd_completion_t,
        mismatch: *mut u64,
    ) -> i32 {
        let img = self.image.handle();
        let (iov, iovcnt) = (d.iov, d.iovcnt);
        match d.kind {
            IoType::Read => ffi::rbd_aio_readv(img, iov, iovcnt as i32, off, c),
            IoType::Write => ffi::rbd_aio_writev(img, iov, iovcnt as i32, off, c),
            IoType::Flush => ffi::rbd_aio_flush(img, c),
            IoType::Unmap => ffi::rbd_aio_discard(img, off, len, c),
            IoType::WriteZeroes => ffi::rbd_aio_write_zeroes(img, off, len as usize, c, 0, 0),
            IoType::Reset => -libc::EOPNOTSUPP,
            IoType::CompareAndWrite => match d.compare_and_write_halves(len as usize) {
                Some((cmp, buf)) => ffi::rbd_aio_compare_and_write(
                    img,
                    off,
                    len as usize,
                    cmp.cast(),
                    buf.cast(),
                    c,
                    mismatch,
                    0,
                ) as i32,
                None => -libc::EINVAL,
            },
        }
    }
}

impl BdevChannel for RbdChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        let (off, len) = (d.offset_blocks * self.bs, d.num_blocks * self.bs);
        let io = match self.rc.send_off(io) {
            Ok(r) => r,
            Err(io) => return io.complete(Err(BdevError::Io(libc::EAGAIN))),
        };
        if let Some(l) = self.image.direct().filter(|_| direct::takes(d.kind)) {
            return direct::submit(&self.image, l, &d, off, len, &self.reqs, io);
        }
        let want = if d.kind == IoType::Read { len } else { 0 };
        // librbd allocates its own completion per I/O as well; this box is
        // what its callback gets back.
        let caw = (d.kind == IoType::CompareAndWrite).then_some(off);
        let p = Box::into_raw(Box::new(Pending {
            completer: self.completer.clone(),
            io,
            want,
            caw,
            mismatch: 0,
            image: Arc::as_ptr(&self.image),
        }));
        let mut c: ffi::rbd_completion_t = std::ptr::null_mut();
        // SAFETY: `p` is handed to librbd, which gives it back to
        // `on_complete` once; the iovecs stay in the I/O's slot until it
        // completes.
        let cb = if self.image.event_fd().is_some() {
            None
        } else {
            Some(on_complete as unsafe extern "C" fn(_, _))
        };
        let mut r = unsafe { ffi::rbd_aio_create_completion(p.cast(), cb, &mut c) };
        if r >= 0 {
            // SAFETY: as above; `mismatch` lives in `p` until completion.
            r = unsafe { self.start(&d, off, len, c, std::ptr::addr_of_mut!((*p).mismatch)) };
        }
        if r < 0 {
            // Refused at once: no callback will come; complete it here.
            // SAFETY: librbd took neither the completion nor `p`.
            unsafe {
                if !c.is_null() {
                    ffi::rbd_aio_release(c);
                }
                let p = Box::from_raw(p);
                self.image.health.failed(-r, &self.image.name);
                p.completer.complete(p.io, Err(errno_err(-r)));
            }
        }
    }

    fn outstanding(&self) -> usize {
        self.rc.outstanding()
    }
}

/// The rbd module: clusters, `bdev_rbd_create` / `bdev_rbd_delete`, and
/// the cluster registrations in the config dump.
pub struct RbdModule {
    pub clusters: Arc<Clusters>,
    rt: Option<RuntimeHandle>,
    /// Open images by bdev name (for `bdev_rbd_resize`).
    images: Mutex<BTreeMap<String, Weak<Image>>>,
}

impl RbdModule {
    pub fn new(rt: Option<RuntimeHandle>) -> RbdModule {
        let cores = rt
            .as_ref()
            .map(|h| (0..h.num_reactors()).filter_map(|i| h.core_of(i)).collect())
            .unwrap_or_default();
        RbdModule {
            clusters: Arc::new(Clusters::new(cores)),
            rt,
            images: Mutex::default(),
        }
    }

    /// `bdev_rbd_create`.
    pub fn create_bdev(&self, reg: &Registry, mut o: RbdOpts) -> Result<Arc<BdevEntry>, RbdError> {
        let rt = self.rt.clone().ok_or(RbdError::NoRuntime)?;
        let bs = o.block_size;
        if !(512..=65536).contains(&bs) || !bs.is_power_of_two() {
            return Err(RbdError::Invalid {
                param: "block_size",
                why: format!("{bs} is not a power of two in 512..=65536"),
            });
        }
        let name = match &o.name {
            Some(n) => n.clone(),
            None => (0..)
                .map(|i| format!("Ceph{i}"))
                .find(|n| reg.get(n).is_none())
                .unwrap_or_default(),
        };
        if reg.get(&name).is_some() {
            return Err(RbdError::Exists(name));
        }
        let cluster = match &o.cluster_name {
            Some(c) => self.clusters.get(c)?,
            None => {
                let co = ClusterOpts {
                    name: format!("{name} (own connection)"),
                    user_id: o.user_id.clone(),
                    config_param: o.config.clone(),
                    ..Default::default()
                };
                Cluster::connect(co, &self.clusters.reactor_cores)?
            }
        };
        let image = Arc::new(Image::open(
            cluster,
            &o.pool_name,
            &o.rbd_name,
            o.read_only,
        )?);
        close_at_exit(&image);
        if o.completion == CompletionMode::Event {
            image.enable_events()?;
        }
        let size = image.size()?;
        let num_blocks = size / bs as u64;
        if num_blocks == 0 {
            return Err(RbdError::Invalid {
                param: "rbd_name",
                why: format!("image of {size} bytes is smaller than one block"),
            });
        }
        o.name = Some(name.clone());
        let uuid = *o.uuid.get_or_insert_with(uuid::Uuid::new_v4);
        let write_cache = o
            .config
            .as_ref()
            .and_then(|c| c.get("rbd_cache"))
            .or_else(|| image.cluster.opts.config_param.as_ref()?.get("rbd_cache"))
            .is_some_and(|v| v == "true");
        image.choose_path(&name, &o, write_cache);
        let info = BdevInfo {
            name: name.clone(),
            uuid,
            product_name: "Ceph Rbd Disk".into(),
            module: "rbd",
            block_size: bs,
            num_blocks,
            required_alignment: 1,
            max_transfer_blocks: 0,
            optimal_boundary_blocks: 0,
            write_cache,
            // Partial discards may leave data (rbd_skip_partial_discard).
            unmap_reads_zero: false,
            memory_resident: false,
        };
        let b = RbdBdev {
            info,
            opts: o,
            image: image.clone(),
            rt,
        };
        let e = reg.register(Arc::new(b)).map_err(RbdError::Control)?;
        if let Err(err) = image.watch(&e, bs as u64) {
            // I/O works without it; only another client's resize goes unseen.
            tracing::warn!(bdev = %name, "{err}: a resize by another client will not be seen");
        }
        self.images
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name, Arc::downgrade(&image));
        Ok(e)
    }

    /// `bdev_rbd_resize`: grows or shrinks the image (`new_size` in MiB,
    /// SPDK's unit) and the bdev with it; returns the new size in bytes.
    pub fn resize(&self, name: &str, new_size_mib: u64) -> Result<u64, RbdError> {
        let img = self
            .images
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .and_then(Weak::upgrade)
            .ok_or_else(|| RbdError::Control(ControlError::NotFound(name.into())))?;
        let bytes = new_size_mib.checked_mul(1 << 20).ok_or(RbdError::Invalid {
            param: "new_size",
            why: "too large".into(),
        })?;
        img.resize(bytes)?;
        img.refresh_bdev()
    }
}

impl BdevModule for RbdModule {
    fn name(&self) -> &'static str {
        "rbd"
    }
    fn create(&self, reg: &Registry, params: Value) -> Result<Arc<BdevEntry>, ControlError> {
        let o: RbdOpts = ustor_bdev::modules::parse_params(params)?;
        self.create_bdev(reg, o).map_err(RbdError::into_control)
    }
    fn delete(&self, reg: &Registry, name: &str) -> Result<(), ControlError> {
        reg.delete(name)?;
        self.images
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
        Ok(())
    }
    fn config_json(&self) -> Vec<Value> {
        self.clusters.config_json()
    }
}

#[cfg(test)]
mod tests {
    use super::mismatch_in_request;

    #[test]
    fn mismatch_offset_in_either_librbd_convention() {
        let (obj, off) = (4u64 << 20, (4u64 << 20) + 4608);
        // librbd >= 17: the image offset of the difference.
        assert_eq!(mismatch_in_request(off + 100, off), 100);
        assert_eq!(mismatch_in_request(off, off), 0);
        // librbd 16: the object's start plus the index.
        assert_eq!(mismatch_in_request(obj + 100, off), 100);
        assert_eq!(mismatch_in_request(obj + 511, off), 511);
    }
}

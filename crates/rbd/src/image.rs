//! An open librbd image (`Image`): its io context, open and close (also
//! at process exit), the header watch that passes a resize or a feature
//! change on to its bdev, and the health `bdev_get_bdevs` reports.

use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once, OnceLock, Weak};

use libc::c_void;
use serde_json::{json, Value};
use ustor_bdev::BdevEntry;

use crate::cluster::{check, Cluster};
use crate::direct::Layout;
use crate::events;
use crate::{ffi, RbdError};

/// An open image and the io context it lives in.
pub struct Image {
    handle: ffi::rbd_image_t,
    ioctx: ffi::rados_ioctx_t,
    pub cluster: Arc<Cluster>,
    /// The bdev over it (and its block size), once registered: a resize,
    /// ours or another client's, is passed on to it.
    bdev: OnceLock<(Weak<BdevEntry>, u64)>,
    /// librbd's update watch (handle, context), unwatched before close.
    watch: Mutex<Option<(u64, *mut Weak<Image>)>>,
    /// Closed already (at process exit, see [`close_at_exit`]).
    closed: AtomicBool,
    /// What `bdev_get_bdevs` reports about failing I/O.
    pub(crate) health: Health,
    /// `pool/image`, for the log.
    pub(crate) name: String,
    /// The direct data path's layout, while it is on (see [`crate::direct`]).
    pub(crate) direct: OnceLock<Layout>,
    pub(crate) direct_on: AtomicBool,
    /// Holds the cluster's Ceph op timeout on (opening, or on librbd's
    /// path; see [`crate::cluster`]).
    pub(crate) holds_timeout: AtomicBool,
    /// The eventfd librbd bumps in [`CompletionMode::Event`].
    events: OnceLock<std::os::fd::OwnedFd>,
}

/// Failing I/O, as the bdev reports it: written on librbd's finisher
/// thread only when an I/O fails (or the first one succeeds after a
/// failure), so the per-I/O cost on success is one relaxed load.
#[derive(Default)]
pub(crate) struct Health {
    /// The last I/O failed (cleared by the next one that succeeds).
    failing: AtomicBool,
    errors: AtomicU64,
    last_errno: AtomicI32,
}

impl Health {
    pub(crate) fn failed(&self, errno: i32, image: &str) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.last_errno.store(errno, Ordering::Relaxed);
        if !self.failing.swap(true, Ordering::AcqRel) {
            let e = std::io::Error::from_raw_os_error(errno);
            tracing::error!(image, "rbd I/O failing: {e}");
        }
    }

    pub(crate) fn succeeded(&self, image: &str) {
        if self.failing.load(Ordering::Relaxed) && self.failing.swap(false, Ordering::AcqRel) {
            tracing::warn!(image, "rbd I/O succeeds again");
        }
    }
}

/// Images open in this process, closed by an `atexit` handler: a process
/// that exits with an image open (`ustor bench`, `ustor serve` at
/// shutdown: their bdevs are never deleted) would leave the image's
/// exclusive lock and watch to a dead client, and the next client's first
/// write would wait for the watch to time out (~30 s).
static OPEN: Mutex<Vec<Weak<Image>>> = Mutex::new(Vec::new());

pub(crate) fn close_at_exit(img: &Arc<Image>) {
    static HOOK: Once = Once::new();
    let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
    open.retain(|w| w.strong_count() > 0);
    open.push(Arc::downgrade(img));
    drop(open);
    extern "C" fn close_all() {
        let open = std::mem::take(&mut *OPEN.lock().unwrap_or_else(|p| p.into_inner()));
        for img in open.iter().filter_map(Weak::upgrade) {
            img.close();
        }
    }
    // SAFETY: registers a plain function for process exit; it runs after
    // main returned, when the reactors (and so all I/O) have stopped.
    HOOK.call_once(|| unsafe {
        libc::atexit(close_all);
    });
}

// SAFETY: librbd image handles take aio calls from any thread (librbd
// serialises internally); close happens once, in Drop.
unsafe impl Send for Image {}
// SAFETY: as above.
unsafe impl Sync for Image {}

impl Drop for Image {
    fn drop(&mut self) {
        self.close();
        if self.holds_timeout.swap(false, Ordering::AcqRel) {
            self.cluster.release_osd_timeout();
        }
        // SAFETY: from rados_ioctx_create, destroyed once, after the image.
        unsafe { ffi::rados_ioctx_destroy(self.ioctx) };
    }
}

impl Image {
    /// Removes the watch and closes the image, once (Drop, or process exit).
    fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        // Unwatch and close send OSD ops of librbd's: bounded by Ceph's
        // timeout (Drop gives the hold back).
        if !self.holds_timeout.swap(true, Ordering::AcqRel) {
            self.cluster.hold_osd_timeout();
        }
        // SAFETY: handles from rbd_open, closed once (the flag above); no
        // I/O is in flight (Drop: every channel, which holds an Arc, is
        // gone; exit: the reactors have stopped).
        unsafe {
            let watch = self.watch.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some((h, ctx)) = watch {
                // After unwatch returns no callback runs (librbd waits for
                // one in progress), so the context can go.
                ffi::rbd_update_unwatch(self.handle, h);
                drop(Box::from_raw(ctx));
            }
            if !self.handle.is_null() {
                ffi::rbd_close(self.handle);
            }
        }
    }

    /// Opens `pool/name` (blocking; the control thread's business).
    pub fn open(
        cluster: Arc<Cluster>,
        pool: &str,
        name: &str,
        ro: bool,
    ) -> Result<Image, RbdError> {
        let cs = |p, s: &str| {
            CString::new(s).map_err(|_| RbdError::Invalid {
                param: p,
                why: "contains a NUL byte".into(),
            })
        };
        let (pc, nc) = (cs("pool_name", pool)?, cs("rbd_name", name)?);
        let mut ioctx = std::ptr::null_mut();
        // SAFETY: a connected cluster handle; ioctx is written on success.
        let r = unsafe { ffi::rados_ioctx_create(cluster.handle(), pc.as_ptr(), &mut ioctx) };
        if r == -libc::ENOENT {
            return Err(RbdError::NoPool(pool.into()));
        }
        check(r, || format!("opening pool `{pool}`"))?;
        let mut img = Image {
            handle: std::ptr::null_mut(),
            ioctx,
            cluster,
            bdev: OnceLock::new(),
            watch: Mutex::new(None),
            closed: AtomicBool::new(false),
            health: Health::default(),
            name: format!("{pool}/{name}"),
            events: OnceLock::new(),
            direct: OnceLock::new(),
            direct_on: AtomicBool::new(false),
            holds_timeout: AtomicBool::new(true),
        };
        img.cluster.hold_osd_timeout();
        let r = img.cluster.clone().placed(|| {
            // SAFETY: a valid ioctx and C strings; the handle is written on
            // success and closed by Drop.
            unsafe {
                if ro {
                    ffi::rbd_open_read_only(ioctx, nc.as_ptr(), &mut img.handle, std::ptr::null())
                } else {
                    ffi::rbd_open(ioctx, nc.as_ptr(), &mut img.handle, std::ptr::null())
                }
            }
        });
        if r == -libc::ENOENT {
            return Err(RbdError::NoImage(format!("{pool}/{name}")));
        }
        check(r, || format!("opening image `{pool}/{name}`"))?;
        Ok(img)
    }

    pub(crate) fn handle(&self) -> ffi::rbd_image_t {
        self.handle
    }

    pub(crate) fn ioctx(&self) -> ffi::rados_ioctx_t {
        self.ioctx
    }

    /// The eventfd of [`CompletionMode::Event`], if on.
    pub(crate) fn event_fd(&self) -> Option<i32> {
        use std::os::fd::AsRawFd;
        self.events.get().map(|f| f.as_raw_fd())
    }

    /// Switches librbd to the event socket (before any I/O).
    pub(crate) fn enable_events(&self) -> Result<(), RbdError> {
        let fd = events::enable(self.handle).map_err(|errno| RbdError::Rados {
            what: "setting the image's event socket".into(),
            errno,
        })?;
        let _ = self.events.set(fd);
        Ok(())
    }

    pub fn size(&self) -> Result<u64, RbdError> {
        let mut s = 0u64;
        // SAFETY: an open image; writes the size.
        check(unsafe { ffi::rbd_get_size(self.handle, &mut s) }, || {
            "reading the image size".into()
        })?;
        Ok(s)
    }

    /// `ok`, `failing` (the last I/O failed), or `pool deleted` (the
    /// pool is gone from the cluster's OSD map: every I/O fails and the
    /// image will not come back; `rbd rm` refuses an open image, so a
    /// deleted pool is how an exported image disappears).
    fn state(&self) -> &'static str {
        if !self.health.failing.load(Ordering::Acquire) {
            return "ok";
        }
        if self.pool_gone() {
            "pool deleted"
        } else {
            "failing"
        }
    }

    /// The pool is gone from the client's OSD map (a local lookup that
    /// never waits: librados' completion threads call it).
    pub(crate) fn pool_gone(&self) -> bool {
        let mut req = 0;
        // SAFETY: a valid ioctx; writes `req`.
        let r = unsafe { ffi::rados_ioctx_pool_requires_alignment2(self.ioctx, &mut req) };
        r == -libc::ENOENT
    }

    pub(crate) fn health_json(&self) -> Value {
        let errno = self.health.last_errno.load(Ordering::Relaxed);
        json!({
            "state": self.state(),
            "io_errors": self.health.errors.load(Ordering::Relaxed),
            "last_error": (errno != 0).then(|| std::io::Error::from_raw_os_error(errno).to_string()),
        })
    }

    pub fn resize(&self, bytes: u64) -> Result<(), RbdError> {
        // SAFETY: an open image.
        check(unsafe { ffi::rbd_resize(self.handle, bytes) }, || {
            format!("resizing the image to {bytes} bytes")
        })
    }

    /// Ties the image to its bdev and watches the image header, so a
    /// resize from any client (`rbd resize`) reaches the bdev.
    pub(crate) fn watch(
        self: &Arc<Image>,
        entry: &Arc<BdevEntry>,
        bs: u64,
    ) -> Result<(), RbdError> {
        let _ = self.bdev.set((Arc::downgrade(entry), bs));
        let ctx = Box::into_raw(Box::new(Arc::downgrade(self)));
        let mut h = 0u64;
        // Placed: the first watch of a process starts librbd's update
        // watchers' thread pool (`tp_librbd`), which would otherwise run
        // wherever the calling thread may.
        let r = self.cluster.placed(|| {
            // SAFETY: an open image; `ctx` stays valid until unwatched in
            // Drop (or freed here when the watch was not set up).
            unsafe { ffi::rbd_update_watch(self.handle, &mut h, Some(on_update), ctx.cast()) }
        });
        if r < 0 {
            // SAFETY: librbd did not keep `ctx`.
            drop(unsafe { Box::from_raw(ctx) });
            return check(r, || "watching the image header".into());
        }
        *self.watch.lock().unwrap_or_else(|p| p.into_inner()) = Some((h, ctx));
        Ok(())
    }

    /// Reads the image size and gives it to the bdev (a no-op when the
    /// size did not change); the new size in bytes.
    pub(crate) fn refresh_bdev(&self) -> Result<u64, RbdError> {
        // A header change may end what the direct path relies on (a
        // snapshot, a feature): then librbd from the next I/O on.
        if self.direct().is_some() {
            if let Err(why) = Layout::probe(self.handle) {
                if !self.holds_timeout.swap(true, Ordering::AcqRel) {
                    self.cluster.hold_osd_timeout();
                }
                self.direct_on.store(false, Ordering::Release);
                tracing::warn!(image = %self.name, "rbd data path: librbd from now on ({why})");
            }
        }
        let size = self.size()?;
        if let Some((e, bs)) = self.bdev.get() {
            if let Some(e) = e.upgrade() {
                e.resize(size / bs);
            }
        }
        Ok(size)
    }
}

/// librbd's update-watch callback (the image header changed: a resize,
/// a snapshot, a feature). It runs on a librbd thread that an image
/// refresh waits for, so the size is read on a short-lived thread of its
/// own (it inherits this thread's placement). Header changes are rare.
unsafe extern "C" fn on_update(arg: *mut c_void) {
    // SAFETY: `arg` is the context `Image::watch` leaked; it lives until
    // the watch is removed, which waits for this callback.
    let img = unsafe { &*(arg as *const Weak<Image>) }.clone();
    let r = std::thread::Builder::new()
        .name("rbd-update".into())
        .spawn(move || {
            if let Some(i) = img.upgrade() {
                if let Err(e) = i.refresh_bdev() {
                    tracing::warn!("rbd image changed, size not read: {e}");
                }
            }
        });
    if let Err(e) = r {
        tracing::warn!("rbd image changed, no thread to read its size: {e}");
    }
}

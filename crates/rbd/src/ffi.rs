//! The few librados/librbd calls ustor uses, declared by hand from
//! `rados/librados.h` and `rbd/librbd.h`, and loaded at run time from
//! `librados.so.2` and `librbd.so.1` (Debian `librados2`, `librbd1`).
//!
//! Why at run time: building ustor then needs no Ceph headers or libraries
//! (one `cargo build` on a stock box), and a host without Ceph's client
//! libraries runs everything else; only registering a cluster fails, with
//! an error naming the package to install. [`load`] opens both libraries
//! once per process and resolves every symbol up front, so a missing
//! symbol is a load error too, never a crash later. Every call returns 0
//! or a negative errno unless noted.
//!
//! The wrappers below may only be called after [`load`] succeeded: every
//! handle passed to them comes from `rados_create`, which the cluster
//! module calls only after a successful [`load`].

#![allow(non_camel_case_types)]

use std::sync::OnceLock;

use libc::{c_char, c_int, c_void, iovec, size_t, ssize_t};
use libloading::Library;

pub type rados_t = *mut c_void;
pub type rados_ioctx_t = *mut c_void;
pub type rbd_image_t = *mut c_void;
pub type rbd_completion_t = *mut c_void;
pub type rbd_callback_t = Option<unsafe extern "C" fn(c: rbd_completion_t, arg: *mut c_void)>;
pub type rbd_update_callback_t = Option<unsafe extern "C" fn(arg: *mut c_void)>;
pub type rados_completion_t = *mut c_void;
pub type rados_callback_t = Option<unsafe extern "C" fn(c: rados_completion_t, arg: *mut c_void)>;
pub type rados_read_op_t = *mut c_void;
pub type rados_write_op_t = *mut c_void;

/// `rbd_stat`'s answer (`rbd_image_info_t`).
#[repr(C)]
pub struct rbd_image_info_t {
    pub size: u64,
    pub obj_size: u64,
    pub num_objs: u64,
    pub order: c_int,
    pub block_name_prefix: [c_char; 24],
    pub parent_pool: i64,
    pub parent_name: [c_char; 96],
}

/// `rbd_set_image_notification` type: the fd is an eventfd.
pub const EVENT_TYPE_EVENTFD: c_int = 2;

/// The library file names and the Debian package that provides each.
pub const LIBRADOS: (&str, &str) = ("librados.so.2", "librados2");
pub const LIBRBD: (&str, &str) = ("librbd.so.1", "librbd1");

/// Declares the table of entry points, its loader and one `unsafe fn` per
/// entry point with the C name, so call sites read like plain FFI.
macro_rules! api {
    ($( $(#[$m:meta])* $lib:ident fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?; )*) => {
        /// Resolved entry points (the libraries stay open for the process).
        pub struct Api {
            $( $name: unsafe extern "C" fn($($ty),*) $(-> $ret)?, )*
        }

        impl Api {
            fn resolve(rados: &Library, rbd: &Library) -> Result<Api, String> {
                Ok(Api {
                    $( $name: {
                        let lib = match stringify!($lib) { "rados" => rados, _ => rbd };
                        // SAFETY: the type is the C prototype of this symbol
                        // in librados.h/librbd.h; the library outlives the
                        // pointer (it is leaked, see `open`).
                        let s = unsafe {
                            lib.get::<unsafe extern "C" fn($($ty),*) $(-> $ret)?>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                        };
                        *s.map_err(|e| format!("{}: {e}", stringify!($name)))?
                    }, )*
                })
            }
        }

        $(
            $(#[$m])*
            /// See the C function of the same name.
            ///
            /// # Safety
            /// As the C function's contract; [`load`] must have succeeded.
            pub unsafe fn $name($($arg: $ty),*) $(-> $ret)? {
                // SAFETY: forwarded to the caller.
                unsafe { (api().$name)($($arg),*) }
            }
        )*
    };
}

api! {
    rados fn rados_create(cluster: *mut rados_t, id: *const c_char) -> c_int;
    rados fn rados_conf_read_file(cluster: rados_t, path: *const c_char) -> c_int;
    rados fn rados_conf_set(cluster: rados_t, option: *const c_char, value: *const c_char) -> c_int;
    rados fn rados_connect(cluster: rados_t) -> c_int;
    rados fn rados_shutdown(cluster: rados_t);
    rados fn rados_ioctx_create(cluster: rados_t, pool: *const c_char, io: *mut rados_ioctx_t) -> c_int;
    rados fn rados_ioctx_destroy(io: rados_ioctx_t);
    /// The pool's id, or -ENOENT when the client's OSD map has no such pool.
    rados fn rados_pool_lookup(cluster: rados_t, pool: *const c_char) -> i64;

    // The direct data path (crate::direct): objects of an image, without librbd.
    /// -ENOENT when the pool is not in the client's OSD map. Answers from
    /// the map the client has (`rados_pool_lookup` may wait for a newer
    /// one, which deadlocks on librados' completion thread).
    rados fn rados_ioctx_pool_requires_alignment2(io: rados_ioctx_t, req: *mut c_int) -> c_int;
    rados fn rados_aio_create_completion2(arg: *mut c_void, cb: rados_callback_t, c: *mut rados_completion_t) -> c_int;
    /// Bytes read (reads) or 0, or a negative errno.
    rados fn rados_aio_get_return_value(c: rados_completion_t) -> c_int;
    rados fn rados_aio_release(c: rados_completion_t);
    rados fn rados_aio_cancel(io: rados_ioctx_t, c: rados_completion_t) -> c_int;
    rados fn rados_aio_read(io: rados_ioctx_t, oid: *const c_char, c: rados_completion_t, buf: *mut c_char, len: size_t, off: u64) -> c_int;
    rados fn rados_aio_write(io: rados_ioctx_t, oid: *const c_char, c: rados_completion_t, buf: *const c_char, len: size_t, off: u64) -> c_int;
    rados fn rados_aio_remove(io: rados_ioctx_t, oid: *const c_char, c: rados_completion_t) -> c_int;
    rados fn rados_create_read_op() -> rados_read_op_t;
    rados fn rados_release_read_op(op: rados_read_op_t);
    rados fn rados_read_op_read(op: rados_read_op_t, off: u64, len: size_t, buf: *mut c_char, bytes_read: *mut size_t, prval: *mut c_int);
    rados fn rados_aio_read_op_operate(op: rados_read_op_t, io: rados_ioctx_t, c: rados_completion_t, oid: *const c_char, flags: c_int) -> c_int;
    rados fn rados_create_write_op() -> rados_write_op_t;
    rados fn rados_release_write_op(op: rados_write_op_t);
    rados fn rados_write_op_write(op: rados_write_op_t, buf: *const c_char, len: size_t, off: u64);
    rados fn rados_write_op_zero(op: rados_write_op_t, off: u64, len: u64);
    rados fn rados_aio_write_op_operate(op: rados_write_op_t, io: rados_ioctx_t, c: rados_completion_t, oid: *const c_char, mtime: *mut libc::time_t, flags: c_int) -> c_int;

    rbd fn rbd_open(io: rados_ioctx_t, name: *const c_char, image: *mut rbd_image_t, snap: *const c_char) -> c_int;
    rbd fn rbd_open_read_only(io: rados_ioctx_t, name: *const c_char, image: *mut rbd_image_t, snap: *const c_char) -> c_int;
    rbd fn rbd_close(image: rbd_image_t) -> c_int;
    rbd fn rbd_get_size(image: rbd_image_t, size: *mut u64) -> c_int;
    rbd fn rbd_resize(image: rbd_image_t, size: u64) -> c_int;
    rbd fn rbd_stat(image: rbd_image_t, info: *mut rbd_image_info_t, infosize: size_t) -> c_int;
    rbd fn rbd_get_old_format(image: rbd_image_t, old: *mut u8) -> c_int;
    rbd fn rbd_get_features(image: rbd_image_t, features: *mut u64) -> c_int;
    rbd fn rbd_get_stripe_unit(image: rbd_image_t, unit: *mut u64) -> c_int;
    rbd fn rbd_get_stripe_count(image: rbd_image_t, count: *mut u64) -> c_int;
    rbd fn rbd_get_block_name_prefix(image: rbd_image_t, prefix: *mut c_char, len: size_t) -> c_int;
    /// -ENOENT when the image has no parent (not a clone).
    rbd fn rbd_get_parent_info(image: rbd_image_t, pool: *mut c_char, pool_len: size_t, name: *mut c_char, name_len: size_t, snap: *mut c_char, snap_len: size_t) -> c_int;
    /// With `*max` too small: -ERANGE, `*max` then the count plus one.
    rbd fn rbd_snap_list(image: rbd_image_t, snaps: *mut c_void, max: *mut c_int) -> c_int;
    rbd fn rbd_update_watch(image: rbd_image_t, handle: *mut u64, cb: rbd_update_callback_t, arg: *mut c_void) -> c_int;
    rbd fn rbd_update_unwatch(image: rbd_image_t, handle: u64) -> c_int;
    rbd fn rbd_set_image_notification(image: rbd_image_t, fd: c_int, kind: c_int) -> c_int;
    /// Number of completions written to `comps`, or a negative errno.
    rbd fn rbd_poll_io_events(image: rbd_image_t, comps: *mut rbd_completion_t, numcomp: c_int) -> c_int;

    rbd fn rbd_aio_create_completion(arg: *mut c_void, cb: rbd_callback_t, c: *mut rbd_completion_t) -> c_int;
    /// Bytes transferred (reads) or 0, or a negative errno.
    rbd fn rbd_aio_get_return_value(c: rbd_completion_t) -> ssize_t;
    rbd fn rbd_aio_get_arg(c: rbd_completion_t) -> *mut c_void;
    rbd fn rbd_aio_release(c: rbd_completion_t);
    rbd fn rbd_aio_readv(image: rbd_image_t, iov: *const iovec, iovcnt: c_int, off: u64, c: rbd_completion_t) -> c_int;
    rbd fn rbd_aio_writev(image: rbd_image_t, iov: *const iovec, iovcnt: c_int, off: u64, c: rbd_completion_t) -> c_int;
    rbd fn rbd_aio_flush(image: rbd_image_t, c: rbd_completion_t) -> c_int;
    rbd fn rbd_aio_discard(image: rbd_image_t, off: u64, len: u64, c: rbd_completion_t) -> c_int;
    rbd fn rbd_aio_write_zeroes(image: rbd_image_t, off: u64, len: size_t, c: rbd_completion_t, zero_flags: c_int, op_flags: c_int) -> c_int;
    /// Completes with -EILSEQ on a miscompare, `mismatch_off` then holding
    /// the image byte offset of the first difference (written before the
    /// completion fires). Only within one 512-byte sector (else -EINVAL).
    #[allow(clippy::too_many_arguments)] // the C prototype's
    rbd fn rbd_aio_compare_and_write(image: rbd_image_t, off: u64, len: size_t, cmp_buf: *const c_char, buf: *const c_char, c: rbd_completion_t, mismatch_off: *mut u64, op_flags: c_int) -> ssize_t;
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

/// Opens librados and librbd and resolves every entry point, once per
/// process; the error says which file is missing and what to install.
pub fn load() -> Result<(), String> {
    API.get_or_init(|| open(LIBRADOS, LIBRBD))
        .as_ref()
        .map(|_| ())
        .map_err(Clone::clone)
}

/// Opens the two libraries (given as file name and package) and resolves
/// the table. The libraries are leaked: the table's pointers live as long
/// as the process, and librados' threads may run until exit anyway.
pub fn open(rados: (&str, &str), rbd: (&str, &str)) -> Result<Api, String> {
    let lib = |(file, pkg): (&str, &str)| {
        // SAFETY: loading runs the library's initialisers; librados and
        // librbd are ordinary shared libraries meant to be loaded into any
        // process (QEMU and SPDK link them).
        unsafe { Library::new(file) }.map_err(|e| format!("{file} not found: install {pkg} ({e})"))
    };
    let (rados, rbd) = (lib(rados)?, lib(rbd)?);
    let api = Api::resolve(&rados, &rbd)?;
    std::mem::forget(rados);
    std::mem::forget(rbd);
    Ok(api)
}

fn api() -> &'static Api {
    match API.get() {
        Some(Ok(a)) => a,
        // Unreachable by the module's contract (no handle exists before a
        // successful load); a panic names the broken invariant.
        _ => panic!("librbd called before ffi::load() succeeded"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_names_the_file_and_the_package() {
        let e = open(("librados-none.so.2", "librados2"), LIBRBD)
            .err()
            .unwrap();
        assert!(
            e.starts_with("librados-none.so.2 not found: install librados2"),
            "{e}"
        );
        let e = open(LIBRADOS, ("librbd-none.so.1", "librbd1"))
            .err()
            .unwrap();
        // Where librados is absent its error comes first; otherwise librbd's.
        let ok = e.starts_with("librados.so.2 not found: install librados2")
            || e.starts_with("librbd-none.so.1 not found: install librbd1");
        assert!(ok, "{e}");
    }
}

//! The few librados/librbd calls ustor uses, declared by hand from
//! `rados/librados.h` and `rbd/librbd.h` (Debian `librados-dev`,
//! `librbd-dev`). No maintained crate wraps librbd; this is the whole
//! surface. Every call returns 0 or a negative errno unless noted.

#![allow(non_camel_case_types)]

use libc::{c_char, c_int, c_void, iovec, size_t, ssize_t};

pub type rados_t = *mut c_void;
pub type rados_ioctx_t = *mut c_void;
pub type rbd_image_t = *mut c_void;
pub type rbd_completion_t = *mut c_void;
pub type rbd_callback_t = Option<unsafe extern "C" fn(c: rbd_completion_t, arg: *mut c_void)>;

#[link(name = "rados")]
extern "C" {
    pub fn rados_create(cluster: *mut rados_t, id: *const c_char) -> c_int;
    pub fn rados_conf_read_file(cluster: rados_t, path: *const c_char) -> c_int;
    pub fn rados_conf_set(cluster: rados_t, option: *const c_char, value: *const c_char) -> c_int;
    pub fn rados_connect(cluster: rados_t) -> c_int;
    pub fn rados_shutdown(cluster: rados_t);
    pub fn rados_ioctx_create(
        cluster: rados_t,
        pool: *const c_char,
        io: *mut rados_ioctx_t,
    ) -> c_int;
    pub fn rados_ioctx_destroy(io: rados_ioctx_t);
}

#[link(name = "rbd")]
extern "C" {
    pub fn rbd_open(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap: *const c_char,
    ) -> c_int;
    pub fn rbd_open_read_only(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap: *const c_char,
    ) -> c_int;
    pub fn rbd_close(image: rbd_image_t) -> c_int;
    pub fn rbd_get_size(image: rbd_image_t, size: *mut u64) -> c_int;
    pub fn rbd_resize(image: rbd_image_t, size: u64) -> c_int;

    pub fn rbd_aio_create_completion(
        arg: *mut c_void,
        cb: rbd_callback_t,
        c: *mut rbd_completion_t,
    ) -> c_int;
    /// Bytes transferred (reads) or 0, or a negative errno.
    pub fn rbd_aio_get_return_value(c: rbd_completion_t) -> ssize_t;
    pub fn rbd_aio_release(c: rbd_completion_t);
    pub fn rbd_aio_readv(
        image: rbd_image_t,
        iov: *const iovec,
        iovcnt: c_int,
        off: u64,
        c: rbd_completion_t,
    ) -> c_int;
    pub fn rbd_aio_writev(
        image: rbd_image_t,
        iov: *const iovec,
        iovcnt: c_int,
        off: u64,
        c: rbd_completion_t,
    ) -> c_int;
    pub fn rbd_aio_flush(image: rbd_image_t, c: rbd_completion_t) -> c_int;
    pub fn rbd_aio_discard(image: rbd_image_t, off: u64, len: u64, c: rbd_completion_t) -> c_int;
    pub fn rbd_aio_write_zeroes(
        image: rbd_image_t,
        off: u64,
        len: size_t,
        c: rbd_completion_t,
        zero_flags: c_int,
        op_flags: c_int,
    ) -> c_int;
}

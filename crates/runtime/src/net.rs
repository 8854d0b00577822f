//! Socket options the targets set on accepted connections (the runtime is
//! the one place that makes raw socket calls).

use std::os::fd::RawFd;

/// Disables Nagle on a TCP socket: storage replies are small and
/// latency-bound, and the targets batch sends themselves (reply batches,
/// the LANoT coalescer). Returns the OS error if the call fails.
pub fn set_nodelay(fd: RawFd) -> std::io::Result<()> {
    let one: libc::c_int = 1;
    // SAFETY: setsockopt with a pointer to a live c_int and its size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

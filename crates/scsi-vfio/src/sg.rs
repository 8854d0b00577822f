//! Copies between the mid-layer's iovecs and a driver's bounce buffer in
//! DMA memory (for data not in memory mapped for DMA).

pub(crate) fn gather(iovs: &[libc::iovec], out: &mut [u8]) {
    let mut at = 0;
    for v in iovs {
        let n = v.iov_len.min(out.len() - at);
        // SAFETY: the mid-layer's iovec, alive while the command is.
        let src = unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, n) };
        out[at..at + n].copy_from_slice(src);
        at += n;
    }
}

pub(crate) fn scatter(src: &[u8], iovs: &[libc::iovec]) {
    let mut at = 0;
    for v in iovs {
        let n = v.iov_len.min(src.len() - at);
        // SAFETY: the mid-layer's iovec, alive until it hears of the
        // completion, and not otherwise borrowed meanwhile.
        let dst = unsafe { std::slice::from_raw_parts_mut(v.iov_base as *mut u8, n) };
        dst.copy_from_slice(&src[at..at + n]);
        at += n;
    }
}

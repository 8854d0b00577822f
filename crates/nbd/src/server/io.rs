//! Socket plumbing for connections: exact receives, full sends, draining,
//! and the reply batch that goes out in one `sendmsg`.
//!
//! A [`SendBatch`] holds up to [`BATCH_REPLIES`] replies: each a header
//! (copied into the batch's own header buffer, at most 32 bytes) and an
//! optional payload buffer (read data, handed over by value from the bdev:
//! never copied). It goes out with non-blocking `sendmsg(2)` calls
//! ([`SendBatch::send_nonblocking`]): one syscall for up to 64 replies, done
//! before the reactor's next ring submission, with no completion to reap
//! and no extra loop pass (an io_uring `SENDMSG` carries at most 8 replies
//! and its completion costs a pass). Only when the socket buffer is full
//! does the sender wait, for `POLLOUT` on the ring.

use std::io;
use std::os::fd::RawFd;

use ustor_runtime::{ops, IoBuf};

use crate::reply::{ReplyHeader, MAX_REPLY_HEADER_LEN};

/// Replies gathered into one `sendmsg` (two iovecs each).
pub const BATCH_REPLIES: usize = 64;
/// Iovecs of a full batch.
pub const BATCH_IOVECS: usize = 2 * BATCH_REPLIES;

fn eof() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection")
}

/// Receives until `buf[start..end]` is full.
pub async fn recv_exact(
    fd: RawFd,
    mut buf: IoBuf,
    mut start: usize,
    end: usize,
) -> (io::Result<()>, IoBuf) {
    debug_assert!(end <= buf.capacity());
    while start < end {
        let (res, b) = ops::recv(fd, buf, start, end - start).await;
        buf = b;
        match res {
            Ok(0) => return (Err(eof()), buf),
            Ok(n) => start += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return (Err(e), buf),
        }
    }
    (Ok(()), buf)
}

/// Reads and drops `n` bytes using `scratch` as the landing area.
pub async fn discard(fd: RawFd, mut scratch: IoBuf, mut n: u64) -> (io::Result<()>, IoBuf) {
    let cap = scratch.capacity() as u64;
    while n > 0 {
        let chunk = n.min(cap) as usize;
        let (res, b) = recv_exact(fd, scratch, 0, chunk).await;
        scratch = b;
        if res.is_err() {
            return (res, scratch);
        }
        n -= chunk as u64;
    }
    (Ok(()), scratch)
}

/// One reply waiting to be sent.
pub struct OutReply {
    pub header: ReplyHeader,
    /// Bytes that follow the header: read data, or a block-status chunk.
    pub data: Option<IoBuf>,
    /// Payload budget the request holds until its reply is sent.
    pub charge: u64,
}

/// Up to [`BATCH_REPLIES`] replies sent with one `sendmsg`, reused for the
/// life of the connection.
pub struct SendBatch {
    headers: IoBuf,
    header_lens: [u8; BATCH_REPLIES],
    data: [Option<IoBuf>; BATCH_REPLIES],
    count: usize,
    /// Bytes of this batch already sent (after a partial `sendmsg`).
    skip: usize,
}

impl SendBatch {
    pub fn new() -> Self {
        Self {
            headers: IoBuf::heap(BATCH_REPLIES * MAX_REPLY_HEADER_LEN),
            header_lens: [0; BATCH_REPLIES],
            data: std::array::from_fn(|_| None),
            count: 0,
            skip: 0,
        }
    }

    pub fn is_full(&self) -> bool {
        self.count == BATCH_REPLIES
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub fn len(&self) -> usize {
        self.count
    }

    /// Adds a reply; the caller checks `is_full` first.
    pub fn push(&mut self, reply: OutReply) {
        debug_assert!(!self.is_full());
        let i = self.count;
        let h = reply.header.as_bytes();
        let at = i * MAX_REPLY_HEADER_LEN;
        self.headers.spare_mut()[at..at + h.len()].copy_from_slice(h);
        self.header_lens[i] = h.len() as u8;
        self.data[i] = reply.data;
        self.count += 1;
    }

    /// Total bytes in the batch.
    pub fn total(&self) -> usize {
        (0..self.count)
            .map(|i| {
                usize::from(self.header_lens[i]) + self.data[i].as_ref().map_or(0, |d| d.len())
            })
            .sum()
    }

    /// Records `n` more bytes sent; returns true when the batch is done.
    pub fn advance(&mut self, n: usize) -> bool {
        self.skip += n;
        self.skip >= self.total()
    }

    /// Empties the batch, returning payload buffers to their pools.
    pub fn clear(&mut self) {
        for d in self.data.iter_mut().take(self.count) {
            *d = None;
        }
        self.count = 0;
        self.skip = 0;
    }
}

impl Default for SendBatch {
    fn default() -> Self {
        Self::new()
    }
}

impl SendBatch {
    /// Fills `out` with the unsent segments; returns how many.
    fn iovecs(&self, out: &mut [libc::iovec; BATCH_IOVECS]) -> usize {
        let mut skip = self.skip;
        let mut n = 0;
        let base = self.headers.as_ptr();
        for i in 0..self.count {
            let header = (
                // SAFETY: slot i lies inside the header buffer (count <= BATCH_REPLIES).
                unsafe { base.add(i * MAX_REPLY_HEADER_LEN) },
                usize::from(self.header_lens[i]),
            );
            let data = self.data[i].as_ref().map(|d| (d.as_ptr(), d.len()));
            for (ptr, len) in std::iter::once(header).chain(data) {
                if skip >= len {
                    skip -= len;
                    continue;
                }
                // SAFETY: skip < len, so the pointer stays inside the segment.
                out[n] = libc::iovec {
                    iov_base: unsafe { ptr.add(skip) } as *mut _,
                    iov_len: len - skip,
                };
                skip = 0;
                n += 1;
            }
        }
        n
    }

    /// One non-blocking `sendmsg` of everything not yet sent; returns the
    /// bytes sent (`WouldBlock` when the socket buffer is full).
    pub fn send_nonblocking(&self, fd: RawFd) -> io::Result<usize> {
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; BATCH_IOVECS];
        let n = self.iovecs(&mut iov);
        debug_assert!(n > 0, "send of an empty batch");
        // SAFETY: the iovecs point into buffers this batch owns, alive for
        // the call.
        unsafe { ops::sendmsg_now(fd, &iov[..n]) }
    }
}

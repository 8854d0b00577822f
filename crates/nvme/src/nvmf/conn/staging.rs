//! The connection's receive staging buffer: bytes read from the socket and
//! not yet consumed (headers, and whatever payload a greedy read brings),
//! and the receive of a payload straight into its own buffer.

use std::io;
use std::os::fd::RawFd;

use ustor_runtime::{ops, IoBuf};

use super::super::stats::{self, inc};
use crate::sock::{self, Seg};

/// Staging buffer for headers (and whatever payload a greedy read brings).
pub(super) const STAGING_LEN: usize = 128 << 10;
/// Payloads up to this size may be copied out of a greedy read: one
/// `recv` then carries several queued writes (capsules, R2T data), and a
/// copy of up to 32 KiB costs less than the receive syscalls (each taking
/// the socket lock that the sender's softirq also takes) that zero-copy
/// needs per write. Measured twice: 4 KiB in-capsule writes at QD32 under
/// spdk_nvme_perf ran at a quarter of nvmf_tgt's IOPS with 2.00 receives
/// per write; 16 KiB R2T writes at QD128 (`nvmf_initiator_load`) went from
/// 43-98 K to 119-195 K IOPS and from 2 to 0.13-0.22 receives per write
/// when this limit rose from 8 to 32 KiB (docs/nvmf.md, run N). At 64 KiB
/// the copy costs what the receives save. Larger payloads are received
/// straight into their buffer. The same limits as the NBD server's.
pub(super) const COPY_MAX: usize = 32 << 10;
/// Bytes read from the socket and not yet consumed.
pub(super) struct Staging {
    buf: Option<IoBuf>,
    start: usize,
    end: usize,
    /// The last PDU carried a large payload, or an R2T for one is due:
    /// read headers exactly, so the next large payload lands in its own
    /// buffer instead of being staged and copied.
    pub(super) exact: bool,
    /// PDUs started from the bytes of the latest receive. More than one:
    /// the host is streaming, so the next receive tries the socket directly
    /// before queueing a ring receive; one (QD1) goes straight to the ring,
    /// with no failed syscall before the response is sent.
    pub(super) pdus_per_recv: u32,
}

impl Staging {
    pub(super) fn new() -> Staging {
        Staging {
            buf: Some(IoBuf::heap(STAGING_LEN)),
            start: 0,
            end: 0,
            exact: true,
            pdus_per_recv: 0,
        }
    }

    pub(super) fn avail(&self) -> usize {
        self.end - self.start
    }

    fn bytes(&mut self) -> &mut [u8] {
        self.buf.as_mut().map_or(&mut [], |b| b.spare_mut())
    }

    pub(super) fn peek(&mut self, n: usize) -> &[u8] {
        let s = self.start;
        &self.bytes()[s..s + n]
    }

    pub(super) fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.avail());
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Receives until `need` bytes are staged. In exact mode a receive asks
    /// for at most `exact_max` staged bytes in all.
    pub(super) async fn fill(
        &mut self,
        fd: RawFd,
        need: usize,
        exact_max: usize,
    ) -> io::Result<()> {
        debug_assert!(need <= STAGING_LEN && need <= exact_max.max(need));
        while self.avail() < need {
            if self.start + need > STAGING_LEN {
                // Moves only a partial header (< `need` bytes).
                let (s, e) = (self.start, self.end);
                self.bytes().copy_within(s..e, 0);
                self.end -= s;
                self.start = 0;
            }
            let max = if self.exact {
                exact_max.max(need) - self.avail()
            } else {
                STAGING_LEN - self.end
            };
            // A streaming host: take what has arrived now, in this pass, so
            // a busy queue answers many commands per pass (and per
            // `sendmsg`) as SPDK's drain-until-EAGAIN does; an idle one
            // (QD1) goes straight to the ring and pays no failed syscall.
            let streaming = std::mem::take(&mut self.pdus_per_recv) > 1;
            let (res, calls) = ops::recv_staged(fd, &mut self.buf, self.end, max, streaming).await;
            stats::with(|c| inc(&c.recv_calls, calls));
            match res {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.end += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Receives `len` bytes into `buf[off..off + len]`: staged bytes first
    /// (copied once, counted), the rest straight from the socket, in one
    /// `recvmsg` (while data is queued) that also brings up to `tail` bytes
    /// of what follows (digest, next headers) into the emptied staging
    /// buffer, saving the next receive.
    pub(super) async fn payload(
        &mut self,
        fd: RawFd,
        mut buf: IoBuf,
        off: usize,
        len: usize,
        tail: usize,
    ) -> (io::Result<()>, IoBuf) {
        let n = len.min(self.avail());
        if n > 0 {
            let s = self.start;
            let src = &self
                .buf
                .as_ref()
                .map_or(&[][..], |b| &b.spare_ref()[s..s + n]);
            buf.spare_mut()[off..off + n].copy_from_slice(src);
            self.consume(n);
            stats::with(|c| {
                inc(&c.payload_copies, 1);
                inc(&c.payload_copied_bytes, n as u64);
            });
        }
        let rest = len - n;
        if rest == 0 {
            return (Ok(()), buf);
        }
        // The staged bytes are all consumed: what follows the payload goes
        // to the start of the staging buffer.
        debug_assert_eq!(self.avail(), 0);
        self.start = 0;
        self.end = 0;
        let tail = tail.min(STAGING_LEN);
        let Some(st) = self.buf.as_mut() else {
            return (Err(io::ErrorKind::BrokenPipe.into()), buf);
        };
        let segs = [
            // SAFETY: off + len <= capacity (the caller's range), so the
            // segment lies inside `buf`.
            Seg {
                ptr: unsafe { buf.as_mut_ptr().add(off + n) },
                len: rest,
            },
            Seg {
                ptr: st.as_mut_ptr(),
                len: tail,
            },
        ];
        let nseg = if tail > 0 { 2 } else { 1 };
        // SAFETY: both segments are memory this task owns (`buf` by value,
        // the staging buffer through `self`) for the whole call; the
        // receive is a synchronous recvmsg, so nothing writes to them after
        // it returns or its future is dropped.
        match unsafe { sock::recv_at_least(fd, &segs[..nseg], rest) }.await {
            Ok((got, calls)) => {
                stats::with(|c| inc(&c.recv_calls, calls));
                self.end = got - rest;
                (Ok(()), buf)
            }
            Err(e) => (Err(e), buf),
        }
    }

    /// Drops `n` bytes (padding, refused data).
    pub(super) async fn skip(&mut self, fd: RawFd, mut n: usize) -> io::Result<()> {
        while n > 0 {
            let k = n.min(STAGING_LEN / 2);
            self.fill(fd, k, k).await?;
            self.consume(k);
            n -= k;
        }
        Ok(())
    }
}

pub(super) trait SpareRef {
    fn spare_ref(&self) -> &[u8];
}

impl SpareRef for IoBuf {
    fn spare_ref(&self) -> &[u8] {
        // SAFETY: the buffer is valid for `capacity` bytes and we only read.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.capacity()) }
    }
}

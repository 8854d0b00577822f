//! The queue pair's receive buffer: `ustor_net`'s staging with the target's
//! read policy on top (exact header reads while a large payload may come)
//! and its counters (`recv_calls`, `payload_copies`).

use std::io;
use std::os::fd::RawFd;

use ustor_net::staging::{Filled, RecvMode, Rewind};
use ustor_net::Seg;
use ustor_runtime::IoBuf;

use super::super::stats::{self, inc};

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
/// straight into their buffer. The connection layer's limit, as NBD's.
pub(super) const COPY_MAX: usize = ustor_net::COPY_MAX;

/// Bytes read from the socket and not yet consumed.
pub(super) struct Staging {
    st: ustor_net::Staging,
    /// The last PDU carried a large payload, or an R2T for one is due:
    /// read headers exactly, so the next large payload lands in its own
    /// buffer instead of being staged and copied.
    pub(super) exact: bool,
}

fn count(f: Filled) {
    stats::with(|c| inc(&c.recv_calls, f.calls));
}

impl Staging {
    /// Made after ICReq (one heap allocation per connection).
    pub(super) fn new() -> Staging {
        Staging {
            st: ustor_net::Staging::new(STAGING_LEN, Rewind::Lazy),
            exact: true,
        }
    }

    pub(super) fn avail(&self) -> usize {
        self.st.avail()
    }

    pub(super) fn peek(&self, n: usize) -> &[u8] {
        self.st.peek(n)
    }

    pub(super) fn consume(&mut self, n: usize) {
        self.st.consume(n);
    }

    /// A PDU started from the staged bytes. More than one per receive: the
    /// host is streaming, so the next receive tries the socket directly
    /// before queueing a ring receive; one (QD1) goes straight to the ring,
    /// with no failed syscall before the response is sent.
    pub(super) fn note_pdu(&mut self) {
        self.st.note_unit();
    }

    /// Receives until `need` bytes are staged. In exact mode a receive asks
    /// for at most `exact_max` staged bytes in all.
    #[inline]
    pub(super) async fn fill(
        &mut self,
        fd: RawFd,
        need: usize,
        exact_max: usize,
    ) -> io::Result<()> {
        let max = if self.exact { exact_max } else { usize::MAX };
        let f = self.st.fill(fd, need, || max, RecvMode::Adaptive).await?;
        count(f);
        Ok(())
    }

    /// Receives `len` bytes into `buf[off..off + len]`: staged bytes first
    /// (copied once, counted), the rest straight from the socket, in one
    /// `recvmsg` (while data is queued) that also brings up to `tail` bytes
    /// of what follows (digest, next headers) into the emptied staging
    /// buffer, saving the next receive.
    #[inline]
    pub(super) async fn payload(
        &mut self,
        fd: RawFd,
        mut buf: IoBuf,
        off: usize,
        len: usize,
        tail: usize,
    ) -> (io::Result<()>, IoBuf) {
        assert!(off + len <= buf.capacity(), "payload beyond its buffer");
        let dst = [Seg {
            // SAFETY: off + len <= capacity (checked above).
            ptr: unsafe { buf.as_mut_ptr().add(off) },
            len,
        }];
        // SAFETY: `buf` is owned by this future for the whole call and the
        // segment lies inside it; the receive is a synchronous recvmsg, so
        // nothing writes to it after the call returns or is dropped.
        let r = unsafe { self.st.recv_payload(fd, &dst, tail) }.await;
        match r {
            Ok(p) => {
                stats::with(|c| {
                    if p.copied > 0 {
                        inc(&c.payload_copies, 1);
                        inc(&c.payload_copied_bytes, p.copied as u64);
                    }
                    inc(&c.recv_calls, p.calls);
                });
                (Ok(()), buf)
            }
            Err(e) => (Err(e), buf),
        }
    }

    /// Drops `n` bytes (padding, refused data).
    pub(super) async fn skip(&mut self, fd: RawFd, n: usize) -> io::Result<()> {
        if n == 0 {
            return Ok(());
        }
        let f = self.st.skip(fd, n as u64, RecvMode::Adaptive).await?;
        count(f);
        Ok(())
    }
}

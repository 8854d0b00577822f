//! The receive staging buffer every protocol reads its headers through.
//!
//! Receives are greedy (as much as the buffer holds, or as much as the
//! protocol allows) so that one receive brings every header, and every small
//! payload, the peer has sent. The protocol then peeks and consumes whole
//! units. A large payload is received with [`Staging::recv_payload`]: what
//! is staged already is copied out once (counted by the caller), the rest
//! lands straight in the caller's memory, in one `recvmsg` that also brings
//! the next headers into the emptied buffer.
//!
//! `buf[start..end]` holds the received, unconsumed bytes. The buffer is an
//! [`IoBuf`] owned by value so a ring receive can own it while in flight;
//! between receives it is always present.

use std::io;
use std::os::fd::RawFd;

use ustor_runtime::{ops, IoBuf};

use crate::recv::{self, Seg, MAX_RECV_IOV};

/// How [`Staging::fill`] receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvMode {
    /// Through the ring (one receive per reactor pass).
    Ring,
    /// A direct non-blocking receive first when the last receive brought
    /// more than one unit ([`Staging::note_unit`]): a streaming peer's data
    /// is taken in this pass; an idle one (QD1) goes straight to the ring
    /// and pays no failed syscall.
    Adaptive,
    /// Non-blocking receives and readiness polls only: the ring never owns
    /// the buffer, so dropping the future at any await loses nothing.
    Direct,
}

/// When staged bytes move back to the front of the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rewind {
    /// Only when what is needed would not fit behind them (moves least).
    Lazy,
    /// Whenever a receive is needed (leaves the most room per receive).
    Eager,
}

/// What one [`Staging::fill`] cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Filled {
    /// Receive syscalls or ring receives made.
    pub calls: u64,
    /// Staged bytes moved to the front of the buffer.
    pub moved: usize,
}

/// What one [`Staging::recv_payload`] cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Payload {
    /// Payload bytes copied out of the staging buffer.
    pub copied: usize,
    /// `recvmsg` calls made for the rest.
    pub calls: u64,
}

/// Bytes read from a socket and not yet consumed.
pub struct Staging {
    /// `None` only while a ring receive owns it.
    buf: Option<IoBuf>,
    cap: usize,
    start: usize,
    end: usize,
    rewind: Rewind,
    /// Units (headers) started since the last receive; see
    /// [`RecvMode::Adaptive`].
    units: u32,
}

fn broken() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "staging buffer lost")
}

impl Staging {
    /// An empty staging buffer of `cap` bytes (one heap allocation: make it
    /// after the handshake, not per accepted socket).
    pub fn new(cap: usize, rewind: Rewind) -> Staging {
        assert!(cap > 0, "staging needs room");
        Staging {
            buf: Some(IoBuf::heap(cap)),
            cap,
            start: 0,
            end: 0,
            rewind,
            units: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Staged bytes not yet consumed.
    pub fn avail(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.buf.as_mut().map_or(&mut [], |b| b.spare_mut())
    }

    /// The staged bytes.
    pub fn staged(&self) -> &[u8] {
        match &self.buf {
            // SAFETY: start <= end <= capacity; the bytes were received.
            Some(b) => unsafe {
                std::slice::from_raw_parts(b.as_ptr().add(self.start), self.end - self.start)
            },
            None => &[],
        }
    }

    /// The next `n` staged bytes (`n <= avail()`).
    pub fn peek(&self, n: usize) -> &[u8] {
        &self.staged()[..n]
    }

    /// Drops `n` staged bytes (`n <= avail()`); an emptied buffer starts
    /// over at its front.
    pub fn consume(&mut self, n: usize) {
        assert!(n <= self.avail(), "consumed more than staged");
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Counts one unit (header) started from the staged bytes.
    pub fn note_unit(&mut self) {
        self.units += 1;
    }

    /// Moves the staged bytes to the front of the buffer; returns how many
    /// moved.
    pub fn compact(&mut self) -> usize {
        if self.start == 0 {
            return 0;
        }
        let (s, e) = (self.start, self.end);
        self.bytes_mut().copy_within(s..e, 0);
        self.end -= s;
        self.start = 0;
        e - s
    }

    /// Grows the buffer to `cap` bytes, keeping what is staged (a small
    /// handshake buffer becomes the full one once the peer is admitted).
    pub fn grow(&mut self, cap: usize) {
        if cap <= self.cap {
            return;
        }
        let mut nb = IoBuf::heap(cap);
        let n = self.avail();
        nb.spare_mut()[..n].copy_from_slice(self.staged());
        self.buf = Some(nb);
        self.cap = cap;
        self.start = 0;
        self.end = n;
    }

    /// Appends `b` behind the staged bytes as a receive would (protocol
    /// unit tests drive [`crate::driver::Protocol::apply`] with it, no
    /// socket needed). Panics when it does not fit.
    pub fn stage_bytes(&mut self, b: &[u8]) {
        if self.end + b.len() > self.cap {
            self.compact();
        }
        assert!(self.end + b.len() <= self.cap, "staging overflow");
        let e = self.end;
        self.bytes_mut()[e..e + b.len()].copy_from_slice(b);
        self.end += b.len();
    }

    /// Copies up to `dst.len()` staged bytes into `dst` and consumes them;
    /// returns how many.
    pub fn take_into(&mut self, dst: &mut [u8]) -> usize {
        let n = dst.len().min(self.avail());
        dst[..n].copy_from_slice(&self.staged()[..n]);
        self.consume(n);
        n
    }

    /// Receives until at least `need` bytes are staged. Each receive asks
    /// for at most `max()` staged bytes in all (asked again after every
    /// wait: the protocol's state may change meanwhile), never less than
    /// `need`, never beyond the buffer.
    pub async fn fill(
        &mut self,
        fd: RawFd,
        need: usize,
        max: impl Fn() -> usize,
        mode: RecvMode,
    ) -> io::Result<Filled> {
        assert!(need <= self.cap, "need beyond the staging buffer");
        let mut f = Filled::default();
        // Budget: each round gains a byte, waits for readiness or fails.
        while self.avail() < need {
            if self.start > 0 && (self.rewind == Rewind::Eager || self.start + need > self.cap) {
                f.moved += self.compact();
            }
            let want = max().clamp(need, self.cap) - self.avail();
            let room = want.min(self.cap - self.end);
            let (res, calls) = self.recv_once(fd, room, mode).await;
            f.calls += calls;
            match res {
                Ok(Some(0)) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(Some(n)) => self.end += n,
                Ok(None) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(f)
    }

    /// One receive of up to `room` bytes at `end`; `Ok(None)`: nothing yet.
    async fn recv_once(
        &mut self,
        fd: RawFd,
        room: usize,
        mode: RecvMode,
    ) -> (io::Result<Option<usize>>, u64) {
        match mode {
            RecvMode::Direct => {
                let Some(b) = self.buf.as_mut() else {
                    return (Err(broken()), 0);
                };
                let seg = Seg {
                    // SAFETY: end + room <= capacity.
                    ptr: unsafe { b.as_mut_ptr().add(self.end) },
                    len: room,
                };
                // SAFETY: the segment lies inside our own buffer.
                match unsafe { recv::try_recv(fd, seg) } {
                    Ok(Some(n)) => (Ok(Some(n)), 1),
                    Ok(None) => (recv::readable(fd).await.map(|()| None), 1),
                    Err(e) => (Err(e), 1),
                }
            }
            RecvMode::Ring | RecvMode::Adaptive => {
                let streaming = mode == RecvMode::Adaptive && std::mem::take(&mut self.units) > 1;
                let (r, calls) =
                    ops::recv_staged(fd, &mut self.buf, self.end, room, streaming).await;
                (r.map(Some), calls)
            }
        }
    }

    /// Receives a payload of `dst`'s total length into `dst`: staged bytes
    /// first (copied once), the rest straight from the socket, in one
    /// `recvmsg` (while data is queued) that also brings up to `tail` bytes
    /// of what follows (digest, next headers) into the emptied buffer.
    ///
    /// # Safety
    /// Every segment of `dst` must be valid for writes for the whole call.
    pub async unsafe fn recv_payload(
        &mut self,
        fd: RawFd,
        dst: &[Seg],
        tail: usize,
    ) -> io::Result<Payload> {
        assert!(dst.len() < MAX_RECV_IOV, "too many payload segments");
        let mut segs = [Seg::EMPTY; MAX_RECV_IOV];
        let mut n = 0;
        let mut p = Payload::default();
        for d in dst {
            let k = d.len.min(self.avail());
            if k > 0 {
                // SAFETY: `d` is writable for d.len >= k bytes (contract);
                // the source is k staged bytes of our own buffer.
                unsafe { std::ptr::copy_nonoverlapping(self.staged().as_ptr(), d.ptr, k) };
                self.consume(k);
                p.copied += k;
            }
            if d.len > k {
                segs[n] = Seg {
                    ptr: d.ptr.wrapping_add(k),
                    len: d.len - k,
                };
                n += 1;
            }
        }
        let rest: usize = segs[..n].iter().map(|s| s.len).sum();
        if rest == 0 {
            return Ok(p);
        }
        // Every staged byte was consumed: what follows the payload goes to
        // the front of the buffer.
        debug_assert_eq!(self.avail(), 0);
        self.start = 0;
        self.end = 0;
        let tail = tail.min(self.cap);
        if tail > 0 {
            let b = self.buf.as_mut().ok_or_else(broken)?;
            segs[n] = Seg {
                ptr: b.as_mut_ptr(),
                len: tail,
            };
            n += 1;
        }
        // SAFETY: the caller's segments are writable (contract); the tail is
        // our own buffer, borrowed through `self` for the call, and the
        // receive is synchronous (nothing writes after it returns).
        let (got, calls) = unsafe { recv::recv_at_least(fd, &segs[..n], rest) }.await?;
        self.end = got - rest;
        p.calls = calls;
        Ok(p)
    }

    /// Drops `n` bytes (padding, refused data): staged ones first, then
    /// received in chunks of at most half the buffer.
    pub async fn skip(&mut self, fd: RawFd, mut n: u64, mode: RecvMode) -> io::Result<Filled> {
        let mut f = Filled::default();
        while n > 0 {
            let k = n.min((self.cap / 2).max(1) as u64) as usize;
            let g = self.fill(fd, k, || k, mode).await?;
            f.calls += g.calls;
            f.moved += g.moved;
            self.consume(k);
            n -= k as u64;
        }
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(s: &mut Staging, b: &[u8]) {
        s.stage_bytes(b);
    }

    #[test]
    fn consume_peek_and_rewind() {
        let mut s = Staging::new(16, Rewind::Lazy);
        stage(&mut s, b"hello world");
        assert_eq!(s.peek(5), b"hello");
        s.consume(6);
        assert_eq!(s.staged(), b"world");
        assert_eq!(s.compact(), 5);
        assert_eq!((s.start, s.end), (0, 5));
        s.consume(5);
        assert!(s.is_empty());
        assert_eq!((s.start, s.end), (0, 0), "emptied buffer starts over");
    }

    #[test]
    fn take_into_copies_what_is_staged() {
        let mut s = Staging::new(16, Rewind::Eager);
        stage(&mut s, b"abcdef");
        let mut d = [0u8; 4];
        assert_eq!(s.take_into(&mut d), 4);
        assert_eq!(&d, b"abcd");
        let mut d = [0u8; 4];
        assert_eq!(s.take_into(&mut d), 2);
        assert_eq!(&d[..2], b"ef");
        assert!(s.is_empty());
    }

    #[test]
    fn grow_keeps_the_staged_bytes() {
        let mut s = Staging::new(8, Rewind::Lazy);
        stage(&mut s, b"xyz12345");
        s.consume(3);
        s.grow(64);
        assert_eq!(s.capacity(), 64);
        assert_eq!(s.staged(), b"12345");
    }

    #[test]
    #[should_panic(expected = "consumed more than staged")]
    fn consuming_more_than_staged_is_a_bug() {
        let mut s = Staging::new(8, Rewind::Lazy);
        stage(&mut s, b"ab");
        s.consume(3);
    }
}

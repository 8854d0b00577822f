//! The send side of a session's connection, shared by the receive loop and
//! every running task: PDUs are queued into one batch (StatSN stamped in
//! queue order) and leave with one `sendmsg` per flush, one flush at a
//! time; a task whose PDUs ride in a flush under way waits for it. The
//! send is a direct non-blocking `sendmsg` unless the reactor will enter
//! its ring anyway this pass (SQEs queued, or the receive loop about to
//! re-arm its receive after a lone command's response): then it is one
//! more SQE in that enter, which sends it at once when the socket has
//! room (one syscall, not two: at QD1 a request costs two syscalls, the
//! enter that reaps its receive and the one that sends the response and
//! re-arms). The ring also takes what a full socket left. A
//! read's Data-In payload is not copied into the batch: it is sent from
//! the buffer the device read into ([`Tx::queue_held`]), which the batch
//! keeps until its send ends. A flush that does not finish within the
//! send timeout shuts the socket down, so a client that stops reading
//! cannot hold a session (or a drain) forever.

use std::cell::{Cell, RefCell};
use std::future::{poll_fn, Future};
use std::io;
use std::os::fd::RawFd;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::Duration;

use ustor_iscsi::wire::{pad4, Bhs, BHS_LEN};
use ustor_runtime::ops::{sendmsg, IoVecs, MAX_IOV};
use ustor_runtime::IoBuf;

use crate::io::ConnError;
use crate::pdu::Seq;
use crate::sess::Window;

/// First size of each send buffer; they grow to the largest flush.
const FIRST_OUT: usize = 8 << 10;

/// Iovecs one direct `sendmsg` takes at most (the ring's take
/// [`MAX_IOV`]).
const NOW_IOV: usize = 256;

/// Room for `more` bytes after `out`'s contents (a bigger buffer, the
/// contents moved, when it has none); the send queue's batches and the
/// login phase's buffer both grow this way.
pub(crate) fn reserve(out: &mut IoBuf, more: usize) {
    let len = out.len();
    if len + more > out.capacity() {
        let mut bigger = IoBuf::heap((len + more).next_power_of_two());
        bigger.spare_mut()[..len].copy_from_slice(out);
        bigger.set_len(len);
        *out = bigger;
    }
}

/// Appends `bytes` to `out` (room made by [`reserve`]).
pub(crate) fn append(out: &mut IoBuf, bytes: &[u8]) {
    let len = out.len();
    out.spare_mut()[len..len + bytes.len()].copy_from_slice(bytes);
    out.set_len(len + bytes.len());
}

/// A payload sent from a buffer of its own, placed before `out`'s byte at
/// `at`.
#[derive(Clone, Copy)]
struct Ext {
    at: usize,
    ptr: *const u8,
    len: usize,
}

/// One send's worth of queued PDUs: headers, digests, padding and small
/// data segments in `out`; payloads sent in place ([`Ext`]) from the
/// buffers in `held`, which the batch owns until it is sent.
struct Batch {
    out: IoBuf,
    ext: Vec<Ext>,
    held: Vec<IoBuf>,
    /// Bytes of the batch already sent.
    skip: usize,
}

impl Batch {
    fn new() -> Batch {
        let mut out = IoBuf::heap(FIRST_OUT);
        out.set_len(0);
        Batch {
            out,
            ext: Vec::new(),
            held: Vec::new(),
            skip: 0,
        }
    }

    /// Room for `more` bytes in `out`.
    fn reserve(&mut self, more: usize) {
        reserve(&mut self.out, more);
    }

    fn append(&mut self, bytes: &[u8]) {
        append(&mut self.out, bytes);
    }

    fn total(&self) -> usize {
        self.out.len() + self.ext.iter().map(|e| e.len).sum::<usize>()
    }

    /// The batch's bytes in order, as (start, length) segments.
    fn segments(&self) -> impl Iterator<Item = (*const u8, usize)> + '_ {
        let base = self.out.as_ptr();
        let tail = self.ext.last().map_or(0, |e| e.at);
        let mut from = 0;
        self.ext
            .iter()
            .flat_map(move |e| {
                let s = (base.wrapping_add(from), e.at - from);
                from = e.at;
                [s, (e.ptr, e.len)]
            })
            .chain(std::iter::once((
                base.wrapping_add(tail),
                self.out.len() - tail,
            )))
    }

    /// Iovecs for the bytes not sent yet (as many as `out` holds).
    fn fill_iov(&self, out: &mut [libc::iovec]) -> usize {
        let (mut skip, mut n) = (self.skip, 0);
        for (p, len) in self.segments() {
            if len <= skip {
                skip -= len;
                continue;
            }
            if n == out.len() {
                break;
            }
            out[n] = libc::iovec {
                iov_base: p.wrapping_add(skip) as *mut libc::c_void,
                iov_len: len - skip,
            };
            (skip, n) = (0, n + 1);
        }
        n
    }

    /// Empties the batch for reuse (the held buffers are freed).
    fn clear(&mut self) {
        self.out.set_len(0);
        self.ext.clear();
        self.held.clear();
        self.skip = 0;
    }
}

impl IoVecs for Batch {
    fn iovecs(&self, out: &mut [libc::iovec; MAX_IOV]) -> usize {
        self.fill_iov(out)
    }
}

struct State {
    cur: Batch,
    /// The other batch (none while a flush sends it).
    spare: Option<Batch>,
    flushing: bool,
    failed: bool,
    /// PDUs queued so far, how many of them a flush has taken, and how
    /// many have been sent.
    queued: u64,
    taken: u64,
    sent: u64,
}

/// Where a queued PDU's header sits, so it can be rewritten while it is
/// still unsent (the status of a read put into its last Data-In after the
/// Data-In was queued).
#[derive(Clone, Copy, Debug)]
pub struct Mark {
    /// The header's offset in the queue buffer.
    at: usize,
    /// PDUs queued up to and including this one.
    n: u64,
}

/// One connection's shared send queue.
pub struct Tx {
    fd: RawFd,
    st: RefCell<State>,
    waiters: RefCell<Vec<Waker>>,
    header_digest: bool,
    data_digest: bool,
    timeout: Cell<Duration>,
    /// StatSN of the next response (per connection).
    statsn: Cell<u32>,
    /// The session's ExpCmdSN and MaxCmdSN (shared by its connections,
    /// whichever reactor they run on).
    window: Arc<Window>,
}

impl Tx {
    pub fn new(
        fd: RawFd,
        digests: (bool, bool),
        timeout: Duration,
        statsn: u32,
        window: Arc<Window>,
    ) -> Tx {
        Tx {
            fd,
            st: RefCell::new(State {
                cur: Batch::new(),
                spare: Some(Batch::new()),
                flushing: false,
                failed: false,
                queued: 0,
                taken: 0,
                sent: 0,
            }),
            waiters: RefCell::default(),
            header_digest: digests.0,
            data_digest: digests.1,
            timeout: Cell::new(timeout),
            statsn: Cell::new(statsn),
            window,
        }
    }

    /// How long one flush may take before the connection ends.
    pub fn set_timeout(&self, d: Duration) {
        self.timeout.set(d);
    }

    /// The sequence numbers now (StatSN not advanced: Data-In, R2T,
    /// NOP-In pings).
    pub fn seq(&self) -> Seq {
        Seq {
            statsn: self.statsn.get(),
            exp_cmdsn: self.window.exp.get(),
            max_cmdsn: self.window.max.get(),
        }
    }

    /// Responses numbered on this connection that the initiator had not
    /// yet seen when it sent a PDU carrying `exp_statsn` (0 for a value
    /// outside the numbers given: a stale or bogus ExpStatSN).
    pub fn unseen(&self, exp_statsn: u32) -> u32 {
        let n = self.statsn.get().wrapping_sub(exp_statsn);
        if n > 1 << 20 {
            0
        } else {
            n
        }
    }

    /// The sequence numbers for a response, StatSN advanced past it.
    pub fn bump(&self) -> Seq {
        let s = self.seq();
        self.statsn.set(s.statsn.wrapping_add(1));
        s
    }

    /// Queues one PDU (header digest, padding and data digest added here).
    pub fn queue(&self, b: &Bhs, data: &[u8]) {
        self.queue_marked(b, data);
    }

    /// Rewrites the header of the PDU at `m` with `b` (same data length)
    /// if no flush has taken it yet and, with `only_if_last`, no PDU was
    /// queued after it (a header that takes a StatSN must not go out
    /// behind responses numbered after it); whether it was rewritten.
    pub fn rewrite(&self, m: Mark, b: &Bhs, only_if_last: bool) -> bool {
        let mut st = self.st.borrow_mut();
        if st.taken >= m.n || (only_if_last && st.queued != m.n) {
            return false;
        }
        let (at, out) = (m.at, &mut st.cur.out[..]);
        out[at..at + BHS_LEN].copy_from_slice(&b.0);
        if self.header_digest {
            let d = crc32c::crc32c(&b.0).to_le_bytes();
            out[at + BHS_LEN..at + BHS_LEN + 4].copy_from_slice(&d);
        }
        true
    }

    /// Queues one PDU; where its header sits, for [`Tx::rewrite`].
    pub fn queue_marked(&self, b: &Bhs, data: &[u8]) -> Mark {
        debug_assert_eq!(b.data_len(), data.len());
        let mut st = self.st.borrow_mut();
        let q = &mut st.cur;
        q.reserve(BHS_LEN + 4 + pad4(data.len()) + 4);
        let at = self.header(q, b);
        if !data.is_empty() {
            q.append(data);
            self.trailer(q, data);
        }
        st.queued += 1;
        Mark { at, n: st.queued }
    }

    /// Queues PDUs whose data segments are the first `len` bytes of `buf`
    /// in pieces of at most `max`, sent from `buf` itself (no copy);
    /// `header(at, n)` makes the header of the piece at `at`. `buf` is
    /// kept until the flush that sends them ends. Where the last header
    /// sits (`None` for no data).
    pub fn queue_held(
        &self,
        buf: IoBuf,
        len: usize,
        max: usize,
        mut header: impl FnMut(usize, usize) -> Bhs,
    ) -> Option<Mark> {
        assert!(len <= buf.len() && max > 0, "Data-In beyond its buffer");
        let mut st = self.st.borrow_mut();
        let mut mark = None;
        let mut start = 0;
        // Budget: each round queues a non-empty piece.
        while start < len {
            let n = (len - start).min(max);
            let b = header(start, n);
            debug_assert_eq!(b.data_len(), n);
            let q = &mut st.cur;
            q.reserve(BHS_LEN + 4 + 3 + 4);
            let at = self.header(q, &b);
            let at_data = q.out.len();
            q.ext.push(Ext {
                at: at_data,
                ptr: buf.as_ptr().wrapping_add(start),
                len: n,
            });
            self.trailer(q, &buf[start..start + n]);
            st.queued += 1;
            mark = Some(Mark { at, n: st.queued });
            start += n;
        }
        if mark.is_some() {
            st.cur.held.push(buf);
        }
        mark
    }

    /// Appends a header (and its digest); where it starts.
    fn header(&self, q: &mut Batch, b: &Bhs) -> usize {
        let at = q.out.len();
        q.append(&b.0);
        if self.header_digest {
            q.append(&crc32c::crc32c(&b.0).to_le_bytes());
        }
        at
    }

    /// Appends the padding and data digest of a data segment `data`.
    fn trailer(&self, q: &mut Batch, data: &[u8]) {
        let pad = [0u8; 3];
        let p = pad4(data.len()) - data.len();
        q.append(&pad[..p]);
        if self.data_digest {
            let d = crc32c::crc32c_append(crc32c::crc32c(data), &pad[..p]);
            q.append(&d.to_le_bytes());
        }
    }

    /// Ends the connection: the socket is shut down (the receive loop sees
    /// its end) and nothing more is sent.
    pub fn close(&self) {
        self.st.borrow_mut().failed = true;
        ustor_net::recv::shutdown(self.fd);
    }

    /// Queues one PDU and waits until it is sent.
    pub async fn send(&self, b: &Bhs, data: &[u8]) -> Result<(), ConnError> {
        self.queue(b, data);
        self.flush().await
    }

    /// Returns once everything queued before the call has been sent.
    pub async fn flush(&self) -> Result<(), ConnError> {
        self.flush_with(false).await
    }

    /// [`Tx::flush`] of a response that the receive loop's next receive
    /// follows in this reactor pass: its send goes through the ring, ahead
    /// of that receive and in the same `io_uring_enter` (one syscall for
    /// both, where a direct `sendmsg` and then the enter made two).
    pub async fn flush_before_recv(&self) -> Result<(), ConnError> {
        self.flush_with(true).await
    }

    async fn flush_with(&self, ring: bool) -> Result<(), ConnError> {
        let want = self.st.borrow().queued;
        // Budget: each round either sends a buffer or waits for the flush
        // under way, which ends (sent, failed or timed out).
        loop {
            let buf = {
                let mut st = self.st.borrow_mut();
                if st.failed {
                    return Err(ConnError::Io(io::ErrorKind::BrokenPipe.into()));
                }
                if st.sent >= want {
                    return Ok(());
                }
                if st.flushing {
                    None
                } else {
                    st.flushing = true;
                    st.taken = st.queued;
                    let spare = st.spare.take().expect("idle sender has its spare");
                    Some((std::mem::replace(&mut st.cur, spare), st.queued))
                }
            };
            let Some((buf, upto)) = buf else {
                self.changed().await;
                continue;
            };
            let (res, mut buf) = self.send_timed(buf, ring).await;
            buf.clear();
            {
                let mut st = self.st.borrow_mut();
                st.spare = Some(buf);
                st.flushing = false;
                st.sent = upto;
                st.failed |= res.is_err();
            }
            self.waiters.borrow_mut().drain(..).for_each(Waker::wake);
            res?;
        }
    }

    /// Waits until the flush under way ends.
    async fn changed(&self) {
        let mut parked = false;
        poll_fn(|cx| {
            if parked {
                return Poll::Ready(());
            }
            parked = true;
            self.waiters.borrow_mut().push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Sends `b`: direct non-blocking sends first (a socket with room,
    /// the common case, takes it without waiting a reactor pass for a ring
    /// completion), the ring for what they left; past the timeout the
    /// socket is shut down, which ends the send (the buffers are never
    /// abandoned to the kernel).
    async fn send_timed(&self, mut b: Batch, ring: bool) -> (Result<(), ConnError>, Batch) {
        // With SQEs already queued, or a receive about to be (`ring`), the
        // reactor enters the ring anyway: the send rides in that enter and
        // completes inside it when the socket has room.
        let rides = if ring {
            ustor_runtime::uring::on_reactor()
        } else {
            ustor_runtime::uring::sq_pending()
        };
        if !rides {
            match send_now(self.fd, &mut b) {
                Ok(true) => return (Ok(()), b),
                Ok(false) => {}
                Err(e) => return (Err(ConnError::Io(e)), b),
            }
        }
        let mut s = pin!(send_rest(self.fd, b));
        let mut t = pin!(ustor_runtime::sleep(self.timeout.get()));
        let mut late = false;
        let (res, b) = poll_fn(|cx| {
            if let Poll::Ready(v) = s.as_mut().poll(cx) {
                return Poll::Ready(v);
            }
            if !late && t.as_mut().poll(cx).is_ready() {
                late = true;
                ustor_net::recv::shutdown(self.fd);
                cx.waker().wake_by_ref();
            }
            Poll::Pending
        })
        .await;
        let res = match res {
            Err(_) if late => Err(ConnError::SendTimeout(self.timeout.get().as_secs())),
            r => r.map_err(ConnError::Io),
        };
        (res, b)
    }
}

/// Non-blocking sends of `b` while the socket takes all it is given;
/// whether all of `b` went.
fn send_now(fd: RawFd, b: &mut Batch) -> io::Result<bool> {
    let total = b.total();
    let mut iov = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; NOW_IOV];
    // Budget: each round sends every byte its iovecs hold, or returns.
    while b.skip < total {
        let n = b.fill_iov(&mut iov);
        let want: usize = iov[..n].iter().map(|v| v.iov_len).sum();
        // SAFETY: the iovecs describe `b.out` and the buffers `b.held`
        // owns, borrowed for the call.
        let sent = match unsafe { ustor_runtime::ops::sendmsg_now(fd, &iov[..n]) } {
            Ok(k) => k,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(false),
            Err(e) => return Err(e),
        };
        b.skip += sent;
        if sent < want {
            return Ok(b.skip >= total);
        }
    }
    Ok(true)
}

/// Sends the rest of `b` through the ring (which waits for room).
async fn send_rest(fd: RawFd, mut b: Batch) -> (io::Result<()>, Batch) {
    let total = b.total();
    // Budget: each round sends a byte or returns.
    while b.skip < total {
        let (res, back) = sendmsg(fd, b).await;
        b = back;
        match res {
            Ok(0) => return (Err(io::ErrorKind::UnexpectedEof.into()), b),
            Ok(n) => b.skip += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if let Err(e) = ustor_net::recv::writable(fd).await {
                    return (Err(e), b);
                }
            }
            Err(e) => return (Err(e), b),
        }
    }
    (Ok(()), b)
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;
    use std::task::{Context, Wake};

    use ustor_iscsi::wire::opcode;

    use super::*;
    use crate::sess::Window;

    struct Noop;

    impl Wake for Noop {
        fn wake(self: Arc<Self>) {}
    }

    fn pdu(itt: u32, len: usize) -> Bhs {
        let mut b = Bhs::new(opcode::DATA_IN, false, 0);
        b.set_itt(itt).set_data_len(len);
        b
    }

    /// A header rewritten only while unsent (and, for a status, while
    /// last); the bytes sent carry the new header, its digest and the
    /// data unchanged.
    #[test]
    fn a_queued_header_is_rewritten_only_while_unsent_and_last() {
        let (a, mut peer) = UnixStream::pair().unwrap();
        let window = Window::new(1, 4, false);
        let tx = Tx::new(
            a.as_raw_fd(),
            (true, false),
            Duration::from_secs(5),
            7,
            window,
        );
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        let m1 = tx.queue_marked(&pdu(1, 4096), &data);
        assert!(tx.rewrite(m1, &pdu(11, 4096), true), "last and unsent");
        let m2 = tx.queue_marked(&pdu(2, 3), &data[..3]);
        assert!(!tx.rewrite(m1, &pdu(12, 4096), true), "a PDU follows it");
        assert!(tx.rewrite(m1, &pdu(13, 4096), false), "unsent");
        let waker = Waker::from(Arc::new(Noop));
        let mut cx = Context::from_waker(&waker);
        let mut f = pin!(tx.flush());
        assert!(matches!(f.as_mut().poll(&mut cx), Poll::Ready(Ok(()))));
        assert!(!tx.rewrite(m2, &pdu(14, 3), false), "already sent");
        let mut got = vec![0u8; 2 * (BHS_LEN + 4) + 4096 + 4];
        peer.read_exact(&mut got).unwrap();
        let h1 = Bhs(got[..BHS_LEN].try_into().unwrap());
        assert_eq!(h1.itt(), 13);
        let d1 = u32::from_le_bytes(got[BHS_LEN..BHS_LEN + 4].try_into().unwrap());
        assert_eq!(d1, crc32c::crc32c(&h1.0), "header digest of the rewrite");
        assert!(got[BHS_LEN + 4..BHS_LEN + 4 + 4096] == data[..]);
        let at = BHS_LEN + 4 + 4096;
        assert_eq!(Bhs(got[at..at + BHS_LEN].try_into().unwrap()).itt(), 2);
    }
}

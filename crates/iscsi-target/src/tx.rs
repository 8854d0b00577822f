//! The send side of a session's connection, shared by the receive loop and
//! every running task: PDUs are queued into one buffer (StatSN stamped in
//! queue order) and leave with one `send` per flush, one flush at a time
//! (a direct non-blocking send; the ring only for what a full socket left);
//! a task whose PDUs ride in a flush under way waits for it. A flush that
//! does not finish within the send timeout shuts the socket down, so a
//! client that stops reading cannot hold a session (or a drain) forever.

use std::cell::{Cell, RefCell};
use std::future::{poll_fn, Future};
use std::io;
use std::os::fd::RawFd;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::Duration;

use ustor_iscsi::wire::{pad4, Bhs, BHS_LEN};
use ustor_runtime::ops::send;
use ustor_runtime::IoBuf;

use crate::io::ConnError;
use crate::pdu::Seq;
use crate::sess::Window;

/// First size of each send buffer; they grow to the largest flush.
const FIRST_OUT: usize = 8 << 10;

struct State {
    out: IoBuf,
    /// The other buffer (none while a flush sends it).
    spare: Option<IoBuf>,
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
/// Data-In was queued, the data copied into the queue once).
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
        let buf = || {
            let mut b = IoBuf::heap(FIRST_OUT);
            b.set_len(0);
            b
        };
        Tx {
            fd,
            st: RefCell::new(State {
                out: buf(),
                spare: Some(buf()),
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
        let (at, out) = (m.at, &mut st.out[..]);
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
        let need = st.out.len() + BHS_LEN + 4 + pad4(data.len()) + 4;
        if need > st.out.capacity() {
            let len = st.out.len();
            let mut bigger = IoBuf::heap(need.next_power_of_two());
            bigger.spare_mut()[..len].copy_from_slice(&st.out);
            bigger.set_len(len);
            st.out = bigger;
        }
        let at = st.out.len();
        append(&mut st.out, &b.0);
        if self.header_digest {
            append(&mut st.out, &crc32c::crc32c(&b.0).to_le_bytes());
        }
        if !data.is_empty() {
            append(&mut st.out, data);
            let pad = [0u8; 3];
            let p = pad4(data.len()) - data.len();
            append(&mut st.out, &pad[..p]);
            if self.data_digest {
                let d = crc32c::crc32c_append(crc32c::crc32c(data), &pad[..p]);
                append(&mut st.out, &d.to_le_bytes());
            }
        }
        st.queued += 1;
        Mark { at, n: st.queued }
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
                    Some((std::mem::replace(&mut st.out, spare), st.queued))
                }
            };
            let Some((buf, upto)) = buf else {
                self.changed().await;
                continue;
            };
            let (res, mut buf) = self.send_timed(buf).await;
            buf.set_len(0);
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

    /// Sends `buf`: a direct non-blocking send first (a socket with room,
    /// the common case, takes it without waiting a reactor pass for a ring
    /// completion), the ring for what it left; past the timeout the socket
    /// is shut down, which ends the send (the buffer is never abandoned to
    /// the kernel).
    async fn send_timed(&self, buf: IoBuf) -> (Result<(), ConnError>, IoBuf) {
        let at = match send_now(self.fd, &buf) {
            Ok(n) if n == buf.len() => return (Ok(()), buf),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
            Err(e) => return (Err(ConnError::Io(e)), buf),
        };
        let mut s = pin!(send_rest(self.fd, buf, at));
        let mut t = pin!(ustor_runtime::sleep(self.timeout.get()));
        let mut late = false;
        let (res, buf) = poll_fn(|cx| {
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
        (res, buf)
    }
}

/// One non-blocking send of all of `buf`; the bytes the socket took.
fn send_now(fd: RawFd, buf: &IoBuf) -> io::Result<usize> {
    let iov = [libc::iovec {
        iov_base: buf.as_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    }];
    // SAFETY: the iovec describes `buf`'s bytes, borrowed for the call.
    unsafe { ustor_runtime::ops::sendmsg_now(fd, &iov) }
}

/// Sends `buf[at..]` through the ring (which waits for room).
async fn send_rest(fd: RawFd, mut buf: IoBuf, mut at: usize) -> (io::Result<()>, IoBuf) {
    let end = buf.len();
    // Budget: each round sends a byte or returns.
    while at < end {
        let (res, b) = send(fd, buf, at, end).await;
        buf = b;
        match res {
            Ok(0) => return (Err(io::ErrorKind::UnexpectedEof.into()), buf),
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if let Err(e) = ustor_net::recv::writable(fd).await {
                    return (Err(e), buf);
                }
            }
            Err(e) => return (Err(e), buf),
        }
    }
    (Ok(()), buf)
}

fn append(out: &mut IoBuf, bytes: &[u8]) {
    let len = out.len();
    out.spare_mut()[len..len + bytes.len()].copy_from_slice(bytes);
    out.set_len(len + bytes.len());
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

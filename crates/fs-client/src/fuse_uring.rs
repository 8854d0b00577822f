//! FUSE over io_uring (Linux 6.14+, `/sys/module/fuse/parameters/enable_uring`):
//! the kernel's requests arrive in ring entries we registered instead of
//! through `read` on /dev/fuse, and are answered by the same ring command
//! that fetches the next one.
//!
//! Ring layout (Documentation/filesystems/fuse-io-uring.rst): one queue per
//! possible CPU (`qid`); a request goes to the queue of the CPU its caller
//! runs on, and the kernel uses the ring only once every queue has an entry.
//! An entry is two buffers: a 288-byte `fuse_uring_req_header` (in/out
//! header, per-op header, and `fuse_uring_ent_in_out` with the commit id and
//! payload size) and a payload buffer of at least max_write. It is
//! registered by an `IORING_OP_URING_CMD` (128-byte SQE: the command area
//! holds `fuse_uring_cmd_req` {flags, commit_id, qid}) with `cmd_op`
//! REGISTER and `addr`/`len` naming the two iovecs; its completion means a
//! request was placed in it. The reply goes into the same buffers and
//! `COMMIT_AND_FETCH` (with the request's commit id) answers it and re-arms
//! the entry. INIT, and requests the kernel sends before the ring is ready
//! (and interrupts), still come through /dev/fuse.
//!
//! [`Queues::serve`] runs the queues of one ring on its thread (the mount
//! makes one ring per CPU, `crate::session`), handing each request to the
//! same handler as the /dev/fuse path ([`crate::ll`]).

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::ll::{self, InHeader, Op};
use crate::pagebuf::PageBuf;

/// `fuse_uring_req_header`: in_out (128), op_in (128), ring_ent_in_out (32).
pub const REQ_HEADER_LEN: usize = 288;
const OP_IN: usize = 128;
const ENT_IN_OUT: usize = 256;
/// `enum fuse_uring_cmd`.
const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// What a handler answers: an errno (0: success) and the reply body.
pub type Answer = (i32, Vec<u8>);

/// A reply body for [`Queues::serve_placed`].
pub enum Body {
    /// Bytes to copy into the entry.
    Bytes(Vec<u8>),
    /// This many bytes already written into the entry's payload buffer
    /// (a READ's data, received there straight from the socket).
    Placed(usize),
}

/// Whether the kernel offers FUSE over io_uring now (the module parameter
/// reads Y).
pub fn enabled() -> bool {
    std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
        .map(|s| s.trim() == "Y")
        .unwrap_or(false)
}

/// Number of queues the kernel expects: its possible CPUs (`0-N` ranges).
pub fn possible_cpus() -> usize {
    let s = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap_or_default();
    let mut max = 0;
    for part in s.trim().split(',') {
        let hi = part
            .rsplit('-')
            .next()
            .and_then(|x| x.parse::<usize>().ok());
        max = max.max(hi.map_or(0, |h| h + 1));
    }
    max.max(1)
}

/// One registered entry: its buffers (kept at fixed addresses while the
/// kernel may write them) and queue.
struct Entry {
    qid: u16,
    head: Box<[u8; REQ_HEADER_LEN]>,
    /// Page-aligned: the kernel copies a write's pages into it and
    /// a read's reply out of it ([`crate::pagebuf`]).
    payload: PageBuf,
    iov: Box<[libc::iovec; 2]>,
}

/// The ring queues of one FUSE connection.
pub struct Queues {
    fd: RawFd,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    ents: Vec<Entry>,
    /// COMMIT_AND_FETCHes submitted: requests answered through the ring.
    pub commits: Arc<AtomicU64>,
    /// Completions of one wait (kept: a Vec per request before).
    done: Vec<(usize, i32)>,
}

impl Queues {
    /// Sets up `per_queue` entries for each queue of `qids` on the FUSE
    /// connection `fd` (INIT already answered with FUSE_OVER_IO_URING),
    /// payload buffers of `payload` bytes (at least max_write). The ring
    /// belongs to the calling thread: its commands complete as that
    /// thread's task work, so it must be served there.
    pub fn new(fd: RawFd, qids: &[u16], per_queue: usize, payload: usize) -> io::Result<Queues> {
        let n = qids.len() * per_queue;
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .build((2 * n).next_power_of_two() as u32)?;
        let mut ents = Vec::with_capacity(n);
        for &q in qids {
            for _ in 0..per_queue {
                let mut e = Entry {
                    qid: q,
                    head: Box::new([0; REQ_HEADER_LEN]),
                    payload: PageBuf::zeroed(payload),
                    iov: Box::new(
                        [libc::iovec {
                            iov_base: std::ptr::null_mut(),
                            iov_len: 0,
                        }; 2],
                    ),
                };
                e.iov[0] = libc::iovec {
                    iov_base: e.head.as_mut_ptr().cast(),
                    iov_len: REQ_HEADER_LEN,
                };
                e.iov[1] = libc::iovec {
                    iov_base: e.payload.as_mut_ptr().cast(),
                    iov_len: payload,
                };
                ents.push(e);
            }
        }
        let mut qs = Queues {
            fd,
            ring,
            ents,
            commits: Arc::new(AtomicU64::new(0)),
            done: Vec::new(),
        };
        for i in 0..qs.ents.len() {
            qs.push(i, CMD_REGISTER, 0)?;
        }
        qs.ring.submit()?;
        Ok(qs)
    }

    /// Queues the ring command `cmd` for entry `i`.
    fn push(&mut self, i: usize, cmd: u32, commit_id: u64) -> io::Result<()> {
        let e = &self.ents[i];
        let mut req = [0u8; 80];
        req[8..16].copy_from_slice(&commit_id.to_le_bytes());
        req[16..18].copy_from_slice(&e.qid.to_le_bytes());
        let sqe = opcode::UringCmd80::new(types::Fd(self.fd), cmd)
            .cmd(req)
            .addr(Some(e.iov.as_ptr() as u64))
            .build()
            .user_data(i as u64);
        let sqe = with_len(sqe, 2);
        // SAFETY: the iovecs and the buffers they name live in `self.ents`
        // (boxed, never moved or freed while the ring exists: `Queues`
        // drops the ring first, field order) for as long as the kernel
        // may use them.
        unsafe { self.ring.submission().push(&sqe) }
            .map_err(|_| io::Error::from_raw_os_error(libc::EBUSY))
    }

    /// Serves requests until the connection ends (unmount: the commands
    /// complete with an error), answering each with `handle`. Returns the
    /// error that ended it (ENOTCONN/ECONNABORTED/ENODEV after an unmount).
    pub fn serve(
        &mut self,
        mut handle: impl FnMut(&InHeader, Result<Op<'_>, ll::WireError>) -> Option<Answer>,
    ) -> io::Error {
        self.serve_placed(|h, op, _| handle(h, op).map(|(e, b)| (e, Body::Bytes(b))))
    }

    /// [`Queues::serve`] whose handler is also given, for a READ, the
    /// entry's payload buffer (empty for every other op) to write the
    /// reply's data into ([`Body::Placed`]): no copy of ours between the
    /// socket and the kernel.
    pub fn serve_placed(
        &mut self,
        mut handle: impl FnMut(
            &InHeader,
            Result<Op<'_>, ll::WireError>,
            &mut [u8],
        ) -> Option<(i32, Body)>,
    ) -> io::Error {
        // Budget: each round waits for completions and re-arms their
        // entries, or ends on an error.
        loop {
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return e;
            }
            let mut done = std::mem::take(&mut self.done);
            done.clear();
            done.extend(
                self.ring
                    .completion()
                    .map(|c| (c.user_data() as usize, c.result())),
            );
            for &(i, res) in &done {
                if res < 0 {
                    return io::Error::from_raw_os_error(-res);
                }
                let commit_id = self.answer(i, &mut handle);
                if let Err(e) = self.push(i, CMD_COMMIT_AND_FETCH, commit_id) {
                    return e;
                }
                self.commits.fetch_add(1, Ordering::Relaxed);
            }
            self.done = done;
        }
    }

    /// Decodes entry `i`'s request, runs `handle`, writes the reply into
    /// the entry; returns the commit id.
    fn answer(
        &mut self,
        i: usize,
        handle: &mut impl FnMut(
            &InHeader,
            Result<Op<'_>, ll::WireError>,
            &mut [u8],
        ) -> Option<(i32, Body)>,
    ) -> u64 {
        let e = &mut self.ents[i];
        let commit_id = u64::from_le_bytes(
            e.head[ENT_IN_OUT + 8..ENT_IN_OUT + 16]
                .try_into()
                .expect("8"),
        );
        let psz = u32::from_le_bytes(
            e.head[ENT_IN_OUT + 16..ENT_IN_OUT + 20]
                .try_into()
                .expect("4"),
        ) as usize;
        let cap = e.payload.len();
        let (errno, n) = match ll::in_header(&e.head[..]) {
            Ok(h) => {
                let op_in = &e.head[OP_IN..ENT_IN_OUT];
                // A READ brings no payload and may answer into the buffer.
                let a = if h.opcode == ll::opcode::READ {
                    handle(&h, ll::decode_op(h.opcode, op_in, &[]), &mut e.payload)
                } else {
                    let op = ll::decode_op(h.opcode, op_in, &e.payload[..psz.min(cap)]);
                    handle(&h, op, &mut [])
                };
                let (errno, n) = match a.unwrap_or((0, Body::Bytes(Vec::new()))) {
                    (0, Body::Bytes(b)) => {
                        let n = b.len().min(cap);
                        e.payload[..n].copy_from_slice(&b[..n]);
                        (0, n)
                    }
                    (0, Body::Placed(n)) => (0, n.min(cap)),
                    (errno, _) => (errno, 0),
                };
                e.head[..ll::OUT_HEADER_LEN].copy_from_slice(&ll::out_header(h.unique, errno, n));
                (errno, n)
            }
            Err(err) => (err.errno(), 0),
        };
        debug_assert!(errno == 0 || n == 0);
        e.head[ENT_IN_OUT + 16..ENT_IN_OUT + 20].copy_from_slice(&(n as u32).to_le_bytes());
        commit_id
    }
}

/// Sets a 128-byte SQE's `len` (offset 24), which `UringCmd80` leaves 0:
/// FUSE's REGISTER reads the iovec count there.
fn with_len(sqe: squeue::Entry128, len: u32) -> squeue::Entry128 {
    // SAFETY: Entry128 is repr(C), exactly the kernel's 128-byte SQE (the
    // crate asserts the size); byte 24..28 is `len` in `struct
    // io_uring_sqe`, a plain u32 any value of which is valid.
    unsafe {
        let mut raw: [u8; 128] = std::mem::transmute(sqe);
        raw[24..28].copy_from_slice(&len.to_le_bytes());
        std::mem::transmute::<[u8; 128], squeue::Entry128>(raw)
    }
}

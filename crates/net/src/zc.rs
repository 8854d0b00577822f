//! Zero-copy sends of a [`PduGroup`] (`IORING_OP_SENDMSG_ZC`): the kernel
//! sends straight from the group's memory (the arena, payload buffers and
//! the caller-owned ranges of [`PduGroup::push_raw`]) and reads it until
//! its notification, which for TCP comes once the data is acknowledged.
//!
//! So the group cannot be cleared and refilled after its send returns, as
//! the plain path does: it moves into a [`Held`] shared by its send ops and
//! comes back to the connection's spare list only when the last of their
//! notifications arrived; the sender goes on with a spare group. The
//! protocol's [`ZcSink`] then gets the group's holds back (what it kept
//! unchanged for the kernel) and what the kernel reported.
//!
//! Where it pays: the kernel pins the pages and posts a second completion
//! per send, so small sends cost more than the copy they save, and on
//! loopback (or a device without scatter-gather) the kernel copies anyway
//! (reported as copied). Protocols ask for it per group, for large
//! payloads.

use std::cell::{Cell, RefCell};
use std::io;
use std::os::fd::RawFd;
use std::rc::Rc;

use ustor_runtime::ops::{IoVecs, MAX_IOV};
use ustor_runtime::zc::{self, ZcNotice};

use crate::group::PduGroup;

/// A group sent zero-copy, once the kernel released it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ZcDone {
    /// Holds the protocol took on the group ([`PduGroup::want_zero_copy`]).
    pub holds: u32,
    /// Notifications of the zero-copy send ops that carried the group (0:
    /// it left by a plain `sendmsg`: no kernel support, or the socket
    /// refused zero copy).
    pub sends: u32,
    /// Of those, the ones that said the kernel copied (an op that sent
    /// nothing, EAGAIN, reports that too: the group then does not count
    /// as zero-copy, the safe side).
    pub copied: u32,
    /// Payload bytes the group carried by reference.
    pub raw_bytes: u64,
}

/// The protocol's report of [`ZcDone`]s; runs on the connection's reactor,
/// possibly after the connection closed.
pub type ZcSink = Rc<dyn Fn(ZcDone)>;

/// A connection's zero-copy state: the sink, spare groups, and whether the
/// socket takes zero-copy sends (off for good after a refusal).
pub struct ZcSender {
    sink: ZcSink,
    spare: Rc<RefCell<Vec<PduGroup>>>,
    usable: Cell<bool>,
    segs: usize,
    arena: usize,
}

impl ZcSender {
    /// Groups like the connection's own: `segs` segments, `arena` bytes.
    pub fn new(sink: ZcSink, segs: usize, arena: usize) -> ZcSender {
        ZcSender {
            sink,
            spare: Rc::new(RefCell::new(Vec::new())),
            usable: Cell::new(zc::send_zc_supported()),
            segs,
            arena,
        }
    }

    /// Sends all of `g` (which asked for zero copy); returns an empty group
    /// to fill next. The sink hears of `g` once the kernel released it.
    pub async fn send(
        &self,
        fd: RawFd,
        g: PduGroup,
        calls: &mut u64,
    ) -> (io::Result<()>, PduGroup) {
        let next = self
            .spare
            .borrow_mut()
            .pop()
            .unwrap_or_else(|| PduGroup::with_capacity(self.segs, self.arena));
        if !self.usable.get() {
            let done = ZcDone {
                holds: g.holds(),
                raw_bytes: g.raw_bytes() as u64,
                ..ZcDone::default()
            };
            // `send_all` hands the group back cleared.
            let (r, g) = crate::sender::send_all(fd, g, calls).await;
            (self.sink)(done);
            self.spare.borrow_mut().push(g);
            return (r, next);
        }
        let held = Rc::new(Held {
            g: RefCell::new(Some(g)),
            sends: Cell::new(0),
            copied: Cell::new(0),
            sink: self.sink.clone(),
            spare: self.spare.clone(),
        });
        let r = self.send_held(fd, &held, calls).await;
        drop(held);
        (r, next)
    }

    /// A group that will never be sent (the connection died): its holds go
    /// back to the protocol now.
    pub fn discard(&self, g: &PduGroup) {
        if g.holds() > 0 {
            (self.sink)(ZcDone {
                holds: g.holds(),
                raw_bytes: g.raw_bytes() as u64,
                ..ZcDone::default()
            });
        }
    }

    async fn send_held(&self, fd: RawFd, held: &Rc<Held>, calls: &mut u64) -> io::Result<()> {
        // Budget: each round sends at least a byte, waits for room, falls
        // back to plain sends, or ends the loop.
        loop {
            let r = zc::sendmsg_zc(fd, HeldRef(held.clone()), noted).await;
            *calls += 1;
            match r {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    if held.group().advance(n) {
                        return Ok(());
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    crate::recv::writable(fd).await?
                }
                // A socket without zero-copy support (not TCP/UDP): plain
                // sends from now on, starting with the rest of this group.
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                    self.usable.set(false);
                    return send_rest(fd, held, calls).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// The rest of a held group by plain non-blocking `sendmsg`s (it may still
/// be shared with earlier zero-copy ops awaiting their notification, so it
/// cannot move to [`crate::sender::send_all`]).
async fn send_rest(fd: RawFd, held: &Held, calls: &mut u64) -> io::Result<()> {
    // Budget: each round sends at least a byte, waits for room, or ends.
    loop {
        let r = crate::sender::try_send(fd, &held.group());
        *calls += 1;
        match r {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                if held.group().advance(n) {
                    return Ok(());
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => crate::recv::writable(fd).await?,
            Err(e) => return Err(e),
        }
    }
}

/// A group the kernel may still read: reported and recycled on drop, when
/// the sender and every send op's notification have let go of it.
struct Held {
    /// Always `Some` until dropped.
    g: RefCell<Option<PduGroup>>,
    sends: Cell<u32>,
    copied: Cell<u32>,
    sink: ZcSink,
    spare: Rc<RefCell<Vec<PduGroup>>>,
}

impl Held {
    fn group(&self) -> std::cell::RefMut<'_, PduGroup> {
        std::cell::RefMut::map(self.g.borrow_mut(), |g| {
            g.as_mut().expect("a held group until dropped")
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let Some(mut g) = self.g.get_mut().take() else {
            return;
        };
        (self.sink)(ZcDone {
            holds: g.holds(),
            sends: self.sends.get(),
            copied: self.copied.get(),
            raw_bytes: g.raw_bytes() as u64,
        });
        g.clear();
        self.spare.borrow_mut().push(g);
    }
}

/// One send op's share of a [`Held`] group.
struct HeldRef(Rc<Held>);

impl IoVecs for HeldRef {
    fn iovecs(&self, out: &mut [libc::iovec; MAX_IOV]) -> usize {
        self.0.group().fill_iovecs(out)
    }
}

fn noted(r: HeldRef, n: ZcNotice) {
    if n.notified {
        r.0.sends.set(r.0.sends.get() + 1);
    }
    if n.notified && n.copied {
        r.0.copied.set(r.0.copied.get() + 1);
    }
}

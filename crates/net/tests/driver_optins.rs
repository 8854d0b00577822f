//! The driver's opt-ins for protocols that count their own units (what
//! NVMe/TCP needs), with a toy protocol over a real socket: an interim
//! reply before the unit's answer (an R2T), a queued job aborted before it
//! executes, a unit parked on the protocol's side that the protocol's
//! backlog leaves out of LANoT's count (through the protocol's own
//! coalescer, whose counters it reads) and that `on_close` ends, and
//! pre-spawned workers.
//!
//! Wire: request header `[op, tag, len u16 le]`, replies `[tag, kind, sum
//! u32 le]`. `W`: `len` bytes, answered `K` + checksum; `R`: answered `T`
//! at once, then its `len` bytes are read and it is answered `K`; `B`: a
//! job that waits until `U` (answered `u`) or the close, answered `B`;
//! `A`: aborts the queued job `len` (answered `a`; the job `C`); `Q`: close.

use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::Duration;

use ustor_net::coalesce::{CoalesceConfig, CoalesceStats, Coalescer, Mode};
use ustor_net::driver::{self, Backlog, DriverConfig, IoEvent, Protocol, Recv, RecvEvent, Via};
use ustor_net::staging::Staging;
use ustor_net::PduGroup;
use ustor_runtime::{IoBuf, PollMode, Runtime, RuntimeConfig};

const HDR: usize = 4;

#[derive(Default)]
struct Toy {
    /// The `R` whose payload is due: (tag, len).
    due: Cell<Option<(u8, usize)>>,
    cur_tag: Cell<u8>,
    aborted: RefCell<Vec<u8>>,
    released: Cell<bool>,
    blocked: RefCell<Option<Waker>>,
    /// Jobs queued or executing, `B` excluded.
    busy: Cell<u32>,
    /// Report `busy` as LANoT's backlog.
    own_backlog: bool,
    /// The protocol's own coalescer, and its counters after each send.
    coal: Option<RefCell<Coalescer>>,
    published: Arc<Mutex<CoalesceStats>>,
}

enum Job {
    Sum(u8, IoBuf),
    Block(u8),
}

struct Reply {
    tag: u8,
    kind: u8,
    sum: u32,
}

fn sum(b: &[u8]) -> u32 {
    b.iter()
        .fold(0u32, |a, &x| a.wrapping_mul(31).wrapping_add(u32::from(x)))
}

fn reply(tag: u8, kind: u8) -> Reply {
    Reply { tag, kind, sum: 0 }
}

impl Toy {
    fn release(&self) {
        self.released.set(true);
        if let Some(w) = self.blocked.borrow_mut().take() {
            w.wake();
        }
    }

    fn header(&self, st: &mut Staging) -> Recv<Self> {
        let h = st.peek(HDR);
        let (op, tag, len) = (h[0], h[1], usize::from(u16::from_le_bytes([h[2], h[3]])));
        st.consume(HDR);
        self.cur_tag.set(tag);
        let payload = |len| Recv::Payload {
            buf: None,
            off: 0,
            len,
            via: Via::Staging,
        };
        match op {
            b'W' => payload(len),
            b'R' => {
                self.due.set(Some((tag, len)));
                Recv::Interim(reply(tag, b'T'))
            }
            b'B' => Recv::Dispatch(Job::Block(tag)),
            b'U' => {
                self.release();
                Recv::Reply(reply(tag, b'u'))
            }
            b'A' => {
                self.aborted.borrow_mut().push(len as u8);
                Recv::Reply(reply(tag, b'a'))
            }
            _ => Recv::Close,
        }
    }
}

impl Protocol for Toy {
    type Job = Job;
    type Reply = Reply;

    fn apply(&self, ev: RecvEvent, st: &mut Staging) -> Recv<Self> {
        match ev {
            RecvEvent::Next | RecvEvent::Resumed => match self.due.get() {
                // The interim reply left; now the unit's data.
                Some((tag, len)) => {
                    self.due.set(None);
                    self.cur_tag.set(tag);
                    Recv::Payload {
                        buf: None,
                        off: 0,
                        len,
                        via: Via::Staging,
                    }
                }
                None => Recv::Stage {
                    need: HDR,
                    max: usize::MAX,
                },
            },
            RecvEvent::Staged => self.header(st),
            RecvEvent::Payload(buf) => {
                self.busy.set(self.busy.get() + 1);
                Recv::Dispatch(Job::Sum(self.cur_tag.get(), buf))
            }
            RecvEvent::Skipped => Recv::Close,
        }
    }

    fn aborted(&self, job: &Job) -> Option<Reply> {
        let Job::Sum(tag, _) = job else { return None };
        let mut a = self.aborted.borrow_mut();
        let i = a.iter().position(|t| t == tag)?;
        a.swap_remove(i);
        self.busy.set(self.busy.get() - 1);
        Some(reply(*tag, b'C'))
    }

    async fn execute(&self, job: Job) -> Reply {
        match job {
            Job::Sum(tag, buf) => {
                self.busy.set(self.busy.get() - 1);
                Reply {
                    tag,
                    kind: b'K',
                    sum: sum(&buf),
                }
            }
            Job::Block(tag) => {
                poll_fn(|cx| {
                    if self.released.get() {
                        return Poll::Ready(());
                    }
                    *self.blocked.borrow_mut() = Some(cx.waker().clone());
                    Poll::Pending
                })
                .await;
                reply(tag, b'B')
            }
        }
    }

    fn encode(&self, r: Reply, g: &mut PduGroup) -> Result<(), Reply> {
        if !g.fits(6, 1, 0) {
            return Err(r);
        }
        let mut h = [r.tag, r.kind, 0, 0, 0, 0];
        h[2..].copy_from_slice(&r.sum.to_le_bytes());
        g.push_bytes(&h);
        g.end_pdu(false);
        Ok(())
    }

    fn backlog(&self, queued: usize, _interim: u32) -> Option<Backlog> {
        self.own_backlog.then(|| {
            let n = self.busy.get() + queued as u32;
            Backlog {
                others: n,
                depth: n,
            }
        })
    }

    fn coalescer(&self) -> Option<&RefCell<Coalescer>> {
        self.coal.as_ref()
    }

    fn on_io(&self, ev: IoEvent) {
        if let (IoEvent::Sent { .. }, Some(c)) = (ev, &self.coal) {
            *self.published.lock().unwrap() = c.borrow().stats();
        }
    }

    fn on_close(&self) {
        self.release();
    }
}

fn req(op: u8, tag: u8, payload: &[u8]) -> Vec<u8> {
    let mut v = vec![op, tag];
    v.extend_from_slice(&(payload.len() as u16).to_le_bytes());
    v.extend_from_slice(payload);
    v
}

/// An `A` names its target in the length field and carries no payload.
fn abort(tag: u8, target: u8) -> Vec<u8> {
    vec![b'A', tag, target, 0]
}

fn start(proto: Toy, cfg: DriverConfig) -> (Runtime, UnixStream) {
    let rt = Runtime::start(RuntimeConfig {
        cores: vec![0],
        pin: false,
        poll_mode: PollMode::Adaptive,
        ..RuntimeConfig::default()
    })
    .expect("runtime starts");
    let (ours, peer) = UnixStream::pair().unwrap();
    let fd = OwnedFd::from(ours);
    rt.handle()
        .spawn_on(0, move || driver::run(fd, proto, cfg))
        .unwrap();
    peer.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    (rt, peer)
}

fn read_reply(peer: &mut UnixStream) -> (u8, u8, u32) {
    let mut h = [0u8; 6];
    peer.read_exact(&mut h).expect("a reply");
    (h[0], h[1], u32::from_le_bytes([h[2], h[3], h[4], h[5]]))
}

fn expect_eof(peer: &mut UnixStream) {
    let mut rest = Vec::new();
    peer.read_to_end(&mut rest).expect("EOF");
    assert!(rest.is_empty(), "nothing after the last reply");
}

#[test]
fn interim_reply_then_the_units_answer() {
    let (_rt, mut peer) = start(Toy::default(), DriverConfig::default());
    let data: Vec<u8> = (0..3000).map(|i| (i % 251) as u8).collect();
    // `R` announces its payload length; the payload follows the header.
    let mut wire = req(b'R', 1, &data);
    wire.extend(req(b'W', 2, &data[..100]));
    wire.extend(req(b'Q', 0, &[]));
    peer.write_all(&wire).unwrap();
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(read_reply(&mut peer));
    }
    let t = got.iter().position(|r| r.1 == b'T').expect("the interim");
    let k = got
        .iter()
        .position(|r| r.0 == 1 && r.1 == b'K')
        .expect("R's answer");
    assert!(t < k, "the interim reply leaves before the unit's answer");
    assert_eq!(got[k].2, sum(&data));
    assert!(got.contains(&(2, b'K', sum(&data[..100]))));
    // The interim reply answered no unit: the driver ended once the two
    // units were answered, not waiting for a third.
    expect_eof(&mut peer);
}

#[test]
fn queued_job_aborted_before_it_executes() {
    let cfg = DriverConfig {
        max_workers: 1,
        prespawn_workers: 1,
        ..DriverConfig::default()
    };
    let (_rt, mut peer) = start(Toy::default(), cfg);
    let data = [7u8; 50];
    // The only worker blocks on B; W 5 and W 6 queue behind it; A aborts 5.
    let mut wire = req(b'B', 1, &[]);
    wire.extend(req(b'W', 5, &data));
    wire.extend(req(b'W', 6, &data));
    wire.extend(abort(9, 5));
    peer.write_all(&wire).unwrap();
    assert_eq!(read_reply(&mut peer), (9, b'a', 0), "the abort's answer");
    peer.write_all(&req(b'U', 2, &[])).unwrap();
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(read_reply(&mut peer));
    }
    got.sort();
    assert_eq!(
        got,
        vec![
            (1, b'B', 0),
            (2, b'u', 0),
            (5, b'C', 0),
            (6, b'K', sum(&data)),
        ],
        "5 was answered without executing, 6 executed"
    );
    peer.write_all(&req(b'Q', 0, &[])).unwrap();
    expect_eof(&mut peer);
}

#[test]
fn own_backlog_leaves_parked_units_out_and_close_ends_them() {
    // A timer far beyond the read timeout: a reply that waited for it
    // would fail the read.
    let lanot = CoalesceConfig {
        mode: Mode::Fixed,
        degree: 8,
        timer_us: 60_000_000,
        ..CoalesceConfig::default()
    };
    let published = Arc::new(Mutex::new(CoalesceStats::ZERO));
    let toy = Toy {
        own_backlog: true,
        coal: Some(RefCell::new(Coalescer::new(lanot))),
        published: published.clone(),
        ..Toy::default()
    };
    let cfg = DriverConfig {
        prespawn_workers: 4,
        coalesce: None,
        ..DriverConfig::default()
    };
    let (_rt, mut peer) = start(toy, cfg);
    let data = [3u8; 200];
    let mut wire = req(b'B', 1, &[]);
    wire.extend(req(b'W', 2, &data));
    peer.write_all(&wire).unwrap();
    // B is parked and outstanding; the protocol does not count it, so W's
    // answer leaves at once (nothing else in flight).
    assert_eq!(read_reply(&mut peer), (2, b'K', sum(&data)));
    // Closing without U: on_close releases B, its answer is sent, then EOF.
    peer.write_all(&req(b'Q', 0, &[])).unwrap();
    assert_eq!(read_reply(&mut peer), (1, b'B', 0));
    expect_eof(&mut peer);
    // The driver decided with the protocol's coalescer: two groups, each
    // sent at once as nothing else was in flight.
    let s = *published.lock().unwrap();
    assert_eq!(
        (s.groups, s.pdus, s.small_groups, s.timer_expiries, s.degree),
        (2, 2, 2, 0, 8)
    );
}

//! The driver's client opt-ins (what the NVMe/TCP initiator needs), with a
//! toy client over a real socket: requests originate locally
//! (`driver::start`, `Conn::send`), answers are received in place into
//! the requester's own buffers (`Recv::Place`), and a sender stuck on a
//! peer that stopped reading is cut off after a drain timeout
//! (`Conn::set_drain_timeout`).
//!
//! Wire: request `[b'R', tag, len u16 le]` (a big request carries a
//! payload of `len` KiB); answer `[tag, len u16 le]` and `len` bytes;
//! `[0xff, 0, 0]` says goodbye.

use std::cell::{Cell, RefCell};
use std::convert::Infallible;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::Duration;

use ustor_net::driver::{self, DriverConfig, IoEvent, Protocol, Recv, RecvEvent};
use ustor_net::recv::Seg;
use ustor_net::staging::Staging;
use ustor_net::PduGroup;
use ustor_runtime::{PollMode, Runtime, RuntimeConfig};

const HDR: usize = 3;
const BYE: u8 = 0xff;

/// A client with one buffer per tag.
struct Client {
    bufs: RefCell<Vec<Vec<u8>>>,
    /// The answer being placed: (tag, len).
    cur: Cell<Option<(u8, usize)>>,
    /// Answers completed, in order.
    done: RefCell<Vec<u8>>,
    copied: Cell<usize>,
    /// Payload of a big request (sent by pointer).
    big: Vec<u8>,
}

enum Out {
    Req(u8, u16),
    Big,
}

fn pattern(tag: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(tag))
        .collect()
}

impl Protocol for Client {
    type Job = Infallible;
    type Reply = Out;

    fn apply(&self, ev: RecvEvent, st: &mut Staging) -> Recv<Self> {
        match ev {
            RecvEvent::Staged => {
                let h = st.peek(HDR);
                let (tag, len) = (h[0], usize::from(u16::from_le_bytes([h[1], h[2]])));
                st.consume(HDR);
                if tag == BYE {
                    return Recv::Close;
                }
                self.cur.set(Some((tag, len)));
                Recv::Place { tail: HDR }
            }
            _ => {
                if let Some((tag, _)) = self.cur.take() {
                    self.done.borrow_mut().push(tag);
                }
                // Exact: the next answer's data is never staged.
                Recv::Stage {
                    need: HDR,
                    max: HDR,
                }
            }
        }
    }

    async fn execute(&self, job: Infallible) -> Out {
        match job {}
    }

    fn encode(&self, r: Out, g: &mut PduGroup) -> Result<(), Out> {
        match r {
            Out::Req(tag, len) => {
                let l = len.to_le_bytes();
                g.push_bytes(&[b'R', tag, l[0], l[1]]);
            }
            Out::Big => {
                let l = ((self.big.len() >> 10) as u16).to_le_bytes();
                g.push_bytes(&[b'B', 0, l[0], l[1]]);
                // SAFETY: `big` lives as long as the protocol, which the
                // connection owns until every send returned.
                unsafe { g.push_raw(self.big.as_ptr(), self.big.len()) };
            }
        }
        g.end_pdu(false);
        Ok(())
    }

    unsafe fn place(&self, out: &mut [Seg]) -> usize {
        let (tag, len) = self.cur.get().expect("an answer is due");
        let mut bufs = self.bufs.borrow_mut();
        let b = &mut bufs[usize::from(tag)];
        // Three segments, as a read with a scattered buffer would give.
        let cuts = [0, len / 3, len / 2, len];
        for i in 0..3 {
            out[i] = Seg {
                // SAFETY: within the tag's buffer (len <= its length).
                ptr: unsafe { b.as_mut_ptr().add(cuts[i]) },
                len: cuts[i + 1] - cuts[i],
            };
        }
        3
    }

    fn on_io(&self, ev: IoEvent) {
        if let IoEvent::Copied { bytes } = ev {
            self.copied.set(self.copied.get() + bytes);
        }
    }
}

fn client(tags: usize, big: usize) -> Client {
    Client {
        bufs: RefCell::new(vec![vec![0; 64 << 10]; tags]),
        cur: Cell::new(None),
        done: RefCell::new(Vec::new()),
        copied: Cell::new(0),
        big: vec![0x5a; big],
    }
}

/// What the client ended with: buffers, completion order, bytes copied.
type Outcome = (Vec<Vec<u8>>, Vec<u8>, usize);

/// Runs `proto` as a client that first sends `out`; the outcome arrives
/// when `serve` returned.
fn run_client(
    proto: Client,
    out: Vec<Out>,
    drain: Option<Duration>,
) -> (Runtime, UnixStream, mpsc::Receiver<Outcome>) {
    let rt = Runtime::start(RuntimeConfig {
        cores: vec![0],
        pin: false,
        poll_mode: PollMode::Adaptive,
        ..RuntimeConfig::default()
    })
    .expect("runtime starts");
    let (ours, peer) = UnixStream::pair().unwrap();
    let fd = OwnedFd::from(ours);
    let (tx, rx) = mpsc::channel();
    rt.handle()
        .spawn_on(0, move || async move {
            let conn = driver::start(fd, proto, DriverConfig::default());
            conn.set_drain_timeout(drain);
            for o in out {
                conn.send(o);
            }
            driver::serve(conn.clone()).await;
            let c = conn.protocol();
            let r = (c.bufs.take(), c.done.take(), c.copied.get());
            tx.send(r).unwrap();
        })
        .unwrap();
    peer.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    (rt, peer, rx)
}

#[test]
fn local_requests_answered_in_place() {
    let lens: [u16; 6] = [1, 512, 4096, 3000, 65535, 17];
    let out = (0..lens.len())
        .map(|t| Out::Req(t as u8, lens[t]))
        .collect();
    // A drain timeout far beyond the test's: the sender ends on its own.
    let drain = Some(Duration::from_secs(600));
    let (_rt, mut peer, rx) = run_client(client(lens.len(), 0), out, drain);
    let mut reqs = Vec::new();
    for _ in 0..lens.len() {
        let mut h = [0u8; 4];
        peer.read_exact(&mut h).expect("a request");
        assert_eq!(h[0], b'R');
        reqs.push((h[1], u16::from_le_bytes([h[2], h[3]])));
    }
    assert_eq!(
        reqs,
        (0..lens.len() as u8).zip(lens).collect::<Vec<_>>(),
        "requests leave in the order sent"
    );
    // Answered out of order, all in one write: data and headers arrive
    // back to back.
    let mut wire = Vec::new();
    for &(tag, len) in reqs.iter().rev() {
        wire.extend_from_slice(&[tag]);
        wire.extend_from_slice(&len.to_le_bytes());
        wire.extend(pattern(tag, usize::from(len)));
    }
    wire.extend_from_slice(&[BYE, 0, 0]);
    peer.write_all(&wire).unwrap();
    let (bufs, done, copied) = rx.recv_timeout(Duration::from_secs(20)).expect("served");
    assert_eq!(done, (0..lens.len() as u8).rev().collect::<Vec<_>>());
    for (t, &len) in lens.iter().enumerate() {
        let len = usize::from(len);
        assert_eq!(bufs[t][..len], pattern(t as u8, len)[..], "tag {t}'s data");
        assert!(bufs[t][len..].iter().all(|&b| b == 0), "nothing past it");
    }
    assert_eq!(copied, 0, "headers staged exactly: data lands in place");
    let mut rest = Vec::new();
    peer.read_to_end(&mut rest).expect("EOF");
    assert!(rest.is_empty());
}

#[test]
fn drain_timeout_cuts_off_a_peer_that_stopped_reading() {
    // Far more than the socket buffers hold; the peer never reads it.
    let drain = Some(Duration::from_millis(200));
    let (_rt, mut peer, rx) = run_client(client(1, 16 << 20), vec![Out::Big], drain);
    peer.write_all(&[BYE, 0, 0]).unwrap();
    let (_, done, _) = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("serve returned although the send could not finish");
    assert!(done.is_empty());
    // The socket was shut down: what the peer reads ends.
    let mut n = 0usize;
    let mut b = vec![0u8; 1 << 20];
    loop {
        match peer.read(&mut b) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) => panic!("read: {e}"),
        }
    }
    assert!(
        n < 16 << 20,
        "the big request did not leave whole ({n} bytes)"
    );
}

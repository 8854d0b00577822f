//! The connection driver with a toy protocol: its state machine tested
//! without sockets, then served over a real socket with pipelined
//! requests of every size, a refused one and a close, with and without
//! coalescing. Replies carry a checksum and the payload back.
//!
//! Wire: request header `[op, tag, len u16 le]`; `W` carries `len` bytes,
//! answered `[tag, 'K', sum u32 le]` + the payload; `X` carries `len` bytes
//! that are refused (skipped), answered `[tag, 'E', 0u32]`; `Q` closes.

use std::cell::Cell;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ustor_net::coalesce::{CoalesceConfig, Mode};
use ustor_net::driver::{self, DriverConfig, IoEvent, Protocol, Recv, RecvEvent, Via};
use ustor_net::staging::{Rewind, Staging};
use ustor_net::PduGroup;
use ustor_runtime::{IoBuf, PollMode, Runtime, RuntimeConfig};

const HDR: usize = 4;
const SMALL: usize = 64;

#[derive(Default)]
struct Counters {
    copied: AtomicU64,
    sent: AtomicU64,
}

struct Toy {
    /// The header being served: (op, tag, len).
    cur: Cell<(u8, u8, usize)>,
    counters: Arc<Counters>,
}

struct Job {
    tag: u8,
    buf: IoBuf,
}

struct Reply {
    tag: u8,
    sum: Option<u32>,
    data: Option<IoBuf>,
}

fn sum(b: &[u8]) -> u32 {
    b.iter()
        .fold(0u32, |a, &x| a.wrapping_mul(31).wrapping_add(u32::from(x)))
}

impl Protocol for Toy {
    type Job = Job;
    type Reply = Reply;

    fn apply(&self, ev: RecvEvent, st: &mut Staging) -> Recv<Self> {
        match ev {
            RecvEvent::Next | RecvEvent::Resumed => Recv::Stage {
                need: HDR,
                max: usize::MAX,
            },
            RecvEvent::Staged => {
                let h = st.peek(HDR);
                let (op, tag, len) = (h[0], h[1], usize::from(u16::from_le_bytes([h[2], h[3]])));
                st.consume(HDR);
                self.cur.set((op, tag, len));
                match op {
                    b'W' => Recv::Payload {
                        buf: None,
                        off: 0,
                        len,
                        via: if len <= SMALL {
                            Via::Staging
                        } else {
                            Via::Direct { tail: HDR }
                        },
                    },
                    b'X' => Recv::Skip(len as u64),
                    _ => Recv::Close,
                }
            }
            RecvEvent::Payload(buf) => Recv::Dispatch(Job {
                tag: self.cur.get().1,
                buf,
            }),
            RecvEvent::Skipped => Recv::Reply(Reply {
                tag: self.cur.get().1,
                sum: None,
                data: None,
            }),
        }
    }

    fn charge(&self, job: &Job) -> u64 {
        job.buf.len() as u64
    }

    async fn execute(&self, job: Job) -> Reply {
        // Larger jobs finish later: replies leave out of order.
        for _ in 0..job.buf.len() / 8192 {
            ustor_runtime::yield_now().await;
        }
        let s = sum(&job.buf);
        Reply {
            tag: job.tag,
            sum: Some(s),
            data: Some(job.buf),
        }
    }

    fn encode(&self, r: Reply, g: &mut PduGroup) -> Result<(), Reply> {
        if !g.fits(6, 1, usize::from(r.data.is_some())) {
            return Err(r);
        }
        let kind = if r.sum.is_some() { b'K' } else { b'E' };
        let mut h = [r.tag, kind, 0, 0, 0, 0];
        h[2..].copy_from_slice(&r.sum.unwrap_or(0).to_le_bytes());
        g.push_bytes(&h);
        if let Some(d) = r.data {
            let n = d.len();
            g.push_data(d, 0, n);
        }
        g.end_pdu(false);
        Ok(())
    }

    fn on_io(&self, ev: IoEvent) {
        match ev {
            IoEvent::Copied { bytes } => {
                self.counters
                    .copied
                    .fetch_add(bytes as u64, Ordering::Relaxed);
            }
            IoEvent::Sent { replies, .. } => {
                self.counters
                    .sent
                    .fetch_add(u64::from(replies), Ordering::Relaxed);
            }
            IoEvent::Received { .. } => {}
        }
    }
}

fn toy() -> (Toy, Arc<Counters>) {
    let c = Arc::new(Counters::default());
    (
        Toy {
            cur: Cell::new((0, 0, 0)),
            counters: c.clone(),
        },
        c,
    )
}

fn req(op: u8, tag: u8, payload: &[u8]) -> Vec<u8> {
    let mut v = vec![op, tag];
    v.extend_from_slice(&(payload.len() as u16).to_le_bytes());
    v.extend_from_slice(payload);
    v
}

#[test]
fn state_machine_without_a_socket() {
    let (t, _) = toy();
    let mut st = Staging::new(256, Rewind::Lazy);
    assert!(matches!(
        t.apply(RecvEvent::Next, &mut st),
        Recv::Stage { need: HDR, .. }
    ));
    st.stage_bytes(&req(b'W', 7, &[1, 2, 3]));
    match t.apply(RecvEvent::Staged, &mut st) {
        Recv::Payload { len, via, buf, .. } => {
            assert_eq!((len, via), (3, Via::Staging));
            assert!(buf.is_none());
        }
        _ => panic!("a write asks for its payload"),
    }
    assert_eq!(st.staged(), &[1, 2, 3], "the payload stays staged");
    st.consume(3);
    st.stage_bytes(&req(b'W', 8, &[0; 100])[..HDR]);
    assert!(matches!(
        t.apply(RecvEvent::Staged, &mut st),
        Recv::Payload {
            via: Via::Direct { tail: HDR },
            len: 100,
            ..
        }
    ));
    st.stage_bytes(&req(b'X', 9, &[5; 10])[..HDR]);
    assert!(matches!(
        t.apply(RecvEvent::Staged, &mut st),
        Recv::Skip(10)
    ));
    match t.apply(RecvEvent::Skipped, &mut st) {
        Recv::Reply(r) => assert_eq!((r.tag, r.sum.is_none()), (9, true)),
        _ => panic!("a refused request is answered at once"),
    }
    st.stage_bytes(&req(b'Q', 0, &[]));
    assert!(matches!(t.apply(RecvEvent::Staged, &mut st), Recv::Close));
}

fn pattern(n: usize, seed: usize) -> Vec<u8> {
    (0..n).map(|i| ((i * 7 + seed * 13) % 251) as u8).collect()
}

fn serve(cfg: DriverConfig) {
    let rt = Runtime::start(RuntimeConfig {
        cores: vec![0],
        pin: false,
        poll_mode: PollMode::Adaptive,
        ..RuntimeConfig::default()
    })
    .expect("runtime starts");
    let (ours, mut peer) = UnixStream::pair().unwrap();
    let (proto, counters) = toy();
    let fd = OwnedFd::from(ours);
    rt.handle()
        .spawn_on(0, move || driver::run(fd, proto, cfg))
        .unwrap();
    let sizes = [1, 17, SMALL, SMALL + 1, 4096, 40000, 65535, 3, 0];
    let payloads: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| pattern(n, i))
        .collect();
    let mut wire = Vec::new();
    for (i, p) in payloads.iter().enumerate() {
        wire.extend(req(b'W', i as u8, p));
    }
    wire.extend(req(b'X', 100, &pattern(3000, 1)));
    wire.extend(req(b'Q', 0, &[]));
    let writer = {
        let mut w = peer.try_clone().unwrap();
        std::thread::spawn(move || w.write_all(&wire).unwrap())
    };
    let mut seen = vec![false; payloads.len()];
    let mut refused = false;
    for _ in 0..=payloads.len() {
        let mut h = [0u8; 6];
        peer.read_exact(&mut h).expect("a reply");
        let s = u32::from_le_bytes([h[2], h[3], h[4], h[5]]);
        if h[1] == b'E' {
            assert_eq!(h[0], 100);
            refused = true;
            continue;
        }
        assert_eq!(h[1], b'K');
        let i = h[0] as usize;
        let mut back = vec![0u8; payloads[i].len()];
        peer.read_exact(&mut back).unwrap();
        assert_eq!(s, sum(&payloads[i]), "checksum of request {i}");
        assert_eq!(back, payloads[i], "payload of request {i}");
        assert!(!std::mem::replace(&mut seen[i], true), "answered twice");
    }
    assert!(refused && seen.iter().all(|&s| s));
    writer.join().unwrap();
    // After Q and every reply, the driver shuts the socket down.
    let mut rest = Vec::new();
    peer.read_to_end(&mut rest).expect("EOF");
    assert!(rest.is_empty());
    assert_eq!(
        counters.sent.load(Ordering::Relaxed),
        payloads.len() as u64 + 1
    );
    let small: usize = sizes.iter().filter(|&&n| n <= SMALL).sum();
    assert!(counters.copied.load(Ordering::Relaxed) >= small as u64);
}

#[test]
fn serves_a_socket_without_coalescing() {
    serve(DriverConfig {
        staging_len: 8192,
        ..DriverConfig::default()
    });
}

#[test]
fn serves_a_socket_with_lanot() {
    serve(DriverConfig {
        staging_len: 8192,
        recv_budget: Some(4),
        max_workers: 2,
        max_outstanding: 3,
        coalesce: Some(CoalesceConfig {
            mode: Mode::Fixed,
            degree: 4,
            timer_us: 50,
            ..CoalesceConfig::default()
        }),
        ..DriverConfig::default()
    });
}

//! The listener with real sockets: the connection cap (and the protocol's
//! answer to connections beyond it), the handshake timeout, and the count
//! following connections as they close.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ustor_net::listener::{
    Accepted, ConnLimit, Listener, ListenerConfig, Placement, Refused, Service, MAX_REFUSING,
};
use ustor_net::recv::recv_exact;
use ustor_runtime::{IoBuf, PollMode, Runtime, RuntimeConfig};

/// Handshake: the peer sends `helo`, we answer `ok`; then every byte is
/// echoed until EOF.
struct Echo;

impl Service for Echo {
    type Fut = std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;
    fn serve(self: Arc<Self>, conn: Accepted) -> Self::Fut {
        Box::pin(async move {
            let fd = conn.fd.as_raw_fd();
            let hello = conn.handshake(recv_exact(fd, IoBuf::heap(4), 0, 4)).await;
            let Some((Ok(()), _)) = hello else { return };
            if ustor_runtime::ops::send_all(fd, buf(b"ok"))
                .await
                .0
                .is_err()
            {
                return;
            }
            loop {
                let (r, b) = ustor_runtime::ops::recv(fd, IoBuf::heap(64), 0, 64).await;
                let Ok(n @ 1..) = r else { return };
                let mut out = IoBuf::heap(n);
                out.set_len(n);
                out.copy_from_slice(&b.spare_mut_copy()[..n]);
                if ustor_runtime::ops::send_all(fd, out).await.0.is_err() {
                    return;
                }
            }
        })
    }
}

/// [`Echo`], and beyond the cap it reads the peer's `helo` and answers
/// `no` before closing.
struct Refusing;

impl Service for Refusing {
    type Fut = std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;
    fn serve(self: Arc<Self>, conn: Accepted) -> Self::Fut {
        Arc::new(Echo).serve(conn)
    }
    fn refuse(self: Arc<Self>, conn: Refused) -> Option<Self::Fut> {
        Some(Box::pin(async move {
            let fd = conn.fd.as_raw_fd();
            let read = ustor_net::time::timeout(conn.timeout, recv_exact(fd, IoBuf::heap(4), 0, 4));
            if let Some((Ok(()), _)) = read.await {
                let _ = ustor_runtime::ops::send_all(fd, buf(b"no")).await;
            }
            ustor_net::recv::shutdown(fd);
        }))
    }
}

trait SpareCopy {
    fn spare_mut_copy(self) -> Vec<u8>;
}

impl SpareCopy for IoBuf {
    fn spare_mut_copy(mut self) -> Vec<u8> {
        self.spare_mut().to_vec()
    }
}

fn buf(b: &[u8]) -> IoBuf {
    let mut x = IoBuf::heap(b.len());
    x.set_len(b.len());
    x.copy_from_slice(b);
    x
}

fn runtime() -> Runtime {
    Runtime::start(RuntimeConfig {
        cores: vec![0, 1],
        pin: false,
        poll_mode: PollMode::Adaptive,
        ..RuntimeConfig::default()
    })
    .expect("runtime starts")
}

/// Waits until `f` holds, failing after 10 s.
fn wait_for(what: &str, f: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

fn hello(addr: std::net::SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"helo").unwrap();
    let mut ok = [0u8; 2];
    s.read_exact(&mut ok).expect("handshake answered");
    assert_eq!(&ok, b"ok");
    s
}

/// The peer was closed: a read gives EOF (or a reset).
fn assert_closed(s: &mut TcpStream) {
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => {}
        Ok(_) => panic!("connection still served"),
        Err(e) => assert_ne!(
            e.kind(),
            std::io::ErrorKind::WouldBlock,
            "not closed in time"
        ),
    }
}

#[test]
fn cap_rejects_and_frees_places() {
    let rt = runtime();
    let limit = ConnLimit::new(2);
    let svc = Arc::new(Echo);
    let l = Listener::bind(
        &rt.handle(),
        "127.0.0.1:0".parse().unwrap(),
        ListenerConfig::new("test", limit.clone()),
        Arc::new(Placement::default()),
        &svc,
    )
    .expect("binds");
    let a = l.local_addr();
    let mut c1 = hello(a);
    let c2 = hello(a);
    let mut c3 = TcpStream::connect(a).unwrap();
    c3.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_closed(&mut c3);
    let s = limit.stats();
    assert_eq!((s.accepted, s.rejected, s.open), (2, 1, 2));
    // Both admitted connections are served, one on each reactor.
    c1.write_all(b"abc").unwrap();
    let mut e = [0u8; 3];
    c1.read_exact(&mut e).unwrap();
    assert_eq!(&e, b"abc");
    drop(c2);
    wait_for("a place to free", || limit.open() == 1);
    let mut c4 = hello(a);
    c4.write_all(b"xyz").unwrap();
    c4.read_exact(&mut e).unwrap();
    assert_eq!(&e, b"xyz");
    assert_eq!(limit.stats().accepted, 3);
    drop((c1, c4));
    assert!(
        limit.wait_idle(Duration::from_secs(10)),
        "connections close"
    );
    l.stop();
}

#[test]
fn silent_peer_is_closed_after_the_handshake_timeout() {
    let rt = runtime();
    let limit = ConnLimit::new(8);
    let svc = Arc::new(Echo);
    let mut cfg = ListenerConfig::new("test", limit.clone());
    cfg.handshake_timeout = Duration::from_millis(200);
    let l = Listener::bind(
        &rt.handle(),
        "127.0.0.1:0".parse().unwrap(),
        cfg,
        Arc::new(Placement::default()),
        &svc,
    )
    .expect("binds");
    let t0 = Instant::now();
    let mut silent = TcpStream::connect(l.local_addr()).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    // A live peer beside it is not affected.
    let mut live = hello(l.local_addr());
    assert_closed(&mut silent);
    assert!(
        t0.elapsed() >= Duration::from_millis(200),
        "not before the timeout"
    );
    wait_for("the timeout counted", || {
        limit.stats().handshake_timeouts == 1
    });
    // The count goes up before the connection's guard is dropped: wait for
    // the silent peer's place to be freed, leaving only the live one.
    wait_for("only the live connection open", || limit.open() == 1);
    live.write_all(b"q").unwrap();
    let mut e = [0u8; 1];
    live.read_exact(&mut e).unwrap();
    assert_eq!(&e, b"q");
}

#[test]
fn stopped_listener_refuses_new_connections() {
    let rt = runtime();
    let limit = ConnLimit::new(8);
    let svc = Arc::new(Echo);
    let l = Listener::bind(
        &rt.handle(),
        "127.0.0.1:0".parse().unwrap(),
        ListenerConfig::new("test", limit.clone()),
        Arc::new(Placement::default()),
        &svc,
    )
    .expect("binds");
    let a = l.local_addr();
    let mut c = hello(a);
    l.stop();
    // The established connection runs on.
    c.write_all(b"z").unwrap();
    let mut e = [0u8; 1];
    c.read_exact(&mut e).unwrap();
    assert_eq!(&e, b"z");
    // A new one is refused or closed unserved.
    if let Ok(mut s) = TcpStream::connect(a) {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(b"helo");
        assert_closed(&mut s);
    }
    assert_eq!(limit.stats().accepted, 1);
}

#[test]
fn refused_connections_get_the_protocols_answer_up_to_a_bound() {
    let rt = runtime();
    let limit = ConnLimit::new(1);
    let svc = Arc::new(Refusing);
    let l = Listener::bind(
        &rt.handle(),
        "127.0.0.1:0".parse().unwrap(),
        ListenerConfig::new("test", limit.clone()),
        Arc::new(Placement::default()),
        &svc,
    )
    .expect("binds");
    let a = l.local_addr();
    let mut admitted = hello(a);
    // MAX_REFUSING silent connections hold every place for an answer (up
    // to the refusal timeout); the ones after them are closed at once.
    let mut waiting: Vec<TcpStream> = (0..MAX_REFUSING)
        .map(|_| TcpStream::connect(a).unwrap())
        .collect();
    wait_for("every refusal counted", || {
        limit.stats().rejected == MAX_REFUSING as u64
    });
    for _ in 0..4 {
        let mut s = TcpStream::connect(a).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let t0 = Instant::now();
        assert_closed(&mut s);
        assert!(t0.elapsed() < Duration::from_secs(1), "not at once");
    }
    // The waiting ones get the answer, then the close.
    for s in &mut waiting {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"helo").unwrap();
        let mut no = [0u8; 2];
        s.read_exact(&mut no).expect("refusal answered");
        assert_eq!(&no, b"no");
        assert_closed(s);
    }
    let st = limit.stats();
    assert_eq!(
        (st.accepted, st.rejected, st.open),
        (1, MAX_REFUSING as u64 + 4, 1)
    );
    // The admitted connection was served all along.
    admitted.write_all(b"k").unwrap();
    let mut e = [0u8; 1];
    admitted.read_exact(&mut e).unwrap();
    assert_eq!(&e, b"k");
    l.stop();
}

/// Hosts as RPCs name them: IPv4, IPv6 with and without brackets; a bad
/// host or port comes back as the text that did not parse.
#[test]
fn socket_addr_takes_the_forms_rpcs_use() {
    use ustor_net::listener::socket_addr;
    assert_eq!(
        socket_addr("127.0.0.1", 4420),
        Ok("127.0.0.1:4420".parse().unwrap())
    );
    assert_eq!(
        socket_addr("::1", "3260"),
        Ok("[::1]:3260".parse().unwrap())
    );
    assert_eq!(
        socket_addr("[::1]", "3260"),
        Ok("[::1]:3260".parse().unwrap())
    );
    assert_eq!(socket_addr("localhost", 1), Err("localhost:1".to_string()));
    assert_eq!(
        socket_addr("127.0.0.1", "x"),
        Err("127.0.0.1:x".to_string())
    );
}

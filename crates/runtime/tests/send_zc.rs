//! `zc::sendmsg_zc` on real sockets: a loopback TCP send of 1 MiB arrives
//! intact, every op's memory is released only by its notification (which
//! on loopback says the kernel copied), a dropped future still keeps its
//! memory until then, and a socket without zero-copy support fails the op
//! and releases the memory at once.

use std::cell::RefCell;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::time::Duration;

use ustor_runtime::ops::{IoVecs, MAX_IOV};
use ustor_runtime::zc::{self, ZcNotice};
use ustor_runtime::Runtime;

mod common;

fn rt() -> Runtime {
    common::one_reactor(4 << 20)
}

/// A range of shared data to send, and the log its notification goes to.
struct Piece {
    data: Rc<Vec<u8>>,
    from: usize,
    log: Rc<RefCell<Vec<ZcNotice>>>,
}

impl IoVecs for Piece {
    fn iovecs(&self, out: &mut [libc::iovec; MAX_IOV]) -> usize {
        out[0] = libc::iovec {
            iov_base: self.data[self.from..].as_ptr() as *mut _,
            iov_len: self.data.len() - self.from,
        };
        1
    }
}

fn noted(p: Piece, n: ZcNotice) {
    p.log.borrow_mut().push(n);
}

/// Whether the ring of reactor 0 has SENDMSG_ZC.
fn zc_kernel(r: &Runtime) -> Result<(), String> {
    let ok = r
        .handle()
        .block_on(0, || async { zc::send_zc_supported() })
        .unwrap();
    ok.then_some(())
        .ok_or_else(|| "io_uring SENDMSG_ZC (Linux 6.1+)".to_string())
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 4096) as u8).collect()
}

#[test]
fn loopback_send_arrives_and_notifications_say_copied() {
    let r = rt();
    testkit::require!(zc_kernel(&r), "a kernel with IORING_OP_SENDMSG_ZC");
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let len = 1 << 20;
    let reader = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        got
    });
    let (ops, notes) = r
        .handle()
        .block_on(0, move || async move {
            let s = std::net::TcpStream::connect(addr).unwrap();
            let data = Rc::new(pattern(len));
            let log = Rc::new(RefCell::new(Vec::new()));
            let (mut at, mut ops) = (0, 0);
            while at < len {
                let p = Piece {
                    data: data.clone(),
                    from: at,
                    log: log.clone(),
                };
                let n = zc::sendmsg_zc(s.as_raw_fd(), p, noted).await.unwrap();
                assert!(n > 0, "a blocking socket sends at least a byte");
                at += n;
                ops += 1;
            }
            let all_in = || log.borrow().len() == ops && Rc::strong_count(&data) == 1;
            testkit::wait_until_async(
                "every send's notification",
                Duration::from_secs(10),
                all_in,
                ustor_runtime::sleep,
            )
            .await;
            let notes = log.borrow().clone();
            (ops, notes)
        })
        .unwrap();
    let got = reader.join().unwrap();
    assert_eq!(got.len(), len);
    assert!(got == pattern(len), "data differs");
    assert_eq!(notes.len(), ops, "one notification per send");
    for n in &notes {
        assert!(n.notified, "{n:?}");
        assert!(n.copied, "loopback TCP copies: {n:?}");
    }
}

#[test]
fn a_dropped_send_keeps_its_memory_until_the_notification() {
    let r = rt();
    testkit::require!(zc_kernel(&r), "a kernel with IORING_OP_SENDMSG_ZC");
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let reader = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        got.len()
    });
    let released = r
        .handle()
        .block_on(0, move || async move {
            let s = std::net::TcpStream::connect(addr).unwrap();
            let data = Rc::new(pattern(64 << 10));
            let log = Rc::new(RefCell::new(Vec::new()));
            let p = Piece {
                data: data.clone(),
                from: 0,
                log: log.clone(),
            };
            let mut op = Box::pin(zc::sendmsg_zc(s.as_raw_fd(), p, noted));
            let w = std::task::Waker::noop();
            let mut cx = std::task::Context::from_waker(w);
            assert!(std::future::Future::poll(op.as_mut(), &mut cx).is_pending());
            drop(op);
            let gone = || Rc::strong_count(&data) == 1;
            testkit::wait_until_async(
                "the dropped send's memory to be released",
                Duration::from_secs(10),
                gone,
                ustor_runtime::sleep,
            )
            .await;
            drop(s);
            // A dropped future releases without calling back.
            gone() && log.borrow().is_empty()
        })
        .unwrap();
    assert!(released);
    assert_eq!(
        reader.join().unwrap(),
        64 << 10,
        "the dropped send still went out"
    );
}

#[test]
fn a_unix_socket_refuses_zero_copy_and_releases_at_once() {
    let r = rt();
    testkit::require!(zc_kernel(&r), "a kernel with IORING_OP_SENDMSG_ZC");
    let (res, notes, refs) = r
        .handle()
        .block_on(0, || async {
            let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
            let data = Rc::new(pattern(4096));
            let log = Rc::new(RefCell::new(Vec::new()));
            let p = Piece {
                data: data.clone(),
                from: 0,
                log: log.clone(),
            };
            let res = zc::sendmsg_zc(a.as_raw_fd(), p, noted).await;
            let gone = || Rc::strong_count(&data) == 1;
            testkit::wait_until_async(
                "the refused send's memory to be released",
                Duration::from_secs(10),
                gone,
                ustor_runtime::sleep,
            )
            .await;
            let notes = log.borrow().clone();
            (
                res.map_err(|e| e.raw_os_error()),
                notes,
                Rc::strong_count(&data),
            )
        })
        .unwrap();
    assert_eq!(res, Err(Some(libc::EOPNOTSUPP)));
    assert_eq!(refs, 1);
    assert_eq!(notes.len(), 1, "the callback ran once: {notes:?}");
    // Nothing went out zero-copy: the kernel reports an unused zero-copy
    // send as copied (or sends no notification at all).
    assert!(notes[0].copied || !notes[0].notified, "{notes:?}");
}

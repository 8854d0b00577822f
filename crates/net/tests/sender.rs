//! The sender over a real socket whose buffer is far smaller than the
//! group: the direct `sendmsg` takes part, the rest goes through the ring
//! (which waits for room), and the peer gets every byte in order.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use ustor_net::PduGroup;
use ustor_runtime::{IoBuf, PollMode, Runtime, RuntimeConfig};

fn pattern(n: usize, seed: usize) -> Vec<u8> {
    (0..n).map(|i| ((i * 13 + seed * 7) % 251) as u8).collect()
}

#[test]
fn partial_sends_complete_in_order() {
    let rt = Runtime::start(RuntimeConfig {
        cores: vec![0],
        pin: false,
        poll_mode: PollMode::Adaptive,
        ..RuntimeConfig::default()
    })
    .expect("runtime starts");
    let (ours, mut peer) = UnixStream::pair().unwrap();
    let small: libc::c_int = 4096;
    // SAFETY: setsockopt with a live int and its size on our own socket.
    let r = unsafe {
        libc::setsockopt(
            ours.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&small as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0);
    // 40 PDUs: a 12-byte header each and 16 KiB of payload (640 KiB).
    let mut expect = Vec::new();
    for i in 0..40 {
        expect.extend_from_slice(format!("hdr{i:09}").as_bytes());
        expect.extend(pattern(16 << 10, i));
    }
    let total = expect.len();
    let reader = std::thread::spawn(move || {
        let mut got = vec![0u8; total];
        peer.read_exact(&mut got).unwrap();
        got
    });
    let fd = ours.as_raw_fd();
    let (ok, calls, empty) = rt
        .handle()
        .block_on(0, move || async move {
            let mut g = PduGroup::with_capacity(128, 4096);
            for i in 0..40 {
                g.push_bytes(format!("hdr{i:09}").as_bytes());
                let p = pattern(16 << 10, i);
                let mut b = IoBuf::heap(p.len());
                b.set_len(p.len());
                b.copy_from_slice(&p);
                let n = b.len();
                g.push_data(b, 0, n);
                g.end_pdu(false);
            }
            let mut calls = 0;
            let (r, g) = ustor_net::sender::send_all(fd, g, &mut calls).await;
            (r.is_ok(), calls, g.is_empty() && g.bytes() == 0)
        })
        .unwrap();
    assert!(ok, "sent");
    assert!(empty, "the group comes back cleared");
    assert!(
        calls > 1,
        "a 4 KiB socket buffer took the group in one call"
    );
    let got = reader.join().unwrap();
    assert!(got == expect, "bytes arrived out of order or changed");
    drop(ours);
}

//! The staging buffer on a real socket: greedy and bounded fills, payloads
//! received in place with the next header behind them, skips.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use ustor_net::recv::Seg;
use ustor_net::staging::{RecvMode, Rewind, Staging};
use ustor_runtime::{PollMode, Runtime, RuntimeConfig};

fn runtime() -> Runtime {
    Runtime::start(RuntimeConfig {
        cores: vec![0],
        pin: false,
        poll_mode: PollMode::Adaptive,
        ..RuntimeConfig::default()
    })
    .expect("runtime starts")
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn fills_payloads_and_skips_keep_the_byte_stream() {
    let rt = runtime();
    let (ours, mut peer) = UnixStream::pair().unwrap();
    // header "H1" + 3000-byte payload + header "H2" + 100 bytes to skip +
    // header "H3", all sent before the receiver starts.
    let payload = pattern(3000, 7);
    let mut wire = b"H1".to_vec();
    wire.extend_from_slice(&payload);
    wire.extend_from_slice(b"H2");
    wire.extend_from_slice(&pattern(100, 9));
    wire.extend_from_slice(b"H3");
    peer.write_all(&wire).unwrap();
    let fd = ours.as_raw_fd();
    for mode in [RecvMode::Ring, RecvMode::Adaptive, RecvMode::Direct] {
        if mode != RecvMode::Ring {
            peer.write_all(&wire).unwrap();
        }
        let expect = payload.clone();
        let ok = rt
            .handle()
            .block_on(0, move || async move {
                // Small staging, exact header reads: the payload is not staged.
                let mut st = Staging::new(64, Rewind::Lazy);
                st.fill(fd, 2, || 2, mode).await.unwrap();
                assert_eq!(st.peek(2), b"H1");
                st.consume(2);
                st.note_unit();
                let mut dst = vec![0u8; 3000];
                let seg = Seg {
                    ptr: dst.as_mut_ptr(),
                    len: dst.len(),
                };
                // SAFETY: `dst` lives across the call.
                let p = unsafe { st.recv_payload(fd, &[seg], 2) }.await.unwrap();
                assert_eq!(p.copied, 0, "nothing was staged");
                assert_eq!(dst, expect);
                // The next header came with the payload's receive.
                st.fill(fd, 2, || 2, mode).await.unwrap();
                assert_eq!(st.peek(2), b"H2");
                st.consume(2);
                st.skip(fd, 100, mode).await.unwrap();
                st.fill(fd, 2, || 64, mode).await.unwrap();
                assert_eq!(st.peek(2), b"H3");
                st.consume(2);
                st.is_empty()
            })
            .unwrap();
        assert!(ok, "{mode:?}: everything consumed");
    }
}

#[test]
fn greedy_fill_stages_payload_that_is_then_copied() {
    let rt = runtime();
    let (ours, mut peer) = UnixStream::pair().unwrap();
    let payload = pattern(1000, 3);
    let mut wire = b"HD".to_vec();
    wire.extend_from_slice(&payload);
    wire.extend_from_slice(b"NX");
    peer.write_all(&wire).unwrap();
    let fd = ours.as_raw_fd();
    let (copied, got, next) = rt
        .handle()
        .block_on(0, move || async move {
            let mut st = Staging::new(4096, Rewind::Eager);
            // Greedy: wait for the whole burst to be staged.
            st.fill(fd, wire.len(), || 4096, RecvMode::Ring)
                .await
                .unwrap();
            st.consume(2);
            let mut dst = vec![0u8; 1000];
            let seg = Seg {
                ptr: dst.as_mut_ptr(),
                len: dst.len(),
            };
            // SAFETY: `dst` lives across the call.
            let p = unsafe { st.recv_payload(fd, &[seg], 0) }.await.unwrap();
            (p.copied, dst, st.staged().to_vec())
        })
        .unwrap();
    assert_eq!(copied, 1000);
    assert_eq!(got, payload);
    assert_eq!(next, b"NX");
}

#[test]
fn eof_is_unexpected_eof() {
    let rt = runtime();
    let (ours, peer) = UnixStream::pair().unwrap();
    drop(peer);
    let fd = ours.as_raw_fd();
    let kind = rt
        .handle()
        .block_on(0, move || async move {
            let mut st = Staging::new(64, Rewind::Lazy);
            st.fill(fd, 8, || 64, RecvMode::Adaptive)
                .await
                .unwrap_err()
                .kind()
        })
        .unwrap();
    assert_eq!(kind, std::io::ErrorKind::UnexpectedEof);
}

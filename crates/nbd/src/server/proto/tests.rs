use super::*;

#[test]
fn extents_are_trimmed_to_the_request() {
    let e = |length, flags| BlockDescriptor { length, flags };
    let mut v = [e(512, 1), e(512, 0), e(512, 1)];
    assert_eq!(allowed_extents(&mut v, 1024, false), 2);
    let mut v = [e(512, 1), e(512, 0), e(512, 1)];
    assert_eq!(allowed_extents(&mut v, 1025, false), 3);
    let mut v = [e(4096, 3)];
    assert_eq!(allowed_extents(&mut v, 512, false), 1);
    assert_eq!(v[0], e(4096, 3), "the last extent may run past");
    let mut v = [e(0, 3), e(512, 3)];
    assert_eq!(allowed_extents(&mut v, 2048, false), 1);
    assert_eq!(v[0], e(2048, 0));
    let mut v = [e(512, 3), e(0, 0)];
    assert_eq!(allowed_extents(&mut v, 2048, false), 1);
    assert_eq!(v[0], e(512, 3));
    let mut v = [e(4096, 3)];
    assert_eq!(allowed_extents(&mut v, 1024, true), 1);
    assert_eq!(v[0], e(1024, 3));
}

#[test]
fn payload_accounting() {
    assert_eq!(
        payload_bytes(&Command::Read {
            offset: 0,
            length: 4096,
            df: false
        }),
        4096
    );
    assert_eq!(payload_bytes(&Command::Flush), 0);
}

/// The receive state machine, driven with staged bytes (no socket): an
/// NBD connection's `apply` over a 1 MiB malloc bdev, on a reactor (the
/// bdev channel lives there).
mod state_machine {
    use super::super::*;
    use crate::export::BlockSizes;
    use crate::wire::{cmd, transmission_flags as tf, RequestHeader};
    use std::sync::Arc;
    use ustor_net::Rewind;
    use ustor_runtime::{PollMode, Runtime, RuntimeConfig};

    fn params() -> TransmissionParams {
        TransmissionParams {
            size_bytes: 1 << 20,
            block_sizes: BlockSizes {
                min: 512,
                preferred: 4096,
                max_payload: 1 << 20,
            },
            flags: tf::HAS_FLAGS | tf::SEND_FLUSH | tf::SEND_FUA,
            structured: false,
            base_allocation: None,
            block_size_agreed: true,
        }
    }

    fn req(kind: u16, cookie: u64, offset: u64, length: u32) -> [u8; REQUEST_HEADER_LEN] {
        RequestHeader {
            flags: 0,
            kind,
            cookie,
            offset,
            length,
        }
        .encode()
    }

    /// Runs `f` with a fresh connection state on a reactor.
    fn with_nbd(f: impl FnOnce(&Nbd) + Send + 'static) {
        let rt = Runtime::start(RuntimeConfig {
            cores: vec![0],
            pin: false,
            poll_mode: PollMode::Adaptive,
            ..RuntimeConfig::default()
        })
        .expect("runtime starts");
        let registry = ustor_bdev::Registry::new(Some(rt.handle()));
        let opts = ustor_bdev::modules::RamOpts {
            name: "m".into(),
            num_blocks: 2048,
            block_size: 512,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        };
        ustor_bdev::modules::malloc::create(&registry, opts).expect("malloc");
        let desc = registry.open("m", true, |_| {}).expect("open");
        let source = Arc::new(super::super::super::BdevSource::new(desc));
        rt.handle()
            .block_on(0, move || async move {
                let ch = source.channel().expect("channel");
                let nbd = Nbd::new(ch, params(), source.features());
                f(&nbd);
            })
            .expect("ran");
    }

    #[test]
    fn small_and_large_writes_choose_their_receive() {
        with_nbd(|nbd| {
            let mut st = Staging::new(64 << 10, Rewind::Eager);
            // Greedy header reads to start with.
            assert!(matches!(
                nbd.apply(RecvEvent::Next, &mut st),
                Recv::Stage {
                    need: 28,
                    max: usize::MAX
                }
            ));
            st.stage_bytes(&req(cmd::WRITE, 1, 0, 4096));
            assert!(matches!(
                nbd.apply(RecvEvent::Staged, &mut st),
                Recv::Payload {
                    len: 4096,
                    via: Via::Staging,
                    off: 0,
                    buf: None
                }
            ));
            let mut b = IoBuf::heap(4096);
            b.set_len(4096);
            match nbd.apply(RecvEvent::Payload(b), &mut st) {
                Recv::Dispatch(j) => assert_eq!((j.cookie, j.payload.is_some()), (1, true)),
                _ => panic!("a received write is dispatched"),
            }
            // A large write: its payload lands in place, with the next
            // header behind it, and headers are then read exactly.
            st.stage_bytes(&req(cmd::WRITE, 2, 0, (COPY_MAX + 512) as u32));
            assert!(matches!(
                nbd.apply(RecvEvent::Staged, &mut st),
                Recv::Payload {
                    via: Via::Direct { tail: 28 },
                    ..
                }
            ));
            let mut b = IoBuf::heap(COPY_MAX + 512);
            b.set_len(COPY_MAX + 512);
            assert!(matches!(
                nbd.apply(RecvEvent::Payload(b), &mut st),
                Recv::Dispatch(_)
            ));
            assert!(matches!(
                nbd.apply(RecvEvent::Next, &mut st),
                Recv::Stage { need: 28, max: 28 }
            ));
            // A read goes straight to a worker and reads turn greedy again.
            st.stage_bytes(&req(cmd::READ, 3, 512, 512));
            match nbd.apply(RecvEvent::Staged, &mut st) {
                Recv::Dispatch(j) => assert_eq!(payload_bytes(&j.command), 512),
                _ => panic!("a read is dispatched"),
            }
            assert!(matches!(
                nbd.apply(RecvEvent::Next, &mut st),
                Recv::Stage {
                    max: usize::MAX,
                    ..
                }
            ));
        });
    }

    #[test]
    fn refusals_skip_their_payload_and_answer_at_once() {
        with_nbd(|nbd| {
            let mut st = Staging::new(4096, Rewind::Eager);
            // Beyond the end of the export: refused, its payload dropped.
            st.stage_bytes(&req(cmd::WRITE, 9, 1 << 20, 1024));
            assert!(matches!(
                nbd.apply(RecvEvent::Staged, &mut st),
                Recv::Skip(1024)
            ));
            match nbd.apply(RecvEvent::Skipped, &mut st) {
                Recv::Reply(r) => {
                    assert!(r.data.is_none());
                    let h = r.header.as_bytes();
                    // Simple reply: magic, error (a write past the end is
                    // ENOSPC = 28), cookie 9.
                    assert_eq!(&h[4..8], &28u32.to_be_bytes());
                    assert_eq!(&h[8..16], &9u64.to_be_bytes());
                }
                _ => panic!("a refusal is answered without a worker"),
            }
            // Disconnect and garbage both close.
            st.stage_bytes(&req(cmd::DISC, 0, 0, 0));
            assert!(matches!(nbd.apply(RecvEvent::Staged, &mut st), Recv::Close));
            st.stage_bytes(&[0xee; 28]);
            assert!(matches!(nbd.apply(RecvEvent::Staged, &mut st), Recv::Close));
        });
    }
}

//! Body of the `iscsi_rx` fuzz target, shared with the proptests that run
//! it on stable: a byte stream "from the target" goes through the
//! initiator's real receive machine ([`State`]) with three commands in
//! flight (two reads, one write), in chunks of varying size, with digests
//! on or off. Malformed PDUs (bad lengths, unknown opcodes, data beyond a
//! task's buffer, wrong ITTs, bad digests) must end in an `RxError`, after
//! which the session fails its commands (what the LLD does before
//! reinstating) — never a panic, a write outside a buffer, or a hang
//! (every loop here is bounded by the input length).

use ustor_scsi::cdb::Cdb;
use ustor_scsi::lld::{DataDir, Nexus, ScsiCmd, TransportError};

use crate::session::{Params, RxError, State, RX_IOVS, TX_IOVS};
use crate::task::SENSE_MAX;

/// Tags of the commands in flight (slot in the low 16 bits).
pub const TAGS: [u32; 3] = [0x0001_0000, 0x0002_0001, 0x0003_0002];
/// Their buffer sizes: read, write, read.
pub const SIZES: [usize; 3] = [8192, 4096, 512];

fn iov(b: &mut [u8]) -> libc::iovec {
    libc::iovec {
        iov_base: b.as_mut_ptr().cast(),
        iov_len: b.len(),
    }
}

/// Runs a byte stream through the receive machine; returns how the stream
/// ended (`Ok` = all bytes taken).
pub fn rx_stream(data: &[u8]) -> Result<(), RxError> {
    let Some((&cfg, data)) = data.split_first() else {
        return Ok(());
    };
    let p = Params {
        header_digest: cfg & 1 != 0,
        data_digest: cfg & 2 != 0,
        immediate_data: cfg & 4 != 0,
        initial_r2t: cfg & 8 != 0,
        first_burst: 2048,
        max_burst: 4096,
        max_send_seg: 1024,
        max_recv_seg: 16384,
    };
    // Chunk sizes 1..=64, or whole reads.
    let chunk = match cfg >> 4 {
        0 => usize::MAX,
        c => c as usize * 4,
    };
    let mut st = State::new(p, 4, 1, 1, 64);
    // Buffers outlive the state's use of them (the mid-layer's promise).
    let (mut r0a, mut r0b) = (vec![0u8; SIZES[0] / 2], vec![0u8; SIZES[0] / 2]);
    let mut w1 = vec![0xa5u8; SIZES[1]];
    let mut r2 = vec![0u8; SIZES[2]];
    let v0 = [iov(&mut r0a), iov(&mut r0b)];
    let v1 = [iov(&mut w1)];
    let v2 = [iov(&mut r2)];
    let cmds = [
        (DataDir::FromDevice, &v0[..]),
        (DataDir::ToDevice, &v1[..]),
        (DataDir::FromDevice, &v2[..]),
    ];
    for (i, (dir, v)) in cmds.iter().enumerate() {
        let cmd = ScsiCmd {
            tag: TAGS[i],
            nexus: Nexus {
                channel: 0,
                target: 0,
                lun: 0,
            },
            cdb: Cdb::test_unit_ready(),
            dir: *dir,
            iov: v.as_ptr(),
            iovcnt: v.len(),
            data_len: SIZES[i] as u32,
        };
        assert!(st.start(&cmd).is_some(), "fresh slots take a command");
    }
    let r = feed(&mut st, data, chunk);
    if r.is_err() {
        st.fail_all(TransportError::Disconnected);
    }
    drain_tx(&mut st);
    let mut sense = [0u8; SENSE_MAX];
    let mut reported = 0;
    while let Some((tag, _, _, n)) = st.take_done(&mut sense) {
        assert!(TAGS.contains(&tag) && n <= SENSE_MAX);
        reported += 1;
    }
    assert!(reported <= TAGS.len(), "a command reported twice");
    if r.is_err() {
        assert_eq!(
            reported,
            TAGS.len(),
            "a failed session reports every command"
        );
    }
    r
}

fn feed(st: &mut State, data: &[u8], chunk: usize) -> Result<(), RxError> {
    feed_with(st, data, chunk, true)
}

/// Feeds bytes as the socket would; `drain` also empties the send side
/// after each read.
fn feed_with(st: &mut State, mut data: &[u8], chunk: usize, drain: bool) -> Result<(), RxError> {
    let mut v = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; RX_IOVS];
    while !data.is_empty() {
        let n = st.rx_iovecs(&mut v);
        assert!(n > 0 && v[..n].iter().all(|x| x.iov_len > 0));
        // What readv would do: fill the iovecs in order.
        let mut take = data.len().min(chunk);
        let mut got = 0;
        for x in &v[..n] {
            let k = x.iov_len.min(take);
            // SAFETY: the machine's iovecs point into its own buffers or the
            // commands' buffers above, all alive and at least iov_len long.
            unsafe { std::ptr::copy_nonoverlapping(data[got..].as_ptr(), x.iov_base.cast(), k) };
            got += k;
            take -= k;
            if take == 0 {
                break;
            }
        }
        data = &data[got..];
        st.rx_advance(got)?;
        if drain {
            drain_tx(st);
        }
    }
    Ok(())
}

/// Sends whatever the machine staged (R2T answers, NOP echoes) to nowhere,
/// in odd-sized pieces, so the send side's bookkeeping is run too.
fn drain_tx(st: &mut State) {
    let mut v = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; TX_IOVS];
    // Bounded: each round sends at least one byte of a finite backlog.
    for _ in 0..10_000 {
        let n = st.tx_iovecs(&mut v);
        if n == 0 {
            return;
        }
        let total: usize = v[..n].iter().map(|x| x.iov_len).sum();
        assert!(total > 0);
        st.tx_advance(total.div_ceil(3).max(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{opcode, pad4, Bhs};
    use proptest::prelude::*;

    /// One target PDU, serialized with digests as `cfg` says.
    fn pdu(cfg: u8, op: u8, flags: u8, itt: u32, f40: u32, f44: u32, data: &[u8]) -> Vec<u8> {
        let mut b = Bhs::new(op, false, flags);
        b.set_itt(itt)
            .set_u32(20, 0x100)
            .set_u32(24, 1)
            .set_u32(32, 64)
            .set_u32(40, f40)
            .set_u32(44, f44)
            .set_data_len(data.len());
        let mut out = b.0.to_vec();
        if cfg & 1 != 0 {
            out.extend_from_slice(&crc32c::crc32c(&b.0).to_le_bytes());
        }
        out.extend_from_slice(data);
        out.resize(out.len() + pad4(data.len()) - data.len(), 0);
        if cfg & 2 != 0 && !data.is_empty() {
            let mut padded = data.to_vec();
            padded.resize(pad4(data.len()), 0);
            out.extend_from_slice(&crc32c::crc32c(&padded).to_le_bytes());
        }
        out
    }

    #[test]
    fn good_stream_completes_every_command() {
        for cfg in [0u8, 1, 2, 3, 0x13, 0x23] {
            let mut s = vec![cfg];
            s.extend(pdu(cfg, opcode::DATA_IN, 0, TAGS[0], 0, 0, &[7; 4096]));
            s.extend(pdu(
                cfg,
                opcode::DATA_IN,
                0x81,
                TAGS[0],
                4096,
                0,
                &[8; 4096],
            ));
            s.extend(pdu(cfg, opcode::R2T, 0x80, TAGS[1], 0, 4096, &[]));
            s.extend(pdu(cfg, opcode::SCSI_RESP, 0x80, TAGS[1], 0, 0, &[]));
            s.extend(pdu(cfg, opcode::DATA_IN, 0x81, TAGS[2], 0, 0, &[9; 510]));
            assert_eq!(rx_stream(&s), Ok(()), "cfg {cfg:#x}");
        }
    }

    #[test]
    fn malformed_pdus_fail_the_session() {
        let c = 3u8;
        type Check = fn(&RxError) -> bool;
        let cases: Vec<(Vec<u8>, Check)> = vec![
            // Data beyond the task's buffer.
            (
                pdu(c, opcode::DATA_IN, 0, TAGS[2], 256, 0, &[1; 512]),
                |e| matches!(e, RxError::Overrun { .. }),
            ),
            // Wrong ITT.
            (
                pdu(c, opcode::DATA_IN, 0, 0x0009_0001, 0, 0, &[1; 4]),
                |e| matches!(e, RxError::UnknownTask(_)),
            ),
            // Data-In for the write.
            (pdu(c, opcode::DATA_IN, 0, TAGS[1], 0, 0, &[1; 4]), |e| {
                matches!(e, RxError::Overrun { .. })
            }),
            // Unknown opcode.
            (pdu(c, 0x1f, 0, TAGS[0], 0, 0, &[]), |e| {
                matches!(e, RxError::Wire(crate::wire::WireError::Opcode(0x1f)))
            }),
            // Segment above our MaxRecvDataSegmentLength.
            (
                pdu(c, opcode::NOP_IN, 0x80, 0xffff_ffff, 0, 0, &[0; 20000]),
                |e| matches!(e, RxError::Wire(crate::wire::WireError::TooLarge(_))),
            ),
            // R2T beyond the buffer.
            (pdu(c, opcode::R2T, 0x80, TAGS[1], 4000, 4096, &[]), |e| {
                matches!(e, RxError::BadR2t)
            }),
        ];
        for (bytes, want) in cases {
            let mut s = vec![c];
            s.extend(bytes);
            let e = rx_stream(&s).unwrap_err();
            assert!(want(&e), "{e:?}");
        }
        // A flipped bit under each digest.
        let mut s = vec![c];
        s.extend(pdu(c, opcode::DATA_IN, 0x81, TAGS[2], 0, 0, &[9; 512]));
        let mut h = s.clone();
        h[1 + 20] ^= 1;
        assert!(matches!(
            rx_stream(&h),
            Err(RxError::Wire(crate::wire::WireError::HeaderDigest))
        ));
        s[1 + 52 + 100] ^= 1;
        assert!(matches!(
            rx_stream(&s),
            Err(RxError::Wire(crate::wire::WireError::DataDigest))
        ));
    }

    #[test]
    fn data_lands_in_the_commands_buffer() {
        // Direct check of zero-copy placement across two iovecs.
        let p = Params {
            header_digest: true,
            data_digest: true,
            immediate_data: false,
            initial_r2t: true,
            first_burst: 4096,
            max_burst: 4096,
            max_send_seg: 4096,
            max_recv_seg: 16384,
        };
        let mut st = State::new(p, 2, 1, 1, 64);
        let (mut a, mut b) = (vec![0u8; 100], vec![0u8; 4000]);
        let v = [iov(&mut a), iov(&mut b)];
        let cmd = ScsiCmd {
            tag: 0x0005_0001,
            nexus: Nexus {
                channel: 0,
                target: 0,
                lun: 0,
            },
            cdb: Cdb::test_unit_ready(),
            dir: DataDir::FromDevice,
            iov: v.as_ptr(),
            iovcnt: 2,
            data_len: 4100,
        };
        st.start(&cmd).unwrap();
        let payload: Vec<u8> = (0..4100u32).map(|i| (i * 7) as u8).collect();
        let s = pdu(3, opcode::DATA_IN, 0x81, 0x0005_0001, 0, 0, &payload);
        feed(&mut st, &s, 1000).unwrap();
        let mut sense = [0u8; SENSE_MAX];
        let (tag, status, resid, _) = st.take_done(&mut sense).unwrap();
        assert_eq!((tag, status.is_ok(), resid), (0x0005_0001, true, 0));
        assert_eq!(&a[..], &payload[..100]);
        assert_eq!(&b[..], &payload[100..]);
    }

    /// Everything the send machine has staged, as bytes on the wire.
    fn sent_bytes(st: &mut State) -> Vec<u8> {
        let mut v = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; TX_IOVS];
        let mut out = Vec::new();
        loop {
            let n = st.tx_iovecs(&mut v);
            if n == 0 {
                return out;
            }
            let mut k = 0;
            for x in &v[..n] {
                // SAFETY: the machine's iovecs point at live buffers.
                out.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(x.iov_base as *const u8, x.iov_len)
                });
                k += x.iov_len;
            }
            st.tx_advance(k);
        }
    }

    /// Splits wire bytes (no digests) into (BHS, data) pairs.
    fn pdus(mut b: &[u8]) -> Vec<(Bhs, Vec<u8>)> {
        let mut out = Vec::new();
        while b.len() >= 48 {
            let h = Bhs::from_slice(b).unwrap();
            let d = h.data_len();
            out.push((h, b[48..48 + d].to_vec()));
            b = &b[48 + pad4(d)..];
        }
        assert!(b.is_empty());
        out
    }

    #[test]
    fn writes_respect_first_burst_and_immediate_limits() {
        // ImmediateData + InitialR2T=No: 1 KiB immediate (the target's
        // MRDSL), unsolicited Data-Out up to FirstBurstLength (2 KiB), then
        // an R2T for the rest.
        let p = Params {
            header_digest: false,
            data_digest: false,
            immediate_data: true,
            initial_r2t: false,
            first_burst: 2048,
            max_burst: 4096,
            max_send_seg: 1024,
            max_recv_seg: 16384,
        };
        let mut st = State::new(p, 2, 1, 1, 64);
        let mut buf: Vec<u8> = (0..8192u32).map(|i| (i * 13) as u8).collect();
        let v = [iov(&mut buf)];
        let cmd = ScsiCmd {
            tag: 0x0007_0001,
            nexus: Nexus {
                channel: 0,
                target: 0,
                lun: 0,
            },
            cdb: Cdb::test_unit_ready(),
            dir: DataDir::ToDevice,
            iov: v.as_ptr(),
            iovcnt: 1,
            data_len: 8192,
        };
        st.start(&cmd).unwrap();
        let first = pdus(&sent_bytes(&mut st));
        assert_eq!(first.len(), 2, "command + one unsolicited Data-Out");
        let (c, imm) = &first[0];
        assert_eq!(c.opcode(), opcode::SCSI_CMD);
        assert!(!c.final_bit(), "F clear: unsolicited data follows");
        assert_eq!(c.u32_at(20), 8192, "EDTL");
        assert_eq!(&imm[..], &buf[..1024]);
        let (d, data) = &first[1];
        assert_eq!(
            (d.opcode(), d.u32_at(20), d.u32_at(40)),
            (opcode::DATA_OUT, 0xffff_ffff, 1024)
        );
        assert!(d.final_bit(), "last PDU of the unsolicited burst");
        assert_eq!(&data[..], &buf[1024..2048]);
        // The target asks for the rest: 4 KiB (MaxBurstLength), then 2 KiB.
        let r2t = pdu(0, opcode::R2T, 0x80, 0x0007_0001, 2048, 4096, &[]);
        feed_with(&mut st, &r2t, usize::MAX, false).unwrap();
        let burst = pdus(&sent_bytes(&mut st));
        assert_eq!(burst.len(), 4, "4 KiB in 1 KiB segments");
        for (i, (h, data)) in burst.iter().enumerate() {
            let off = 2048 + i * 1024;
            assert_eq!(
                (h.u32_at(20), h.u32_at(36), h.u32_at(40)),
                (0x100, i as u32, off as u32)
            );
            assert_eq!(h.final_bit(), i == 3);
            assert_eq!(&data[..], &buf[off..off + 1024]);
        }
        // Immediate data off and InitialR2T=Yes: the command goes alone.
        let mut st = State::new(
            Params {
                immediate_data: false,
                initial_r2t: true,
                ..p
            },
            2,
            1,
            1,
            64,
        );
        st.start(&cmd).unwrap();
        let only = pdus(&sent_bytes(&mut st));
        assert_eq!(only.len(), 1);
        assert!(only[0].0.final_bit() && only[0].1.is_empty());
    }

    /// A stream of PDUs with fields drawn near the interesting values.
    fn structured() -> impl Strategy<Value = Vec<u8>> {
        let one = (
            prop::sample::select(vec![
                opcode::DATA_IN,
                opcode::SCSI_RESP,
                opcode::R2T,
                opcode::NOP_IN,
                opcode::TMF_RESP,
                opcode::ASYNC,
                opcode::REJECT,
                opcode::LOGOUT_RESP,
                opcode::LOGIN_RESP,
                0x1f,
            ]),
            any::<u8>(),
            prop::sample::select(vec![TAGS[0], TAGS[1], TAGS[2], 0xffff_ffff, 0x0004_0003, 7]),
            0u32..9000,
            0u32..9000,
            0usize..5000,
        );
        (any::<u8>(), prop::collection::vec(one, 0..8)).prop_map(|(cfg, pdus)| {
            let mut s = vec![cfg];
            for (op, fl, itt, f40, f44, dlen) in pdus {
                s.extend(pdu(cfg, op, fl, itt, f40, f44, &vec![0x5a; dlen]));
            }
            s
        })
    }

    proptest! {
        #[test]
        fn rx_never_panics_on_bytes(data in prop::collection::vec(any::<u8>(), 0..400)) {
            let _ = rx_stream(&data);
        }

        #[test]
        fn rx_never_panics_on_pdus(data in structured()) {
            let _ = rx_stream(&data);
        }
    }
}

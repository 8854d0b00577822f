//! Against the fake controller: the initiator pads to CPDA, takes padded
//! C2HData, and answers malformed PDUs with an H2CTermReq.

use super::fake_controller::*;
use super::*;

#[test]
fn initiator_pads_to_cpda_and_takes_padded_c2h_data() {
    let h = host::host();
    for (i, digests) in [false, true].into_iter().enumerate() {
        for (cpda, c2h_pda) in [(3u8, 15u8), (0, 2), (MAX_PDA, MAX_PDA)] {
            let f = fake(FakeCfg {
                cpda,
                c2h_pda,
                fault: Fault::None,
            });
            let name = format!("Pad{i}x{cpda}");
            let bdev = h.attach(&name, f.port, digests).unwrap();
            // In-capsule (4 KiB), then R2T (32 KiB in 8 KiB H2CData PDUs).
            for (slba, len) in [(8u64, 4096usize), (64, 32768)] {
                let data = pattern(len, slba + u64::from(cpda));
                let got = h.write_read(&bdev, slba, Some(data.clone()), len).unwrap();
                assert!(got == data, "data through padded PDUs differs");
            }
            // Untouched blocks read as the fake's pattern.
            let disk = pattern(FAKE_BLOCKS as usize * 512, 77);
            let got = h.write_read(&bdev, 1000, None, 8192).unwrap();
            assert!(got[..] == disk[1000 * 512..1000 * 512 + 8192]);
            h.detach(&name);
            // Connect data, the in-capsule write and 4 H2CData PDUs at least.
            assert!(f.seen.data_pdus.load(Ordering::Relaxed) >= 6);
            assert_eq!(f.seen.misaligned.load(Ordering::Relaxed), 0, "CPDA {cpda}");
            assert!(f.seen.terms.lock().unwrap().is_empty());
            assert_eq!(f.seen.broken.load(Ordering::Relaxed), 0);
        }
    }
}

/// Waits for the fake's record of an H2CTermReq.
fn term_of(f: &Fake) -> (u16, u32, Vec<u8>) {
    f.terms
        .recv_timeout(Duration::from_secs(15))
        .expect("no H2CTermReq from the initiator");
    f.seen.terms.lock().unwrap()[0].clone()
}

#[test]
fn malformed_controller_pdus_get_an_h2c_term_req() {
    let h = host::host();
    let inval = fes::INVALID_HEADER_FIELD;
    let cases = [
        (Fault::C2HIdleCid, false, inval, 8, PduType::C2HData),
        (
            Fault::C2HOutOfRange,
            false,
            fes::DATA_OUT_OF_RANGE,
            12,
            PduType::C2HData,
        ),
        (
            Fault::C2HSuccessNotLast,
            true,
            inval,
            ch_off::FLAGS,
            PduType::C2HData,
        ),
        (Fault::RespIdleCid, false, inval, 20, PduType::CapsuleResp),
        (Fault::R2TForRead, true, inval, 8, PduType::R2T),
        (
            Fault::BadHeaderDigest,
            true,
            fes::HEADER_DIGEST_ERROR,
            0,
            PduType::CapsuleResp,
        ),
        (
            Fault::HostPdu,
            false,
            fes::PDU_SEQUENCE_ERROR,
            ch_off::PDU_TYPE,
            PduType::CapsuleCmd,
        ),
    ];
    for (i, (fault, digests, fes_want, fei_want, ty)) in cases.into_iter().enumerate() {
        let f = fake(FakeCfg {
            cpda: 0,
            c2h_pda: 0,
            fault,
        });
        let name = format!("Bad{i}");
        let bdev = h.attach(&name, f.port, digests).unwrap();
        // The read meets the fault; the queue reconnects and retries it
        // on a well-behaved connection.
        let disk = pattern(FAKE_BLOCKS as usize * 512, 77);
        let got = h.write_read(&bdev, 16, None, 4096).unwrap();
        assert!(got[..] == disk[16 * 512..16 * 512 + 4096], "{fault:?}");
        let (fes_got, fei_got, hdr) = term_of(&f);
        assert_eq!((fes_got, fei_got), (fes_want, fei_want), "{fault:?}");
        // The request quotes the offending header.
        assert!(hdr.len() >= CH_LEN, "{fault:?}: {hdr:?}");
        assert_eq!(hdr[0], ty as u8, "{fault:?}");
        assert!(f.seen.io_conns.load(Ordering::Relaxed) >= 2, "{fault:?}");
        assert_eq!(f.seen.broken.load(Ordering::Relaxed), 0, "{fault:?}");
        h.detach(&name);
    }
}

#[test]
fn malformed_admin_pdus_get_an_h2c_term_req() {
    let h = host::host();
    for (i, (fault, fei)) in [
        (Fault::AdminBadCpda, 10),
        (Fault::AdminBadHlen, ch_off::HLEN),
    ]
    .into_iter()
    .enumerate()
    {
        let f = fake(FakeCfg {
            cpda: 0,
            c2h_pda: 0,
            fault,
        });
        assert!(h.attach(&format!("BadAdmin{i}"), f.port, false).is_err());
        let (fes_got, fei_got, hdr) = term_of(&f);
        assert_eq!(
            (fes_got, fei_got),
            (fes::INVALID_HEADER_FIELD, fei),
            "{fault:?}"
        );
        let ty = if fault == Fault::AdminBadCpda {
            PduType::IcResp
        } else {
            PduType::CapsuleResp
        };
        assert_eq!(hdr[0], ty as u8);
    }
}

/// An I/O queue's connection starts inside its driver protocol: a bad
/// ICResp there gets the H2CTermReq too, and the queue comes back on a
/// controller reset with the read intact.
#[test]
fn malformed_io_queue_icresp_gets_an_h2c_term_req() {
    let h = host::host();
    let f = fake(FakeCfg {
        cpda: 0,
        c2h_pda: 0,
        fault: Fault::IoBadCpda,
    });
    let bdev = h.attach("BadIoIc", f.port, false).unwrap();
    let disk = pattern(FAKE_BLOCKS as usize * 512, 77);
    let got = h.write_read(&bdev, 16, None, 4096).unwrap();
    assert!(got[..] == disk[16 * 512..16 * 512 + 4096]);
    let (fes_got, fei_got, hdr) = term_of(&f);
    assert_eq!((fes_got, fei_got), (fes::INVALID_HEADER_FIELD, 10));
    assert_eq!(hdr[0], PduType::IcResp as u8);
    // A later connection of the queue got through to its Connect.
    assert!(f.seen.io_conns.load(Ordering::Relaxed) >= 1);
    assert_eq!(f.seen.broken.load(Ordering::Relaxed), 0);
    h.detach("BadIoIc");
}

#[test]
fn initiator_queue_stats_report_adaptive_moves() {
    use ustor_net::coalesce::{CoalesceConfig, Mode};
    let e = env();
    let h = host::beside(&e);
    let port = e.port.to_string();
    let mut p = ustor_nvme::initiator::AttachParams::tcp("Adapt", "127.0.0.1", &port, NQN);
    p.hostnqn = Some(HOSTNQN.into());
    // Adaptive, degree 1, a one-group window: the first group is full, so
    // the first window raises the degree.
    p.coalesce = CoalesceConfig {
        mode: Mode::Adaptive,
        degree: 1,
        min_degree: 1,
        window: 1,
        ..CoalesceConfig::default()
    };
    let bdev = h.attach_with(&p).unwrap();
    for i in 0..8 {
        let d = pattern(4096, i);
        assert_eq!(
            h.write_read(&bdev, i * 8, Some(d.clone()), 4096).unwrap(),
            d
        );
    }
    let (raises, _lowers) = h.adaptive_moves("Adapt");
    assert!(raises >= 1, "adaptive raises not reported");
    h.detach("Adapt");
}

//! Identify: namespace descriptors, CSI-specific and unknown CNS, active namespace lists.

use super::*;

// ---------------------------------------------------------------------
// 3. Identify
// ---------------------------------------------------------------------

/// Namespace Identification Descriptor list (CNS 03h): descriptors of
/// NIDT (byte 0), NIDL (byte 1), 2 reserved bytes, then NIDL bytes: NGUID
/// (2h, 16), UUID (3h, 16, the bdev's UUID in RFC 4122 byte order), CSI
/// (4h, 1, NVM = 0), then a zero NIDT. The NGUID matches Identify
/// Namespace bytes 119:104.
#[test]
fn identify_ns_descriptors() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    let uuid = *e.registry.get("Malloc0").unwrap().info().uuid.as_bytes();
    let (d, c) = identify(&mut a, 3, 1, 0);
    assert!(c.status().is_success());
    assert_eq!(d.len(), 4096);
    let mut at = 0;
    let mut seen = Vec::new();
    while d[at] != 0 {
        let (nidt, nidl) = (d[at], usize::from(d[at + 1]));
        assert_eq!(&d[at + 2..at + 4], &[0, 0], "reserved");
        seen.push((nidt, d[at + 4..at + 4 + nidl].to_vec()));
        at += 4 + nidl;
    }
    assert!(d[at..].iter().all(|b| *b == 0));
    assert_eq!(
        seen,
        vec![(2, uuid.to_vec()), (3, uuid.to_vec()), (4, vec![0])],
        "NGUID (= UUID by default), UUID, CSI"
    );
    let (ns, _) = identify(&mut a, 0, 1, 0);
    assert_eq!(&ns[104..120], &uuid, "Identify Namespace NGUID");
    assert_eq!(&ns[120..128], &[0; 8], "EUI64 not reported");

    // A namespace with its own UUID and NGUID.
    malloc(&e, "Malloc1", 2048);
    let nsid = e
        .target
        .nvmf_subsystem_add_ns(&AddNsParams {
            nqn: NQN.into(),
            namespace: NamespaceParams {
                bdev_name: "Malloc1".into(),
                nsid: 0,
                uuid: Some("6b1f2a3c-4d5e-4f60-8172-839495a6b7c8".into()),
                nguid: Some("00112233445566778899AABBCCDDEEFF".into()),
            },
        })
        .unwrap();
    let (d, c) = identify(&mut a, 3, nsid, 0);
    assert!(c.status().is_success());
    assert_eq!((d[0], d[1]), (2, 16));
    assert_eq!(
        d[4..20],
        [
            0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd,
            0xee, 0xff
        ]
    );
    assert_eq!((d[20], d[21]), (3, 16));
    assert_eq!(
        d[24..40],
        [
            0x6b, 0x1f, 0x2a, 0x3c, 0x4d, 0x5e, 0x4f, 0x60, 0x81, 0x72, 0x83, 0x94, 0x95, 0xa6,
            0xb7, 0xc8
        ]
    );
    let (ns, _) = identify(&mut a, 0, nsid, 0);
    assert_eq!(ns[104..120], d[4..20]);
    // An inactive NSID: Invalid Namespace or Format.
    assert_eq!(
        identify(&mut a, 3, 5, 0).1.status(),
        Status::INVALID_NAMESPACE
    );
}

/// CNS 05h / 06h with CSI 00h (NVM): the I/O command set specific Identify
/// Namespace / Controller structures (4096 bytes; all-zero means no NVM
/// specific limits, which is what Linux reads for VSL/WZSL/DMRL/DMRSL);
/// another CSI or an unknown CNS: Invalid Field.
#[test]
fn identify_csi_specific_and_unknown_cns() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    for cns in [5, 6] {
        let (d, c) = identify(&mut a, cns, if cns == 5 { 1 } else { 0 }, 0);
        assert!(c.status().is_success(), "CNS {cns}");
        assert_zero(&d, &format!("CNS {cns}"));
        assert_eq!(
            identify(&mut a, cns, 1, 2).1.status(),
            Status::INVALID_FIELD,
            "CNS {cns} CSI 2 (ZNS)"
        );
    }
    for cns in [0x04, 0x07, 0x10, 0x13] {
        assert_eq!(
            identify(&mut a, cns, 0, 0).1.status(),
            Status::INVALID_FIELD,
            "CNS {cns:#x}"
        );
    }
    // Identify Namespace for the broadcast NSID without namespace
    // management, and for NSID 0.
    for nsid in [0, 0xffff_ffff] {
        assert_eq!(
            identify(&mut a, 0, nsid, 0).1.status(),
            Status::INVALID_NAMESPACE
        );
    }
    // An inactive NSID within NN reads as zeroes.
    let (d, c) = identify(&mut a, 0, 2, 0);
    assert!(c.status().is_success());
    assert_zero(&d, "4 KiB of zeroes");
}

/// Active Namespace ID list (CNS 02h): active NSIDs greater than CDW1.NSID,
/// increasing, zero-terminated, up to 1024 entries.
#[test]
fn identify_active_ns_list_with_start_nsid() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    malloc(&e, "Malloc1", 2048);
    malloc(&e, "Malloc2", 2048);
    add_ns(&e, NQN, "Malloc2", 5);
    add_ns(&e, NQN, "Malloc1", 3);
    let (id, _) = identify(&mut a, 1, 0, 0);
    assert_eq!(le32(&id, 516), 8, "NN");
    let list = |a: &mut Client, start: u32| {
        let (d, c) = identify(a, 2, start, 0);
        assert!(c.status().is_success());
        assert_eq!(d.len(), 4096);
        let ids: Vec<u32> = (0..1024)
            .map(|i| le32(&d, i * 4))
            .take_while(|x| *x != 0)
            .collect();
        let n = ids.len();
        assert!(d[n * 4..].iter().all(|b| *b == 0));
        ids
    };
    assert_eq!(list(&mut a, 0), [1, 3, 5]);
    assert_eq!(list(&mut a, 1), [3, 5]);
    assert_eq!(list(&mut a, 2), [3, 5]);
    assert_eq!(list(&mut a, 3), [5]);
    assert_eq!(list(&mut a, 5), Vec::<u32>::new());
    assert_eq!(list(&mut a, 100), Vec::<u32>::new());
}

/// NVMe Base 1.4 5.15.2.2 (CNS 02h): "If the NSID field is set to
/// FFFFFFFEh or FFFFFFFFh, then the controller shall abort the command with
/// a status of Invalid Namespace or Format". QEMU (nvme_identify_nslist)
/// and SPDK do so.
#[test]
fn identify_active_ns_list_rejects_broadcast_nsids() {
    let e = env();
    let (mut a, _) = Client::admin(e.port, Digests::default());
    for nsid in [0xffff_fffe, 0xffff_ffff] {
        assert_eq!(
            identify(&mut a, 2, nsid, 0).1.status(),
            Status::INVALID_NAMESPACE,
            "NSID {nsid:#x}"
        );
    }
}

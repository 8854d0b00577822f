//! The chain walker on well-formed and malformed chains, and the config
//! space layout.

use super::*;
use vm_memory::{GuestAddress as GA, GuestMemoryMmap};

const MEM: u64 = 1 << 20;

fn mem() -> GuestMem {
    GuestMem::from_map(GuestMemoryMmap::from_ranges(&[(GA(0), MEM as usize)]).unwrap())
}

fn header(mem: &GuestMemoryMmap, at: u64, typ: u32, sector: u64) {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&typ.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    mem.write_slice(&h, GA(at)).unwrap();
}

fn d(addr: u64, len: u32, write: bool) -> Desc {
    Desc { addr, len, write }
}

#[test]
fn read_request_in_three_descriptors() {
    let m = mem();
    header(&m, 0, req_type::IN, 8);
    let r = parse_chain(
        &[d(0, 16, false), d(4096, 4096, true), d(8192, 1, true)],
        &m,
        Vec::new(),
    )
    .unwrap();
    assert_eq!(r.kind, Kind::Read);
    assert_eq!(r.sector, 8);
    assert_eq!(r.data_len, 4096);
    assert_eq!(
        r.segs,
        vec![Seg {
            addr: GA(4096),
            len: 4096,
            write: true
        }]
    );
    assert_eq!(r.status, GA(8192));
}

#[test]
fn header_and_status_may_share_descriptors_with_data() {
    let m = mem();
    header(&m, 0, req_type::OUT, 1);
    // Header split over two descriptors, the first also... no: header then
    // data in one readable descriptor, status at the end of a writable one.
    let r = parse_chain(
        &[d(0, 8, false), d(8, 8 + 512, false), d(4096, 1, true)],
        &m,
        Vec::new(),
    )
    .unwrap();
    assert_eq!(r.kind, Kind::Write);
    assert_eq!(r.sector, 1);
    assert_eq!(
        r.segs,
        vec![Seg {
            addr: GA(16),
            len: 512,
            write: false
        }]
    );
    let r = parse_chain(&[d(0, 16, false), d(4096, 513, true)], &m, {
        header(&m, 0, req_type::IN, 0);
        Vec::new()
    })
    .unwrap();
    assert_eq!(
        r.segs,
        vec![Seg {
            addr: GA(4096),
            len: 512,
            write: true
        }]
    );
    assert_eq!(r.status, GA(4096 + 512));
}

#[test]
fn a_header_at_any_alignment_or_across_regions_is_read_whole() {
    // An odd address (the one-load path), then a header whose 16 bytes
    // straddle two adjacent regions (the byte copy through the map).
    let m = mem();
    header(&m, 3, req_type::OUT, 0x0102_0304_0506_0708);
    let r = parse_chain(&[d(3, 16 + 512, false), d(4096, 1, true)], &m, Vec::new()).unwrap();
    assert_eq!(
        (r.kind, r.sector, r.data_len),
        (Kind::Write, 0x0102_0304_0506_0708, 512)
    );
    assert_eq!(r.segs[0].addr, GA(19));
    let two = GuestMem::from_map(
        GuestMemoryMmap::from_ranges(&[(GA(0), 0x1000), (GA(0x1000), 0x1000)]).unwrap(),
    );
    header(&two, 0xff8, req_type::IN, 9);
    let r = parse_chain(
        &[d(0xff8, 16, false), d(0x1800, 513, true)],
        &two,
        Vec::new(),
    )
    .unwrap();
    assert_eq!((r.kind, r.sector, r.data_len), (Kind::Read, 9, 512));
}

#[test]
fn malformed_chains_get_an_error_status_or_none() {
    let m = mem();
    header(&m, 0, req_type::IN, 0);
    let err = |descs: &[Desc]| parse_chain(descs, &m, Vec::new()).unwrap_err().0;
    // No status byte at all.
    assert_eq!(err(&[]), ChainError::NoStatus);
    assert_eq!(err(&[d(0, 16, false)]), ChainError::NoStatus);
    assert_eq!(
        err(&[d(0, 16, false), d(MEM, 1, true)]),
        ChainError::NoStatus,
        "status outside memory"
    );
    // Status known: IOERR.
    let status = GA(8192);
    let bad = |descs: &[Desc]| match err(descs) {
        ChainError::Malformed(a, why) => {
            assert_eq!(a, status);
            why
        }
        e => panic!("{e:?}"),
    };
    bad(&[d(0, 8, false), d(8192, 1, true)]); // short header
    bad(&[d(0, 16, true), d(8192, 1, true)]); // header device-writable
    bad(&[d(0, 16, false), d(4096, 512, false), d(8192, 1, true)]); // read into readable
    bad(&[d(0, 16, false), d(MEM - 256, 512, true), d(8192, 1, true)]); // data out of bounds
    bad(&[
        d(0, 16, false),
        d(u64::MAX - 10, 512, true),
        d(8192, 1, true),
    ]); // wraps
    let long: Vec<Desc> = std::iter::once(d(0, 16, false))
        .chain((0..SEG_MAX as u64 + 1).map(|i| d(4096 + i * 512, 512, true)))
        .chain(std::iter::once(d(8192, 1, true)))
        .collect();
    bad(&long); // too many segments
    header(&m, 0, req_type::OUT, 0);
    bad(&[d(0, 16, false), d(4096, 512, true), d(8192, 1, true)]); // write from writable
}

#[test]
fn unknown_types_parse_and_are_answered_unsupp() {
    let m = mem();
    header(&m, 0, 77, 0);
    let r = parse_chain(&[d(0, 16, false), d(8192, 1, true)], &m, Vec::new()).unwrap();
    assert_eq!(r.kind, Kind::Other(77));
}

#[test]
fn ranges_and_id() {
    let m = mem();
    let mut raw = [0u8; 32];
    raw[0..8].copy_from_slice(&8u64.to_le_bytes());
    raw[8..12].copy_from_slice(&16u32.to_le_bytes());
    raw[16..24].copy_from_slice(&64u64.to_le_bytes());
    raw[24..28].copy_from_slice(&8u32.to_le_bytes());
    raw[28..32].copy_from_slice(&1u32.to_le_bytes());
    m.write_slice(&raw, GA(4096)).unwrap();
    header(&m, 0, req_type::WRITE_ZEROES, 0);
    // The two ranges split across two descriptors mid-range.
    let r = parse_chain(
        &[
            d(0, 16, false),
            d(4096, 20, false),
            d(4116, 12, false),
            d(8192, 1, true),
        ],
        &m,
        Vec::new(),
    )
    .unwrap();
    let mut out = Vec::new();
    read_ranges(&r, m.map(), &mut out).unwrap();
    assert_eq!(
        out,
        vec![
            Range {
                sector: 8,
                num_sectors: 16,
                unmap: false
            },
            Range {
                sector: 64,
                num_sectors: 8,
                unmap: true
            }
        ]
    );
    m.write_slice(&2u32.to_le_bytes(), GA(4096 + 28)).unwrap();
    assert!(
        read_ranges(&r, m.map(), &mut out).is_err(),
        "reserved flag bits"
    );
    header(&m, 0, req_type::GET_ID, 0);
    let r = parse_chain(
        &[d(0, 16, false), d(4096, 20, true), d(8192, 1, true)],
        &m,
        Vec::new(),
    )
    .unwrap();
    assert_eq!(write_id(&r, m.map(), "Malloc0").unwrap(), 20);
    let mut id = [0u8; 20];
    m.read_slice(&mut id, GA(4096)).unwrap();
    assert_eq!(&id[..8], b"Malloc0\0");
}

#[test]
fn config_space_layout() {
    let g = BlkGeometry {
        block_size: 4096,
        num_blocks: 1000,
        num_queues: 2,
        read_only: false,
        flush: true,
        discard: true,
        write_zeroes: true,
        opt_io_blocks: 0,
    };
    use virtio_bindings::virtio_blk::virtio_blk_config as C;
    // What we fill: everything before the secure-erase fields (answered
    // zero-padded past it).
    assert_eq!(
        CONFIG_LEN,
        std::mem::offset_of!(C, max_secure_erase_sectors)
    );
    assert_eq!(34, std::mem::offset_of!(C, num_queues));
    assert_eq!(32, std::mem::offset_of!(C, wce));
    let c = g.config(true);
    assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 8000);
    assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 4096);
    assert_eq!(c[32], 1);
    assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 2);
    assert_eq!(
        u32::from_le_bytes(c[44..48].try_into().unwrap()),
        8,
        "discard alignment in sectors"
    );
    let f = g.features();
    for bit in [
        feature::FLUSH,
        feature::DISCARD,
        feature::WRITE_ZEROES,
        feature::MQ,
        feature::EVENT_IDX,
    ] {
        assert_ne!(f & bit, 0);
    }
    let ro = BlkGeometry {
        read_only: true,
        ..g
    };
    assert_eq!(
        ro.features() & (feature::DISCARD | feature::WRITE_ZEROES),
        0
    );
    assert_ne!(ro.features() & feature::RO, 0);
}

fn desc_at(m: &GuestMemoryMmap, table: u64, i: u64, addr: u64, len: u32, flags: u16, next: u16) {
    let mut raw = [0u8; 16];
    raw[0..8].copy_from_slice(&addr.to_le_bytes());
    raw[8..12].copy_from_slice(&len.to_le_bytes());
    raw[12..14].copy_from_slice(&flags.to_le_bytes());
    raw[14..16].copy_from_slice(&next.to_le_bytes());
    m.write_slice(&raw, GA(table + i * 16)).unwrap();
}

#[test]
fn read_chain_by_head_direct_and_indirect() {
    let m = mem();
    let table = 0x8000;
    // Head 3 -> 5 -> 1 (write).
    desc_at(&m, table, 3, 0x1000, 16, 1, 5);
    desc_at(&m, table, 5, 0x2000, 512, 1 | 2, 1);
    desc_at(&m, table, 1, 0x3000, 1, 2, 0);
    let mut out = chain_buf();
    let k = read_chain(&m, GA(table), 8, 3, &mut out);
    assert_eq!(
        &out[..k],
        &[
            d(0x1000, 16, false),
            d(0x2000, 512, true),
            d(0x3000, 1, true)
        ]
    );
    // Head 6: an indirect table of two.
    let ind = 0x9000;
    desc_at(&m, table, 6, ind, 32, 4, 0);
    desc_at(&m, ind, 0, 0x4000, 16, 1, 1);
    desc_at(&m, ind, 1, 0x5000, 1, 2, 0);
    let k = read_chain(&m, GA(table), 8, 6, &mut out);
    assert_eq!(&out[..k], &[d(0x4000, 16, false), d(0x5000, 1, true)]);
}

#[test]
fn read_chain_ends_loops_and_bad_links() {
    let m = mem();
    let table = 0x8000;
    desc_at(&m, table, 0, 0x1000, 16, 1, 1);
    desc_at(&m, table, 1, 0x2000, 16, 1, 0);
    let mut out = chain_buf();
    let k = read_chain(&m, GA(table), 2, 0, &mut out);
    assert!(k <= 3, "a loop ends ({k})");
    desc_at(&m, table, 0, 0x1000, 16, 1, 9);
    assert_eq!(
        read_chain(&m, GA(table), 2, 0, &mut out),
        1,
        "next outside the table"
    );
    assert_eq!(
        read_chain(&m, GA(table), 2, 7, &mut out),
        0,
        "head outside the table"
    );
    assert_eq!(
        read_chain(&m, GA(MEM - 8), 2, 0, &mut out),
        0,
        "table outside memory"
    );
}

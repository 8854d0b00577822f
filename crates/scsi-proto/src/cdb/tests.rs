//! CDB builders and the parser: round trips, refused CDBs, any bytes.

use super::*;
use proptest::prelude::*;

#[test]
fn builders_parse_back() {
    let cases = [
        (Cdb::test_unit_ready(), Command::TestUnitReady),
        (
            Cdb::inquiry(Some(0xb0), 252),
            Command::Inquiry {
                page: Some(0xb0),
                alloc_len: 252,
            },
        ),
        (
            Cdb::inquiry(None, 96),
            Command::Inquiry {
                page: None,
                alloc_len: 96,
            },
        ),
        (
            Cdb::read_capacity_16(32),
            Command::ReadCapacity16 { alloc_len: 32 },
        ),
        (
            Cdb::report_luns(4096),
            Command::ReportLuns {
                select: 0,
                alloc_len: 4096,
            },
        ),
        (
            Cdb::rw(false, 7, 8),
            Command::Read {
                lba: 7,
                blocks: 8,
                fua: false,
            },
        ),
        (
            Cdb::rw(true, 1 << 33, 8),
            Command::Write {
                lba: 1 << 33,
                blocks: 8,
                fua: false,
            },
        ),
        (
            Cdb::rw(true, 0, 1 << 16),
            Command::Write {
                lba: 0,
                blocks: 1 << 16,
                fua: false,
            },
        ),
        (
            Cdb::synchronize_cache(5, 10),
            Command::SynchronizeCache { lba: 5, blocks: 10 },
        ),
        (
            Cdb::synchronize_cache(1 << 40, 10),
            Command::SynchronizeCache {
                lba: 1 << 40,
                blocks: 10,
            },
        ),
        (Cdb::unmap(24), Command::Unmap { param_len: 24 }),
        (
            Cdb::write_same_16(9, 100, true, false),
            Command::WriteSame16 {
                lba: 9,
                blocks: 100,
                unmap: true,
                ndob: false,
            },
        ),
    ];
    for (cdb, want) in cases {
        assert_eq!(Command::parse(cdb.as_bytes()), Ok(want), "{cdb:?}");
    }
    assert_eq!(Cdb::rw(false, 0, 8).len(), 10);
    assert_eq!(Cdb::rw(false, u32::MAX as u64, 2).len(), 16);
}

#[test]
fn short_and_long_forms_parse() {
    let rd6 = [op::READ_6, 0x01, 0x02, 0x03, 0, 0];
    assert_eq!(
        Command::parse(&rd6),
        Ok(Command::Read {
            lba: 0x010203,
            blocks: 256,
            fua: false
        })
    );
    let mut wr12 = [0u8; 12];
    wr12[0] = op::WRITE_12;
    wr12[1] = 0x08;
    wr12[2..6].copy_from_slice(&7u32.to_be_bytes());
    wr12[6..10].copy_from_slice(&9u32.to_be_bytes());
    assert_eq!(
        Command::parse(&wr12),
        Ok(Command::Write {
            lba: 7,
            blocks: 9,
            fua: true
        })
    );
    let ms10 = [op::MODE_SENSE_10, 0x08, 0x3f, 0, 0, 0, 0, 0x01, 0x00, 0];
    assert_eq!(
        Command::parse(&ms10),
        Ok(Command::ModeSense {
            long: true,
            dbd: true,
            pc: 0,
            page: 0x3f,
            subpage: 0,
            alloc_len: 256
        })
    );
    let vf = [op::VERIFY_10, 0x02, 0, 0, 0, 5, 0, 0, 2, 0];
    assert_eq!(
        Command::parse(&vf),
        Ok(Command::Verify {
            lba: 5,
            blocks: 2,
            bytchk: 1
        })
    );
    let bad = [op::VERIFY_10, 0x04, 0, 0, 0, 5, 0, 0, 2, 0];
    assert_eq!(Command::parse(&bad), Err(CdbError::InvalidField(1)));
}

#[test]
fn refused_cdbs() {
    assert_eq!(Command::parse(&[]), Err(CdbError::Empty));
    assert!(matches!(
        Command::parse(&[0x28, 0, 0]),
        Err(CdbError::Short { need: 10, .. })
    ));
    assert_eq!(
        Command::parse(&[0xff; 16]),
        Err(CdbError::UnsupportedOpcode(0xff))
    );
    assert_eq!(
        Command::parse(&[0x12, 0, 0x80, 0, 0xff, 0]),
        Err(CdbError::InvalidField(2))
    );
}

#[test]
fn unmap_param_round_trips() {
    let mut p = [0u8; UNMAP_PARAM_LEN_ONE];
    unmap_param(&mut p, 1000, 64);
    let mut got = Vec::new();
    assert_eq!(parse_unmap_param(&p, 8, |l, n| got.push((l, n))), 1);
    assert_eq!(got, vec![(1000, 64)]);
    assert_eq!(parse_unmap_param(&p[..7], 8, |_, _| {}), 0);
}

proptest! {
    #[test]
    fn parse_never_panics(data in proptest::collection::vec(any::<u8>(), 0..40)) {
        crate::fuzz::cdb(&data);
    }

    #[test]
    fn rw_round_trips(write: bool, lba in 0u64..(1 << 48), blocks in 1u32..(1 << 20)) {
        let c = Cdb::rw(write, lba, blocks);
        let parsed = Command::parse(c.as_bytes()).unwrap();
        let want = if write {
            Command::Write { lba, blocks, fua: false }
        } else {
            Command::Read { lba, blocks, fua: false }
        };
        prop_assert_eq!(parsed, want);
    }
}

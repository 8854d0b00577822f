//! The core over a malloc bdev with plain buffers: data written and read
//! back by checksum, every command's answer, and sense for each failure.

use std::sync::Arc;

use proptest::prelude::*;
use ustor_bdev::modules::{malloc, RamOpts};
use ustor_bdev::Registry;
use ustor_scsi_proto::capacity::Capacity;
use ustor_scsi_proto::cdb::{op, unmap_param, Cdb, UNMAP_PARAM_LEN_ONE};
use ustor_scsi_proto::inquiry::{self, StdInquiry};
use ustor_scsi_proto::lun::decode_report_luns;
use ustor_scsi_proto::sense::asc;
use ustor_scsi_proto::{ScsiStatus, SenseKey};

use crate::test_util::ready;
use crate::*;

const BS: u32 = 512;
const BLOCKS: u64 = 4096;

struct Rig {
    _reg: Arc<Registry>,
    t: LunTable,
}

fn rig() -> Rig {
    let reg = Registry::new(None);
    let mut t = LunTable::new();
    for lun in [0u64, 3] {
        let name = format!("tgt-core-{}-{lun}", std::process::id());
        let opts = RamOpts {
            name: name.clone(),
            num_blocks: BLOCKS,
            block_size: BS,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        };
        malloc::create(&reg, opts).unwrap();
        let d = reg.open(&name, true, |_| {}).unwrap();
        let lu = Lun::open(LuConfig::disk("CORE DISK", lun as u32, true), &d).unwrap();
        t.add(lun, lu).unwrap();
    }
    // A fresh table reports "LUNs changed" first; start the tests clean.
    for (_, lu) in t.luns() {
        lu.set_ua(None);
    }
    Rig { _reg: reg, t }
}

fn exec(r: &Rig, lun: u64, cdb: &[u8], d: &mut BufData) -> Outcome {
    ready(r.t.execute(lun, cdb, d)).expect("no transport error")
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(2654435761) ^ seed) as u8)
        .collect()
}

fn sum(b: &[u8]) -> u64 {
    b.iter().enumerate().fold(0u64, |a, (i, x)| {
        a.wrapping_mul(31).wrapping_add(*x as u64 ^ i as u64)
    })
}

fn read(r: &Rig, lba: u64, blocks: u32) -> Vec<u8> {
    let mut d = BufData::read(blocks * BS);
    let o = exec(r, 0, Cdb::read_16(lba, blocks, false).as_bytes(), &mut d);
    assert_eq!(o, Outcome::good(0));
    d.input
}

fn sense_of(o: Outcome) -> (SenseKey, (u8, u8)) {
    assert_eq!(o.status, ScsiStatus::CheckCondition);
    let s = o.sense.expect("sense");
    (s.key, s.code())
}

#[test]
fn write_then_read_back_all_forms() {
    let r = rig();
    // 3000 blocks (1.5 MiB) crosses the 1 MiB chunk.
    let data = pattern(3000 * BS as usize, 7);
    let mut d = BufData::write(data.clone());
    let o = exec(&r, 0, Cdb::write_16(10, 3000, true).as_bytes(), &mut d);
    assert_eq!(o, Outcome::good(0));
    assert_eq!(sum(&read(&r, 10, 3000)), sum(&data));
    // READ(6), READ(10), READ(12) see the same bytes.
    let mut d = BufData::read(4 * BS);
    exec(&r, 0, &[op::READ_6, 0, 0, 10, 4, 0], &mut d);
    assert_eq!(d.input, data[..4 * BS as usize]);
    let mut d = BufData::read(4 * BS);
    exec(&r, 0, Cdb::read_10(12, 4, false).as_bytes(), &mut d);
    assert_eq!(d.input, data[2 * BS as usize..6 * BS as usize]);
    let mut c12 = [0u8; 12];
    c12[0] = op::READ_12;
    c12[2..6].copy_from_slice(&10u32.to_be_bytes());
    c12[6..10].copy_from_slice(&1u32.to_be_bytes());
    let mut d = BufData::read(BS);
    exec(&r, 0, &c12, &mut d);
    assert_eq!(d.input, data[..BS as usize]);
    // WRITE(6) and WRITE AND VERIFY(10).
    let one = pattern(BS as usize, 99);
    let mut d = BufData::write(one.clone());
    assert_eq!(
        exec(&r, 0, &[op::WRITE_6, 0, 0, 1, 1, 0], &mut d),
        Outcome::good(0)
    );
    assert_eq!(read(&r, 1, 1), one);
    let mut wv = [0u8; 10];
    wv[0] = op::WRITE_AND_VERIFY_10;
    wv[2..6].copy_from_slice(&2u32.to_be_bytes());
    wv[7..9].copy_from_slice(&1u16.to_be_bytes());
    let mut d = BufData::write(one.clone());
    assert_eq!(exec(&r, 0, &wv, &mut d), Outcome::good(0));
    assert_eq!(read(&r, 2, 1), one);
}

#[test]
fn range_length_and_direction_are_checked() {
    let r = rig();
    let mut d = BufData::read(2 * BS);
    let o = exec(&r, 0, Cdb::read_16(BLOCKS - 1, 2, false).as_bytes(), &mut d);
    assert_eq!(
        sense_of(o),
        (SenseKey::IllegalRequest, asc::LBA_OUT_OF_RANGE)
    );
    assert_eq!(o.resid, 2 * BS);
    let mut d = BufData::read(BS);
    let o = exec(&r, 0, Cdb::read_16(0, 2, false).as_bytes(), &mut d);
    assert_eq!(sense_of(o).1, asc::INVALID_FIELD_IN_CDB);
    let mut d = BufData::write(vec![0; BS as usize]);
    let o = exec(&r, 0, Cdb::read_16(0, 1, false).as_bytes(), &mut d);
    assert_eq!(sense_of(o).1, asc::INVALID_FIELD_IN_CDB);
    let mut d = BufData::none();
    let o = exec(&r, 0, &[0xff; 16], &mut d);
    assert_eq!(sense_of(o), (SenseKey::IllegalRequest, asc::INVALID_OPCODE));
    let o = exec(&r, 0, &[op::READ_10, 0], &mut d);
    assert_eq!(sense_of(o).1, asc::INVALID_FIELD_IN_CDB);
}

#[test]
fn inquiry_vpd_and_capacity() {
    let r = rig();
    let mut d = BufData::read(96);
    let o = exec(&r, 0, Cdb::inquiry(None, 96).as_bytes(), &mut d);
    assert_eq!(o, Outcome::good(0));
    // Version descriptors: SAM-5, SPC-4, SBC-3.
    assert_eq!(&d.input[58..64], &[0x00, 0xa0, 0x04, 0x60, 0x04, 0xc0]);
    let s = StdInquiry::decode(&d.input).unwrap();
    assert_eq!(
        (s.vendor.as_str(), s.product.as_str()),
        ("USTOR", "CORE DISK")
    );
    let mut d = BufData::read(255);
    exec(&r, 0, Cdb::inquiry(Some(0), 255).as_bytes(), &mut d);
    assert_eq!(
        inquiry::decode_supported(&d.input),
        [0, 0x80, 0x83, 0xb0, 0xb1]
    );
    let mut d = BufData::read(255);
    exec(&r, 3, Cdb::inquiry(Some(0x80), 255).as_bytes(), &mut d);
    assert_eq!(
        inquiry::decode_serial(&d.input).as_deref(),
        Some("USTOR00000003")
    );
    let mut d = BufData::read(255);
    exec(&r, 3, Cdb::inquiry(Some(0x83), 255).as_bytes(), &mut d);
    let ids = inquiry::decode_device_id(&d.input);
    assert_eq!(ids[0].id(), "naa.6001405e00000003");
    let mut d = BufData::read(255);
    let o = exec(&r, 0, Cdb::inquiry(Some(0x99), 255).as_bytes(), &mut d);
    assert_eq!(sense_of(o).1, asc::INVALID_FIELD_IN_CDB);
    let mut d = BufData::read(32);
    exec(&r, 0, Cdb::read_capacity_16(32).as_bytes(), &mut d);
    let c = Capacity::decode(&d.input).unwrap();
    assert_eq!((c.num_blocks, c.block_size, c.lbpme), (BLOCKS, BS, true));
    let mut d = BufData::read(8);
    exec(
        &r,
        0,
        &[op::READ_CAPACITY_10, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        &mut d,
    );
    assert_eq!(d.input[..4], ((BLOCKS - 1) as u32).to_be_bytes());
    assert_eq!(d.input[4..], BS.to_be_bytes());
}

#[test]
fn mode_sense_6_and_10() {
    let r = rig();
    let mut d = BufData::read(255);
    let o = exec(&r, 0, &[op::MODE_SENSE_6, 0, 0x3f, 0, 255, 0], &mut d);
    assert_eq!(o.status, ScsiStatus::Good);
    // header 4 + block descriptor 8 + caching 20 + control 12
    assert_eq!(d.input.len(), 44);
    assert_eq!(d.input[0] as usize, 43);
    assert_eq!(d.input[3], 8);
    assert_eq!(d.input[12] & 0x3f, 0x08);
    let mut d = BufData::read(255);
    let c = [op::MODE_SENSE_10, 0x08, 0x0a, 0, 0, 0, 0, 0, 255, 0];
    exec(&r, 0, &c, &mut d);
    assert_eq!(d.input.len(), 8 + 12);
    assert_eq!(d.input[8], 0x0a);
    let mut d = BufData::read(255);
    let o = exec(
        &r,
        0,
        &[op::MODE_SENSE_6, 0, 0x3f | 0xc0, 0, 255, 0],
        &mut d,
    );
    assert_eq!(sense_of(o).1, asc::SAVING_PARAMS_NOT_SUPPORTED);
    let o = exec(&r, 0, &[op::MODE_SENSE_6, 0, 0x01, 0, 255, 0], &mut d);
    assert_eq!(sense_of(o).1, asc::INVALID_FIELD_IN_CDB);
}

#[test]
fn unmap_write_same_and_sync() {
    let r = rig();
    let data = pattern(64 * BS as usize, 3);
    exec(
        &r,
        0,
        Cdb::write_16(0, 64, false).as_bytes(),
        &mut BufData::write(data.clone()),
    );
    let mut p = [0u8; UNMAP_PARAM_LEN_ONE];
    unmap_param(&mut p, 8, 8);
    let mut d = BufData::write(p.to_vec());
    assert_eq!(
        exec(&r, 0, Cdb::unmap(24).as_bytes(), &mut d),
        Outcome::good(0)
    );
    let back = read(&r, 0, 64);
    assert!(back[8 * BS as usize..16 * BS as usize]
        .iter()
        .all(|b| *b == 0));
    assert_eq!(back[..8 * BS as usize], data[..8 * BS as usize]);
    assert_eq!(back[16 * BS as usize..], data[16 * BS as usize..]);
    unmap_param(&mut p, BLOCKS, 1);
    let o = exec(
        &r,
        0,
        Cdb::unmap(24).as_bytes(),
        &mut BufData::write(p.to_vec()),
    );
    assert_eq!(sense_of(o).1, asc::LBA_OUT_OF_RANGE);
    // WRITE SAME(16) of a pattern block, and WRITE SAME(10) of zeroes.
    let blk = pattern(BS as usize, 11);
    let c = Cdb::write_same_16(100, 2500, false, false);
    assert_eq!(
        exec(&r, 0, c.as_bytes(), &mut BufData::write(blk.clone())),
        Outcome::good(0)
    );
    let back = read(&r, 100, 2500);
    assert!(back.chunks(BS as usize).all(|b| b == &blk[..]));
    let mut ws10 = [0u8; 10];
    ws10[0] = op::WRITE_SAME_10;
    ws10[2..6].copy_from_slice(&100u32.to_be_bytes());
    ws10[7..9].copy_from_slice(&4u16.to_be_bytes());
    let o = exec(&r, 0, &ws10, &mut BufData::write(vec![0; BS as usize]));
    assert_eq!(o, Outcome::good(0));
    assert!(read(&r, 100, 4).iter().all(|b| *b == 0));
    assert_eq!(read(&r, 104, 1), blk);
    let o = exec(
        &r,
        0,
        Cdb::synchronize_cache(0, 0).as_bytes(),
        &mut BufData::none(),
    );
    assert_eq!(o, Outcome::good(0));
    let o = exec(
        &r,
        0,
        &[op::START_STOP_UNIT, 0, 0, 0, 1, 0],
        &mut BufData::none(),
    );
    assert_eq!(o, Outcome::good(0));
}

#[test]
fn verify_compares() {
    let r = rig();
    let data = pattern(8 * BS as usize, 5);
    exec(
        &r,
        0,
        Cdb::write_16(40, 8, false).as_bytes(),
        &mut BufData::write(data.clone()),
    );
    let mut v = [0u8; 10];
    v[0] = op::VERIFY_10;
    v[1] = 0x02; // BYTCHK 1
    v[2..6].copy_from_slice(&40u32.to_be_bytes());
    v[7..9].copy_from_slice(&8u16.to_be_bytes());
    assert_eq!(
        exec(&r, 0, &v, &mut BufData::write(data.clone())),
        Outcome::good(0)
    );
    let mut bad = data.clone();
    bad[1000] ^= 1;
    let o = exec(&r, 0, &v, &mut BufData::write(bad));
    assert_eq!(
        sense_of(o),
        (SenseKey::Miscompare, asc::MISCOMPARE_DURING_VERIFY)
    );
    v[1] = 0; // medium only
    assert_eq!(exec(&r, 0, &v, &mut BufData::none()), Outcome::good(0));
}

#[test]
fn luns_attentions_and_report_luns() {
    let mut r = rig();
    let mut d = BufData::read(255);
    let o = exec(&r, 0, Cdb::report_luns(255).as_bytes(), &mut d);
    assert_eq!(o.status, ScsiStatus::Good);
    assert_eq!(decode_report_luns(&d.input, 10).0, vec![0, 3]);
    // A LUN that is not there: qualifier 3 to INQUIRY, sense otherwise.
    let mut d = BufData::read(36);
    exec(&r, 7, Cdb::inquiry(None, 36).as_bytes(), &mut d);
    assert_eq!(d.input[0], 0x7f);
    let o = exec(
        &r,
        7,
        Cdb::test_unit_ready().as_bytes(),
        &mut BufData::none(),
    );
    assert_eq!(
        sense_of(o),
        (SenseKey::IllegalRequest, asc::LUN_NOT_SUPPORTED)
    );
    // Removing a LUN: the others report it once, INQUIRY passes through.
    assert!(r.t.remove(3).is_some());
    let tur = Cdb::test_unit_ready();
    let mut d = BufData::read(36);
    assert_eq!(
        exec(&r, 0, Cdb::inquiry(None, 36).as_bytes(), &mut d).status,
        ScsiStatus::Good
    );
    let o = exec(&r, 0, tur.as_bytes(), &mut BufData::none());
    assert_eq!(
        sense_of(o),
        (SenseKey::UnitAttention, asc::REPORTED_LUNS_CHANGED)
    );
    assert_eq!(
        exec(&r, 0, tur.as_bytes(), &mut BufData::none()),
        Outcome::good(0)
    );
    r.t.reset_all();
    let o = exec(&r, 0, tur.as_bytes(), &mut BufData::none());
    assert_eq!(sense_of(o).1, asc::POWER_ON_RESET);
    let mut d = BufData::read(18);
    assert_eq!(
        exec(&r, 0, Cdb::request_sense(18).as_bytes(), &mut d),
        Outcome::good(0)
    );
    assert_eq!(d.input[0], 0x70);
}

proptest! {
    #[test]
    fn any_cdb_gets_a_status(data in proptest::collection::vec(any::<u8>(), 0..600)) {
        crate::fuzz::cdb(&data);
    }

    #[test]
    fn known_opcodes_with_random_fields(opc in prop::sample::select(vec![
        op::READ_6, op::WRITE_6, op::INQUIRY, op::MODE_SENSE_6, op::READ_CAPACITY_10,
        op::READ_10, op::WRITE_10, op::VERIFY_10, op::WRITE_AND_VERIFY_10, op::UNMAP,
        op::WRITE_SAME_10, op::MODE_SENSE_10, op::READ_16, op::WRITE_16, op::WRITE_SAME_16,
        op::SYNCHRONIZE_CACHE_16, op::SERVICE_ACTION_IN_16, op::REPORT_LUNS, op::READ_12,
    ]), rest in proptest::collection::vec(any::<u8>(), 17..200), head in any::<[u8; 2]>()) {
        let mut data = head.to_vec();
        data.push(opc);
        data.extend_from_slice(&rest);
        crate::fuzz::cdb(&data);
    }
}

/// A resized bdev: the next command gets CAPACITY DATA HAS CHANGED (once),
/// READ CAPACITY shows the new size, and the new end is enforced.
#[test]
fn resize_raises_capacity_changed_and_read_capacity_follows() {
    let r = rig();
    let name = format!("tgt-core-{}-0", std::process::id());
    assert!(r._reg.get(&name).unwrap().resize(BLOCKS / 2));
    let tur = [op::TEST_UNIT_READY, 0, 0, 0, 0, 0];
    let o = exec(&r, 0, &tur, &mut BufData::none());
    assert_eq!(
        sense_of(o),
        (SenseKey::UnitAttention, asc::CAPACITY_CHANGED)
    );
    assert_eq!(exec(&r, 0, &tur, &mut BufData::none()), Outcome::good(0));
    // The other LUN's bdev did not change: no attention there.
    assert_eq!(exec(&r, 3, &tur, &mut BufData::none()), Outcome::good(0));
    let mut d = BufData::read(32);
    exec(&r, 0, Cdb::read_capacity_16(32).as_bytes(), &mut d);
    let c = Capacity::decode(&d.input).unwrap();
    assert_eq!(c.num_blocks, BLOCKS / 2);
    let mut d = BufData::read(BS);
    let o = exec(&r, 0, Cdb::read_16(BLOCKS / 2, 1, false).as_bytes(), &mut d);
    assert_eq!(sense_of(o).1, asc::LBA_OUT_OF_RANGE);
}

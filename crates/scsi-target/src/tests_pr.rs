//! Reservations between two I_T nexuses (two tables over one unit sharing
//! its [`LuShared`]), and the read-then-write commands.

use ustor_scsi_proto::cdb::op;
use ustor_scsi_proto::sense::asc;
use ustor_scsi_proto::{ScsiStatus, SenseKey};

use crate::pr::{EXCLUSIVE_ACCESS, WRITE_EXCLUSIVE_AR};
use crate::test_util::{ready, SharedUnit};
use crate::*;

const BS: u32 = 512;

/// The tables drop before the unit they use.
struct Two {
    a: LunTable,
    b: Option<LunTable>,
    _unit: SharedUnit,
}

fn two() -> Two {
    let u = SharedUnit::new("pr", 1024);
    Two {
        a: u.table("iqn.a,i,0x1"),
        b: Some(u.table("iqn.b,i,0x2")),
        _unit: u,
    }
}

fn run(t: &LunTable, cdb: &[u8], d: &mut BufData) -> Outcome {
    ready(t.execute(0, cdb, d)).expect("no transport error")
}

fn prout(t: &LunTable, sa: u8, ty: u8, key: u64, sa_key: u64) -> ScsiStatus {
    let mut p = vec![0u8; 24];
    p[0..8].copy_from_slice(&key.to_be_bytes());
    p[8..16].copy_from_slice(&sa_key.to_be_bytes());
    let cdb = [op::PERSISTENT_RESERVE_OUT, sa, ty, 0, 0, 0, 0, 0, 24, 0];
    run(t, &cdb, &mut BufData::write(p)).status
}

fn prin(t: &LunTable, sa: u8) -> Vec<u8> {
    let cdb = [op::PERSISTENT_RESERVE_IN, sa, 0, 0, 0, 0, 0, 0x10, 0, 0];
    let mut d = BufData::read(4096);
    assert_eq!(run(t, &cdb, &mut d).status, ScsiStatus::Good);
    d.input
}

fn rw(t: &LunTable, write: bool) -> ScsiStatus {
    let cdb = ustor_scsi_proto::cdb::Cdb::rw(write, 1, 1);
    let mut d = if write {
        BufData::write(vec![7; BS as usize])
    } else {
        BufData::read(BS)
    };
    run(t, cdb.as_bytes(), &mut d).status
}

const GOOD: ScsiStatus = ScsiStatus::Good;
const CONFLICT: ScsiStatus = ScsiStatus::ReservationConflict;

#[test]
fn exclusive_access_shuts_out_the_other_nexus() {
    let r = two();
    let b = r.b.as_ref().unwrap();
    assert_eq!(prout(&r.a, 6, 0, 0, 0xaa), GOOD);
    assert_eq!(prout(b, 6, 0, 0, 0xbb), GOOD);
    // REGISTER with a wrong key: conflict; RESERVE with another's key too.
    assert_eq!(prout(&r.a, 0, 0, 0x1, 0xcc), CONFLICT);
    assert_eq!(prout(&r.a, 1, EXCLUSIVE_ACCESS, 0xbb, 0), CONFLICT);
    assert_eq!(prout(&r.a, 1, EXCLUSIVE_ACCESS, 0xaa, 0), GOOD);
    let rr = prin(&r.a, 1);
    assert_eq!(&rr[4..16], &[0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0xaa]);
    assert_eq!(rr[21], EXCLUSIVE_ACCESS);
    assert_eq!((rw(&r.a, false), rw(&r.a, true)), (GOOD, GOOD));
    assert_eq!((rw(b, false), rw(b, true)), (CONFLICT, CONFLICT));
    // Another type may not be reserved over it, nor released by type.
    assert_eq!(prout(b, 1, EXCLUSIVE_ACCESS, 0xbb, 0), CONFLICT);
    let rel = prout(&r.a, 2, WRITE_EXCLUSIVE_AR, 0xaa, 0);
    assert_eq!(rel, ScsiStatus::CheckCondition);
    // Unregistering the holder releases the reservation.
    assert_eq!(prout(&r.a, 0, 0, 0xaa, 0), GOOD);
    assert_eq!(&prin(&r.a, 1)[4..8], &[0; 4]);
    assert_eq!((rw(b, false), rw(b, true)), (GOOD, GOOD));
    let keys = prin(b, 0);
    // Generation: 2 registrations + 1 unregistration; one key left.
    assert_eq!(
        &keys[..16],
        &[0, 0, 0, 3, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 0xbb]
    );
}

#[test]
fn all_registrants_and_preempt() {
    let r = two();
    let b = r.b.as_ref().unwrap();
    assert_eq!(prout(&r.a, 6, 0, 0, 1), GOOD);
    assert_eq!(prout(b, 6, 0, 0, 2), GOOD);
    assert_eq!(prout(&r.a, 1, WRITE_EXCLUSIVE_AR, 1, 0), GOOD);
    assert_eq!(rw(b, true), GOOD, "every registrant holds it");
    assert_eq!(&prin(b, 1)[8..16], &[0; 8], "key 0 for all registrants");
    // B preempts A's registration: A is told, its key is gone.
    assert_eq!(prout(b, 4, WRITE_EXCLUSIVE_AR, 2, 1), GOOD);
    let o = run(&r.a, &[0; 6], &mut BufData::none());
    let s = o.sense.expect("unit attention");
    assert_eq!((s.key, s.code()), (SenseKey::UnitAttention, (0x2a, 0x05)));
    assert_eq!(rw(&r.a, true), CONFLICT);
    assert_eq!(&prin(&r.a, 0)[4..8], &[0, 0, 0, 8]);
    // REPORT CAPABILITIES: 8 bytes, TMV, the six types.
    assert_eq!(prin(&r.a, 2), vec![0, 8, 0x10, 0x80, 0xea, 0x01, 0, 0]);
    // READ FULL STATUS names B's port as its TransportID.
    let full = prin(&r.a, 3);
    assert!(full.windows(11).any(|w| w == b"iqn.b,i,0x2"));
    // Unknown service actions and a short parameter list.
    let cdb = [op::PERSISTENT_RESERVE_IN, 4, 0, 0, 0, 0, 0, 0x10, 0, 0];
    let o = run(&r.a, &cdb, &mut BufData::read(4096));
    assert_eq!(o.sense.map(|s| s.code()), Some(asc::INVALID_FIELD_IN_CDB));
    let cdb = [op::PERSISTENT_RESERVE_OUT, 0, 0, 0, 0, 0, 0, 0, 8, 0];
    let o = run(&r.a, &cdb, &mut BufData::write(vec![0; 8]));
    assert_eq!(
        o.sense.map(|s| s.code()),
        Some(asc::PARAM_LIST_LENGTH_ERROR)
    );
    // CLEAR by B: nothing left.
    assert_eq!(prout(b, 3, 0, 2, 0), GOOD);
    assert_eq!(&prin(b, 0)[4..8], &[0; 4]);
}

#[test]
fn reserve6_is_per_nexus_and_ends_with_it() {
    let mut r = two();
    let reserve = [op::RESERVE_6, 0, 0, 0, 0, 0];
    let release = [op::RELEASE_6, 0, 0, 0, 0, 0];
    let ms = [op::MODE_SENSE_6, 0, 0x3f, 0, 0xff, 0];
    let none = &mut BufData::none();
    assert_eq!(run(&r.a, &reserve, none).status, GOOD);
    assert_eq!(run(&r.a, &reserve, none).status, GOOD);
    {
        let b = r.b.as_ref().unwrap();
        assert_eq!(run(b, &reserve, none).status, CONFLICT);
        // Another's RELEASE is GOOD and changes nothing.
        assert_eq!(run(b, &release, none).status, GOOD);
        assert_eq!(run(b, &ms, &mut BufData::read(255)).status, CONFLICT);
        assert_eq!(run(&r.a, &ms, &mut BufData::read(255)).status, GOOD);
        assert_eq!(prout(b, 6, 0, 0, 5), CONFLICT);
    }
    // A LUN reset releases it and tells the other nexus.
    assert!(r.a.reset_lun(0));
    let b = r.b.take().unwrap();
    let s = run(&b, &reserve, none).sense.expect("reset attention");
    assert_eq!(s.code(), asc::POWER_ON_RESET);
    assert_eq!(run(&b, &reserve, none).status, GOOD);
    // The nexus goes away: its reservation with it.
    drop(b);
    run(&r.a, &[0; 6], none);
    assert_eq!(run(&r.a, &reserve, none).status, GOOD);
}

fn cdb16(opc: u8, lba: u64, n: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = opc;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&n.to_be_bytes());
    c
}

#[test]
fn compare_and_write_orwrite_prefetch_lba_status() {
    let r = two();
    let t = &r.a;
    let blk = |v: u8| vec![v; BS as usize];
    let w = ustor_scsi_proto::cdb::Cdb::rw(true, 8, 1);
    assert_eq!(
        run(t, w.as_bytes(), &mut BufData::write(blk(0x11))).status,
        GOOD
    );
    // COMPARE AND WRITE: byte 5 differs, the miscompare says so.
    let mut caw = cdb16(op::COMPARE_AND_WRITE, 8, 0);
    caw[13] = 1;
    let mut bad = blk(0x11);
    bad[5] = 0;
    bad.extend(blk(0x22));
    let o = run(t, &caw, &mut BufData::write(bad));
    let s = o.sense.expect("miscompare");
    assert_eq!((s.key, s.info), (SenseKey::Miscompare, Some(5)));
    let mut good = blk(0x11);
    good.extend(blk(0x22));
    assert_eq!(run(t, &caw, &mut BufData::write(good)).status, GOOD);
    // ORWRITE ORs 0x44 into 0x22.
    let or = cdb16(op::ORWRITE_16, 8, 1);
    assert_eq!(run(t, &or, &mut BufData::write(blk(0x44))).status, GOOD);
    let mut d = BufData::read(BS);
    let rd = ustor_scsi_proto::cdb::Cdb::rw(false, 8, 1);
    assert_eq!(run(t, rd.as_bytes(), &mut d).status, GOOD);
    assert_eq!(d.input, blk(0x66));
    // PRE-FETCH: in range GOOD, beyond the end out of range.
    let o = run(t, &cdb16(op::PRE_FETCH_16, 1000, 24), &mut BufData::none());
    assert_eq!(o.status, GOOD);
    let o = run(t, &cdb16(op::PRE_FETCH_16, 1000, 25), &mut BufData::none());
    assert_eq!(o.sense.map(|s| s.code()), Some(asc::LBA_OUT_OF_RANGE));
    // GET LBA STATUS: one descriptor from the LBA to the end, mapped.
    let mut gls = cdb16(op::SERVICE_ACTION_IN_16, 1000, 24);
    gls[1] = op::SA_GET_LBA_STATUS;
    let mut d = BufData::read(24);
    assert_eq!(run(t, &gls, &mut d).status, GOOD);
    assert_eq!(&d.input[16..21], &[0, 0, 0, 24, 0]);
}

#[test]
fn mode_select_swp_d_sense_and_defect_data() {
    let r = two();
    let b = r.b.as_ref().unwrap();
    let sense6 = |t: &LunTable, pc: u8| {
        let mut d = BufData::read(255);
        let cdb = [op::MODE_SENSE_6, 0x08, pc << 6 | 0x0a, 0, 255, 0];
        assert_eq!(run(t, &cdb, &mut d).status, GOOD);
        d.input
    };
    // Changeable: D_SENSE and SWP; current: neither.
    let ch = sense6(&r.a, 1);
    assert_eq!((ch[4 + 2], ch[4 + 4]), (0x04, 0x08));
    let mut page = sense6(&r.a, 0);
    assert_eq!((page[4 + 2], page[4 + 4]), (0, 0));
    // MODE SELECT(6) of the control page with both set.
    page[0] = 0;
    page[4 + 2] |= 0x04;
    page[4 + 4] |= 0x08;
    let sel = [op::MODE_SELECT_6, 0x10, 0, 0, page.len() as u8, 0];
    assert_eq!(
        run(&r.a, &sel, &mut BufData::write(page.clone())).status,
        GOOD
    );
    // The other nexus is told, then writes are refused with descriptor
    // sense; reads go on.
    let s = run(b, &[0; 6], &mut BufData::none()).sense.unwrap();
    assert_eq!(s.code(), (0x2a, 0x01));
    let o = run(
        b,
        ustor_scsi_proto::cdb::Cdb::rw(true, 0, 1).as_bytes(),
        &mut BufData::write(vec![0; 512]),
    );
    let s = o.sense.unwrap_or_else(|| panic!("write protected: {o:?}"));
    assert_eq!(
        (s.key, s.code(), s.descriptor),
        (SenseKey::DataProtect, (0x27, 0x02), true)
    );
    assert_eq!(rw(b, false), GOOD);
    assert_eq!(sense6(b, 0)[2] & 0x80, 0x80, "WP in the header");
    // A field we do not let change: refused.
    let mut bad = page.clone();
    bad[4 + 3] = 0x10;
    let o = run(&r.a, &sel, &mut BufData::write(bad));
    assert_eq!(
        o.sense.map(|s| s.code()),
        Some(asc::INVALID_FIELD_IN_PARAM_LIST)
    );
    // Clear both again.
    page[4 + 2] &= !0x04;
    page[4 + 4] &= !0x08;
    assert_eq!(run(&r.a, &sel, &mut BufData::write(page)).status, GOOD);
    assert_eq!(rw(&r.a, true), GOOD);
    // READ DEFECT DATA(10): the header alone, no lists.
    let mut d = BufData::read(32);
    let cdb = [op::READ_DEFECT_DATA_10, 0, 0x1d, 0, 0, 0, 0, 0, 32, 0];
    assert_eq!(run(&r.a, &cdb, &mut d).status, GOOD);
    assert_eq!(d.input, vec![0, 0x05, 0, 0]);
}

/// An EXTENDED COPY parameter list: one identification target descriptor
/// naming the unit by `naa`, one block-to-block segment.
fn xcopy_list(naa: &[u8; 8], list_id: u8, blocks: u16, from: u64, to: u64) -> Vec<u8> {
    let mut p = vec![0u8; 16 + 32 + 28];
    p[0] = list_id;
    p[3] = 32;
    p[11] = 28;
    let t = &mut p[16..48];
    t[0] = 0xe4;
    t[4] = 1;
    t[5] = 3;
    t[7] = 8;
    t[8..16].copy_from_slice(naa);
    t[29..32].copy_from_slice(&BS.to_be_bytes()[1..]);
    let s = &mut p[48..76];
    s[0] = 0x02;
    s[3] = 0x18;
    s[10..12].copy_from_slice(&blocks.to_be_bytes());
    s[12..20].copy_from_slice(&from.to_be_bytes());
    s[20..28].copy_from_slice(&to.to_be_bytes());
    p
}

#[test]
fn extended_copy_within_the_unit() {
    let r = two();
    let t = &r.a;
    let naa = t.get(0).unwrap().config().naa;
    let data: Vec<u8> = (0..8 * BS).map(|i| (i * 7 % 251) as u8).collect();
    let w = ustor_scsi_proto::cdb::Cdb::rw(true, 0, 8);
    assert_eq!(
        run(t, w.as_bytes(), &mut BufData::write(data.clone())).status,
        GOOD
    );
    let p = xcopy_list(&naa, 5, 8, 0, 500);
    let mut cdb = [0u8; 16];
    cdb[0] = op::EXTENDED_COPY;
    cdb[10..14].copy_from_slice(&(p.len() as u32).to_be_bytes());
    assert_eq!(run(t, &cdb, &mut BufData::write(p)).status, GOOD);
    let mut d = BufData::read(8 * BS);
    let rd = ustor_scsi_proto::cdb::Cdb::rw(false, 500, 8);
    assert_eq!(run(t, rd.as_bytes(), &mut d).status, GOOD);
    assert_eq!(d.input, data);
    // Its results are held for this nexus only.
    let mut rcr = [0u8; 16];
    rcr[0] = op::RECEIVE_COPY_RESULTS;
    rcr[2] = 5;
    rcr[13] = 64;
    let mut d = BufData::read(64);
    assert_eq!(run(t, &rcr, &mut d).status, GOOD);
    assert_eq!(&d.input[4..12], &[1, 0, 1, 0, 0, 0, 0x10, 0]);
    let o = run(r.b.as_ref().unwrap(), &rcr, &mut BufData::read(64));
    assert_eq!(o.sense.map(|s| s.code()), Some(asc::INVALID_FIELD_IN_CDB));
    // Another unit's designator, or beyond the end: COPY ABORTED.
    for p in [
        xcopy_list(&[9; 8], 6, 8, 0, 500),
        xcopy_list(&naa, 6, 8, 0, 1020),
    ] {
        let o = run(t, &cdb, &mut BufData::write(p));
        assert_eq!(o.sense.map(|s| s.key), Some(SenseKey::CopyAborted));
    }
}

/// Unit attentions are per I_T nexus, not per table: a nexus with two
/// tables on the unit (an iSCSI session's connections on two reactors)
/// hears of a reset, a resize or a code told to it once, from whichever
/// table runs its next command; a table opened after a resize nobody has
/// noticed knows the new size, and the nexuses before it are told.
#[test]
fn attentions_are_owed_once_per_nexus_not_per_table() {
    let u = SharedUnit::new("pr-ua", 1024);
    let (reg, name) = (&u.reg, &u.name);
    let table = |nexus: &str| u.table(nexus);
    let (a1, a2, b) = (
        table("iqn.a,i,0x1"),
        table("iqn.a,i,0x1"),
        table("iqn.b,i,0x2"),
    );
    let tur = [op::TEST_UNIT_READY, 0, 0, 0, 0, 0];
    let ua = |t: &LunTable| {
        let o = run(t, &tur, &mut BufData::none());
        o.sense.map(|s| {
            assert_eq!(s.key, SenseKey::UnitAttention);
            s.code()
        })
    };

    assert!(a1.reset_lun(0));
    assert_eq!(ua(&a2), Some(asc::POWER_ON_RESET));
    assert_eq!((ua(&a1), ua(&a2)), (None, None));
    assert_eq!((ua(&b), ua(&b)), (Some(asc::POWER_ON_RESET), None));

    assert!(reg.get(name).unwrap().resize(512));
    assert_eq!(ua(&a1), Some(asc::CAPACITY_CHANGED));
    assert_eq!((ua(&a2), ua(&a1)), (None, None));
    assert_eq!((ua(&b), ua(&b)), (Some(asc::CAPACITY_CHANGED), None));

    let cleared = (0x2f, 0x00);
    a1.tell("iqn.b,i,0x2", cleared, |l| l == 0);
    a1.tell("iqn.b,i,0x2", cleared, |l| l == 0);
    a2.tell("iqn.gone,i,0x9", cleared, |_| true);
    assert_eq!((ua(&b), ua(&b)), (Some(cleared), None));
    assert_eq!((ua(&a1), ua(&a2)), (None, None));

    // Resized again; a table opened now knows the size, the others learn.
    assert!(reg.get(name).unwrap().resize(256));
    let c = table("iqn.c,i,0x3");
    assert_eq!(ua(&c), None);
    assert_eq!((ua(&a2), ua(&a1)), (Some(asc::CAPACITY_CHANGED), None));
    assert_eq!((ua(&b), ua(&b)), (Some(asc::CAPACITY_CHANGED), None));
}

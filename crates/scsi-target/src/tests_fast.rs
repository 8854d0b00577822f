//! The fast path ([`LunTable::rw_now`]) over a malloc bdev: what it moves
//! is what the full path reads back (checksums), it answers a reservation
//! conflict and a unit attention as the full path does, and everything it
//! declines is left untouched for [`LunTable::execute`].

use ustor_runtime::IoBuf;
use ustor_scsi_proto::cdb::Cdb;
use ustor_scsi_proto::sense::asc;
use ustor_scsi_proto::{ScsiStatus, Sense, SenseKey};

use crate::test_util::{ready, SharedUnit};
use crate::*;

const BS: u32 = 512;
const BLOCKS: u64 = 4096;

/// Two I_T nexuses over one unit (the tables drop before it).
struct Rig {
    a: LunTable,
    b: LunTable,
    _unit: SharedUnit,
}

fn rig() -> Rig {
    let u = SharedUnit::new("fast", BLOCKS);
    Rig {
        a: u.table("iqn.a,i,0x1"),
        b: u.table("iqn.b,i,0x2"),
        _unit: u,
    }
}

/// Plain buffers whose data-out is lent (as vhost-user lends guest memory).
struct Lent(BufData);

impl DataPath for Lent {
    fn direction(&self) -> Direction {
        self.0.direction()
    }
    fn expected_len(&self) -> u32 {
        self.0.expected_len()
    }
    async fn data_out(&mut self, offset: u32, dst: &mut [u8]) -> Result<usize, XferError> {
        self.0.data_out(offset, dst).await
    }
    fn data_out_buf(&mut self, offset: u32, len: usize) -> Option<IoBuf> {
        let src = self.0.out.get(offset as usize..offset as usize + len)?;
        let mut b = IoBuf::heap(len);
        b.copy_from_slice(src);
        Some(b)
    }
    async fn data_in(&mut self, offset: u32, src: &[u8]) -> Result<usize, XferError> {
        self.0.data_in(offset, src).await
    }
}

impl DataNow for Lent {
    fn data_in_now(&mut self, offset: u32, src: &[u8]) -> usize {
        self.0.data_in_now(offset, src)
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn done(s: RwStart) -> Outcome {
    match s {
        RwStart::Done(o) => o,
        RwStart::Waiting(_) => panic!("a malloc bdev answers at once"),
        RwStart::Declined => panic!("declined"),
    }
}

/// Off a reactor there is no buffer pool: reads use this one (the spare
/// a queue keeps).
fn spare() -> Option<IoBuf> {
    Some(IoBuf::heap(1 << 20))
}

fn declined(s: RwStart) -> bool {
    matches!(s, RwStart::Declined)
}

fn full<D: DataPath>(t: &LunTable, cdb: &[u8], d: &mut D) -> Outcome {
    ready(t.execute(0, cdb, d)).expect("no transport error")
}

#[test]
fn fast_writes_and_reads_match_the_full_path() {
    let r = rig();
    let mut spare = spare();
    // WRITE(10) and WRITE(16) through the fast path, read back by the full path.
    for (k, cdb) in [Cdb::write_10(8, 8, false), Cdb::write_16(100, 16, false)]
        .iter()
        .enumerate()
    {
        let blocks = if k == 0 { 8 } else { 16 };
        let data = pattern(blocks * BS as usize, k as u8 + 1);
        let mut d = Lent(BufData::write(data.clone()));
        assert_eq!(
            done(r.a.rw_now(0, cdb.as_bytes(), &mut d, &mut spare)),
            Outcome::good(0)
        );
        let lba = if k == 0 { 8 } else { 100 };
        let mut back = BufData::read(blocks as u32 * BS);
        let o = full(
            &r.a,
            Cdb::read_16(lba, blocks as u32, false).as_bytes(),
            &mut back,
        );
        assert_eq!(o, Outcome::good(0));
        assert_eq!(back.input, data, "write {k} read back");
    }
    // Written by the full path, read by the fast one (10, 12 and 16-byte
    // forms; the spare buffer goes back after each).
    let data = pattern(32 * BS as usize, 9);
    let o = full(
        &r.a,
        Cdb::write_16(200, 32, false).as_bytes(),
        &mut BufData::write(data.clone()),
    );
    assert_eq!(o, Outcome::good(0));
    for (cdb, at, n) in [
        (Cdb::read_10(200, 4, false), 0usize, 4usize),
        (Cdb::read_16(200, 32, false), 0, 32),
        (Cdb::read_10(210, 8, false), 10, 8),
    ] {
        let mut d = BufData::read((n * BS as usize) as u32);
        assert_eq!(
            done(r.a.rw_now(0, cdb.as_bytes(), &mut d, &mut spare)),
            Outcome::good(0)
        );
        let want = &data[at * BS as usize..(at + n) * BS as usize];
        assert_eq!(d.input, want, "read of {n} blocks at +{at}");
        assert!(spare.as_ref().is_some_and(|b| b.capacity() == 1 << 20));
    }
    let read12 = [0xa8, 0, 0, 0, 0, 200, 0, 0, 0, 2, 0, 0];
    let mut d = BufData::read(2 * BS);
    assert_eq!(
        done(r.a.rw_now(0, &read12, &mut d, &mut spare)),
        Outcome::good(0)
    );
    assert_eq!(d.input, &data[..2 * BS as usize]);
}

#[test]
fn what_it_declines_the_full_path_answers() {
    let r = rig();
    let mut spare = spare();
    let w = |lba, n, fua| Cdb::write_16(lba, n, fua);
    let bytes = |n: u32| pattern((n * BS) as usize, 3);
    let cases: Vec<(&str, Vec<u8>, Lent)> = vec![
        (
            "FUA",
            w(0, 1, true).as_bytes().to_vec(),
            Lent(BufData::write(bytes(1))),
        ),
        (
            "length short",
            w(0, 2, false).as_bytes().to_vec(),
            Lent(BufData::write(bytes(1))),
        ),
        (
            "past the end",
            w(BLOCKS - 1, 2, false).as_bytes().to_vec(),
            Lent(BufData::write(bytes(2))),
        ),
        (
            "wrong direction",
            Cdb::read_10(0, 1, false).as_bytes().to_vec(),
            Lent(BufData::write(bytes(1))),
        ),
        (
            "READ(6)",
            vec![0x08, 0, 0, 0, 1, 0],
            Lent(BufData::read(BS)),
        ),
        (
            "RDPROTECT",
            {
                let mut c = Cdb::read_10(0, 1, false).as_bytes().to_vec();
                c[1] |= 0x20;
                c
            },
            Lent(BufData::read(BS)),
        ),
        (
            "zero blocks",
            Cdb::read_10(0, 0, false).as_bytes().to_vec(),
            Lent(BufData::read(0)),
        ),
        (
            "over one chunk",
            Cdb::read_16(0, 2049, false).as_bytes().to_vec(),
            Lent(BufData::read(2049 * BS)),
        ),
        (
            "INQUIRY",
            vec![0x12, 0, 0, 0, 36, 0],
            Lent(BufData::read(36)),
        ),
    ];
    for (why, cdb, mut d) in cases {
        assert!(declined(r.a.rw_now(0, &cdb, &mut d, &mut spare)), "{why}");
        assert!(d.0.input.is_empty(), "{why}: nothing moved");
    }
    // No such LUN.
    let mut d = BufData::read(BS);
    assert!(declined(r.a.rw_now(
        5,
        Cdb::read_10(0, 1, false).as_bytes(),
        &mut d,
        &mut spare
    )));
    // Data-out the transport cannot lend goes the full path (a copy).
    let mut d = BufData::write(bytes(1));
    assert!(declined(r.a.rw_now(
        0,
        w(0, 1, false).as_bytes(),
        &mut d,
        &mut spare
    )));

    // A unit attention owed is not taken: the full path reports it next.
    let ua = Sense::new(SenseKey::UnitAttention, asc::POWER_ON_RESET);
    r.a.get(0).unwrap().set_ua(Some(ua));
    let cdb = Cdb::read_10(0, 1, false);
    assert!(declined(r.a.rw_now(
        0,
        cdb.as_bytes(),
        &mut BufData::read(BS),
        &mut spare
    )));
    let o = full(&r.a, cdb.as_bytes(), &mut BufData::read(BS));
    assert_eq!(o.sense.map(|s| s.code()), Some(asc::POWER_ON_RESET));
    assert_eq!(
        done(r.a.rw_now(0, cdb.as_bytes(), &mut BufData::read(BS), &mut spare)),
        Outcome::good(0)
    );

    // A read-modify-write holding the write gate: writes are declined
    // (the full path waits for it), reads go on.
    let lu = r.a.get(0).unwrap();
    let g = ready(lu.shared.gate.exclusive());
    let mut d = Lent(BufData::write(bytes(1)));
    assert!(declined(r.a.rw_now(
        0,
        w(0, 1, false).as_bytes(),
        &mut d,
        &mut spare
    )));
    assert_eq!(
        done(r.a.rw_now(0, cdb.as_bytes(), &mut BufData::read(BS), &mut spare)),
        Outcome::good(0)
    );
    drop(g);
    let mut d = Lent(BufData::write(bytes(1)));
    assert_eq!(
        done(r.a.rw_now(0, w(0, 1, false).as_bytes(), &mut d, &mut spare)),
        Outcome::good(0)
    );
}

#[test]
fn conflicts_and_attentions_are_answered_as_the_full_path_does() {
    let r = rig();
    let mut spare = spare();
    // RESERVE(6) by nexus a: b's reads and writes conflict, a's do not.
    assert_eq!(
        full(&r.a, &[0x16, 0, 0, 0, 0, 0], &mut BufData::none()).status,
        ScsiStatus::Good
    );
    let rd = Cdb::read_10(0, 1, false);
    let wr = Cdb::write_10(0, 1, false);
    let o = done(r.b.rw_now(0, rd.as_bytes(), &mut BufData::read(BS), &mut spare));
    assert_eq!(o, Outcome::conflict(BS));
    let mut d = Lent(BufData::write(pattern(BS as usize, 5)));
    assert_eq!(
        done(r.b.rw_now(0, wr.as_bytes(), &mut d, &mut spare)).status,
        ScsiStatus::ReservationConflict
    );
    assert_eq!(
        done(r.a.rw_now(0, rd.as_bytes(), &mut BufData::read(BS), &mut spare)),
        Outcome::good(0)
    );
    // RELEASE(6); a LUN reset from a owes b a unit attention, which b's
    // next fast READ reports (the reservations' own, taken once).
    assert_eq!(
        full(&r.a, &[0x17, 0, 0, 0, 0, 0], &mut BufData::none()).status,
        ScsiStatus::Good
    );
    assert!(r.a.reset_lun(0));
    // a's own attention is the table's; b's is held by the reservations.
    let o = done(r.b.rw_now(0, rd.as_bytes(), &mut BufData::read(BS), &mut spare));
    assert_eq!(o.status, ScsiStatus::CheckCondition);
    assert_eq!(
        o.sense.map(|s| (s.key, s.code())),
        Some((SenseKey::UnitAttention, asc::POWER_ON_RESET))
    );
    let mut d = BufData::read(BS);
    assert_eq!(
        done(r.b.rw_now(0, rd.as_bytes(), &mut d, &mut spare)),
        Outcome::good(0)
    );
    assert_eq!(d.input.len(), BS as usize);
}

/// Data-in memory of the transport's own that it lends in place.
struct InPlace {
    mem: Vec<u8>,
    copies: usize,
}

impl DataPath for InPlace {
    fn direction(&self) -> Direction {
        Direction::FromDevice
    }
    fn expected_len(&self) -> u32 {
        self.mem.len() as u32
    }
    async fn data_out(&mut self, _: u32, _: &mut [u8]) -> Result<usize, XferError> {
        Ok(0)
    }
    async fn data_in(&mut self, offset: u32, src: &[u8]) -> Result<usize, XferError> {
        Ok(self.data_in_now(offset, src))
    }
}

impl DataNow for InPlace {
    fn data_in_now(&mut self, offset: u32, src: &[u8]) -> usize {
        self.copies += 1;
        let n = src
            .len()
            .min(self.mem.len().saturating_sub(offset as usize));
        self.mem[offset as usize..offset as usize + n].copy_from_slice(&src[..n]);
        n
    }
    fn data_in_place(&mut self, offset: u32, len: usize) -> Option<IoBuf> {
        let s = self.mem.get_mut(offset as usize..offset as usize + len)?;
        let p = std::ptr::NonNull::new(s.as_mut_ptr())?;
        // SAFETY: `mem` outlives the read (the fast path answers a malloc
        // read in the call) and nothing else touches it meanwhile.
        Some(unsafe { IoBuf::borrowed(p, len as u32) })
    }
}

#[test]
fn reads_from_a_bdev_that_completes_in_submit_land_in_place() {
    let r = rig();
    let lu = r.a.get(0).unwrap();
    assert!(
        lu.channel().completes_in_submit(),
        "malloc completes in submit"
    );
    let data = pattern(16 * BS as usize, 11);
    let o = full(
        &r.a,
        Cdb::write_16(300, 16, false).as_bytes(),
        &mut BufData::write(data.clone()),
    );
    assert_eq!(o, Outcome::good(0));
    let mut spare = None;
    let mut d = InPlace {
        mem: vec![0; 16 * BS as usize],
        copies: 0,
    };
    let o = done(r.a.rw_now(
        0,
        Cdb::read_16(300, 16, false).as_bytes(),
        &mut d,
        &mut spare,
    ));
    assert_eq!(o, Outcome::good(0));
    assert_eq!(d.mem, data, "read back in place");
    assert_eq!(d.copies, 0, "no copy");
    assert!(spare.is_none(), "no buffer of ours taken");
}

/// Data-out the transport lends as several buffers (a guest's scattered
/// pages): the full path writes from them, in order, with no copy.
struct Scattered {
    out: Vec<u8>,
    lent: usize,
    back: usize,
}

impl DataPath for Scattered {
    fn direction(&self) -> Direction {
        Direction::ToDevice
    }
    fn expected_len(&self) -> u32 {
        self.out.len() as u32
    }
    async fn data_out(&mut self, _: u32, _: &mut [u8]) -> Result<usize, XferError> {
        panic!("scattered data-out is lent, not copied");
    }
    fn data_out_bufs(&mut self, offset: u32, len: usize, max: usize) -> Option<Vec<IoBuf>> {
        let src = self.out.get(offset as usize..offset as usize + len)?;
        // Uneven pieces: 512 bytes, then the rest in two.
        let cut = [512, 512 + (len - 512) / 2, len];
        let mut v = Vec::new();
        let mut at = 0;
        for end in cut {
            let mut b = IoBuf::heap(end - at);
            b.copy_from_slice(&src[at..end]);
            v.push(b);
            at = end;
        }
        assert!(v.len() <= max);
        self.lent += 1;
        Some(v)
    }
    fn bufs_back(&mut self, bufs: Vec<IoBuf>) {
        assert_eq!(bufs.len(), 3, "the list comes back whole");
        self.back += 1;
    }
    async fn data_in(&mut self, _: u32, _: &[u8]) -> Result<usize, XferError> {
        Ok(0)
    }
}

#[test]
fn scattered_data_out_is_written_from_where_it_lies() {
    let r = rig();
    let data = pattern(24 * BS as usize, 21);
    let mut d = Scattered {
        out: data.clone(),
        lent: 0,
        back: 0,
    };
    let o = full(&r.a, Cdb::write_16(400, 24, true).as_bytes(), &mut d);
    assert_eq!(o, Outcome::good(0));
    assert_eq!((d.lent, d.back), (1, 1));
    let mut back = BufData::read(24 * BS);
    let o = full(&r.a, Cdb::read_16(400, 24, false).as_bytes(), &mut back);
    assert_eq!(o, Outcome::good(0));
    assert_eq!(back.input, data);
}

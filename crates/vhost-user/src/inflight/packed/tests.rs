use vm_memory::GuestMemoryMmap;

use super::*;
use crate::inflight::InflightRegion;

const SIZE: u16 = 16;
const DESC: u64 = 0x1000;

fn mem() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap()
}

fn track() -> (PackedTrack, std::fs::File) {
    let (r, f) = InflightRegion::create(1, SIZE, true).unwrap();
    assert!(r.fits_packed());
    (PackedTrack::new(r.queue(0)), f)
}

/// A chain of `n` descriptors with buffer ID `id` (data addresses tell
/// chains apart).
fn chain(id: u16, n: u16) -> Vec<RawDesc> {
    (0..n)
        .map(|k| RawDesc {
            addr: 0x8000 + id as u64 * 0x100 + k as u64 * 0x10,
            len: 16 + k as u32,
            id,
            flags: if k + 1 < n { 1 } else { 2 },
        })
        .collect()
}

/// Tracks the take of `c`.
fn take(t: &PackedTrack, c: &[RawDesc]) {
    t.taken(c.len() as u16, |k| c[k as usize]);
}

/// Writes a used descriptor's flags at `slot` for wrap counter `wrap`.
fn mark_used(m: &GuestMemoryMmap, slot: u16, wrap: bool) {
    let f: u16 = if wrap { F_AVAIL | F_USED } else { 0 };
    m.write_obj(f, GuestAddress(DESC + slot as u64 * 16 + 14))
        .unwrap();
}

/// Marks `slot` available for wrap counter `wrap` (not used).
fn mark_avail(m: &GuestMemoryMmap, slot: u16, wrap: bool) {
    let f: u16 = if wrap { F_AVAIL } else { F_USED };
    m.write_obj(f, GuestAddress(DESC + slot as u64 * 16 + 14))
        .unwrap();
}

/// Returns `id` (its chain `n` slots) at used position `pos`, fully.
fn complete(
    t: &PackedTrack,
    m: &GuestMemoryMmap,
    id: u16,
    pos: (u16, bool),
    n: u16,
) -> (u16, bool) {
    let next = advance(pos.0, pos.1, n as u32, SIZE);
    t.used(id, next);
    mark_used(m, pos.0, pos.1);
    t.used_done(id);
    next
}

#[test]
fn a_fresh_part_starts_where_the_frontend_says() {
    let (t, _f) = track();
    let rec = t.recover(&mem(), GuestAddress(DESC), (3, false)).unwrap();
    assert_eq!(rec.used, (3, false));
    assert_eq!(rec.avail, (3, false));
    assert!(rec.resubmit.is_empty());
}

#[test]
fn a_restart_resubmits_the_chains_in_flight_in_order() {
    let (t, f) = track();
    let m = mem();
    t.recover(&m, GuestAddress(DESC), (0, true)).unwrap();
    // Taken: id 4 (3 slots), id 7 (1), id 2 (2), id 9 (3); 7 and 9 done.
    for (id, n) in [(4, 3), (7, 1), (2, 2), (9, 3)] {
        take(&t, &chain(id, n));
    }
    let p = complete(&t, &m, 7, (0, true), 1);
    let p = complete(&t, &m, 9, p, 3);
    assert_eq!(p, (4, true));
    drop(t);
    // A new process maps the same file.
    let r = InflightRegion::open(
        f,
        0,
        crate::inflight::queue_region_size_packed(SIZE),
        1,
        SIZE,
    )
    .unwrap();
    let t = PackedTrack::new(r.queue(0));
    let rec = t.recover(&m, GuestAddress(DESC), (0, true)).unwrap();
    assert_eq!(rec.used, (4, true));
    assert_eq!(rec.avail, (9, true), "4 used slots + 5 in flight");
    let ids: Vec<u16> = rec.resubmit.iter().map(|c| c.id).collect();
    assert_eq!(ids, vec![4, 2]);
    assert_eq!(rec.resubmit[0].descs, chain(4, 3));
    assert_eq!(rec.resubmit[1].descs, chain(2, 2));
    // They complete after the restart, and new chains are tracked.
    let p = complete(&t, &m, 2, rec.used, 2);
    take(&t, &chain(11, 2));
    let p = complete(&t, &m, 4, p, 3);
    let rec = t.recover(&m, GuestAddress(DESC), (0, true)).unwrap();
    assert_eq!(rec.used, p);
    let ids: Vec<u16> = rec.resubmit.iter().map(|c| c.id).collect();
    assert_eq!(ids, vec![11]);
}

#[test]
fn laps_of_the_ring_keep_the_free_list_whole() {
    let (t, _f) = track();
    let m = mem();
    t.recover(&m, GuestAddress(DESC), (0, true)).unwrap();
    let mut pos = (0, true);
    // 40 chains of 3 slots, two in flight at a time: 7.5 laps.
    take(&t, &chain(0, 3));
    for k in 1..40u16 {
        take(&t, &chain(k % SIZE, 3));
        pos = complete(&t, &m, (k - 1) % SIZE, pos, 3);
    }
    let rec = t.recover(&m, GuestAddress(DESC), (0, true)).unwrap();
    assert_eq!(rec.used, pos);
    assert_eq!(rec.avail, advance(pos.0, pos.1, 3, SIZE));
    assert_eq!(rec.resubmit.len(), 1);
    assert_eq!(rec.resubmit[0].descs, chain(39 % SIZE, 3));
}

#[test]
fn killed_before_the_used_descriptor_rolls_back() {
    let (t, _f) = track();
    let m = mem();
    t.recover(&m, GuestAddress(DESC), (0, true)).unwrap();
    take(&t, &chain(5, 2));
    take(&t, &chain(6, 1));
    mark_avail(&m, 0, true);
    // The free list and used index moved, the descriptor did not.
    t.used(5, (2, true));
    let rec = t.recover(&m, GuestAddress(DESC), (0, true)).unwrap();
    assert_eq!(rec.used, (0, true));
    assert_eq!(rec.avail, (3, true));
    let ids: Vec<u16> = rec.resubmit.iter().map(|c| c.id).collect();
    assert_eq!(ids, vec![5, 6]);
}

#[test]
fn killed_after_the_used_descriptor_commits() {
    let (t, _f) = track();
    let m = mem();
    t.recover(&m, GuestAddress(DESC), (0, true)).unwrap();
    take(&t, &chain(5, 2));
    take(&t, &chain(6, 1));
    t.used(5, (2, true));
    mark_used(&m, 0, true);
    // SIGKILL before used_done: 5 is still marked, but the driver has it.
    let rec = t.recover(&m, GuestAddress(DESC), (0, true)).unwrap();
    assert_eq!(rec.used, (2, true));
    assert_eq!(rec.avail, (3, true));
    let ids: Vec<u16> = rec.resubmit.iter().map(|c| c.id).collect();
    assert_eq!(ids, vec![6]);
}

#[test]
fn killed_in_the_middle_of_a_take_takes_it_again() {
    let (t, _f) = track();
    let m = mem();
    t.recover(&m, GuestAddress(DESC), (0, true)).unwrap();
    take(&t, &chain(1, 2));
    // A take cut short: head marked, old_free_head not moved.
    let head: u16 = t.q.get(OLD_FREE_HEAD);
    t.eput(head, E_COUNTER, 99u64);
    t.eput(head, E_INFLIGHT, 1u8);
    t.q.put(FREE_HEAD, head + 1);
    let rec = t.recover(&m, GuestAddress(DESC), (0, true)).unwrap();
    let ids: Vec<u16> = rec.resubmit.iter().map(|c| c.id).collect();
    assert_eq!(ids, vec![1]);
    assert_eq!(rec.avail, (2, true));
}

#[test]
fn a_damaged_region_is_refused_or_survived_never_a_panic() {
    let m = mem();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..200 {
        let (t, _f) = track();
        t.recover(&m, GuestAddress(DESC), (0, true)).unwrap();
        let len = P_HEADER + P_ENTRY * SIZE as usize;
        for off in (8..len).step_by(2) {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            if seed % 3 == 0 {
                t.q.put(off, (seed >> 16) as u16 % (2 * SIZE));
            }
        }
        if let Ok(rec) = t.recover(&m, GuestAddress(DESC), (0, true)) {
            let slots: usize = rec.resubmit.iter().map(|c| c.descs.len()).sum();
            assert!(slots <= SIZE as usize);
            assert!(rec.used.0 < SIZE && rec.avail.0 < SIZE);
        }
    }
}

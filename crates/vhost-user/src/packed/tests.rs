//! The packed ring against a small driver written here from the spec
//! (§2.8.21-22), and against rings a hostile driver wrote (errors, never a
//! panic or a loop).

use std::collections::HashMap;

use proptest::prelude::*;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::*;

const MEM: usize = 64 << 10;
const DESC_AT: u64 = 0;
const DRIVER_AT: u64 = 0x4000;
const DEVICE_AT: u64 = 0x4010;
const TABLE_AT: u64 = 0x5000;
const DATA_AT: u64 = 0x8000;

/// The driver side: writes chains with the flags of each slot's lap, the
/// first descriptor's flags last; reads used descriptors back.
struct Drv {
    mem: GuestMemoryMmap,
    size: u16,
    avail: (u16, bool),
    used: (u16, bool),
    /// Slots each buffer ID in flight took.
    chains: HashMap<u16, u16>,
}

impl Drv {
    fn new(size: u16) -> Drv {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM)]).unwrap();
        Drv {
            mem,
            size,
            avail: (0, true),
            used: (0, true),
            chains: HashMap::new(),
        }
    }

    fn ring(&self, event_idx: bool) -> PackedRing {
        let (d, dr, dv) = (
            GuestAddress(DESC_AT),
            GuestAddress(DRIVER_AT),
            GuestAddress(DEVICE_AT),
        );
        PackedRing::new(self.size, d, dr, dv, event_idx, (1 << 15) | (1 << 31)).unwrap()
    }

    fn write_desc(&self, slot: u16, addr: u64, len: u32, id: u16, flags: u16) {
        let at = GuestAddress(DESC_AT + slot as u64 * 16);
        self.mem.write_obj(addr, at).unwrap();
        self.mem.write_obj(len, GuestAddress(at.0 + 8)).unwrap();
        self.mem.write_obj(id, GuestAddress(at.0 + 12)).unwrap();
        self.mem.write_obj(flags, GuestAddress(at.0 + 14)).unwrap();
    }

    fn lap_flags(wrap: bool) -> u16 {
        if wrap {
            F_AVAIL
        } else {
            F_USED
        }
    }

    /// Makes a chain of `(len, write, extra flags)` available with `id`.
    fn add(&mut self, descs: &[(u32, bool, u16)], id: u16) {
        let first = self.avail;
        let mut first_flags = 0;
        for (i, &(len, write, extra)) in descs.iter().enumerate() {
            let mut f = Self::lap_flags(self.avail.1) | extra;
            if write {
                f |= F_WRITE;
            }
            if i + 1 < descs.len() {
                f |= F_NEXT;
            }
            let addr = DATA_AT + self.avail.0 as u64 * 0x100;
            if i == 0 {
                first_flags = f;
                // Flags 0 are never available: written for real below.
                self.write_desc(self.avail.0, addr, len, id, 0);
            } else {
                self.write_desc(self.avail.0, addr, len, id, f);
            }
            self.avail = advance(self.avail.0, self.avail.1, 1, self.size);
        }
        // The first descriptor becomes available last.
        let at = GuestAddress(DESC_AT + first.0 as u64 * 16 + 14);
        self.mem.store(first_flags, at, Ordering::Release).unwrap();
        self.chains.insert(id, descs.len() as u16);
    }

    /// A used descriptor, if the device wrote the next one.
    fn take_used(&mut self) -> Option<(u16, u32)> {
        let at = DESC_AT + self.used.0 as u64 * 16;
        let f: u16 = self.mem.read_obj(GuestAddress(at + 14)).unwrap();
        let w = self.used.1;
        if (f & F_AVAIL != 0) != w || (f & F_USED != 0) != w {
            return None;
        }
        let id: u16 = self.mem.read_obj(GuestAddress(at + 12)).unwrap();
        let len: u32 = self.mem.read_obj(GuestAddress(at + 8)).unwrap();
        let n = self
            .chains
            .remove(&id)
            .expect("used id the driver had made available");
        self.used = advance(self.used.0, self.used.1, n, self.size);
        Some((id, len))
    }

    fn set_driver_event(&self, off_wrap: u16, flags: u16) {
        self.mem
            .write_obj(off_wrap, GuestAddress(DRIVER_AT))
            .unwrap();
        self.mem
            .write_obj(flags, GuestAddress(DRIVER_AT + 2))
            .unwrap();
    }
}

fn buf() -> Vec<Desc> {
    vec![Desc::default(); 8]
}

#[test]
fn chains_wrap_many_laps_completed_out_of_order() {
    let mut d = Drv::new(8);
    let mut r = d.ring(false);
    let mut out = buf();
    let mut next_id = 0u16;
    for round in 0..40u32 {
        // Three chains of 1-3 descriptors per round (at most 6 slots of 8).
        let mut taken = Vec::new();
        for c in 0..3u16 {
            let n = 1 + ((round as u16 + c) % 3) as usize;
            let chain: Vec<_> = (0..n).map(|i| (64 + i as u32, i + 1 == n, 0)).collect();
            d.add(&chain, next_id);
            next_id = (next_id + 1) % 8;
        }
        while let Some(t) = r.pop(&d.mem, &mut out) {
            assert!(t.descs >= 1 && t.descs <= 3, "{t:?}");
            assert!(out[t.descs - 1].write);
            taken.push(t.head);
        }
        assert_eq!(taken.len(), 3, "round {round}");
        assert_eq!(r.in_flight(), 3);
        // Newest first: the used slots are filled in completion order.
        for &id in taken.iter().rev() {
            r.add_used(&d.mem, id, 7).unwrap();
        }
        for &id in taken.iter().rev() {
            assert_eq!(d.take_used(), Some((id, 7)), "round {round}");
        }
        assert_eq!(d.take_used(), None);
        assert_eq!(r.in_flight(), 0);
        assert_eq!(
            r.indices().0,
            r.indices().1,
            "drained: both sides at one place"
        );
    }
    assert!(r.broken().is_none());
}

#[test]
fn an_indirect_table_is_one_slot() {
    let mut d = Drv::new(4);
    let mut r = d.ring(false);
    for (i, (len, write)) in [(16u32, false), (512, true), (1, true)].iter().enumerate() {
        let at = GuestAddress(TABLE_AT + i as u64 * 16);
        d.mem.write_obj(DATA_AT + i as u64 * 0x1000, at).unwrap();
        d.mem.write_obj(*len, GuestAddress(at.0 + 8)).unwrap();
        let f: u16 = if *write { F_WRITE } else { 0 };
        d.mem.write_obj(f, GuestAddress(at.0 + 14)).unwrap();
    }
    d.add(&[(48, false, F_INDIRECT)], 2);
    d.mem.write_obj(TABLE_AT, GuestAddress(DESC_AT)).unwrap();
    let mut out = buf();
    let t = r.pop(&d.mem, &mut out).unwrap();
    assert_eq!(t, Taken { head: 2, descs: 3 });
    assert_eq!(
        out[1],
        Desc {
            addr: DATA_AT + 0x1000,
            len: 512,
            write: true
        }
    );
    r.add_used(&d.mem, 2, 513).unwrap();
    assert_eq!(d.take_used(), Some((2, 513)));
    assert_eq!(r.indices().0, 1 | 1 << 15);
}

#[test]
fn malformed_indirect_chains_come_back_empty() {
    let mut d = Drv::new(8);
    let mut r = d.ring(false);
    let mut out = buf();
    // Length not a whole number of descriptors.
    d.add(&[(20, false, F_INDIRECT)], 0);
    // Indirect with NEXT (two slots).
    d.add(&[(32, false, F_INDIRECT), (1, true, 0)], 1);
    // A table outside guest memory.
    d.add(&[(32, false, F_INDIRECT)], 2);
    d.mem
        .write_obj(u64::MAX - 8, GuestAddress(DESC_AT + 3 * 16))
        .unwrap();
    for id in 0..3 {
        assert_eq!(r.pop(&d.mem, &mut out), Some(Taken { head: id, descs: 0 }));
    }
    for id in 0..3 {
        r.add_used(&d.mem, id, 0).unwrap();
        assert_eq!(d.take_used(), Some((id, 0)));
    }
    assert!(r.broken().is_none());
}

#[test]
fn a_chain_longer_than_the_buffer_fills_it() {
    let mut d = Drv::new(16);
    let mut r = d.ring(false);
    let chain: Vec<_> = (0..12).map(|_| (8u32, false, 0)).collect();
    d.add(&chain, 5);
    let mut out = buf();
    assert_eq!(r.pop(&d.mem, &mut out), Some(Taken { head: 5, descs: 8 }));
    r.add_used(&d.mem, 5, 0).unwrap();
    assert_eq!(d.take_used(), Some((5, 0)));
    assert_eq!(r.indices().0, 12 | 1 << 15);
}

fn broken_by(setup: impl FnOnce(&mut Drv)) -> PackedError {
    let mut d = Drv::new(8);
    let mut r = d.ring(false);
    setup(&mut d);
    let mut out = buf();
    while r.pop(&d.mem, &mut out).is_some() {}
    let e = r.broken().expect("ring broken");
    // Stays broken: nothing more is taken.
    d.add(&[(1, true, 0)], 7);
    assert_eq!(r.pop(&d.mem, &mut out), None);
    assert!(!r.enable_notification(&d.mem));
    e
}

#[test]
fn a_buffer_id_beyond_the_ring_breaks_it() {
    assert_eq!(
        broken_by(|d| d.add(&[(1, true, 0)], 8)),
        PackedError::BadId(8)
    );
}

#[test]
fn a_buffer_id_in_flight_twice_breaks_it() {
    let e = broken_by(|d| {
        d.add(&[(1, true, 0)], 3);
        d.add(&[(1, true, 0)], 3);
    });
    assert_eq!(e, PackedError::IdInFlight(3));
}

#[test]
fn a_chain_around_the_whole_ring_breaks_it() {
    // Every slot has NEXT and is available: the chain never ends.
    let e = broken_by(|d| {
        for s in 0..8 {
            d.write_desc(s, DATA_AT, 8, 0, F_AVAIL | F_NEXT);
        }
    });
    assert_eq!(e, PackedError::TooLong);
}

#[test]
fn a_later_descriptor_with_the_wrong_wrap_bits_breaks_it() {
    let e = broken_by(|d| {
        d.add(&[(16, false, 0), (1, true, 0)], 1);
        // The second slot as the previous lap would have it.
        d.write_desc(1, DATA_AT, 1, 1, F_USED | F_WRITE);
    });
    assert_eq!(e, PackedError::NotAvailable(1));
}

#[test]
fn wrong_wrap_bits_at_the_head_are_not_available() {
    let d = Drv::new(8);
    let mut r = d.ring(false);
    let mut out = buf();
    // Both bits set in the first lap: a used descriptor, not available.
    d.write_desc(0, DATA_AT, 1, 0, F_AVAIL | F_USED | F_WRITE);
    assert_eq!(r.pop(&d.mem, &mut out), None);
    // Neither bit: not available either.
    d.write_desc(0, DATA_AT, 1, 0, F_WRITE);
    assert_eq!(r.pop(&d.mem, &mut out), None);
    assert!(r.broken().is_none());
    assert!(!r.enable_notification(&d.mem));
}

#[test]
fn a_ring_outside_memory_breaks_it() {
    let d = Drv::new(8);
    let far = GuestAddress(MEM as u64 * 4);
    let mut r = PackedRing::new(8, far, far, far, false, 1 << 15).unwrap();
    let mut out = buf();
    assert_eq!(r.pop(&d.mem, &mut out), None);
    assert_eq!(r.broken(), Some(PackedError::Unreadable));
}

#[test]
fn vring_base_carries_both_wrap_counters() {
    let g = GuestAddress(0);
    assert!(PackedRing::new(8, g, g, g, false, 8).is_err());
    assert!(PackedRing::new(8, g, g, g, false, 3 | (9 << 16)).is_err());
    let r = PackedRing::new(8, g, g, g, false, 5 | 1 << 15).unwrap();
    assert_eq!(r.indices(), (5 | 1 << 15, 5 | 1 << 15));
    let r = PackedRing::new(8, g, g, g, false, 5 | (3 << 16)).unwrap();
    assert_eq!(r.indices(), (5, 3));
}

#[test]
fn notifications_follow_the_driver_event_structure() {
    let mut d = Drv::new(4);
    let mut r = d.ring(true);
    let mut out = buf();
    let mut run = |d: &mut Drv, r: &mut PackedRing, id: u16| {
        d.add(&[(1, true, 0)], id);
        let t = r.pop(&d.mem, &mut out).unwrap();
        r.add_used(&d.mem, t.head, 1).unwrap();
        let n = r.needs_notification(&d.mem);
        d.take_used().unwrap();
        n
    };
    d.set_driver_event(0, EVENT_DISABLE);
    assert!(!run(&mut d, &mut r, 0));
    d.set_driver_event(0, EVENT_ENABLE);
    assert!(run(&mut d, &mut r, 1));
    // Used slots 2 and 3 of lap 1 come next; ask at slot 3.
    d.set_driver_event(3 | 1 << 15, EVENT_DESC);
    assert!(!run(&mut d, &mut r, 2));
    assert!(run(&mut d, &mut r, 3));
    // Next lap (wrap 0): ask at slot 1.
    d.set_driver_event(1, EVENT_DESC);
    assert!(!run(&mut d, &mut r, 0));
    assert!(run(&mut d, &mut r, 1));
    // An offset of the lap before: already passed, no notification.
    d.set_driver_event(3 | 1 << 15, EVENT_DESC);
    assert!(!run(&mut d, &mut r, 2));
}

#[test]
fn kicks_are_asked_for_only_when_idle() {
    let mut d = Drv::new(4);
    let mut r = d.ring(false);
    let flags = |d: &Drv| d.mem.read_obj::<u16>(GuestAddress(DEVICE_AT + 2)).unwrap();
    r.disable_notification(&d.mem);
    assert_eq!(flags(&d), EVENT_DISABLE);
    assert!(!r.enable_notification(&d.mem));
    assert_eq!(flags(&d), EVENT_ENABLE);
    d.add(&[(1, true, 0)], 0);
    assert!(r.enable_notification(&d.mem), "a chain is waiting");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Whatever the driver wrote in the ring, its tables and the base,
    /// taking and returning chains ends (a bounded number of pops), never
    /// panics, and a taken chain's descriptors fit the buffer.
    #[test]
    fn hostile_rings_never_panic_or_loop(
        ring in proptest::collection::vec(any::<u8>(), 0..512),
        table in proptest::collection::vec(any::<u8>(), 0..256),
        size in 1u16..=32,
        base in any::<u32>(),
        event in any::<u32>(),
        order in any::<u64>(),
    ) {
        let d = Drv::new(size);
        d.mem.write_slice(&ring, GuestAddress(DESC_AT)).unwrap();
        d.mem.write_slice(&table, GuestAddress(TABLE_AT)).unwrap();
        d.mem.write_obj(event, GuestAddress(DRIVER_AT)).unwrap();
        let g = GuestAddress;
        let Ok(mut r) = PackedRing::new(size, g(DESC_AT), g(DRIVER_AT), g(DEVICE_AT), true, base) else {
            return Ok(());
        };
        let mut out = buf();
        let mut held = Vec::new();
        for step in 0..(4 * size as u64) {
            match r.pop(&d.mem, &mut out) {
                Some(t) => {
                    prop_assert!(t.descs <= out.len());
                    prop_assert!(t.head < size);
                    held.push(t.head);
                }
                None => {
                    if held.is_empty() { break; }
                }
            }
            if !held.is_empty() && order >> (step % 64) & 1 == 1 {
                let id = held.swap_remove((order as usize + step as usize) % held.len());
                prop_assert!(r.add_used(&d.mem, id, 1).is_ok());
                let _ = r.needs_notification(&d.mem);
            }
        }
        prop_assert_eq!(r.in_flight(), held.len());
        let _ = r.enable_notification(&d.mem);
    }
}

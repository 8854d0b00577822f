//! The ring + chain walker of the data path under hostile rings (the body
//! of the `vhost_ring_chains` fuzz target): random bytes, and rings built
//! from random descriptors whose addresses, lengths, flags and `next`
//! links make out-of-bounds buffers, loops, indirect tables and wrong
//! directions. Every case must end (no hang on a loop) without a panic,
//! and every accepted request must stay inside guest memory.

use proptest::prelude::*;
use ustor_vhost::fuzzing::{
    packed_chains, ring_chains, Outcome, EVENT_IDX_AT, MEM_BYTES, PACKED_BASE_AT, SIZE_AT,
};
use ustor_vhost::scsi::fuzzing::scsi_chains;

const NEXT: u16 = 1;
const WRITE: u16 = 2;
const INDIRECT: u16 = 4;

#[derive(Debug, Clone, Copy)]
struct D {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

fn desc() -> impl Strategy<Value = D> {
    (
        prop_oneof![
            // Mostly buffers in guest memory past the rings, some anywhere.
            0x3000u64..(MEM_BYTES as u64),
            any::<u64>(),
        ],
        prop_oneof![1u32..4097, any::<u32>()],
        0u16..8,
        0u16..20,
    )
        .prop_map(|(addr, len, flags, next)| D {
            addr,
            len,
            flags: flags & (NEXT | WRITE | INDIRECT),
            next,
        })
}

/// Guest memory with a 16-entry ring: descriptor table at 0, avail ring
/// at 0x1000 offering `heads`, a request header in every buffer.
fn ring(descs: &[D], heads: &[u16], typ: u32) -> Vec<u8> {
    let mut m = vec![0u8; MEM_BYTES];
    m[SIZE_AT] = 4; // a ring of 16
    for (i, d) in descs.iter().enumerate().take(16) {
        let o = i * 16;
        m[o..o + 8].copy_from_slice(&d.addr.to_le_bytes());
        m[o + 8..o + 12].copy_from_slice(&d.len.to_le_bytes());
        m[o + 12..o + 14].copy_from_slice(&d.flags.to_le_bytes());
        m[o + 14..o + 16].copy_from_slice(&d.next.to_le_bytes());
    }
    let a = 0x1000;
    m[a + 2..a + 4].copy_from_slice(&(heads.len() as u16).to_le_bytes());
    for (i, h) in heads.iter().enumerate().take(16) {
        m[a + 4 + 2 * i..a + 6 + 2 * i].copy_from_slice(&h.to_le_bytes());
    }
    // Request headers where buffers usually point.
    for o in (0x3000..MEM_BYTES).step_by(0x1000) {
        m[o..o + 4].copy_from_slice(&typ.to_le_bytes());
    }
    m
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes(data in proptest::collection::vec(any::<u8>(), 0..0x3100)) {
        let _ = ring_chains(&data);
    }

    #[test]
    fn random_rings(
        descs in proptest::collection::vec(desc(), 16),
        heads in proptest::collection::vec(0u16..20, 0..17),
        typ in prop_oneof![Just(0u32), Just(1), Just(4), Just(8), Just(11), Just(13), any::<u32>()],
    ) {
        let _ = ring_chains(&ring(&descs, &heads, typ));
    }

    /// The same hostile rings walked as virtio-scsi chains (the body of
    /// the `vhost_scsi_chains` fuzz target).
    #[test]
    fn scsi_random_bytes(data in proptest::collection::vec(any::<u8>(), 0..0x3100)) {
        let _ = scsi_chains(&data);
    }

    /// A packed ring from random bytes (the body of the
    /// `vhost_packed_chains` fuzz target).
    #[test]
    fn packed_random_bytes(data in proptest::collection::vec(any::<u8>(), 0..0x3100)) {
        let _ = packed_chains(&data);
    }

    /// Packed rings from random descriptors: AVAIL/USED bits of either
    /// lap, chains (NEXT) that run on or around the ring, indirect tables
    /// anywhere, buffer IDs past the ring or repeated, a random base.
    #[test]
    fn packed_random_rings(
        descs in proptest::collection::vec(pdesc(), 1..40),
        size in 1u8..32,
        base in prop_oneof![Just(None), any::<u32>().prop_map(Some)],
        event in any::<u32>(),
        event_idx in any::<bool>(),
        typ in prop_oneof![Just(0u32), Just(1), Just(4), any::<u32>()],
    ) {
        let _ = packed_chains(&packed_ring(&descs, size, base, event, event_idx, typ));
    }

    #[test]
    fn scsi_random_rings(
        descs in proptest::collection::vec(desc(), 16),
        heads in proptest::collection::vec(0u16..20, 0..17),
    ) {
        let _ = scsi_chains(&ring(&descs, &heads, 0));
    }
}

#[test]
fn scsi_chain_order_and_bounds() {
    let d = |addr, len, flags, next| D {
        addr,
        len,
        flags,
        next,
    };
    // A command (header, response) is taken; a readable buffer after a
    // writable one, and one past guest memory, are refused.
    let descs = [
        d(0x3000, 51, NEXT, 1),
        d(0x4000, 108, WRITE, 0),
        d(0x5000, 108, WRITE | NEXT, 3),
        d(0x6000, 51, 0, 0),
        d(MEM_BYTES as u64 - 8, 51, NEXT, 1),
    ];
    let o = scsi_chains(&ring(&descs, &[0, 2, 4], 0));
    assert_eq!((o.chains, o.commands, o.refused), (1, 1, 2), "{o:?}");
}

#[test]
fn descriptor_loop_ends() {
    // 0 -> 1 -> 0 -> ...: the iterator stops after the table's size.
    let d = |next| D {
        addr: 0x3000,
        len: 16,
        flags: NEXT,
        next,
    };
    let o = ring_chains(&ring(&[d(1), d(0)], &[0], 0));
    assert_eq!(
        o,
        Outcome {
            no_status: 1,
            ..Outcome::default()
        }
    );
    // The same loop through a writable descriptor: too long, IOERR.
    let w = |next| D {
        addr: 0x3000,
        len: 16,
        flags: NEXT | WRITE,
        next,
    };
    let o = ring_chains(&ring(&[d(1), w(0)], &[0], 0));
    assert_eq!(o.accepted, 0, "{o:?}");
}

/// Header, one data buffer, status: the shape every test below breaks.
fn req(data: D) -> Vec<D> {
    let hdr = D {
        addr: 0x3000,
        len: 16,
        flags: NEXT,
        next: 1,
    };
    let st = D {
        addr: 0x5000,
        len: 1,
        flags: WRITE,
        next: 0,
    };
    vec![
        hdr,
        D {
            flags: data.flags | NEXT,
            next: 2,
            ..data
        },
        st,
    ]
}

#[test]
fn a_valid_read_is_accepted() {
    let o = ring_chains(&ring(
        &req(D {
            addr: 0x4000,
            len: 512,
            flags: WRITE,
            next: 0,
        }),
        &[0],
        0,
    ));
    assert_eq!(
        o,
        Outcome {
            accepted: 1,
            ..Outcome::default()
        }
    );
}

#[test]
fn out_of_bounds_and_wrong_direction() {
    let ioerr = Outcome {
        ioerr: 1,
        ..Outcome::default()
    };
    // Data past the end of memory.
    let oob = D {
        addr: MEM_BYTES as u64 - 8,
        len: 4096,
        flags: WRITE,
        next: 0,
    };
    assert_eq!(ring_chains(&ring(&req(oob), &[0], 0)), ioerr);
    // Data wrapping the address space.
    let wrap = D {
        addr: u64::MAX - 100,
        len: 512,
        flags: WRITE,
        next: 0,
    };
    assert_eq!(ring_chains(&ring(&req(wrap), &[0], 0)), ioerr);
    // A read whose data buffer is device-readable.
    let ro = D {
        addr: 0x4000,
        len: 512,
        flags: 0,
        next: 0,
    };
    assert_eq!(ring_chains(&ring(&req(ro), &[0], 0)), ioerr);
    // A write whose data buffer is device-writable.
    let wr = D {
        addr: 0x4000,
        len: 512,
        flags: WRITE,
        next: 0,
    };
    assert_eq!(ring_chains(&ring(&req(wr), &[0], 1)), ioerr);
    // A head index outside the table: the ring offers nothing usable.
    let o = ring_chains(&ring(&req(ro), &[40], 0));
    assert_eq!(o.accepted, 0, "{o:?}");
}

/// One vhost-user message: header (request, flags with version 1 and
/// maybe NEED_REPLY, size) and a body of `size` bytes.
fn msg(req: u32, flags: u32, body: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(12 + body.len());
    m.extend_from_slice(&req.to_le_bytes());
    m.extend_from_slice(&(flags | 1).to_le_bytes());
    m.extend_from_slice(&(body.len() as u32).to_le_bytes());
    m.extend_from_slice(body);
    m
}

fn u64s(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_message_streams(
        msgs in proptest::collection::vec(
            (0u32..48, prop_oneof![Just(0u32), Just(8)], proptest::collection::vec(any::<u8>(), 0..80)),
            0..24,
        ),
        tail in proptest::collection::vec(any::<u8>(), 0..16),
    ) {
        let mut data: Vec<u8> = msgs.iter().flat_map(|(r, f, b)| msg(*r, *f, b)).collect();
        data.extend_from_slice(&tail);
        ustor_vhost::fuzzing::messages(&data);
    }
}

#[test]
fn messages_out_of_order_and_out_of_range() {
    // Request codes (vhost-user spec).
    const SET_FEATURES: u32 = 2;
    const SET_VRING_NUM: u32 = 8;
    const SET_VRING_ADDR: u32 = 9;
    const SET_VRING_BASE: u32 = 10;
    const GET_VRING_BASE: u32 = 11;
    const SET_VRING_KICK: u32 = 12;
    const SET_VRING_ENABLE: u32 = 18;
    const GET_CONFIG: u32 = 24;
    const NOFD: u64 = 1 << 8;
    let mut s = Vec::new();
    // Ring set-up before features and memory, rings past the device's.
    s.extend(msg(SET_VRING_ADDR, 0, &[0u8; 40]));
    s.extend(msg(SET_VRING_NUM, 0, &u64s(&[0, 1 << 20])));
    s.extend(msg(SET_VRING_NUM, 0, &u64s(&[7, 128])));
    s.extend(msg(SET_VRING_BASE, 0, &u64s(&[1000, 5])));
    s.extend(msg(GET_VRING_BASE, 0, &u64s(&[0, 0])));
    s.extend(msg(SET_VRING_KICK, 0, &u64s(&[NOFD])));
    s.extend(msg(SET_VRING_KICK, 0, &u64s(&[200 | NOFD])));
    s.extend(msg(SET_VRING_ENABLE, 0, &u64s(&[0, 1])));
    s.extend(msg(SET_FEATURES, 0, &u64s(&[u64::MAX])));
    // GET_CONFIG larger than the config space, and a truncated message.
    let mut cfg = vec![0u8; 12 + 300];
    cfg[4..8].copy_from_slice(&300u32.to_le_bytes());
    s.extend(msg(GET_CONFIG, 0, &cfg));
    s.extend(&msg(SET_VRING_NUM, 0, &u64s(&[0, 128]))[..14]);
    ustor_vhost::fuzzing::messages(&s);
}

const P_AVAIL: u16 = 1 << 7;

#[derive(Debug, Clone, Copy)]
struct PD {
    addr: u64,
    len: u32,
    id: u16,
    flags: u16,
}

fn pdesc() -> impl Strategy<Value = PD> {
    (
        prop_oneof![0x3000u64..(MEM_BYTES as u64), any::<u64>()],
        prop_oneof![1u32..4097, Just(48), any::<u32>()],
        prop_oneof![0u16..8, any::<u16>()],
        // Mostly available in the first lap (AVAIL, not USED).
        prop_oneof![
            3 => (0u16..8).prop_map(|f| f | P_AVAIL),
            1 => any::<u16>(),
        ],
    )
        .prop_map(|(addr, len, id, flags)| PD {
            addr,
            len,
            id,
            flags,
        })
}

/// Guest memory with a packed ring of `size` at 0, the driver's event
/// structure at 0x1000, request headers where buffers usually point.
fn packed_ring(
    descs: &[PD],
    size: u8,
    base: Option<u32>,
    event: u32,
    event_idx: bool,
    typ: u32,
) -> Vec<u8> {
    let mut m = vec![0u8; MEM_BYTES];
    m[SIZE_AT] = size - 1;
    m[EVENT_IDX_AT] = event_idx as u8;
    if let Some(b) = base {
        m[PACKED_BASE_AT - 1] = 1;
        m[PACKED_BASE_AT..PACKED_BASE_AT + 4].copy_from_slice(&b.to_le_bytes());
    }
    for (i, d) in descs.iter().enumerate().take(size as usize) {
        let o = i * 16;
        m[o..o + 8].copy_from_slice(&d.addr.to_le_bytes());
        m[o + 8..o + 12].copy_from_slice(&d.len.to_le_bytes());
        m[o + 12..o + 14].copy_from_slice(&d.id.to_le_bytes());
        m[o + 14..o + 16].copy_from_slice(&d.flags.to_le_bytes());
    }
    m[0x1000..0x1004].copy_from_slice(&event.to_le_bytes());
    for o in (0x3000..MEM_BYTES).step_by(0x1000) {
        m[o..o + 4].copy_from_slice(&typ.to_le_bytes());
    }
    // Indirect tables at 0x3000 hold descriptors too.
    for (i, d) in descs.iter().enumerate().take(8) {
        let o = 0x3100 + i * 16;
        m[o..o + 8].copy_from_slice(&d.addr.to_le_bytes());
        m[o + 8..o + 12].copy_from_slice(&d.len.to_le_bytes());
        m[o + 14..o + 16].copy_from_slice(&d.flags.to_le_bytes());
    }
    m
}

#[test]
fn packed_valid_read_accepted_and_hostile_ids_break_the_ring() {
    let d = |addr, len, id, flags| PD {
        addr,
        len,
        id,
        flags: flags | P_AVAIL,
    };
    // Header, data, status in three slots, buffer ID 2 on the last.
    let chain = [
        d(0x3000, 16, 2, NEXT),
        d(0x4000, 512, 2, NEXT | WRITE),
        d(0x5000, 1, 2, WRITE),
    ];
    let o = packed_chains(&packed_ring(&chain, 8, None, 0, false, 0));
    assert_eq!(
        o,
        Outcome {
            accepted: 1,
            ..Outcome::default()
        }
    );
    // The same chain then one with ID 2 again while 2 is in flight: the
    // first is taken, the ring breaks at the second.
    let mut twice = chain.to_vec();
    twice.extend(chain);
    let o = packed_chains(&packed_ring(&twice, 8, None, 0, false, 0));
    assert_eq!(o.accepted, 1, "{o:?}");
    // A buffer ID past the ring: nothing taken.
    let bad = [d(0x3000, 16, 8, NEXT), d(0x5000, 1, 8, WRITE)];
    let o = packed_chains(&packed_ring(&bad, 8, None, 0, false, 0));
    assert_eq!(o, Outcome::default());
}

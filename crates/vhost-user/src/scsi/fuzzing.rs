//! Entry point for the `vhost_scsi_chains` fuzz target (the same body runs
//! as a proptest on stable, tests/proptests.rs): the bytes are a guest's
//! memory holding a split ring a hostile driver wrote (the layout of
//! [`crate::fuzzing::ring_chains`]); every available chain is popped and
//! walked as the scsi queues do ([`Chain::fill`]), then read as a
//! command (header, LUN), as a control request, and answered (response or
//! event written through the writable stream). Every piece of an accepted
//! chain must lie in guest memory with the access it needs, and no answer
//! may be written past the writable stream.

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryMmap, Permissions};

use super::wire::{self, Chain, CmdResp, Event, CMD_REQ_LEN, CMD_RESP_LEN};
use crate::fuzzing::{EVENT_IDX_AT, MEM_BYTES, SIZE_AT};

/// What [`scsi_chains`] made of the chains it popped.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ScsiOutcome {
    /// Well-formed chains.
    pub chains: u32,
    /// Of those, commands with a header and room for a response.
    pub commands: u32,
    /// Refused chains (wrong order, outside memory, too long).
    pub refused: u32,
}

/// Pops and walks every chain a ring in `data` offers (see the module
/// comment); panics if an accepted piece leaves guest memory.
pub fn scsi_chains(data: &[u8]) -> ScsiOutcome {
    let mut out = ScsiOutcome::default();
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_BYTES)])
        .expect("harness memory");
    let n = data.len().min(MEM_BYTES);
    mem.write_slice(&data[..n], GuestAddress(0))
        .expect("harness write");
    let size = 1u16 << (data.get(SIZE_AT).copied().unwrap_or(8) % 9);
    let Ok(mut q) = Queue::new(256) else {
        return out;
    };
    q.set_size(size);
    q.set_desc_table_address(Some(0), Some(0));
    q.set_avail_ring_address(Some(0x1000), Some(0));
    q.set_used_ring_address(Some(0x2000), Some(0));
    q.set_event_idx(data.get(EVENT_IDX_AT).is_some_and(|b| b & 1 != 0));
    q.set_ready(true);
    if !q.is_valid(&mem) {
        return out;
    }
    let mut chain = Chain::default();
    for _ in 0..size {
        let Some(c) = q.pop_descriptor_chain(&mem) else {
            break;
        };
        let head = c.head_index();
        let descs = c.map(|d| (d.addr().0, d.len(), d.is_write_only()));
        let filled = chain.fill(head, descs, &mem);
        // Even a refused chain keeps only pieces inside guest memory.
        check(&mem, &chain);
        if filled.is_err() {
            out.refused += 1;
            let _ = q.add_used(&mem, head, 0);
            continue;
        }
        out.chains += 1;
        let mut len = 0;
        if let Some(h) = wire::cmd_header(&chain, &mem) {
            out.commands += 1;
            let _ = wire::decode_lun(&h.lun);
            let r = CmdResp::transport(wire::resp::BAD_TARGET).encode();
            assert_eq!(chain.write(&mem, 0, &r), r.len());
            // Data-in as the target core would move it: never past the
            // writable stream.
            let din = chain.wr_len - CMD_RESP_LEN;
            let moved = chain.write(&mem, CMD_RESP_LEN, &[0x5a; 4096]);
            assert!(moved as u64 <= din);
            let mut dout = [0u8; 4096];
            let got = chain.read(&mem, CMD_REQ_LEN, &mut dout);
            assert!(got as u64 <= chain.rd_len - CMD_REQ_LEN);
            len = CMD_RESP_LEN as u32 + moved as u32;
        }
        let _ = wire::ctrl_req(&chain, &mem);
        if chain.wr_len >= wire::EVENT_LEN {
            let ev = Event::added(head as u8 % 8).encode(head & 1 == 0);
            assert_eq!(chain.write(&mem, 0, &ev), ev.len());
        }
        let _ = q.add_used(&mem, head, len);
    }
    out
}

fn check<M: GuestMemory>(mem: &M, c: &Chain) {
    let (mut rd, mut wr) = (0u64, 0u64);
    for p in &c.rd {
        assert!(mem.check_range(p.addr, p.len as usize, Permissions::Read));
        rd += p.len as u64;
    }
    for p in &c.wr {
        assert!(mem.check_range(p.addr, p.len as usize, Permissions::Write));
        wr += p.len as u64;
    }
    assert_eq!((rd, wr), (c.rd_len, c.wr_len));
}

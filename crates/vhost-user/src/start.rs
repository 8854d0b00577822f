//! What the control thread hands a queue's task to run a ring
//! ([`VringStart`]): the ring's layout and base from the SET_VRING_*
//! messages, its eventfds, the memory map, the device and the stop flag.
//! A module of its own so the ring layer ([`crate::virtq`]) opens a ring
//! from it without importing the request loops that run one
//! ([`crate::vring`], [`crate::scsi`]).

use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{mpsc, Arc};

use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use crate::device::BlkDevice;
use crate::eventfd::CallFd;
use crate::inflight::QueueInflight;

/// Everything a queue needs to run, sent from the control thread (`D`:
/// the device the ring serves).
pub struct VringStart<D = BlkDevice> {
    pub index: u16,
    pub size: u16,
    /// Guest physical addresses of the three parts of the ring (packed:
    /// the descriptor ring, the driver's and the device's event
    /// suppression structures).
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    /// SET_VRING_BASE: a split ring's next available index; a packed
    /// ring's available and used slots with their wrap counters.
    pub base: u32,
    /// VIRTIO_F_RING_PACKED was negotiated.
    pub packed: bool,
    pub event_idx: bool,
    pub kick: Arc<File>,
    pub call: Arc<CallFd>,
    pub mem: GuestMemoryAtomic<GuestMemoryMmap>,
    /// Bumped after each change of `mem`'s map ([`crate::memory::MemTable::generation`]).
    pub mem_gen: Arc<AtomicU64>,
    pub dev: Arc<D>,
    pub stop: Arc<AtomicBool>,
    /// Where the task reports where it stopped once stopped
    /// ([`crate::virtq::Virtq::indices`]).
    pub done: mpsc::Sender<(u16, u16)>,
    /// This queue's part of the inflight region, when the frontend set one.
    pub inflight: Option<QueueInflight>,
}

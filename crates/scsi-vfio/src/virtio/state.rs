//! The driver state of one virtio-scsi device: device bring-up (status,
//! features, queues), command slots with their headers, responses and
//! bounce buffers in DMA memory, submission, and reaping of the used
//! rings. Everything here is synchronous; `lld` adds the async control
//! path on top.

use std::collections::VecDeque;

use ustor_scsi::lld::{DataDir, Nexus, QueueError, ScsiCmd, Tag, TransportError};
use ustor_scsi::ScsiStatus;
use ustor_vfio::{DmaMem, Vfio};

use super::pci::{self, Transport};
use super::vq::{layout, Seg, SplitQueue};
use super::wire::{self, CmdResp};
use super::VirtioError;
use crate::sg::{gather, scatter};
use crate::wake::Wake;

pub const CTRL_Q: usize = 0;
pub const EVENT_Q: usize = 1;
pub const REQ_Q: usize = 2;
const QUEUE_MAX: u16 = 256;
pub const SLOTS: usize = 64;
/// Per slot: request header at 0 (19 + cdb_size), response at 256.
const SLOT_BYTES: usize = 1024;
const RESP_OFF: usize = 256;
pub const BOUNCE: usize = 128 << 10;
pub const MAX_SG: usize = 64;
const EVENTS: usize = 8;
/// TMFs in flight at most: an abort the device cannot finish keeps its
/// buffers (the device owns them until it answers), and the LUN reset
/// that follows needs buffers of its own.
pub const TMF_SLOTS: usize = 4;
/// Per TMF slot: the request at 0, its 1-byte response at 32.
const TMF_BYTES: usize = 64;
/// Control area after the slots: the TMF slots, then the event buffers.
const CTRL_OFF: usize = SLOTS * SLOT_BYTES;
const EVENT_OFF: usize = CTRL_OFF + TMF_SLOTS * TMF_BYTES;
const AREA_BYTES: usize = EVENT_OFF + EVENTS * wire::EVENT_LEN;

/// The device configuration the driver uses (virtio-scsi config space).
#[derive(Clone, Copy, Debug, Default)]
pub struct DevCfg {
    pub seg_max: u32,
    pub max_sectors: u32,
    pub cmd_per_lun: u32,
    pub sense_size: usize,
    pub cdb_size: usize,
    pub max_target: u16,
    pub max_lun: u32,
    pub features: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    Free,
    /// A mid-layer command.
    Mid,
    /// A driver-internal command (scan); result kept in `done`.
    Internal,
    /// Aborted or reset away: freed silently when the device returns it.
    Forgotten,
}

#[derive(Clone, Copy, Debug)]
pub struct Slot {
    pub state: SlotState,
    pub tag: Tag,
    pub nexus: Nexus,
    dir: DataDir,
    iov: *const libc::iovec,
    iovcnt: usize,
    data_len: u32,
    bounced: bool,
    pub done: Option<CmdResp>,
}

const FREE_SLOT: Slot = Slot {
    state: SlotState::Free,
    tag: 0,
    nexus: Nexus {
        channel: 0,
        target: 0,
        lun: 0,
    },
    dir: DataDir::None,
    iov: std::ptr::null(),
    iovcnt: 0,
    data_len: 0,
    bounced: false,
    done: None,
};

/// One TMF slot's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TmfSlot {
    Free,
    /// Sent, not answered.
    Busy,
    /// Answered with this response code, not yet taken.
    Done(u8),
    /// Given up on (timed out) while the device still holds it: freed
    /// when the device answers, or by a device reset.
    Abandoned,
}

/// A completion copied out of DMA memory, so the mid-layer's callback runs
/// with no borrow of the driver held.
pub struct Finished {
    pub tag: Tag,
    pub status: Result<ScsiStatus, TransportError>,
    pub sense: [u8; 256],
    pub sense_len: usize,
    pub resid: u32,
}

/// A byte view of DMA memory we own.
///
/// # Safety
/// `off + len` within `mem`; the device must not be writing those bytes
/// (the slot is not in flight, or its completion was reaped).
unsafe fn bytes<'a>(mem: &DmaMem, off: usize, len: usize) -> &'a mut [u8] {
    debug_assert!(off + len <= mem.len);
    std::slice::from_raw_parts_mut(mem.ptr.add(off), len)
}

pub struct State {
    pub vfio: Vfio,
    pub tp: Transport,
    pub cfg: DevCfg,
    qmem: [DmaMem; 3],
    qsize: [u16; 3],
    pub queues: Vec<SplitQueue>,
    notify: [usize; 3],
    area: DmaMem,
    bounce: DmaMem,
    pub slots: Vec<Slot>,
    free: Vec<u16>,
    /// Descriptor head → command slot, event buffer, TMF slot (per queue:
    /// each queue numbers its descriptors from 0).
    head_slot: [Vec<u16>; 3],
    ready: VecDeque<u16>,
    failed: VecDeque<(Tag, TransportError)>,
    pub tmfs: [TmfSlot; TMF_SLOTS],
    pub events: u64,
    /// The interrupt that wakes a sleeping reactor, if any.
    pub wake: Option<Wake>,
    /// An event said targets or LUNs came or went (see `Lld::take_rescan`).
    pub rescan: bool,
    pub zero_copy: u64,
    /// Zero-copy commands whose data is in another reactor's pool.
    pub zero_copy_foreign: u64,
    pub bounced: u64,
    pub pool_mapped: usize,
    /// The owning reactor's buffer pool (address, length).
    pub own_pool: (usize, usize),
}

impl State {
    pub fn open(vfio: Vfio) -> Result<State, VirtioError> {
        vfio.enable_bus_master()?;
        let tp = Transport::open(&vfio)?;
        tp.reset()?;
        tp.add_status(pci::STATUS_ACK | pci::STATUS_DRIVER);
        if tp.num_queues() < 3 {
            return Err(VirtioError::Transport("fewer than 3 virtqueues".into()));
        }
        let mut qsize = [0u16; 3];
        let mut qmem = Vec::new();
        for (q, size) in qsize.iter_mut().enumerate() {
            *size = tp.queue_max(q as u16).min(QUEUE_MAX);
            if *size == 0 || !size.is_power_of_two() {
                return Err(VirtioError::Transport(format!(
                    "queue {q}: bad size {size}"
                )));
            }
            qmem.push(vfio.alloc_dma(layout(*size).2)?);
        }
        let area = vfio.alloc_dma(AREA_BYTES)?;
        let bounce = vfio.alloc_dma(SLOTS * BOUNCE)?;
        let wake = Wake::start(&vfio);
        let mut s = State {
            vfio,
            tp,
            cfg: DevCfg::default(),
            qmem: [qmem[0], qmem[1], qmem[2]],
            qsize,
            queues: Vec::new(),
            notify: [0; 3],
            area,
            bounce,
            slots: vec![FREE_SLOT; SLOTS],
            free: (0..SLOTS as u16).rev().collect(),
            head_slot: std::array::from_fn(|_| vec![0; QUEUE_MAX as usize]),
            ready: VecDeque::with_capacity(SLOTS),
            failed: VecDeque::new(),
            tmfs: [TmfSlot::Free; TMF_SLOTS],
            events: 0,
            wake,
            rescan: false,
            zero_copy: 0,
            zero_copy_foreign: 0,
            bounced: 0,
            pool_mapped: 0,
            own_pool: (0, 0),
        };
        s.bring_up(false)?;
        Ok(s)
    }

    /// Features, configuration and queues, then DRIVER_OK. `again`: after
    /// a reset, with the memory already allocated.
    pub fn bring_up(&mut self, again: bool) -> Result<(), VirtioError> {
        let tp = &self.tp;
        if again {
            tp.reset()?;
            tp.add_status(pci::STATUS_ACK | pci::STATUS_DRIVER);
        }
        let offered = tp.device_features();
        if offered == 0 || offered == u64::MAX {
            // Every virtio-scsi device offers some feature: this one does
            // not answer reads (gone, or its memory decoding is off).
            return Err(VirtioError::Transport(format!(
                "device does not respond (features read as {offered:#x})"
            )));
        }
        if offered & pci::F_VERSION_1 == 0 {
            return Err(VirtioError::Transport(
                "device lacks VIRTIO_F_VERSION_1".into(),
            ));
        }
        if offered & pci::F_ACCESS_PLATFORM == 0 {
            // Without it the device DMAs to guest-physical addresses,
            // bypassing the IOMMU and our IOVAs.
            return Err(VirtioError::Transport(
                "device bypasses the IOMMU (no VIRTIO_F_ACCESS_PLATFORM; QEMU: \
                 iommu_platform=on)"
                    .into(),
            ));
        }
        let features = pci::F_VERSION_1 | pci::F_ACCESS_PLATFORM | (offered & pci::F_SCSI_HOTPLUG);
        tp.set_features(features)?;
        self.cfg = DevCfg {
            seg_max: tp.device_cfg32(4),
            max_sectors: tp.device_cfg32(8),
            cmd_per_lun: tp.device_cfg32(12),
            sense_size: tp.device_cfg32(20) as usize,
            cdb_size: tp.device_cfg32(24) as usize,
            max_target: tp.device_cfg16(30),
            max_lun: tp.device_cfg32(32),
            features,
        };
        if self.cfg.cdb_size < 16 || self.cfg.cdb_size > 200 || self.cfg.sense_size > 512 {
            return Err(VirtioError::Transport(format!(
                "unsupported cdb_size {} / sense_size {}",
                self.cfg.cdb_size, self.cfg.sense_size
            )));
        }
        self.queues.clear();
        for q in 0..3 {
            let m = self.qmem[q];
            // SAFETY: the device is reset: no queue memory is in use.
            unsafe { bytes(&m, 0, m.len) }.fill(0);
            let vq = SplitQueue::new(m, self.qsize[q]);
            // Every queue interrupts through vector 0 where a sleeping
            // reactor needs waking (the rings are polled either way).
            let vector = self.wake.as_ref().map(|_| 0);
            let ring = [vq.desc_iova(), vq.avail_iova(), vq.used_iova()];
            let (off, took) = self.tp.setup_queue(q as u16, vq.size(), ring, vector);
            self.notify[q] = off;
            vq.set_interrupt(took);
            self.queues.push(vq);
        }
        for i in 0..EVENTS {
            self.post_event(i);
        }
        self.tp.add_status(pci::STATUS_DRIVER_OK);
        self.slots.fill(FREE_SLOT);
        self.free = (0..SLOTS as u16).rev().collect();
        self.ready.clear();
        self.failed.clear();
        // The reset took every TMF buffer back from the device.
        self.tmfs = [TmfSlot::Free; TMF_SLOTS];
        Ok(())
    }

    fn post_event(&mut self, i: usize) {
        let seg = Seg {
            iova: self.area.iova_at(EVENT_OFF + i * wire::EVENT_LEN),
            len: wire::EVENT_LEN as u32,
            write: true,
        };
        if let Some(h) = self.queues[EVENT_Q].push(&[seg]) {
            self.head_slot[EVENT_Q][h as usize] = i as u16;
            self.tp.notify(self.notify[EVENT_Q], EVENT_Q as u16);
        }
    }

    fn resp_len(&self) -> usize {
        12 + self.cfg.sense_size
    }

    /// Starts a command in slot `si` (taken from the free list by the
    /// caller). Data: zero-copy when every segment is DMA-mapped.
    fn start(&mut self, si: u16, cmd: &ScsiCmd, state: SlotState) -> Result<(), QueueError> {
        let s = si as usize;
        // SAFETY: slot `si` is free: the device holds none of its bytes.
        let hdr = unsafe { bytes(&self.area, s * SLOT_BYTES, RESP_OFF) };
        let hlen = wire::encode_cmd(
            hdr,
            cmd.nexus,
            si as u64,
            cmd.cdb.as_bytes(),
            self.cfg.cdb_size,
        );
        let mut segs = [Seg {
            iova: 0,
            len: 0,
            write: false,
        }; MAX_SG + 2];
        segs[0] = Seg {
            iova: self.area.iova_at(s * SLOT_BYTES),
            len: hlen as u32,
            write: false,
        };
        let resp = Seg {
            iova: self.area.iova_at(s * SLOT_BYTES + RESP_OFF),
            len: self.resp_len() as u32,
            write: true,
        };
        let write = cmd.dir == DataDir::FromDevice;
        let mut data = [resp; MAX_SG];
        let mut nd = 0;
        let mut bounced = false;
        // SAFETY: the mid-layer keeps the iovecs alive until completion.
        let iovs = unsafe { cmd.iovecs() };
        if cmd.dir != DataDir::None && cmd.data_len > 0 {
            for v in iovs.iter().filter(|v| v.iov_len > 0) {
                let iova = self.vfio.iova_of(v.iov_base as *const u8, v.iov_len);
                match iova {
                    Some(iova) if nd < MAX_SG => {
                        data[nd] = Seg {
                            iova,
                            len: v.iov_len as u32,
                            write,
                        };
                        nd += 1;
                    }
                    _ => {
                        bounced = true;
                        break;
                    }
                }
            }
            // No iovecs at all: a driver-internal command, data in the bounce.
            bounced |= nd == 0;
            if bounced {
                if cmd.data_len as usize > BOUNCE {
                    self.failed
                        .push_back((cmd.tag, TransportError::Protocol("transfer too long")));
                    return Ok(());
                }
                if cmd.dir == DataDir::ToDevice {
                    // SAFETY: slot `si`'s bounce buffer, not in flight.
                    let b = unsafe { bytes(&self.bounce, s * BOUNCE, cmd.data_len as usize) };
                    gather(iovs, b);
                }
                data[0] = Seg {
                    iova: self.bounce.iova_at(s * BOUNCE),
                    len: cmd.data_len,
                    write,
                };
                nd = 1;
            }
        }
        let mut n = 1;
        let order: [&[Seg]; 2] = if write {
            [std::slice::from_ref(&resp), &data[..nd]]
        } else {
            [&data[..nd], std::slice::from_ref(&resp)]
        };
        for part in order {
            for seg in part {
                segs[n] = *seg;
                n += 1;
            }
        }
        let head = self.queues[REQ_Q]
            .push(&segs[..n])
            .ok_or(QueueError::HostBusy)?;
        self.head_slot[REQ_Q][head as usize] = si;
        self.slots[s] = Slot {
            state,
            tag: cmd.tag,
            nexus: cmd.nexus,
            dir: cmd.dir,
            iov: cmd.iov,
            iovcnt: cmd.iovcnt,
            data_len: cmd.data_len,
            bounced,
            done: None,
        };
        if bounced {
            self.bounced += 1;
        } else if nd > 0 {
            self.zero_copy += 1;
            if iovs
                .first()
                .is_some_and(|v| crate::foreign(self.own_pool, v.iov_base as usize))
            {
                self.zero_copy_foreign += 1;
            }
        }
        self.tp.notify(self.notify[REQ_Q], REQ_Q as u16);
        Ok(())
    }

    /// Queues a command in a free slot.
    pub fn submit(&mut self, cmd: &ScsiCmd, state: SlotState) -> Result<u16, QueueError> {
        let si = self.free.pop().ok_or(QueueError::HostBusy)?;
        match self.start(si, cmd, state) {
            Ok(()) if self.slots[si as usize].state == SlotState::Free => {
                // Failed before the device saw it: reported via `failed`.
                self.free.push(si);
                Ok(si)
            }
            Ok(()) => Ok(si),
            Err(e) => {
                self.free.push(si);
                Err(e)
            }
        }
    }

    fn release(&mut self, si: u16) {
        self.slots[si as usize] = FREE_SLOT;
        self.free.push(si);
    }

    /// Moves every used entry of the three queues to where it belongs.
    pub fn reap(&mut self) {
        while let Some((head, _)) = self.queues[REQ_Q].pop() {
            let si = self.head_slot[REQ_Q][head as usize];
            let s = si as usize;
            match self.slots[s].state {
                SlotState::Mid => self.ready.push_back(si),
                SlotState::Internal => {
                    // SAFETY: the device returned this slot's buffers.
                    let r =
                        unsafe { bytes(&self.area, s * SLOT_BYTES + RESP_OFF, self.resp_len()) };
                    self.slots[s].done = Some(wire::decode_resp(r));
                }
                SlotState::Forgotten => self.release(si),
                SlotState::Free => {}
            }
        }
        while let Some((head, _)) = self.queues[CTRL_Q].pop() {
            let k = self.head_slot[CTRL_Q][head as usize] as usize % TMF_SLOTS;
            // SAFETY: the TMF response byte, returned by the device.
            let code = unsafe { bytes(&self.area, CTRL_OFF + k * TMF_BYTES + 32, 1) }[0];
            self.tmfs[k] = match self.tmfs[k] {
                TmfSlot::Busy => TmfSlot::Done(code),
                _ => TmfSlot::Free,
            };
        }
        while let Some((head, _)) = self.queues[EVENT_Q].pop() {
            self.events += 1;
            let i = self.head_slot[EVENT_Q][head as usize] as usize % EVENTS;
            // SAFETY: the event buffer the device returned; we post it
            // again only below.
            let ev = unsafe { bytes(&self.area, EVENT_OFF + i * wire::EVENT_LEN, wire::EVENT_LEN) };
            if wire::event_wants_rescan(ev) {
                self.rescan = true;
            }
            self.post_event(i);
        }
    }

    /// The next finished mid-layer command, its slot released.
    pub fn take_ready(&mut self) -> Option<Finished> {
        if let Some((tag, e)) = self.failed.pop_front() {
            return Some(Finished {
                tag,
                status: Err(e),
                sense: [0; 256],
                sense_len: 0,
                resid: 0,
            });
        }
        let si = self.ready.pop_front()?;
        let s = si as usize;
        let slot = self.slots[s];
        // SAFETY: the device returned this slot's buffers.
        let r = unsafe { bytes(&self.area, s * SLOT_BYTES + RESP_OFF, self.resp_len()) };
        let resp = wire::decode_resp(r);
        let mut f = Finished {
            tag: slot.tag,
            status: wire::outcome(&resp),
            sense: [0; 256],
            sense_len: resp.sense_len.min(256),
            resid: resp.resid.min(slot.data_len),
        };
        f.sense[..f.sense_len].copy_from_slice(&r[12..12 + f.sense_len]);
        if slot.bounced && slot.dir == DataDir::FromDevice && resp.response == wire::S_OK {
            let n = (slot.data_len - f.resid) as usize;
            // SAFETY: returned by the device; the iovecs are alive until
            // the mid-layer hears of this completion, which is after this.
            let (b, iovs) = unsafe {
                (
                    bytes(&self.bounce, s * BOUNCE, n),
                    std::slice::from_raw_parts(slot.iov, slot.iovcnt),
                )
            };
            scatter(b, iovs);
        }
        self.release(si);
        Some(f)
    }

    /// Data-in of a finished internal command (from its bounce buffer).
    pub fn internal_data(&mut self, si: u16, len: usize) -> Vec<u8> {
        // SAFETY: the device returned this slot; len <= BOUNCE by caller.
        let v = unsafe { bytes(&self.bounce, si as usize * BOUNCE, len.min(BOUNCE)) }.to_vec();
        self.release(si);
        v
    }

    /// Drops a command the mid-layer no longer waits for (aborted or reset
    /// away); its slot is reused once the device gives it back.
    pub fn forget(&mut self, si: u16) {
        if let Some(p) = self.ready.iter().position(|&x| x == si) {
            self.ready.remove(p);
            self.release(si);
        } else if self.slots[si as usize].state != SlotState::Free {
            self.slots[si as usize].state = SlotState::Forgotten;
        }
    }

    /// Sends one TMF on the control queue in a free TMF slot; `None` if
    /// every slot is still held by the device (or the queue is full).
    pub fn send_tmf(&mut self, subtype: u32, nexus: Nexus, tag: u64) -> Option<usize> {
        let k = self.tmfs.iter().position(|t| *t == TmfSlot::Free)?;
        let off = CTRL_OFF + k * TMF_BYTES;
        // SAFETY: a free TMF slot's buffers: the device holds none of them.
        wire::encode_tmf(unsafe { bytes(&self.area, off, 33) }, subtype, nexus, tag);
        let segs = [
            Seg {
                iova: self.area.iova_at(off),
                len: wire::TMF_REQ_LEN as u32,
                write: false,
            },
            Seg {
                iova: self.area.iova_at(off + 32),
                len: 1,
                write: true,
            },
        ];
        let head = self.queues[CTRL_Q].push(&segs)?;
        self.head_slot[CTRL_Q][head as usize] = k as u16;
        self.tmfs[k] = TmfSlot::Busy;
        self.tp.notify(self.notify[CTRL_Q], CTRL_Q as u16);
        Some(k)
    }

    /// TMF slot `k`'s response code once the device answered (the slot is
    /// then free again).
    pub fn take_tmf(&mut self, k: usize) -> Option<u8> {
        match self.tmfs[k] {
            TmfSlot::Done(code) => {
                self.tmfs[k] = TmfSlot::Free;
                Some(code)
            }
            _ => None,
        }
    }

    /// Gives up waiting for TMF slot `k`: it stays out of use until the
    /// device answers it (or is reset).
    pub fn abandon_tmf(&mut self, k: usize) {
        self.tmfs[k] = match self.tmfs[k] {
            TmfSlot::Busy => TmfSlot::Abandoned,
            _ => TmfSlot::Free,
        };
    }
}

//! The modern virtio PCI transport (virtio 1.x, section 4.1): finds the
//! common, notify and device configuration structures through the
//! vendor-specific PCI capabilities, and drives status, features and
//! queue setup through the common configuration. Legacy I/O-port
//! virtio is not supported (QEMU: `disable-legacy=on` or a PCIe slot).

use ustor_vfio::{Bar, Vfio};

use super::VirtioError;

const CAP_VNDR: u8 = 0x09;
const CFG_COMMON: u8 = 1;
const CFG_NOTIFY: u8 = 2;
const CFG_DEVICE: u8 = 4;

// Common configuration offsets.
const DEVICE_FEATURE_SELECT: usize = 0;
const DEVICE_FEATURE: usize = 4;
const DRIVER_FEATURE_SELECT: usize = 8;
const DRIVER_FEATURE: usize = 12;
const MSIX_CONFIG: usize = 16;
const NUM_QUEUES: usize = 18;
const DEVICE_STATUS: usize = 20;
const QUEUE_SELECT: usize = 22;
const QUEUE_SIZE: usize = 24;
const QUEUE_MSIX_VECTOR: usize = 26;
const QUEUE_ENABLE: usize = 28;
const QUEUE_NOTIFY_OFF: usize = 30;
const QUEUE_DESC: usize = 32;
const QUEUE_DRIVER: usize = 40;
const QUEUE_DEVICE: usize = 48;
const NO_VECTOR: u16 = 0xffff;

pub const STATUS_ACK: u8 = 1;
pub const STATUS_DRIVER: u8 = 2;
pub const STATUS_DRIVER_OK: u8 = 4;
pub const STATUS_FEATURES_OK: u8 = 8;
pub const STATUS_FAILED: u8 = 128;

pub const F_VERSION_1: u64 = 1 << 32;
/// virtio-scsi: the device reports hot-plug and hot-unplug on the event
/// queue.
pub const F_SCSI_HOTPLUG: u64 = 1 << 1;
pub const F_ACCESS_PLATFORM: u64 = 1 << 33;

#[derive(Clone, Copy, Debug)]
struct Loc {
    bar: usize,
    off: usize,
    len: usize,
}

/// The mapped BARs and where each structure lives in them.
pub struct Transport {
    bars: Vec<Option<Bar>>,
    common: Loc,
    notify: Loc,
    notify_mult: u32,
    device: Loc,
}

impl Transport {
    pub fn open(vfio: &Vfio) -> Result<Transport, VirtioError> {
        let mut common = None;
        let mut notify = None;
        let mut device = None;
        let mut notify_mult = 0;
        for (at, id) in vfio.capabilities()? {
            if id != CAP_VNDR {
                continue;
            }
            let at = at as u64;
            let cfg_type = vfio.config_read8(at + 3)?;
            let loc = Loc {
                bar: vfio.config_read8(at + 4)? as usize,
                off: vfio.config_read32(at + 8)? as usize,
                len: vfio.config_read32(at + 12)? as usize,
            };
            match cfg_type {
                CFG_COMMON if common.is_none() => common = Some(loc),
                CFG_NOTIFY if notify.is_none() => {
                    notify = Some(loc);
                    notify_mult = vfio.config_read32(at + 16)?;
                }
                CFG_DEVICE if device.is_none() => device = Some(loc),
                _ => {}
            }
        }
        let (Some(common), Some(notify), Some(device)) = (common, notify, device) else {
            return Err(VirtioError::Transport(
                "no modern virtio PCI capabilities (a legacy-only device?)".into(),
            ));
        };
        let mut bars: Vec<Option<Bar>> = (0..6).map(|_| None).collect();
        for loc in [common, notify, device] {
            if loc.bar > 5 {
                return Err(VirtioError::Transport(format!(
                    "capability in BAR {}",
                    loc.bar
                )));
            }
            if bars[loc.bar].is_none() {
                bars[loc.bar] = Some(vfio.bar(loc.bar as u32)?);
            }
            let len = bars[loc.bar].as_ref().map_or(0, |b| b.len());
            if loc.off.saturating_add(loc.len) > len || (loc.bar == common.bar && common.len < 56) {
                return Err(VirtioError::Transport("capability outside its BAR".into()));
            }
        }
        Ok(Transport {
            bars,
            common,
            notify,
            notify_mult,
            device,
        })
    }

    fn bar(&self, l: Loc) -> &Bar {
        // `open` mapped every BAR a location names.
        self.bars[l.bar].as_ref().expect("mapped in open")
    }

    fn c8(&self, off: usize) -> u8 {
        self.bar(self.common).read8(self.common.off + off)
    }
    fn c16(&self, off: usize) -> u16 {
        self.bar(self.common).read16(self.common.off + off)
    }
    fn c32(&self, off: usize) -> u32 {
        self.bar(self.common).read32(self.common.off + off)
    }
    fn w8(&self, off: usize, v: u8) {
        self.bar(self.common).write8(self.common.off + off, v)
    }
    fn w16(&self, off: usize, v: u16) {
        self.bar(self.common).write16(self.common.off + off, v)
    }
    fn w32(&self, off: usize, v: u32) {
        self.bar(self.common).write32(self.common.off + off, v)
    }
    fn w64(&self, off: usize, v: u64) {
        self.w32(off, v as u32);
        self.w32(off + 4, (v >> 32) as u32);
    }

    /// A 32-bit field of the device-specific configuration.
    pub fn device_cfg32(&self, off: usize) -> u32 {
        if off + 4 > self.device.len {
            return 0;
        }
        self.bar(self.device).read32(self.device.off + off)
    }

    pub fn device_cfg16(&self, off: usize) -> u16 {
        if off + 2 > self.device.len {
            return 0;
        }
        self.bar(self.device).read16(self.device.off + off)
    }

    pub fn status(&self) -> u8 {
        self.c8(DEVICE_STATUS)
    }

    pub fn add_status(&self, bits: u8) {
        self.w8(DEVICE_STATUS, self.status() | bits);
    }

    /// Resets the device and waits (bounded) until it reads back 0.
    pub fn reset(&self) -> Result<(), VirtioError> {
        self.w8(DEVICE_STATUS, 0);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while self.status() != 0 {
            if self.status() == 0xff {
                // A device that is gone reads as all-ones.
                return Err(VirtioError::Transport(
                    "device does not respond (status reads 0xff)".into(),
                ));
            }
            if std::time::Instant::now() > deadline {
                return Err(VirtioError::Transport("device did not reset".into()));
            }
            std::hint::spin_loop();
        }
        self.w16(MSIX_CONFIG, NO_VECTOR);
        Ok(())
    }

    pub fn device_features(&self) -> u64 {
        self.w32(DEVICE_FEATURE_SELECT, 0);
        let lo = self.c32(DEVICE_FEATURE) as u64;
        self.w32(DEVICE_FEATURE_SELECT, 1);
        let hi = self.c32(DEVICE_FEATURE) as u64;
        lo | hi << 32
    }

    /// Writes the driver features and checks the device took them.
    pub fn set_features(&self, f: u64) -> Result<(), VirtioError> {
        self.w32(DRIVER_FEATURE_SELECT, 0);
        self.w32(DRIVER_FEATURE, f as u32);
        self.w32(DRIVER_FEATURE_SELECT, 1);
        self.w32(DRIVER_FEATURE, (f >> 32) as u32);
        self.add_status(STATUS_FEATURES_OK);
        if self.status() & STATUS_FEATURES_OK == 0 {
            self.add_status(STATUS_FAILED);
            return Err(VirtioError::Transport("device refused our features".into()));
        }
        Ok(())
    }

    pub fn num_queues(&self) -> u16 {
        self.c16(NUM_QUEUES)
    }

    /// The device's maximum size of queue `q` (0: no such queue).
    pub fn queue_max(&self, q: u16) -> u16 {
        self.w16(QUEUE_SELECT, q);
        self.c16(QUEUE_SIZE)
    }

    /// Programs and enables queue `q` (rings at desc, avail, used; MSI-X
    /// `vector` or none); returns its notify offset in the notify BAR and
    /// whether the device took the vector.
    pub fn setup_queue(
        &self,
        q: u16,
        size: u16,
        ring: [u64; 3],
        vector: Option<u16>,
    ) -> (usize, bool) {
        let [desc, avail, used] = ring;
        self.w16(QUEUE_SELECT, q);
        self.w16(QUEUE_SIZE, size);
        let v = vector.unwrap_or(NO_VECTOR);
        self.w16(QUEUE_MSIX_VECTOR, v);
        // The device answers NO_VECTOR where it cannot take the vector.
        let took = vector.is_some() && self.c16(QUEUE_MSIX_VECTOR) == v;
        self.w64(QUEUE_DESC, desc);
        self.w64(QUEUE_DRIVER, avail);
        self.w64(QUEUE_DEVICE, used);
        let off = self.c16(QUEUE_NOTIFY_OFF) as usize * self.notify_mult as usize;
        self.w16(QUEUE_ENABLE, 1);
        (off, took)
    }

    /// Rings queue `q`'s doorbell.
    pub fn notify(&self, notify_off: usize, q: u16) {
        if notify_off + 2 <= self.notify.len {
            self.bar(self.notify)
                .write16(self.notify.off + notify_off, q);
        }
    }
}

//! One PCI function opened through VFIO: its container (TYPE1v2 IOMMU),
//! group and device fd; config space, BARs, reset, and DMA mappings.

use std::ffi::CString;
use std::fs::OpenOptions;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crate::dma::{IovaSpace, Mapping};
use crate::sysfs::{group_of, PciId};
use crate::uapi::*;
use crate::{DmaMem, Result, VfioError};

const PCI_COMMAND: u64 = 4;
const CMD_IO: u16 = 1 << 0;
const CMD_MEMORY: u16 = 1 << 1;
const CMD_BUS_MASTER: u16 = 1 << 2;
const CMD_INTX_DISABLE: u16 = 1 << 10;

fn ioctl_ptr<T>(fd: RawFd, req: libc::c_ulong, arg: &mut T, what: &str) -> Result<i32> {
    // SAFETY: every request used with this helper takes a pointer to the
    // uapi struct `T` (argsz set by the caller), valid for the call.
    let r = unsafe { libc::ioctl(fd, req as _, arg as *mut T) };
    if r < 0 {
        Err(VfioError::sys(what))
    } else {
        Ok(r)
    }
}

fn ioctl_val(fd: RawFd, req: libc::c_ulong, arg: libc::c_ulong, what: &str) -> Result<i32> {
    // SAFETY: these requests take an integer argument, not a pointer.
    let r = unsafe { libc::ioctl(fd, req as _, arg) };
    if r < 0 {
        Err(VfioError::sys(what))
    } else {
        Ok(r)
    }
}

fn open_rw(path: &str) -> Result<OwnedFd> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map(OwnedFd::from)
        .map_err(|e| VfioError::Sys {
            what: format!("open {path}"),
            source: e,
        })
}

/// A PCI device owned by this process through vfio-pci. `!Send`: it lives
/// on the reactor of the driver that opened it.
pub struct Vfio {
    bdf: String,
    group_no: u32,
    // Field order is drop order: the device goes before its group, the
    // group before the container.
    device: OwnedFd,
    _group: OwnedFd,
    container: OwnedFd,
    regions: Vec<RegionInfo>,
    flags: u32,
    iova: IovaSpace,
}

impl Vfio {
    /// Opens `bdf` (e.g. `0000:00:04.0`), which must be bound to vfio-pci
    /// with its IOMMU group to itself.
    pub fn open(bdf: &str) -> Result<Vfio> {
        let (group_no, group_path) = group_of(bdf)?;
        let container = open_rw("/dev/vfio/vfio")?;
        let cfd = container.as_raw_fd();
        if ioctl_val(cfd, VFIO_GET_API_VERSION, 0, "VFIO_GET_API_VERSION")? != VFIO_API_VERSION {
            return Err(VfioError::Unsupported("unknown VFIO API version".into()));
        }
        if ioctl_val(
            cfd,
            VFIO_CHECK_EXTENSION,
            VFIO_TYPE1V2_IOMMU,
            "VFIO_CHECK_EXTENSION",
        )? != 1
        {
            return Err(VfioError::Unsupported(
                "the kernel's VFIO has no TYPE1v2 IOMMU (load vfio_iommu_type1)".into(),
            ));
        }
        let group = open_rw(&group_path.to_string_lossy())?;
        let gfd = group.as_raw_fd();
        let mut st = GroupStatus {
            argsz: 8,
            ..Default::default()
        };
        ioctl_ptr(gfd, VFIO_GROUP_GET_STATUS, &mut st, "VFIO_GROUP_GET_STATUS")?;
        if st.flags & VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(VfioError::GroupShared {
                bdf: bdf.into(),
                group: group_no,
                others: "devices".into(),
            });
        }
        let mut c = cfd;
        ioctl_ptr(
            gfd,
            VFIO_GROUP_SET_CONTAINER,
            &mut c,
            "VFIO_GROUP_SET_CONTAINER",
        )?;
        ioctl_val(cfd, VFIO_SET_IOMMU, VFIO_TYPE1V2_IOMMU, "VFIO_SET_IOMMU")?;
        let limit = iova_limit(cfd);
        let name = CString::new(bdf).map_err(|_| VfioError::NoDevice(bdf.into()))?;
        // SAFETY: GET_DEVICE_FD takes a NUL-terminated name, valid here.
        let dfd = unsafe { libc::ioctl(gfd, VFIO_GROUP_GET_DEVICE_FD as _, name.as_ptr()) };
        if dfd < 0 {
            return Err(VfioError::sys(format!("VFIO_GROUP_GET_DEVICE_FD {bdf}")));
        }
        // SAFETY: a new fd the kernel just gave us, owned by nobody else.
        let device = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(dfd) };
        let mut info = DeviceInfo {
            argsz: 16,
            ..Default::default()
        };
        ioctl_ptr(dfd, VFIO_DEVICE_GET_INFO, &mut info, "VFIO_DEVICE_GET_INFO")?;
        if info.flags & VFIO_DEVICE_FLAGS_PCI == 0 {
            return Err(VfioError::Unsupported(format!("{bdf} is not a PCI device")));
        }
        let mut regions = Vec::new();
        for index in 0..info.num_regions.min(VFIO_PCI_NUM_REGIONS) {
            let mut r = RegionInfo {
                argsz: 32,
                index,
                ..Default::default()
            };
            // A region the device lacks answers EINVAL: keep it empty.
            if ioctl_ptr(dfd, VFIO_DEVICE_GET_REGION_INFO, &mut r, "region").is_err() {
                r.size = 0;
            }
            regions.push(r);
        }
        Ok(Vfio {
            bdf: bdf.to_string(),
            group_no,
            device,
            _group: group,
            container,
            regions,
            flags: info.flags,
            iova: IovaSpace::new(limit),
        })
    }

    pub fn bdf(&self) -> &str {
        &self.bdf
    }

    pub fn group(&self) -> u32 {
        self.group_no
    }

    fn region(&self, index: u32) -> Result<RegionInfo> {
        self.regions
            .get(index as usize)
            .copied()
            .filter(|r| r.size > 0)
            .ok_or_else(|| VfioError::Unsupported(format!("{}: no region {index}", self.bdf)))
    }

    /// Reads `buf.len()` bytes of region `index` at `off` (config space,
    /// I/O-port BARs).
    pub fn region_read(&self, index: u32, off: u64, buf: &mut [u8]) -> Result<()> {
        let r = self.region(index)?;
        // SAFETY: pread into a buffer we own exclusively, of its length.
        let n = unsafe {
            libc::pread(
                self.device.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                (r.offset + off) as libc::off_t,
            )
        };
        if n != buf.len() as isize {
            return Err(VfioError::sys(format!("{}: read region {index}", self.bdf)));
        }
        Ok(())
    }

    /// Writes `buf` to region `index` at `off`.
    pub fn region_write(&self, index: u32, off: u64, buf: &[u8]) -> Result<()> {
        let r = self.region(index)?;
        // SAFETY: pwrite from a buffer valid for its length.
        let n = unsafe {
            libc::pwrite(
                self.device.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                (r.offset + off) as libc::off_t,
            )
        };
        if n != buf.len() as isize {
            return Err(VfioError::sys(format!(
                "{}: write region {index}",
                self.bdf
            )));
        }
        Ok(())
    }

    pub fn config_read8(&self, off: u64) -> Result<u8> {
        let mut b = [0u8; 1];
        self.region_read(VFIO_PCI_CONFIG_REGION_INDEX, off, &mut b)?;
        Ok(b[0])
    }

    pub fn config_read16(&self, off: u64) -> Result<u16> {
        let mut b = [0u8; 2];
        self.region_read(VFIO_PCI_CONFIG_REGION_INDEX, off, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    pub fn config_read32(&self, off: u64) -> Result<u32> {
        let mut b = [0u8; 4];
        self.region_read(VFIO_PCI_CONFIG_REGION_INDEX, off, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    pub fn config_write16(&self, off: u64, v: u16) -> Result<()> {
        self.region_write(VFIO_PCI_CONFIG_REGION_INDEX, off, &v.to_le_bytes())
    }

    /// Vendor and device ID from config space.
    pub fn id(&self) -> Result<PciId> {
        Ok(PciId {
            vendor: self.config_read16(0)?,
            device: self.config_read16(2)?,
        })
    }

    /// Turns on memory and I/O decoding and bus mastering, and INTx off
    /// (completions are polled).
    pub fn enable_bus_master(&self) -> Result<()> {
        let cmd = self.config_read16(PCI_COMMAND)?;
        let want = cmd | CMD_IO | CMD_MEMORY | CMD_BUS_MASTER | CMD_INTX_DISABLE;
        self.config_write16(PCI_COMMAND, want)
    }

    /// Stops the device's DMA (bus mastering off).
    pub fn disable_bus_master(&self) -> Result<()> {
        let cmd = self.config_read16(PCI_COMMAND)?;
        self.config_write16(PCI_COMMAND, cmd & !CMD_BUS_MASTER)
    }

    /// The PCI capabilities list: (offset, capability ID).
    pub fn capabilities(&self) -> Result<Vec<(u8, u8)>> {
        let mut out = Vec::new();
        if self.config_read16(6)? & (1 << 4) == 0 {
            return Ok(out);
        }
        let mut at = self.config_read8(0x34)? & 0xfc;
        // A malformed list could loop: 48 capabilities fill config space.
        while at >= 0x40 && out.len() < 48 {
            let id = self.config_read8(at as u64)?;
            out.push((at, id));
            at = self.config_read8(at as u64 + 1)? & 0xfc;
        }
        Ok(out)
    }

    /// Routes vector 0 of the device's MSI-X (MSI where it has none) to a
    /// new non-blocking eventfd: each interrupt then bumps its counter, so
    /// a reactor can sleep until the device has something. Returns the fd
    /// and `"msix"` or `"msi"`. The interrupt stays routed until the device
    /// fd is closed.
    pub fn irq_eventfd(&self) -> Result<(OwnedFd, &'static str)> {
        let dfd = self.device.as_raw_fd();
        let kinds = [
            (VFIO_PCI_MSIX_IRQ_INDEX, "msix"),
            (VFIO_PCI_MSI_IRQ_INDEX, "msi"),
        ];
        for (index, kind) in kinds {
            let mut info = IrqInfo {
                argsz: 16,
                index,
                ..Default::default()
            };
            let ok = ioctl_ptr(dfd, VFIO_DEVICE_GET_IRQ_INFO, &mut info, "irq info").is_ok();
            if !ok || info.count == 0 {
                continue;
            }
            // SAFETY: plain eventfd(2); the result is checked.
            let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
            if fd < 0 {
                return Err(VfioError::sys("eventfd"));
            }
            // SAFETY: a new fd the kernel just gave us, owned by nobody else.
            let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            let mut set = IrqSetEventfd {
                argsz: 24,
                flags: VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
                index,
                start: 0,
                count: 1,
                fd: fd.as_raw_fd(),
            };
            ioctl_ptr(dfd, VFIO_DEVICE_SET_IRQS, &mut set, "VFIO_DEVICE_SET_IRQS")?;
            return Ok((fd, kind));
        }
        Err(VfioError::Unsupported(format!(
            "{}: no MSI-X or MSI interrupt",
            self.bdf
        )))
    }

    /// Function-level reset, when vfio-pci offers one for this device.
    pub fn reset(&self) -> Result<bool> {
        if self.flags & VFIO_DEVICE_FLAGS_RESET == 0 {
            return Ok(false);
        }
        ioctl_val(
            self.device.as_raw_fd(),
            VFIO_DEVICE_RESET,
            0,
            "VFIO_DEVICE_RESET",
        )?;
        Ok(true)
    }

    /// Maps memory BAR `index` into the process.
    pub fn bar(&self, index: u32) -> Result<Bar> {
        let r = self.region(index)?;
        if index > 5 || r.flags & VFIO_REGION_INFO_FLAG_MMAP == 0 {
            return Err(VfioError::Unsupported(format!(
                "{}: BAR {index} cannot be mapped (an I/O-port BAR: use region_read/write)",
                self.bdf
            )));
        }
        // SAFETY: a shared mapping of the device fd at the offset and size
        // VFIO reported for this BAR; checked for MAP_FAILED below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                r.size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.device.as_raw_fd(),
                r.offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(VfioError::sys(format!("{}: mmap BAR {index}", self.bdf)));
        }
        Ok(Bar {
            ptr: p.cast(),
            len: r.size as usize,
        })
    }

    fn map_dma(&self, vaddr: usize, len: usize, owned: bool) -> Result<u64> {
        let iova = self.iova.reserve(len)?;
        let mut m = DmaMap {
            argsz: 32,
            flags: VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE,
            vaddr: vaddr as u64,
            iova,
            size: len as u64,
        };
        let fd = self.container.as_raw_fd();
        ioctl_ptr(fd, VFIO_IOMMU_MAP_DMA, &mut m, "VFIO_IOMMU_MAP_DMA")?;
        self.iova.maps.borrow_mut().push(Mapping {
            vaddr,
            len,
            iova,
            owned,
        });
        Ok(iova)
    }

    /// Allocates `len` zeroed bytes (rounded up to pages) mapped for DMA.
    pub fn alloc_dma(&self, len: usize) -> Result<DmaMem> {
        let len = len.div_ceil(4096).max(1) * 4096;
        // SAFETY: an anonymous private mapping, checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(VfioError::sys("mmap DMA memory"));
        }
        match self.map_dma(p as usize, len, true) {
            Ok(iova) => Ok(DmaMem {
                ptr: p.cast(),
                len,
                iova,
            }),
            Err(e) => {
                // SAFETY: the mapping we just made, not handed out.
                unsafe { libc::munmap(p, len) };
                Err(e)
            }
        }
    }

    /// Maps memory this process owns elsewhere (a reactor's buffer pool)
    /// for DMA; it must outlive this `Vfio`. Page-aligned `ptr` and `len`.
    pub fn map_external(&self, ptr: *mut u8, len: usize) -> Result<u64> {
        if !(ptr as usize).is_multiple_of(4096) || !len.is_multiple_of(4096) || len == 0 {
            return Err(VfioError::Unsupported(
                "DMA mappings must be page aligned".into(),
            ));
        }
        self.map_dma(ptr as usize, len, false)
    }

    /// The IOVA of `[addr, addr+len)` when it lies in one DMA mapping:
    /// arithmetic over a short list, no syscall.
    pub fn iova_of(&self, addr: *const u8, len: usize) -> Option<u64> {
        self.iova.translate(addr as usize, len)
    }
}

impl Drop for Vfio {
    fn drop(&mut self) {
        let _ = self.disable_bus_master();
        let maps = std::mem::take(&mut *self.iova.maps.borrow_mut());
        for m in maps {
            let mut u = DmaUnmap {
                argsz: 24,
                flags: 0,
                iova: m.iova,
                size: m.len as u64,
            };
            let _ = ioctl_ptr(
                self.container.as_raw_fd(),
                VFIO_IOMMU_UNMAP_DMA,
                &mut u,
                "unmap",
            );
            if m.owned {
                // SAFETY: our own anonymous mapping; the device no longer
                // reaches it (bus mastering off, IOMMU mapping removed).
                unsafe { libc::munmap(m.vaddr as *mut libc::c_void, m.len) };
            }
        }
    }
}

/// The top of the IOVA space from VFIO_IOMMU_GET_INFO's IOVA-range
/// capability (the IOMMU's address width); 2^39 when not reported.
fn iova_limit(cfd: RawFd) -> u64 {
    const DEFAULT: u64 = 1 << 39;
    let mut buf = [0u64; 64];
    let hdr = IommuType1Info {
        argsz: std::mem::size_of_val(&buf) as u32,
        ..Default::default()
    };
    // SAFETY: IommuType1Info is plain data no larger than `buf`.
    unsafe { std::ptr::write(buf.as_mut_ptr().cast::<IommuType1Info>(), hdr) };
    // SAFETY: GET_INFO writes at most argsz (= size of buf) bytes into buf.
    let r = unsafe { libc::ioctl(cfd, VFIO_IOMMU_GET_INFO as _, buf.as_mut_ptr()) };
    if r < 0 {
        return DEFAULT;
    }
    let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).collect();
    parse_iova_limit(&bytes).unwrap_or(DEFAULT)
}

/// Walks the capability chain of a `vfio_iommu_type1_info` reply for the
/// IOVA-range capability; returns the end of the range holding our base.
fn parse_iova_limit(b: &[u8]) -> Option<u64> {
    let u32_at = |o: usize| Some(u32::from_ne_bytes(b.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_ne_bytes(b.get(o..o + 8)?.try_into().ok()?));
    if u32_at(4)? & VFIO_IOMMU_INFO_CAPS == 0 {
        return None;
    }
    let mut at = u32_at(16)? as usize;
    for _ in 0..16 {
        if at == 0 {
            return None;
        }
        let id = u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?);
        if id == VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE {
            let n = u32_at(at + 8)? as usize;
            for i in 0..n.min(64) {
                let (s, e) = (u64_at(at + 16 + i * 16)?, u64_at(at + 24 + i * 16)?);
                if s <= crate::dma::IOVA_BASE && crate::dma::IOVA_BASE < e {
                    return Some(e.saturating_add(1));
                }
            }
            return None;
        }
        at = u32_at(at + 4)? as usize;
    }
    None
}

/// A memory BAR mapped into the process. Accessors are volatile and
/// bounds-checked: an access past the end reads as all-ones and writes
/// nothing, as a PCI master abort would.
pub struct Bar {
    ptr: *mut u8,
    len: usize,
}

macro_rules! bar_rw {
    ($read:ident, $write:ident, $t:ty) => {
        pub fn $read(&self, off: usize) -> $t {
            if off % std::mem::size_of::<$t>() != 0
                || off.saturating_add(std::mem::size_of::<$t>()) > self.len
            {
                return <$t>::MAX;
            }
            // SAFETY: in bounds and aligned (checked above) of a mapping
            // that lives as long as `self`.
            unsafe { std::ptr::read_volatile(self.ptr.add(off).cast::<$t>()) }
        }

        pub fn $write(&self, off: usize, v: $t) {
            if off % std::mem::size_of::<$t>() != 0
                || off.saturating_add(std::mem::size_of::<$t>()) > self.len
            {
                return;
            }
            // SAFETY: in bounds and aligned (checked above).
            unsafe { std::ptr::write_volatile(self.ptr.add(off).cast::<$t>(), v) }
        }
    };
}

impl Bar {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    bar_rw!(read8, write8, u8);
    bar_rw!(read16, write16, u16);
    bar_rw!(read32, write32, u32);
}

impl Drop for Bar {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `Vfio::bar`, not used after this.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_iova_range_capability_gives_the_limit() {
        let mut b = vec![0u8; 96];
        b[4..8].copy_from_slice(&VFIO_IOMMU_INFO_CAPS.to_ne_bytes());
        b[16..20].copy_from_slice(&24u32.to_ne_bytes());
        b[24..26].copy_from_slice(&1u16.to_ne_bytes());
        b[32..36].copy_from_slice(&2u32.to_ne_bytes());
        // [0, 0xfedfffff], [0xfef00000, 2^39-1]
        b[40..48].copy_from_slice(&0u64.to_ne_bytes());
        b[48..56].copy_from_slice(&0xfedf_ffffu64.to_ne_bytes());
        b[56..64].copy_from_slice(&0xfef0_0000u64.to_ne_bytes());
        b[64..72].copy_from_slice(&((1u64 << 39) - 1).to_ne_bytes());
        assert_eq!(parse_iova_limit(&b), Some(0xfee0_0000));
        // Truncated or capability-less replies fall back.
        assert_eq!(parse_iova_limit(&b[..40]), None);
        assert_eq!(parse_iova_limit(&[0u8; 24]), None);
        let mut lp = b.clone();
        lp[28..32].copy_from_slice(&24u32.to_ne_bytes()); // next = itself
        lp[24..26].copy_from_slice(&9u16.to_ne_bytes());
        assert_eq!(parse_iova_limit(&lp), None);
    }
}

//! The kernel's VFIO uapi (`<linux/vfio.h>`): ioctl numbers and the
//! argument structs this crate uses, with their sizes checked at compile
//! time. Numbers are `_IO(';', 100 + n)`.

const fn io(nr: libc::c_ulong) -> libc::c_ulong {
    ((b';' as libc::c_ulong) << 8) | (100 + nr)
}

pub const VFIO_API_VERSION: i32 = 0;
pub const VFIO_TYPE1V2_IOMMU: libc::c_ulong = 3;

pub const VFIO_GET_API_VERSION: libc::c_ulong = io(0);
pub const VFIO_CHECK_EXTENSION: libc::c_ulong = io(1);
pub const VFIO_SET_IOMMU: libc::c_ulong = io(2);
pub const VFIO_GROUP_GET_STATUS: libc::c_ulong = io(3);
pub const VFIO_GROUP_SET_CONTAINER: libc::c_ulong = io(4);
pub const VFIO_GROUP_GET_DEVICE_FD: libc::c_ulong = io(6);
pub const VFIO_DEVICE_GET_INFO: libc::c_ulong = io(7);
pub const VFIO_DEVICE_GET_REGION_INFO: libc::c_ulong = io(8);
pub const VFIO_DEVICE_GET_IRQ_INFO: libc::c_ulong = io(9);
pub const VFIO_DEVICE_SET_IRQS: libc::c_ulong = io(10);
pub const VFIO_DEVICE_RESET: libc::c_ulong = io(11);
pub const VFIO_IOMMU_GET_INFO: libc::c_ulong = io(12);
pub const VFIO_IOMMU_MAP_DMA: libc::c_ulong = io(13);
pub const VFIO_IOMMU_UNMAP_DMA: libc::c_ulong = io(14);

pub const VFIO_GROUP_FLAGS_VIABLE: u32 = 1;
pub const VFIO_DEVICE_FLAGS_RESET: u32 = 1;
pub const VFIO_DEVICE_FLAGS_PCI: u32 = 2;
pub const VFIO_REGION_INFO_FLAG_READ: u32 = 1;
pub const VFIO_REGION_INFO_FLAG_WRITE: u32 = 2;
pub const VFIO_REGION_INFO_FLAG_MMAP: u32 = 4;
pub const VFIO_DMA_MAP_FLAG_READ: u32 = 1;
pub const VFIO_DMA_MAP_FLAG_WRITE: u32 = 2;
pub const VFIO_IOMMU_INFO_CAPS: u32 = 2;
pub const VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE: u16 = 1;

/// PCI region indexes of a vfio-pci device: BAR0..BAR5, ROM, config.
pub const VFIO_PCI_CONFIG_REGION_INDEX: u32 = 7;
pub const VFIO_PCI_NUM_REGIONS: u32 = 9;
/// Interrupt indexes of a vfio-pci device: INTx, MSI, MSI-X.
pub const VFIO_PCI_MSI_IRQ_INDEX: u32 = 1;
pub const VFIO_PCI_MSIX_IRQ_INDEX: u32 = 2;
pub const VFIO_IRQ_SET_DATA_EVENTFD: u32 = 1 << 2;
pub const VFIO_IRQ_SET_ACTION_TRIGGER: u32 = 1 << 5;

#[repr(C)]
#[derive(Default)]
pub struct GroupStatus {
    pub argsz: u32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Default)]
pub struct DeviceInfo {
    pub argsz: u32,
    pub flags: u32,
    pub num_regions: u32,
    pub num_irqs: u32,
}

#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
pub struct RegionInfo {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub cap_offset: u32,
    pub size: u64,
    pub offset: u64,
}

#[repr(C)]
#[derive(Default)]
pub struct IommuType1Info {
    pub argsz: u32,
    pub flags: u32,
    pub iova_pgsizes: u64,
    pub cap_offset: u32,
    pub pad: u32,
}

#[repr(C)]
#[derive(Default)]
pub struct DmaMap {
    pub argsz: u32,
    pub flags: u32,
    pub vaddr: u64,
    pub iova: u64,
    pub size: u64,
}

#[repr(C)]
#[derive(Default)]
pub struct DmaUnmap {
    pub argsz: u32,
    pub flags: u32,
    pub iova: u64,
    pub size: u64,
}

#[repr(C)]
#[derive(Default)]
pub struct IrqInfo {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub count: u32,
}

/// `struct vfio_irq_set` with one eventfd as its data.
#[repr(C)]
#[derive(Default)]
pub struct IrqSetEventfd {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub start: u32,
    pub count: u32,
    pub fd: i32,
}

const _: () = assert!(std::mem::size_of::<GroupStatus>() == 8);
const _: () = assert!(std::mem::size_of::<IrqInfo>() == 16);
const _: () = assert!(std::mem::size_of::<IrqSetEventfd>() == 24);
const _: () = assert!(std::mem::size_of::<DeviceInfo>() == 16);
const _: () = assert!(std::mem::size_of::<RegionInfo>() == 32);
const _: () = assert!(std::mem::size_of::<IommuType1Info>() == 24);
const _: () = assert!(std::mem::size_of::<DmaMap>() == 32);
const _: () = assert!(std::mem::size_of::<DmaUnmap>() == 24);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_header() {
        assert_eq!(VFIO_GET_API_VERSION, 0x3b64);
        assert_eq!(VFIO_SET_IOMMU, 0x3b66);
        assert_eq!(VFIO_GROUP_GET_DEVICE_FD, 0x3b6a);
        assert_eq!(VFIO_DEVICE_GET_REGION_INFO, 0x3b6c);
        assert_eq!(VFIO_DEVICE_GET_IRQ_INFO, 0x3b6d);
        assert_eq!(VFIO_DEVICE_SET_IRQS, 0x3b6e);
        assert_eq!(VFIO_IOMMU_MAP_DMA, 0x3b71);
        assert_eq!(VFIO_IOMMU_UNMAP_DMA, 0x3b72);
    }
}

//! The sysfs side of VFIO: is a PCI device bound to vfio-pci, which IOMMU
//! group it is in, and who else is in that group. Checked before any
//! ioctl, so a misconfigured device gets a sentence saying how to fix it.

use std::fs;
use std::path::{Path, PathBuf};

use crate::{Result, VfioError};

const PCI_DEVICES: &str = "/sys/bus/pci/devices";

/// Vendor and device ID of a PCI function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PciId {
    pub vendor: u16,
    pub device: u16,
}

/// The shell commands that hand `bdf` to vfio-pci.
pub fn bind_hint(bdf: &str) -> String {
    format!(
        "modprobe vfio-pci; echo vfio-pci > {PCI_DEVICES}/{bdf}/driver_override; \
         echo {bdf} > {PCI_DEVICES}/{bdf}/driver/unbind (if bound); \
         echo {bdf} > /sys/bus/pci/drivers_probe"
    )
}

fn driver_of(dev: &Path) -> Option<String> {
    let link = fs::read_link(dev.join("driver")).ok()?;
    Some(link.file_name()?.to_string_lossy().into_owned())
}

/// A PCI address is `DDDD:BB:DD.F`; anything else could walk sysfs.
fn valid_bdf(bdf: &str) -> bool {
    let b = bdf.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && b.iter()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// Checks that `bdf` exists, is bound to vfio-pci and that every other
/// device of its IOMMU group is too (or is a bridge with no driver);
/// returns the group's /dev/vfio path.
pub(crate) fn group_of(bdf: &str) -> Result<(u32, PathBuf)> {
    let dev = Path::new(PCI_DEVICES).join(bdf);
    if !valid_bdf(bdf) || !dev.exists() {
        return Err(VfioError::NoDevice(bdf.to_string()));
    }
    match driver_of(&dev) {
        Some(d) if d == "vfio-pci" => {}
        d => {
            return Err(VfioError::NotBound {
                bdf: bdf.to_string(),
                driver: d.unwrap_or_else(|| "no driver".into()),
                hint: bind_hint(bdf),
            })
        }
    }
    let group: u32 = fs::read_link(dev.join("iommu_group"))
        .ok()
        .and_then(|l| l.file_name()?.to_str()?.parse().ok())
        .ok_or_else(|| VfioError::NoGroup(bdf.to_string()))?;
    let members = Path::new("/sys/kernel/iommu_groups")
        .join(group.to_string())
        .join("devices");
    let mut others = Vec::new();
    for e in fs::read_dir(&members).map_err(|e| VfioError::Sys {
        what: format!("read {}", members.display()),
        source: e,
    })? {
        let Ok(e) = e else { continue };
        let name = e.file_name().to_string_lossy().into_owned();
        match driver_of(&e.path()) {
            Some(d) if d == "vfio-pci" || d == "pcieport" => {}
            None => {}
            Some(d) => others.push(format!("{name} ({d})")),
        }
    }
    if !others.is_empty() {
        return Err(VfioError::GroupShared {
            bdf: bdf.to_string(),
            group,
            others: others.join(", "),
        });
    }
    Ok((group, PathBuf::from(format!("/dev/vfio/{group}"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_checked_before_sysfs_is_touched() {
        assert!(valid_bdf("0000:00:04.0"));
        assert!(!valid_bdf("00:04.0"));
        assert!(!valid_bdf("../../../etc"));
        assert!(!valid_bdf("0000:00:04.0/x"));
        assert!(matches!(
            group_of("0000:ff:1f.7"),
            Err(VfioError::NoDevice(_))
        ));
        assert!(matches!(group_of("../x"), Err(VfioError::NoDevice(_))));
    }

    #[test]
    fn the_hint_names_the_device() {
        let h = bind_hint("0000:00:04.0");
        assert!(h.contains("0000:00:04.0/driver_override"));
        assert!(h.contains("drivers_probe"));
    }
}

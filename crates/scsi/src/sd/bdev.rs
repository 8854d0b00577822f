//! SCSI bdevs: user-defined mappings of a named bdev onto a range of a
//! SCSI disk (`{"name": "custom", "device": "sda", "offset": "1G", "size":
//! "400G"}`). Several per device, overlaps refused. Bdev I/O becomes
//! READ/WRITE(10/16), SYNCHRONIZE CACHE, UNMAP or WRITE SAME(16) by the
//! device's block limits; the generic bdev layer splits data I/O to the
//! device's (and host's) maximum transfer.
//!
//! A channel on the host's reactor puts I/O straight into the host's
//! preallocated command slots (no lock, allocation or copy); a channel on
//! any other reactor forwards it there and back (`crate::sd::forward`).

use std::rc::Rc;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use ustor_bdev::{Bdev, BdevChannel, BdevError, BdevInfo, IoHandle, IoType};

use crate::lun::Hctl;
use crate::mid::host::{BdevIo, IoCaps, Pending};
use crate::mid::{local_host, Device, DeviceState, MapRecord, ScsiError, ScsiStack, StackShared};
use crate::sd::forward::{RemoteChannel, Target};

/// A size as bytes or text with a binary unit (`"400G"`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum Size {
    Bytes(u64),
    Text(String),
}

impl Size {
    fn bytes(&self, param: &'static str) -> Result<u64, ScsiError> {
        match self {
            Size::Bytes(b) => Ok(*b),
            Size::Text(t) => ustor_bdev::parse_size(t).ok_or_else(|| ScsiError::Invalid {
                param,
                why: format!("`{t}` is not a size"),
            }),
        }
    }
}

/// `bdev_scsi_create` parameters.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ScsiBdevOpts {
    pub name: String,
    /// H:C:T:L, device name (`sda`), serial, or VPD 0x83 id.
    pub device: String,
    /// Start on the device (bytes or `"1G"`); default 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<Size>,
    /// Length (bytes or `"400G"`); default: the rest of the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<Size>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<uuid::Uuid>,
}

/// `bdev_scsi_delete` parameters.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ScsiBdevDelete {
    pub name: String,
}

struct ScsiBdev {
    info: BdevInfo,
    opts: ScsiBdevOpts,
    stack: u64,
    host: u32,
    reactor: usize,
    hctl: Hctl,
    base_lba: u64,
    caps: IoCaps,
    /// Most iovec segments per command (the host's limit).
    max_sg: usize,
    rt: ustor_runtime::RuntimeHandle,
}

struct ScsiChannel {
    host: Rc<crate::mid::Host>,
    dev: Rc<Device>,
    base_lba: u64,
    caps: IoCaps,
    max_sg: usize,
}

impl BdevChannel for ScsiChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        if d.iovcnt > self.max_sg {
            io.complete(Err(BdevError::TooManySegments(d.iovcnt)));
            return;
        }
        if matches!(self.dev.state(), DeviceState::Removed) {
            io.complete(Err(BdevError::Removed));
            return;
        }
        self.host.submit_bdev(Pending {
            desc: d,
            io: BdevIo::Local(io),
            dev: self.dev.clone(),
            base_lba: self.base_lba,
            caps: self.caps,
        });
    }
}

impl Bdev for ScsiBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }

    fn io_type_supported(&self, t: IoType) -> bool {
        match t {
            IoType::Read | IoType::Write | IoType::Flush | IoType::Reset => true,
            IoType::Unmap => self.caps.max_unmap_blocks > 0,
            IoType::WriteZeroes => self.caps.max_write_same_blocks > 0,
            // COMPARE AND WRITE is not sent to disks yet.
            IoType::CompareAndWrite => false,
        }
    }

    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        // On the host's reactor the channel feeds the host's command slots
        // directly; elsewhere it forwards each I/O there (crate::forward).
        if ustor_runtime::reactor_id() != self.reactor {
            let ch = RemoteChannel::new(
                self.rt.clone(),
                Target {
                    stack: self.stack,
                    host: self.host,
                    host_reactor: self.reactor,
                    hctl: self.hctl,
                    base_lba: self.base_lba,
                    caps: self.caps,
                },
                self.max_sg,
            )?;
            return Ok(Box::new(ch));
        }
        let host = local_host(self.stack, self.host).ok_or(BdevError::Removed)?;
        let dev = host.device(&self.hctl).ok_or(BdevError::Removed)?;
        let max_sg = host.limits.max_sg_entries.max(1) as usize;
        Ok(Box::new(ScsiChannel {
            host,
            dev,
            base_lba: self.base_lba,
            caps: self.caps,
            max_sg,
        }))
    }

    fn config_json(&self) -> Value {
        json!({"method": "bdev_scsi_create", "params": self.opts})
    }

    fn driver_info(&self) -> Value {
        json!({"scsi": {
            "device": self.opts.device,
            "hctl": self.hctl.to_string(),
            "offset_blocks": self.base_lba,
            "max_unmap_blocks": self.caps.max_unmap_blocks,
            "max_write_same_blocks": self.caps.max_write_same_blocks,
        }})
    }
}

/// `bdev_scsi_create`: maps a bdev onto a device range; returns its name.
pub fn create(stack: &ScsiStack, mut opts: ScsiBdevOpts) -> Result<String, ScsiError> {
    let d = stack.find_device(&opts.device)?;
    if d.driver != Some("sd") || d.state != DeviceState::Running || d.block_size == 0 {
        return Err(ScsiError::Invalid {
            param: "device",
            why: format!("{} is not a running disk", opts.device),
        });
    }
    let bs = d.block_size as u64;
    let cap = d.num_blocks * bs;
    let offset = opts.offset.as_ref().map_or(Ok(0), |s| s.bytes("offset"))?;
    let size = match &opts.size {
        Some(s) => s.bytes("size")?,
        None => cap.saturating_sub(offset),
    };
    let bad = |param, why: String| Err(ScsiError::Invalid { param, why });
    if offset % bs != 0 || size % bs != 0 {
        return bad(
            "size",
            format!("offset and size must be multiples of the {bs}-byte block"),
        );
    }
    if size == 0 || offset.checked_add(size).is_none_or(|e| e > cap) {
        return bad(
            "size",
            format!("{offset}+{size} does not fit the device's {cap} bytes"),
        );
    }
    let hctl = Hctl {
        host: d.host,
        channel: d.channel,
        target: d.target,
        lun: d.lun,
    };
    let (start, n) = (offset / bs, size / bs);
    let shared: &Arc<StackShared> = &stack.shared;
    {
        let g = shared.lock();
        if let Some(m) = g.maps.iter().find(|m| {
            m.hctl == hctl && m.offset_blocks < start + n && start < m.offset_blocks + m.num_blocks
        }) {
            return bad("offset", format!("overlaps SCSI bdev {}", m.bdev));
        }
    }
    let host = stack
        .hosts()
        .into_iter()
        .find(|h| h.host == d.host)
        .ok_or(ScsiError::NoHost(d.host))?;
    let lim = d.block_limits.unwrap_or_default();
    let mut max_xfer = (host.limits.max_transfer_bytes as u64 / bs).max(1);
    if lim.max_xfer_blocks > 0 {
        max_xfer = max_xfer.min(lim.max_xfer_blocks as u64);
    }
    let caps = IoCaps {
        block_size: d.block_size,
        max_unmap_blocks: if d.thin_provisioned
            && lim.max_unmap_blocks > 0
            && lim.max_unmap_descriptors > 0
        {
            lim.max_unmap_blocks as u64
        } else {
            0
        },
        max_write_same_blocks: lim.max_write_same_blocks.min(u32::MAX as u64),
    };
    let uuid = *opts.uuid.get_or_insert_with(uuid::Uuid::new_v4);
    let info = BdevInfo {
        name: opts.name.clone(),
        uuid,
        product_name: format!("SCSI disk {} {}", d.vendor, d.product)
            .trim()
            .to_string(),
        module: "scsi",
        block_size: d.block_size,
        num_blocks: n,
        required_alignment: host.limits.dma_alignment.max(1),
        max_transfer_blocks: max_xfer.min(u32::MAX as u64) as u32,
        optimal_boundary_blocks: 0,
        write_cache: true,
        // What the disk promises (LBPRZ), and only where we unmap at all.
        unmap_reads_zero: d.unmap_reads_zero && caps.max_unmap_blocks > 0,
        memory_resident: false,
    };
    let name = opts.name.clone();
    let bdev = ScsiBdev {
        info,
        opts,
        stack: shared.id,
        host: d.host,
        reactor: host.reactor,
        hctl,
        base_lba: start,
        caps,
        max_sg: host.limits.max_sg_entries.max(1) as usize,
        rt: shared.rt.clone(),
    };
    {
        // Check-and-insert under one lock so two creates cannot overlap.
        let mut g = shared.lock();
        if g.maps.iter().any(|m| {
            m.hctl == hctl && m.offset_blocks < start + n && start < m.offset_blocks + m.num_blocks
        }) {
            return bad("offset", "overlaps another SCSI bdev".into());
        }
        g.maps.push(MapRecord {
            bdev: name.clone(),
            device: d.name.clone(),
            hctl,
            offset_blocks: start,
            num_blocks: n,
        });
    }
    if let Err(e) = shared.bdevs.register(Arc::new(bdev)) {
        shared.lock().maps.retain(|m| m.bdev != name);
        return Err(e.into());
    }
    Ok(name)
}

/// `bdev_scsi_delete`.
pub fn delete(stack: &ScsiStack, name: &str) -> Result<(), ScsiError> {
    let known = stack.shared.lock().maps.iter().any(|m| m.bdev == name);
    if !known {
        return Err(ScsiError::NoDevice(name.to_string()));
    }
    stack.shared.bdevs.delete(name)?;
    stack.shared.lock().maps.retain(|m| m.bdev != name);
    Ok(())
}

/// Every SCSI bdev mapping.
pub fn list(stack: &ScsiStack) -> Vec<MapRecord> {
    stack.shared.lock().maps.clone()
}

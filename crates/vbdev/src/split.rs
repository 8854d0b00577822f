//! The split bdev (`bdev_split_create` / `bdev_split_delete`): a base cut
//! into `split_count` equal parts named `{base}p{i}`, each I/O one child
//! at the part's offset on the base. The parts share one descriptor of
//! the base, claimed exclusively for all of them.

use std::sync::{Arc, Weak};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use ustor_bdev::modules::parse_params;
use ustor_bdev::{
    Bdev, BdevChannel, BdevEntry, BdevError, BdevEvent, BdevInfo, BdevModule, ControlError, Desc,
    IoChannel, IoHandle, IoType, Registry,
};

use crate::base;

/// `bdev_split_create`'s parameters (SPDK's names).
#[derive(Deserialize, Serialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct SplitParams {
    pub base_bdev: String,
    pub split_count: u32,
    /// Size of each part; 0 or absent: the base divided evenly.
    #[serde(default)]
    pub split_size_mb: u64,
}

struct SplitPart {
    info: BdevInfo,
    base: Arc<[Desc; 1]>,
    offset: u64,
    /// Part 0 carries the config call for all of them.
    params: Option<SplitParams>,
}

struct SplitChannel {
    base: IoChannel,
    offset: u64,
}

impl BdevChannel for SplitChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        let off = if d.kind == IoType::Reset {
            0
        } else {
            d.offset_blocks + self.offset
        };
        // A part's I/O is one piece of its base: the base takes it itself.
        io.forward(&self.base, off);
    }
}

impl Bdev for SplitPart {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, t: IoType) -> bool {
        base::all_support(&self.base[..], t)
    }
    fn fua_supported(&self, t: IoType) -> bool {
        base::all_fua(&self.base[..], t)
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        Ok(Box::new(SplitChannel {
            base: self.base[0].channel()?,
            offset: self.offset,
        }))
    }
    fn config_json(&self) -> Value {
        match &self.params {
            Some(p) => json!({"method": "bdev_split_create", "params": p}),
            None => Value::Null,
        }
    }
    fn driver_info(&self) -> Value {
        json!({"split": {"base_bdev": self.base[0].name(), "offset_blocks": self.offset}})
    }
}

fn part_name(base: &str, i: u32) -> String {
    format!("{base}p{i}")
}

/// Creates the parts; returns their names. Nothing is created when a
/// parameter is bad or a part's name is taken.
pub fn create(
    reg: &Registry,
    weak: &Weak<Registry>,
    p: SplitParams,
) -> Result<Vec<String>, ControlError> {
    if p.split_count == 0 {
        return Err(ControlError::invalid("split_count", "must be at least 1"));
    }
    let names: Vec<String> = (0..p.split_count)
        .map(|i| part_name(&p.base_bdev, i))
        .collect();
    for n in &names {
        base::check_free(reg, n)?;
    }
    let (w, parts, base) = (weak.clone(), names.clone(), p.base_bdev.clone());
    let d = reg.open(&p.base_bdev, true, move |ev| match ev {
        BdevEvent::Remove => {
            if let Some(r) = w.upgrade() {
                for n in &parts {
                    let _ = r.hot_remove(n);
                }
            }
        }
        // The parts' layout is fixed at creation: they keep their sizes.
        BdevEvent::Resize => tracing::warn!(
            base = %base,
            "split base bdev resized; its parts keep their sizes"
        ),
    })?;
    d.claim_exclusive(&format!("split ({}p*)", p.base_bdev))?;
    let bi = d.info().clone();
    let blocks = if p.split_size_mb == 0 {
        bi.num_blocks / p.split_count as u64
    } else {
        let b = (p.split_size_mb << 20) / bi.block_size as u64;
        if b * p.split_count as u64 > bi.num_blocks {
            return Err(ControlError::invalid(
                "split_size_mb",
                format!(
                    "{} parts of {} MiB exceed `{}` ({} bytes)",
                    p.split_count,
                    p.split_size_mb,
                    p.base_bdev,
                    bi.size_bytes()
                ),
            ));
        }
        b
    };
    if blocks == 0 {
        return Err(ControlError::invalid("split_count", "parts would be empty"));
    }
    let base = Arc::new([d]);
    for (i, n) in names.iter().enumerate() {
        // Stable across restarts (save_config, then load): from the base's.
        let uuid = uuid::Uuid::from_u128(
            bi.uuid.as_u128()
                ^ (i as u128 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835),
        );
        let info = base::info(n, Some(uuid), "Split Disk", "split", &base[..], blocks)?;
        let part = SplitPart {
            info,
            base: base.clone(),
            offset: i as u64 * blocks,
            params: (i == 0).then(|| p.clone()),
        };
        if let Err(e) = reg.register(Arc::new(part)) {
            for n in &names[..i] {
                let _ = reg.delete(n);
            }
            return Err(e);
        }
    }
    Ok(names)
}

/// `bdev_split_delete`: deletes every part of `base_bdev` (refused, and
/// nothing deleted, while any part is claimed).
pub fn delete(reg: &Registry, base_bdev: &str) -> Result<(), ControlError> {
    let parts: Vec<String> = (0..)
        .map(|i| part_name(base_bdev, i))
        .take_while(|n| reg.get(n).is_some_and(|e| e.info().module == "split"))
        .collect();
    if parts.is_empty() {
        return Err(ControlError::NotFound(format!("split of {base_bdev}")));
    }
    for n in &parts {
        if let Some(by) = reg.get(n).and_then(|e| e.claimed_by()) {
            return Err(ControlError::Claimed {
                name: n.clone(),
                by,
            });
        }
    }
    for n in &parts {
        reg.delete(n)?;
    }
    Ok(())
}

/// The split module. Its RPC methods are not the plain create/delete by
/// name (create returns every part; delete takes the base), so the binary
/// registers them itself.
pub struct SplitModule(pub Weak<Registry>);

impl BdevModule for SplitModule {
    fn name(&self) -> &'static str {
        "split"
    }
    fn create_method(&self) -> Option<String> {
        None
    }
    fn delete_method(&self) -> Option<String> {
        None
    }
    fn create(&self, reg: &Registry, params: Value) -> Result<Arc<BdevEntry>, ControlError> {
        let names = create(reg, &self.0, parse_params(params)?)?;
        reg.get(&names[0])
            .ok_or_else(|| ControlError::NotFound(names[0].clone()))
    }
}

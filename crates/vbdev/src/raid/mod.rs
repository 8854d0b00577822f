//! The raid module (`bdev_raid_create` / `bdev_raid_delete`, SPDK's names
//! and parameters): raid1 ([`mirror`]), raid0 and concat arrays over claimed members, sized
//! as SPDK sizes them (each member used up to a whole number of strips;
//! raid0 uses the smallest member's size on every member). The data path
//! is in [`map`]. An array's facts (`bdev_raid_get_bdevs`) are its
//! `driver_specific.raid` in `bdev_get_bdevs`. An array grows when its
//! members do (RBD images resized, say): a concat by the new whole strips
//! of its last member (appended), a raid0 once every member has gained a
//! whole strip (each member's new strips continue the same strip map, so
//! nothing moves), a raid1 ([`mirror`]) to its smallest member. A shrink,
//! or a concat's other member resized, leaves the array's size as it is.

pub mod map;
mod membership;
pub mod mirror;
pub mod sb;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use serde::Deserialize;
use serde_json::{json, Value};
use ustor_bdev::modules::parse_params;
use ustor_bdev::{
    Bdev, BdevChannel, BdevEntry, BdevError, BdevInfo, BdevModule, ControlError, Desc, IoType,
    Registry,
};

use crate::base;
use map::{ConcatChannel, Raid0Channel};

/// The array layouts this module builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Raid0,
    Concat,
    Raid1,
}

impl Level {
    fn parse(s: &str) -> Result<Level, ControlError> {
        match s {
            "raid0" | "0" => Ok(Level::Raid0),
            "concat" => Ok(Level::Concat),
            "raid1" | "1" => Ok(Level::Raid1),
            _ => Err(ControlError::invalid(
                "raid_level",
                format!("`{s}` is not supported (raid0, concat, raid1)"),
            )),
        }
    }
    fn name(self) -> &'static str {
        match self {
            Level::Raid0 => "raid0",
            Level::Concat => "concat",
            Level::Raid1 => "raid1",
        }
    }
}

/// SPDK's client sends `base_bdevs` as a list; older ones as one string
/// of names separated by spaces.
#[derive(Deserialize)]
#[serde(untagged)]
enum BaseList {
    List(Vec<String>),
    Words(String),
}

/// `bdev_raid_create`'s parameters.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RaidParams {
    name: String,
    raid_level: String,
    base_bdevs: BaseList,
    #[serde(default)]
    strip_size_kb: u32,
    /// The old name of `strip_size_kb`.
    #[serde(default)]
    strip_size: u32,
    uuid: Option<uuid::Uuid>,
    #[serde(default)]
    superblock: bool,
}

/// A checked raid configuration.
#[derive(Clone, Debug)]
pub struct RaidConfig {
    pub name: String,
    pub level: Level,
    pub members: Vec<String>,
    pub strip_size_kb: u32,
    pub uuid: Option<uuid::Uuid>,
    /// Members carry a superblock (`superblock: true`); `Some` when the
    /// array is assembled from the one found on them (not written again).
    pub superblock: bool,
    pub existing: Option<sb::Superblock>,
}

impl RaidConfig {
    fn from_params(p: RaidParams) -> Result<RaidConfig, ControlError> {
        let level = Level::parse(&p.raid_level)?;
        let members = match p.base_bdevs {
            BaseList::List(v) => v,
            BaseList::Words(s) => s.split_whitespace().map(String::from).collect(),
        };
        if members.is_empty() {
            return Err(ControlError::invalid("base_bdevs", "no members"));
        }
        base::check_distinct(&members)?;
        let strip = if p.strip_size_kb != 0 {
            p.strip_size_kb
        } else {
            p.strip_size
        };
        if level == Level::Raid1 {
            if strip != 0 {
                return Err(ControlError::invalid(
                    "strip_size_kb",
                    "raid1 has no strips (0 or absent)",
                ));
            }
        } else if !strip.is_power_of_two() {
            return Err(ControlError::invalid(
                "strip_size_kb",
                format!("{strip} is not a power of two"),
            ));
        }
        Ok(RaidConfig {
            name: p.name,
            level,
            members,
            strip_size_kb: strip,
            uuid: p.uuid,
            superblock: p.superblock,
            existing: None,
        })
    }
}

struct RaidBdev {
    info: BdevInfo,
    cfg: RaidConfig,
    members: Box<[Desc]>,
    /// Blocks of each member the array uses (they grow with the members).
    used: Box<[AtomicU64]>,
    shift: u32,
    /// Blocks before the data on each member (the superblock's room).
    off: u64,
}

impl Bdev for RaidBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, t: IoType) -> bool {
        base::all_support(&self.members, t)
    }
    fn fua_supported(&self, t: IoType) -> bool {
        base::all_fua(&self.members, t)
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        let members = self
            .members
            .iter()
            .map(|d| d.channel())
            .collect::<Result<Box<[_]>, _>>()?;
        let bs = self.info.block_size as u64;
        Ok(match self.cfg.level {
            Level::Raid0 => Box::new(Raid0Channel {
                members,
                shift: self.shift,
                bs,
                off: self.off,
            }),
            Level::Raid1 => unreachable!("raid1 is a MirrorBdev"),
            Level::Concat => {
                let mut starts = vec![0u64];
                for u in self.used.iter() {
                    starts.push(starts.last().unwrap() + u.load(Ordering::Relaxed));
                }
                // The last member reaches to the array's end, whatever it
                // grows to: the generic layer checks the range against the
                // array's size, which grows only after the member did.
                *starts.last_mut().unwrap() = u64::MAX;
                Box::new(ConcatChannel {
                    members,
                    starts: starts.into(),
                    bs,
                    off: self.off,
                })
            }
        })
    }
    fn config_json(&self) -> Value {
        let c = &self.cfg;
        if c.superblock {
            // As SPDK: the members' superblocks hold the configuration.
            return Value::Null;
        }
        json!({"method": "bdev_raid_create", "params": {
            "name": c.name, "raid_level": c.level.name(), "base_bdevs": c.members,
            "strip_size_kb": c.strip_size_kb, "uuid": self.info.uuid.to_string(),
            "superblock": false,
        }})
    }
    fn driver_info(&self) -> Value {
        let c = &self.cfg;
        let n = self.members.len();
        let list: Vec<Value> = self
            .members
            .iter()
            .zip(self.used.iter())
            .map(|(d, u)| {
                json!({"name": d.name(), "uuid": d.info().uuid.to_string(),
                "is_configured": true, "data_offset": self.off,
                "data_size": u.load(Ordering::Relaxed)})
            })
            .collect();
        json!({"raid": {
            "uuid": self.info.uuid.to_string(), "strip_size_kb": c.strip_size_kb,
            "state": "online", "raid_level": c.level.name(), "superblock": c.superblock,
            "num_base_bdevs": n, "num_base_bdevs_discovered": n,
            "num_base_bdevs_operational": n, "base_bdevs_list": list,
        }})
    }
}

impl RaidBdev {
    /// Of a member of `blocks` blocks, what the array can use: whole
    /// strips after the superblock's room.
    fn whole(&self, blocks: u64) -> u64 {
        let strip = 1u64 << self.shift;
        blocks.saturating_sub(self.off) / strip * strip
    }

    /// A member was resized: the array takes what it gained and says its
    /// new size; `None` when it did not grow (a shrink keeps the array's
    /// size: its end fails on the member). concat: only its last member
    /// (`base_blocks`) grows it. raid0: every member is used to the
    /// smallest one's whole strips, read live from each descriptor.
    fn grow(&self, base_blocks: u64) -> Option<u64> {
        let want = match self.cfg.level {
            Level::Concat => self.whole(base_blocks),
            Level::Raid0 => self
                .members
                .iter()
                .map(|d| self.whole(d.num_blocks()))
                .min()?,
            Level::Raid1 => unreachable!("raid1 is a MirrorBdev"),
        };
        let grown = match self.cfg.level {
            Level::Concat => self.used.last()?.fetch_max(want, Ordering::Relaxed) < want,
            // Every member, no short cut: a resize of another member
            // racing this one can only raise them further.
            _ => {
                let mut g = false;
                for u in self.used.iter() {
                    g |= u.fetch_max(want, Ordering::Relaxed) < want;
                }
                g
            }
        };
        grown.then(|| self.used.iter().map(|u| u.load(Ordering::Relaxed)).sum())
    }
}

/// Creates the array `cfg` describes. Nothing is created (and no member
/// stays claimed) when a member is missing, claimed, of another block
/// size or smaller than a strip.
pub fn create(
    reg: &Registry,
    weak: &Weak<Registry>,
    cfg: RaidConfig,
) -> Result<Arc<BdevEntry>, ControlError> {
    base::check_free(reg, &cfg.name)?;
    // The array, once made, for its members' resizes.
    let me: Arc<OnceLock<Weak<RaidBdev>>> = Arc::default();
    let last = cfg.members.len() - 1;
    let members = cfg
        .members
        .iter()
        .enumerate()
        .map(|(i, m)| {
            // A concat's other members keep their size: growing one would
            // move the data of the members after it.
            let on = if cfg.level == Level::Raid0 || i == last {
                let me = me.clone();
                base::OnResize::Ask(Arc::new(move |blocks| me.get()?.upgrade()?.grow(blocks)))
            } else {
                base::OnResize::Report
            };
            base::open(reg, weak, m, &cfg.name, on)
        })
        .collect::<Result<Box<[Desc]>, _>>()?;
    let bs = members[0].info().block_size as u64;
    let off = match &cfg.existing {
        Some(sb) => sb.data_offset,
        None if cfg.superblock => sb::data_offset(bs),
        None => 0,
    };
    let strip_bytes = cfg.strip_size_kb as u64 * 1024;
    if strip_bytes < bs {
        return Err(ControlError::invalid(
            "strip_size_kb",
            format!("{} KiB is less than the block size {bs}", cfg.strip_size_kb),
        ));
    }
    let strip = strip_bytes / bs;
    let whole = |d: &Desc| d.num_blocks().saturating_sub(off) / strip * strip;
    if let Some(d) = members.iter().find(|d| whole(d) == 0) {
        return Err(ControlError::invalid(
            "base_bdevs",
            format!("`{}` is smaller than one strip", d.name()),
        ));
    }
    let used: Vec<u64> = match cfg.level {
        Level::Raid0 => {
            let min = members.iter().map(whole).min().unwrap_or(0);
            members.iter().map(|_| min).collect()
        }
        Level::Concat => members.iter().map(whole).collect(),
        Level::Raid1 => unreachable!("raid1 is a MirrorBdev"),
    };
    let total = used.iter().sum();
    let info = base::info(&cfg.name, cfg.uuid, "Raid Volume", "raid", &members, total)?;
    if cfg.superblock && cfg.existing.is_none() {
        let uuids = members.iter().map(|d| d.info().uuid).collect();
        let s = new_superblock(&cfg, &info, off, uuids);
        sb::write_all(weak, &cfg.members, Some(&s))?;
    }
    let raid = Arc::new(RaidBdev {
        info,
        shift: strip.trailing_zeros(),
        cfg,
        members,
        used: used.into_iter().map(AtomicU64::new).collect(),
        off,
    });
    let _ = me.set(Arc::downgrade(&raid));
    let e = reg.register(raid.clone())?;
    // A member grown while the array was being made.
    let last = raid.members.last().map_or(0, |d| d.num_blocks());
    if let Some(n) = raid.grow(last) {
        e.resize(n);
    }
    Ok(e)
}

/// The first superblock of a new array (slot 0's; each member gets its own).
pub(crate) fn new_superblock(
    cfg: &RaidConfig,
    info: &BdevInfo,
    off: u64,
    members: Vec<uuid::Uuid>,
) -> sb::Superblock {
    sb::Superblock {
        name: cfg.name.clone(),
        uuid: info.uuid,
        raid_level: cfg.level.name().into(),
        strip_size_kb: cfg.strip_size_kb,
        block_size: info.block_size,
        data_offset: off,
        seq: 1,
        members,
        slot: 0,
    }
}

/// The raid module.
pub struct RaidModule(pub Weak<Registry>);

impl BdevModule for RaidModule {
    fn name(&self) -> &'static str {
        "raid"
    }
    fn create(&self, reg: &Registry, params: Value) -> Result<Arc<BdevEntry>, ControlError> {
        let cfg = RaidConfig::from_params(parse_params(params)?)?;
        if cfg.level == Level::Raid1 {
            return mirror::create(reg, &self.0, cfg);
        }
        create(reg, &self.0, cfg)
    }

    /// Deletes the array; with a superblock, the members' superblocks are
    /// wiped after (else `examine` would bring the array back).
    fn delete(&self, reg: &Registry, name: &str) -> Result<(), ControlError> {
        let e = reg
            .get(name)
            .filter(|e| e.info().module == "raid")
            .ok_or_else(|| ControlError::NotFound(name.to_string()))?;
        let raid = e.bdev().driver_info()["raid"].clone();
        drop(e);
        reg.delete(name)?;
        if raid["superblock"] == true {
            let members: Vec<String> = raid["base_bdevs_list"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["name"].as_str().map(String::from))
                .collect();
            sb::write_all(&self.0, &members, None)?;
        }
        Ok(())
    }

    fn examine(&self, reg: &Registry, bdev: &Arc<BdevEntry>) {
        sb::examine(&self.0, reg, bdev);
    }
}

/// `bdev_raid_get_bdevs`' entries for `category` (all, online,
/// configuring, offline): every array here is online once created.
pub fn get_bdevs(reg: &Registry, category: &str) -> Result<Vec<Value>, ControlError> {
    if !matches!(category, "all" | "online" | "configuring" | "offline") {
        return Err(ControlError::invalid(
            "category",
            format!("`{category}` is not all, online, configuring or offline"),
        ));
    }
    Ok(reg
        .list()
        .iter()
        .filter(|e| e.info().module == "raid")
        .filter_map(|e| {
            let mut v = e.bdev().driver_info().get("raid")?.clone();
            let on = v["state"] == category;
            v["name"] = json!(e.info().name);
            (category == "all" || on).then_some(v)
        })
        .collect())
}

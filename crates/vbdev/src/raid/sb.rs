//! raid superblocks (`superblock: true`): each member starts with a 4 KiB
//! record of the array (name, UUID, level, strip, members by UUID in slot
//! order, this member's slot), and the array's data starts 1 MiB in, as
//! SPDK reserves. `examine` reads the record from every bdev registered
//! and, once every member of an array has appeared, reassembles it: a
//! configuration needs only the base bdevs.
//!
//! The record: magic, version, JSON length and the JSON's CRC32C in a
//! 32-byte header, then the JSON. Anything else there (no magic) is not
//! a member; a record that fails its checks is reported and ignored.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use serde::{Deserialize, Serialize};
use ustor_bdev::{BdevEntry, BdevError, ControlError, Registry};
use ustor_runtime::IoBuf;

use super::{Level, RaidConfig};

const MAGIC: [u8; 8] = *b"USTRAID\x01";
const VERSION: u32 = 1;
const HEADER: usize = 32;
/// Bytes of the record (the JSON ends before this).
pub const SB_BYTES: usize = 4096;
/// Where the data starts on every member of an array with a superblock.
pub const DATA_OFFSET_BYTES: u64 = 1 << 20;

/// What one member's record says.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Superblock {
    pub name: String,
    pub uuid: uuid::Uuid,
    pub raid_level: String,
    pub strip_size_kb: u32,
    pub block_size: u32,
    /// Blocks before the data on each member.
    pub data_offset: u64,
    /// Bumped on each membership change; the highest wins.
    pub seq: u64,
    /// Member UUIDs by slot; nil for a slot not in sync (a raid1 member
    /// that failed, was removed, or is being rebuilt): examine does not
    /// wait for it.
    pub members: Vec<uuid::Uuid>,
    /// This member's slot.
    pub slot: u32,
}

/// Why a record was not taken.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SbError {
    #[error("raid superblock: version {0} is not supported")]
    Version(u32),
    #[error("raid superblock: length {0} does not fit")]
    Length(u32),
    #[error("raid superblock: checksum mismatch")]
    Checksum,
    #[error("raid superblock: {0}")]
    Json(String),
    #[error("raid superblock: slot {slot} of {n} members")]
    Slot { slot: u32, n: usize },
    #[error("raid superblock: slot {0} is out of sync in the member's own record")]
    OwnSlotEmpty(u32),
    #[error("raid superblock: a {0} array with an empty slot")]
    EmptySlot(String),
}

impl Superblock {
    /// The record's bytes (`SB_BYTES`); refused when the JSON does not fit.
    pub fn encode(&self) -> Result<Vec<u8>, ControlError> {
        let json = serde_json::to_vec(self).expect("plain data serializes");
        if json.len() > SB_BYTES - HEADER {
            return Err(ControlError::invalid(
                "base_bdevs",
                "too many members (or names too long) for the superblock",
            ));
        }
        let mut b = vec![0u8; SB_BYTES];
        b[..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(json.len() as u32).to_le_bytes());
        b[16..20].copy_from_slice(&crc32c::crc32c(&json).to_le_bytes());
        b[HEADER..HEADER + json.len()].copy_from_slice(&json);
        Ok(b)
    }

    /// The record in `b` (a member's first bytes): `None` when there is
    /// none (no magic), an error when one is there but broken.
    pub fn decode(b: &[u8]) -> Result<Option<Superblock>, SbError> {
        if b.len() < HEADER || b[..8] != MAGIC {
            return Ok(None);
        }
        let word = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        if word(8) != VERSION {
            return Err(SbError::Version(word(8)));
        }
        let len = word(12);
        let end = HEADER
            .checked_add(len as usize)
            .filter(|e| *e <= b.len().min(SB_BYTES));
        let end = end.ok_or(SbError::Length(len))?;
        let json = &b[HEADER..end];
        if crc32c::crc32c(json) != word(16) {
            return Err(SbError::Checksum);
        }
        let sb: Superblock =
            serde_json::from_slice(json).map_err(|e| SbError::Json(e.to_string()))?;
        if sb.slot as usize >= sb.members.len() {
            return Err(SbError::Slot {
                slot: sb.slot,
                n: sb.members.len(),
            });
        }
        if sb.members[sb.slot as usize].is_nil() {
            return Err(SbError::OwnSlotEmpty(sb.slot));
        }
        // Only a mirror goes on with a slot out of sync.
        if sb.raid_level != "raid1" && sb.members.iter().any(uuid::Uuid::is_nil) {
            return Err(SbError::EmptySlot(sb.raid_level));
        }
        Ok(Some(sb))
    }

    /// Slots examine waits for (the others were given up by the array).
    fn wanted(&self, slot: usize) -> bool {
        !self.members[slot].is_nil()
    }

    /// The record member `slot` gets.
    pub fn for_slot(&self, slot: usize) -> Superblock {
        Superblock {
            slot: slot as u32,
            ..self.clone()
        }
    }
}

/// Blocks reserved at the start of each member for block size `bs`.
pub fn data_offset(bs: u64) -> u64 {
    DATA_OFFSET_BYTES.div_ceil(bs)
}

/// Reads (`data` None) or writes the record area of bdev `name` on a
/// reactor; returns what was read (or written).
async fn io(reg: Arc<Registry>, name: String, data: Option<Vec<u8>>) -> Result<Vec<u8>, BdevError> {
    let d = reg
        .open(&name, data.is_some(), |_| {})
        .map_err(|_| BdevError::Removed)?;
    let ch = d.channel()?;
    let bs = ch.block_size() as usize;
    let n = SB_BYTES.div_ceil(bs);
    if (n as u64) > ch.num_blocks() {
        return Ok(Vec::new());
    }
    let mut buf = IoBuf::alloc(n * bs).await;
    buf.set_len(n * bs);
    let (res, buf) = match data {
        Some(v) => {
            buf.fill(0);
            buf[..v.len()].copy_from_slice(&v);
            ch.write(0, n as u64, buf).await
        }
        None => ch.read(0, n as u64, buf).await,
    };
    res.map(|()| buf.to_vec())
}

/// Writes `sb` (None: zeros, wiping it) to the members `names` (slot
/// order), waiting for the writes: the control thread only.
pub fn write_all(
    reg: &Weak<Registry>,
    names: &[String],
    sb: Option<&Superblock>,
) -> Result<(), ControlError> {
    let reg = reg
        .upgrade()
        .ok_or_else(|| ControlError::NotFound("registry".into()))?;
    let rt = reg
        .runtime()
        .cloned()
        .ok_or_else(|| ControlError::invalid("superblock", "needs a runtime"))?;
    if ustor_runtime::is_reactor_thread() {
        return Err(ControlError::invalid(
            "superblock",
            "superblock writes run from the control thread",
        ));
    }
    for (slot, name) in names.iter().enumerate() {
        let bytes = match sb {
            Some(sb) => sb.for_slot(slot).encode()?,
            None => vec![0u8; SB_BYTES],
        };
        let (r, n) = (reg.clone(), name.clone());
        let res = rt
            .block_on(0, move || io(r, n, Some(bytes)))
            .map_err(|e| ControlError::invalid("superblock", e.to_string()))?;
        res.map_err(|e| {
            ControlError::invalid("superblock", format!("writing it to `{name}`: {e}"))
        })?;
    }
    Ok(())
}

/// Writes record `sb` (for its slot) to member `name`, from a reactor.
pub async fn write_one(reg: Weak<Registry>, name: String, sb: Superblock) -> Result<(), BdevError> {
    let reg = reg.upgrade().ok_or(BdevError::Removed)?;
    let bytes = sb.encode().map_err(|_| BdevError::Io(libc::EOVERFLOW))?;
    io(reg, name, Some(bytes)).await.map(|_| ())
}

/// An array seen on some of its members, waiting for the rest.
struct Pending {
    sb: Superblock,
    /// Bdev names by slot, as they appear.
    found: Vec<Option<String>>,
}

static PENDING: Mutex<Vec<(usize, Pending)>> = Mutex::new(Vec::new());

/// Examine reads (and the assemblies they lead to) not finished yet.
static EXAMINING: AtomicUsize = AtomicUsize::new(0);

/// How many examines are still running (`bdev_wait_for_examine` waits
/// for 0).
pub fn examining() -> usize {
    EXAMINING.load(Ordering::Acquire)
}

/// The raid module's `examine`: reads `e`'s first bytes on reactor 0 (in
/// the background: registration may happen on any thread) and, when they
/// hold a superblock, records the member; the array is assembled once
/// all of its members are here.
pub fn examine(weak: &Weak<Registry>, reg: &Registry, e: &Arc<BdevEntry>) {
    let Some(rt) = reg.runtime().cloned() else {
        return;
    };
    let i = e.info();
    // A bdev in memory starts empty: it cannot hold a record (and its
    // counters stay the caller's own).
    if i.memory_resident
        || !e.claimers().is_empty()
        || i.num_blocks * i.block_size as u64 <= DATA_OFFSET_BYTES
    {
        return;
    }
    let (w, name) = (weak.clone(), e.info().name.clone());
    EXAMINING.fetch_add(1, Ordering::AcqRel);
    let sent = rt.spawn_on(0, move || async move {
        examine_one(w, name).await;
        EXAMINING.fetch_sub(1, Ordering::AcqRel);
    });
    if sent.is_err() {
        EXAMINING.fetch_sub(1, Ordering::AcqRel);
    }
}

async fn examine_one(w: Weak<Registry>, name: String) {
    {
        let Some(reg) = w.upgrade() else { return };
        let bytes = match io(reg.clone(), name.clone(), None).await {
            Ok(b) => b,
            Err(err) => {
                tracing::debug!("raid examine: reading {name}: {err}");
                return;
            }
        };
        match Superblock::decode(&bytes) {
            Ok(Some(sb)) => found(&reg, &w, &name, sb),
            Ok(None) => {}
            Err(err) => tracing::warn!("raid examine: {name}: {err}"),
        }
    }
}

/// Member `name` holds `sb`: note it in its slot (the record's own slot:
/// a member's UUID may change across restarts, as a file bdev's does);
/// assemble when every slot is filled.
fn found(reg: &Registry, w: &Weak<Registry>, name: &str, sb: Superblock) {
    let key = reg as *const Registry as usize;
    if let Some(e) = reg.get(&sb.name) {
        if e.info().uuid == sb.uuid {
            // The array runs without this member (it started degraded, or
            // dropped it): its data may be stale, so it only comes back
            // through bdev_raid_add_base_bdev, which rebuilds it.
            tracing::warn!(
                "raid examine: {name} is an out-of-sync member of {}; add it back with \
                 bdev_raid_add_base_bdev to rebuild it",
                sb.name
            );
            return;
        }
    }
    let ready = {
        let mut p = PENDING.lock().unwrap_or_else(|p| p.into_inner());
        let at = p
            .iter()
            .position(|(k, x)| *k == key && x.sb.uuid == sb.uuid);
        let at = match at {
            Some(i) => i,
            None => {
                let n = sb.members.len();
                p.push((
                    key,
                    Pending {
                        sb: sb.clone(),
                        found: vec![None; n],
                    },
                ));
                p.len() - 1
            }
        };
        let x = &mut p[at].1;
        if sb.seq > x.sb.seq {
            // A newer view of the membership: members with the older one
            // are stale and not taken.
            x.found = vec![None; sb.members.len()];
            x.sb = sb.clone();
        }
        let slot = &mut x.found[sb.slot as usize];
        match slot {
            _ if sb.seq != x.sb.seq => {}
            Some(other) => {
                tracing::warn!(
                    "raid examine: {name} and {other} both hold slot {} of {}",
                    sb.slot,
                    sb.name
                );
            }
            None => *slot = Some(name.to_string()),
        }
        if (0..x.found.len()).all(|i| x.found[i].is_some() || !x.sb.wanted(i)) {
            Some(p.remove(at).1)
        } else {
            None
        }
    };
    if let Some(x) = ready {
        assemble(reg, w, x);
    }
}

fn assemble(reg: &Registry, w: &Weak<Registry>, x: Pending) {
    let sb = x.sb;
    if reg.get(&sb.name).is_some() {
        tracing::warn!("raid examine: {} exists already; not assembled", sb.name);
        return;
    }
    let level = match Level::parse(&sb.raid_level) {
        Ok(l) => l,
        Err(e) => return tracing::warn!("raid examine: {}: {e}", sb.name),
    };
    let cfg = RaidConfig {
        name: sb.name.clone(),
        level,
        // Slots not in sync stay empty (raid1 only: see `decode`).
        members: x.found.into_iter().map(Option::unwrap_or_default).collect(),
        strip_size_kb: sb.strip_size_kb,
        uuid: Some(sb.uuid),
        superblock: true,
        existing: Some(sb.clone()),
    };
    let res = match level {
        Level::Raid1 => super::mirror::create(reg, w, cfg),
        _ => super::create(reg, w, cfg),
    };
    match res {
        Ok(_) => tracing::info!("raid {}: assembled from its superblocks", sb.name),
        Err(e) => tracing::warn!("raid examine: assembling {}: {e}", sb.name),
    }
}

/// Examine has settled (every configured bdev read): each raid1 still
/// waiting for a member starts degraded without it, so an array with a dead
/// disk still comes up, as mdadm does with `--run`. The new record (the
/// missing slot given up) goes to the members it has. A member that shows
/// up later is stale and is only taken back through
/// `bdev_raid_add_base_bdev`. raid0 and concat cannot run without a member,
/// so they keep waiting, and the log says which members are missing.
pub fn start_degraded(reg: &Registry, w: &Weak<Registry>) {
    let key = reg as *const Registry as usize;
    let ready: Vec<Pending> = {
        let mut p = PENDING.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        let mut i = 0;
        while i < p.len() {
            let (k, x) = &p[i];
            let raid1 = x.sb.raid_level == "raid1";
            if *k == key && raid1 && x.found.iter().any(Option::is_some) {
                out.push(p.remove(i).1);
                continue;
            }
            if *k == key {
                let have = x.found.iter().flatten().count();
                tracing::warn!(
                    "raid {}: {have} of {} members found; waiting for the rest",
                    x.sb.name,
                    x.found.len()
                );
            }
            i += 1;
        }
        out
    };
    for x in ready {
        let missing: Vec<usize> = (0..x.found.len())
            .filter(|i| x.found[*i].is_none() && x.sb.wanted(*i))
            .collect();
        tracing::warn!(
            "raid1 {}: starting degraded, slots {missing:?} missing",
            x.sb.name
        );
        assemble(reg, w, x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Superblock {
        Superblock {
            name: "r".into(),
            uuid: uuid::Uuid::new_v4(),
            raid_level: "raid0".into(),
            strip_size_kb: 64,
            block_size: 512,
            data_offset: 2048,
            seq: 1,
            members: vec![uuid::Uuid::new_v4(), uuid::Uuid::new_v4()],
            slot: 1,
        }
    }

    #[test]
    fn round_trips() {
        let sb = sample();
        assert_eq!(Superblock::decode(&sb.encode().unwrap()), Ok(Some(sb)));
    }

    #[test]
    fn malformed_records_are_refused() {
        let sb = sample();
        let good = sb.encode().unwrap();
        assert_eq!(Superblock::decode(&[0u8; SB_BYTES]), Ok(None));
        assert_eq!(Superblock::decode(&good[..10]), Ok(None));
        let mut b = good.clone();
        b[40] ^= 1;
        assert_eq!(Superblock::decode(&b), Err(SbError::Checksum));
        let mut b = good.clone();
        b[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(Superblock::decode(&b), Err(SbError::Length(_))));
        let mut b = good.clone();
        b[8] = 9;
        assert_eq!(Superblock::decode(&b), Err(SbError::Version(9)));
        let mut hole = sb.clone();
        hole.members[0] = uuid::Uuid::nil();
        // raid0 cannot have a slot out of sync; raid1 can, but not the
        // member's own.
        assert!(matches!(
            Superblock::decode(&hole.encode().unwrap()),
            Err(SbError::EmptySlot(_))
        ));
        hole.raid_level = "raid1".into();
        assert!(Superblock::decode(&hole.encode().unwrap())
            .unwrap()
            .is_some());
        hole.slot = 0;
        assert_eq!(
            Superblock::decode(&hole.encode().unwrap()),
            Err(SbError::OwnSlotEmpty(0))
        );
        let bad = Superblock { slot: 5, ..sb };
        let b = bad.encode().unwrap();
        assert!(matches!(Superblock::decode(&b), Err(SbError::Slot { .. })));
        // Every truncation and every single-byte change is refused or read.
        for cut in 0..good.len().min(600) {
            let _ = Superblock::decode(&good[..cut]);
        }
    }
}

//! raid1 membership changes over RPC: removing a member, adding one in an
//! empty or failed slot, and the background rebuild that copies the array
//! onto it before it is read from.

use super::*;

/// The mirror holding member `base` (by name).
fn holding(reg: &Registry, base: &str) -> Result<(Arc<Mirror>, usize), ControlError> {
    for e in reg.list().iter().filter(|e| e.info().module == "raid") {
        if let Ok(m) = LIVE.find(reg, &e.info().name, "raid") {
            let i = m
                .slots()
                .iter()
                .position(|d| d.as_ref().is_some_and(|d| d.name() == base));
            if let Some(i) = i {
                return Ok((m, i));
            }
        }
    }
    Err(ControlError::NotFound(format!(
        "{base} (as a raid1 member)"
    )))
}

/// How long a membership change over RPC waits for the new record.
const RECORD_WAIT: Duration = Duration::from_secs(10);

/// `bdev_raid_remove_base_bdev`: empties the member's slot and releases
/// it; refused for the last member holding the data. With superblocks the
/// members left get a record without it, and its own record is wiped, so
/// it does not come back at the next start.
pub fn remove_base(reg: &Registry, base: &str) -> Result<(), ControlError> {
    let (m, i) = holding(reg, base)?;
    if m.state(i) == ONLINE && m.online() == 1 {
        return Err(ControlError::invalid(
            "name",
            format!("`{base}` is the last member holding {}'s data", m.name),
        ));
    }
    m.clear_slot(i);
    let (Some(r), Some(seq)) = (m.records.get(), m.note_membership()) else {
        return Ok(());
    };
    if !r.wait(seq, RECORD_WAIT) {
        return Err(ControlError::invalid(
            "name",
            format!(
                "`{base}` removed, but {}'s superblocks were not all rewritten",
                m.name
            ),
        ));
    }
    crate::raid::sb::write_all(&r.reg, &[base.to_string()], None)
}

/// The mirror, the slot a new member goes to, and its descriptor.
pub struct Joined {
    pub(in crate::raid) m: Arc<Mirror>,
    pub(in crate::raid) slot: usize,
    rt: Option<ustor_runtime::RuntimeHandle>,
}

/// `bdev_raid_add_base_bdev`: puts `base` in an empty (or failed) slot of
/// `raid`, written from now on; the caller starts [`rebuild`].
pub fn add_base(reg: &Registry, raid: &str, base: &str) -> Result<Joined, ControlError> {
    let m = LIVE.find(reg, raid, "raid")?;
    crate::base::check_no_cycle(reg, raid, base)?;
    if m.rebuild.running.load(Ordering::Acquire) {
        return Err(ControlError::invalid(
            "raid_bdev",
            format!("{raid} is rebuilding"),
        ));
    }
    let slot = {
        let s = m.slots();
        (0..s.len())
            .find(|i| s[*i].is_none())
            .or_else(|| (0..s.len()).find(|i| m.state(*i) == FAILED))
            .ok_or_else(|| ControlError::invalid("raid_bdev", format!("{raid} has no free slot")))?
    };
    // A failed member added back (after the fault is fixed): its old
    // descriptor holds the claim, so it goes first.
    let same = m.slots()[slot].as_ref().is_some_and(|d| d.name() == base);
    if same {
        m.clear_slot(slot);
    }
    let d = open_member(reg, &Arc::downgrade(&m), base, raid)?;
    let have = m
        .slots()
        .iter()
        .flatten()
        .next()
        .map(|x| x.info().block_size);
    if d.num_blocks().saturating_sub(m.off) < m.blocks()
        || have.is_some_and(|bs| bs != d.info().block_size)
    {
        return Err(ControlError::invalid(
            "base_bdev",
            format!("`{base}` is smaller than {raid} or of another block size"),
        ));
    }
    m.clear_slot(slot);
    m.state[slot].store(REBUILDING, Ordering::Release);
    m.slots()[slot] = Some(d);
    m.epoch.fetch_add(1, Ordering::AcqRel);
    let r = &m.rebuild;
    r.slot.store(slot as u64, Ordering::Relaxed);
    r.done.store(0, Ordering::Relaxed);
    r.running.store(true, Ordering::Release);
    Ok(Joined {
        m,
        slot,
        rt: reg.runtime().cloned(),
    })
}

/// Bytes copied per rebuild step.
const CHUNK_BLOCKS_BYTES: u64 = 256 << 10;

/// The background copy onto the joined member (run on a reactor): chunk
/// by chunk from an online member; a chunk a write touched meanwhile is
/// copied again. The member is read from once the copy ends.
pub async fn rebuild(j: Joined) -> Result<(), BdevError> {
    let m = j.m;
    let r = &m.rebuild;
    quiesce(&m, j.rt.as_ref()).await;
    let res = copy(&m, j.slot).await;
    match res {
        Ok(()) => {
            m.state[j.slot].store(ONLINE, Ordering::Release);
            tracing::info!("raid1 {}: rebuild of member {} done", m.name, j.slot);
            // In sync now: the records take it (its own included).
            m.note_membership();
        }
        Err(e) => {
            m.state[j.slot].store(FAILED, Ordering::Release);
            tracing::warn!("raid1 {}: rebuild of member {} failed: {e}", m.name, j.slot);
        }
    }
    r.running.store(false, Ordering::Release);
    res
}

/// Waits until no write sent before the rebuild started is in flight:
/// such a write did not go to the new member, and one that stayed in
/// flight across a whole chunk copy would be missed by it. First a
/// message through every reactor: after it, each reactor's channels see
/// the rebuild running and count their writes in its generations; then
/// every channel's uncounted writes drain.
async fn quiesce(m: &Mirror, rt: Option<&ustor_runtime::RuntimeHandle>) {
    if let Some(rt) = rt {
        let seen = Arc::new(AtomicBool::new(false));
        let s2 = seen.clone();
        let sent = rt.for_each_reactor(Arc::new(|| {}), move || s2.store(true, Ordering::Release));
        while sent.is_ok() && !seen.load(Ordering::Acquire) {
            ustor_runtime::yield_now().await;
        }
    }
    loop {
        let busy = {
            let l = m.chans.lock().unwrap_or_else(|p| p.into_inner());
            l.iter()
                .filter_map(Weak::upgrade)
                .any(|c| c.load(Ordering::Acquire) != 0)
        };
        if !busy {
            return;
        }
        ustor_runtime::yield_now().await;
    }
}

async fn copy(m: &Mirror, slot: usize) -> Result<(), BdevError> {
    let r = &m.rebuild;
    let (src, dst) = {
        let s = m.slots();
        let src = (0..s.len()).find(|i| *i != slot && m.state(*i) == ONLINE && s[*i].is_some());
        let src = src.ok_or(BdevError::Io(libc::ENODEV))?;
        let dst = s[slot].as_ref().ok_or(BdevError::Removed)?;
        (s[src].as_ref().unwrap().channel()?, dst.channel()?)
    };
    let bs = src.block_size() as u64;
    let step = (CHUNK_BLOCKS_BYTES / bs).max(1);
    let mut buf = ustor_runtime::IoBuf::alloc((step * bs) as usize).await;
    let mut lba = 0;
    // The size is read each step: an array grown meanwhile is copied to
    // its new end.
    while lba < m.blocks() {
        let n = step.min(m.blocks() - lba);
        loop {
            r.dirty.store(false, Ordering::SeqCst);
            r.lo.store(lba, Ordering::SeqCst);
            r.hi.store(lba + n, Ordering::SeqCst);
            // Writes counted before the window was set may have missed it:
            // wait until they are done (later ones see the window).
            let old = (r.gen.fetch_add(1, Ordering::SeqCst) & 1) as usize;
            while r.writes[old].load(Ordering::SeqCst) != 0 {
                ustor_runtime::yield_now().await;
            }
            buf.set_len((n * bs) as usize);
            let (res, b) = src.read(m.off + lba, n, buf).await;
            buf = b;
            res?;
            let (res, b) = dst.write(m.off + lba, n, buf).await;
            buf = b;
            res?;
            if !r.dirty.load(Ordering::SeqCst) {
                break;
            }
        }
        lba += n;
        r.done.store(lba, Ordering::Relaxed);
        if m.state(slot) == FAILED {
            return Err(BdevError::Io(libc::EIO));
        }
    }
    r.hi.store(0, Ordering::Release);
    Ok(())
}

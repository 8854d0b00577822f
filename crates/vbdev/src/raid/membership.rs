//! A raid1's superblocks kept true as its membership changes: a member
//! that fails, is hot-removed or is removed over RPC, and one that finishes
//! its rebuild, each give the array a new record. The record has the next
//! sequence number, and a nil UUID marks each slot that is not in sync. It
//! is written in the background to every member in sync, so examine at the
//! next start takes the newest view. It never takes a member with an older
//! record (stale data), and never waits for a slot the array had already
//! given up.
//!
//! Writes run on reactor 0, one pass at a time. A change made during a pass
//! makes the pass run again with the newest record, so members never end up
//! with an older record written over a newer one.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use ustor_bdev::Registry;

use super::mirror::{Mirror, ONLINE};
use super::sb::{self, Superblock};

/// The array's current record and the state of its writer.
pub(super) struct Records {
    pub(super) reg: Weak<Registry>,
    st: Mutex<State>,
    done: Condvar,
}

struct State {
    sb: Superblock,
    /// A writer pass is running on reactor 0.
    running: bool,
    /// The record changed while it ran: run again.
    again: bool,
    /// The highest sequence number on every member in sync.
    written: u64,
}

impl Records {
    /// `sb` is the record on the members now (a new array's, already
    /// written, or the one examine assembled the array from).
    pub(super) fn new(reg: Weak<Registry>, sb: Superblock) -> Records {
        let written = sb.seq;
        Records {
            reg,
            st: Mutex::new(State {
                sb,
                running: false,
                again: false,
                written,
            }),
            done: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Brings the record in line with `in_sync` (per slot: the member's
    /// UUID when it is in sync, `None` when not) and starts writing it
    /// when it changed; returns the sequence number that holds once the
    /// writes are done.
    pub(super) fn note(&self, m: &Arc<Mirror>, in_sync: &[Option<uuid::Uuid>]) -> u64 {
        let mut st = self.lock();
        let members: Vec<uuid::Uuid> = in_sync
            .iter()
            .zip(&st.sb.members)
            .map(|(now, was)| match now {
                None => uuid::Uuid::nil(),
                // A member that was in sync keeps the UUID it was recorded
                // with (a file bdev's own changes at each start).
                Some(_) if !was.is_nil() => *was,
                Some(u) => *u,
            })
            .collect();
        if members != st.sb.members {
            st.sb.members = members;
            st.sb.seq += 1;
        }
        let seq = st.sb.seq;
        if st.written >= seq {
            return seq;
        }
        if st.running {
            st.again = true;
            return seq;
        }
        st.running = true;
        drop(st);
        let rt = self.reg.upgrade().and_then(|r| r.runtime().cloned());
        let m2 = m.clone();
        let sent = rt.map(|rt| rt.spawn_on(0, move || write_passes(m2)));
        if !matches!(sent, Some(Ok(_))) {
            tracing::warn!("raid1 {}: no reactor to write its superblocks", m.name);
            self.lock().running = false;
            self.done.notify_all();
        }
        seq
    }

    /// Waits until record `seq` is on every member in sync; false on a
    /// write error or after `timeout`.
    pub(super) fn wait(&self, seq: u64, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        let mut st = self.lock();
        while st.written < seq && st.running {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self
                .done
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        st.written >= seq
    }
}

impl Mirror {
    /// The members in sync (online), by slot, with name and UUID: what the
    /// record lists and where it is written.
    pub(super) fn in_sync_members(&self) -> Vec<(usize, String, uuid::Uuid)> {
        let s = self.slots();
        (0..s.len())
            .filter_map(|i| match &s[i] {
                Some(d) if self.state(i) == ONLINE => {
                    Some((i, d.name().to_string(), d.info().uuid))
                }
                _ => None,
            })
            .collect()
    }

    /// The membership changed: an array with superblocks writes a new
    /// record (in the background); returns its sequence number.
    pub(super) fn note_membership(self: &Arc<Self>) -> Option<u64> {
        let r = self.records.get()?;
        let mut in_sync = vec![None; self.slots().len()];
        for (i, _, uuid) in self.in_sync_members() {
            in_sync[i] = Some(uuid);
        }
        Some(r.note(self, &in_sync))
    }
}

/// The writer: the newest record to every member in sync, again while the
/// record changes under it.
async fn write_passes(m: Arc<Mirror>) {
    let Some(r) = m.records.get() else { return };
    loop {
        let sb = {
            let mut st = r.lock();
            st.again = false;
            st.sb.clone()
        };
        let mut ok = true;
        for (slot, name, _) in m.in_sync_members() {
            if let Err(e) = sb::write_one(r.reg.clone(), name.clone(), sb.for_slot(slot)).await {
                tracing::warn!("raid1 {}: superblock to {name}: {e}", m.name);
                ok = false;
            }
        }
        let mut st = r.lock();
        if ok {
            st.written = st.written.max(sb.seq);
        }
        if !st.again {
            st.running = false;
            drop(st);
            r.done.notify_all();
            return;
        }
    }
}

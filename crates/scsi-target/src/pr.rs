//! Reservations of one logical unit, shared by every I_T nexus that sees
//! it (SPC-4 §5.9, SPC-2 RESERVE/RELEASE): registrations, the persistent
//! reservation, the SPC-2 reservation, the generation, and the unit
//! attentions other nexuses are owed (preempted, released, reset).
//!
//! A nexus is named by the transport (iSCSI: `initiator,i,0xISID`; the
//! name doubles as the iSCSI TransportID in READ FULL STATUS). The state
//! sits behind a mutex because sessions of one LUN run on several
//! reactors; every operation takes it once and never awaits under it.
//! A command's check does not take it while there is nothing to hear (no
//! reservation of either kind, no unit attention owed to any nexus): a
//! flag every change under the lock keeps says so.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ustor_scsi_proto::sense::asc;
use ustor_scsi_proto::{Sense, SenseKey};

use crate::data::{DataPath, XferError};
use crate::lu::Lun;
use crate::outcome::Outcome;

/// Reservation types (SPC-4 table 191).
pub const WRITE_EXCLUSIVE: u8 = 1;
pub const EXCLUSIVE_ACCESS: u8 = 3;
pub const WRITE_EXCLUSIVE_RO: u8 = 5;
pub const EXCLUSIVE_ACCESS_RO: u8 = 6;
pub const WRITE_EXCLUSIVE_AR: u8 = 7;
pub const EXCLUSIVE_ACCESS_AR: u8 = 8;

/// RESERVATIONS PREEMPTED, RESERVATIONS RELEASED, REGISTRATIONS PREEMPTED.
const RESV_PREEMPTED: (u8, u8) = (0x2a, 0x03);
const RESV_RELEASED: (u8, u8) = (0x2a, 0x04);
const REGS_PREEMPTED: (u8, u8) = (0x2a, 0x05);

/// How a command touches the medium, for the conflict rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// Never conflicts (INQUIRY, REPORT LUNS, REQUEST SENSE, ...).
    Always,
    /// PERSISTENT RESERVE IN/OUT: their own rules, but an SPC-2
    /// reservation of another nexus shuts them out.
    Persistent,
    Read,
    Write,
}

/// Why a PERSISTENT RESERVE OUT was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PrError {
    Conflict,
    InvalidCdb,
    InvalidParam,
    /// RELEASE of a type other than the one held.
    InvalidRelease,
}

/// An I_T nexus, named by its transport.
pub type Nexus = Arc<str>;

#[derive(Default)]
struct State {
    generation: u32,
    regs: Vec<(Nexus, u64)>,
    /// The persistent reservation: holder and type.
    resv: Option<(Nexus, u8)>,
    /// The SPC-2 reservation's holder.
    reserve6: Option<Nexus>,
    /// Unit attentions owed, by nexus.
    ua: Vec<(Nexus, Sense)>,
    /// Nexuses with a table open on the unit (for reset attentions).
    attached: Vec<Nexus>,
    /// The capacity the attached nexuses were last told of.
    blocks: Option<u64>,
}

fn all_registrants(t: u8) -> bool {
    matches!(t, WRITE_EXCLUSIVE_AR | EXCLUSIVE_ACCESS_AR)
}

impl State {
    fn key_of(&self, n: &str) -> Option<u64> {
        self.regs.iter().find(|(x, _)| &**x == n).map(|r| r.1)
    }

    fn is_holder(&self, n: &str) -> bool {
        match &self.resv {
            Some((_, t)) if all_registrants(*t) => self.key_of(n).is_some(),
            Some((h, _)) => &**h == n,
            None => false,
        }
    }

    /// Whether `n` meets a reservation conflict for a command of `a`.
    fn conflicts(&self, n: &str, a: Access) -> bool {
        if self.reserve6.as_deref().is_some_and(|h| h != n) && a != Access::Always {
            return true;
        }
        let Some((_, t)) = &self.resv else {
            return false;
        };
        if self.is_holder(n) {
            return false;
        }
        let registered = self.key_of(n).is_some();
        let shared = matches!(
            *t,
            WRITE_EXCLUSIVE_RO | EXCLUSIVE_ACCESS_RO | WRITE_EXCLUSIVE_AR | EXCLUSIVE_ACCESS_AR
        );
        match a {
            Access::Always | Access::Persistent => false,
            Access::Write => !(shared && registered),
            Access::Read => match *t {
                EXCLUSIVE_ACCESS => true,
                EXCLUSIVE_ACCESS_RO | EXCLUSIVE_ACCESS_AR => !registered,
                _ => false,
            },
        }
    }

    /// Registered nexuses other than `n`.
    fn others(&self, n: &str) -> Vec<Nexus> {
        self.regs
            .iter()
            .filter(|r| &*r.0 != n)
            .map(|r| r.0.clone())
            .collect()
    }

    fn owe(&mut self, n: &Nexus, code: (u8, u8)) {
        let s = Sense::new(SenseKey::UnitAttention, code);
        if !self.ua.iter().any(|(x, u)| x == n && *u == s) {
            self.ua.push((n.clone(), s));
        }
    }

    /// The unit has `blocks` blocks: if the nexuses attached were told of
    /// another capacity, each is owed CAPACITY DATA HAS CHANGED.
    fn resized(&mut self, blocks: u64) {
        if self.blocks.replace(blocks).is_some_and(|b| b != blocks) {
            let all = self.attached.clone();
            all.iter().for_each(|n| self.owe(n, asc::CAPACITY_CHANGED));
        }
    }

    /// Removes `n`'s registration, releasing what it held.
    fn unregister(&mut self, n: &str) {
        self.regs.retain(|(x, _)| &**x != n);
        let Some((h, t)) = self.resv.clone() else {
            return;
        };
        let gone = if all_registrants(t) {
            self.regs.is_empty()
        } else {
            &*h == n
        };
        if gone {
            self.resv = None;
            if matches!(t, WRITE_EXCLUSIVE_RO | EXCLUSIVE_ACCESS_RO) {
                let others: Vec<Nexus> = self.regs.iter().map(|r| r.0.clone()).collect();
                others.iter().for_each(|o| self.owe(o, RESV_RELEASED));
            }
        }
    }

    /// Removes the registrations with `key` (but `except`'s); the nexuses
    /// removed are owed REGISTRATIONS PREEMPTED. Returns how many.
    fn preempt_key(&mut self, key: u64, except: &str) -> usize {
        let gone: Vec<Nexus> = self
            .regs
            .iter()
            .filter(|(x, k)| *k == key && &**x != except)
            .map(|r| r.0.clone())
            .collect();
        self.regs.retain(|(x, k)| *k != key || &**x == except);
        gone.iter().for_each(|g| self.owe(g, REGS_PREEMPTED));
        gone.len()
    }
}

/// The unit's answer to a command about to run ([`Reservations::check`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Check {
    /// A unit attention was owed to the command's nexus: it is the answer.
    Attention(Sense),
    /// A reservation of another nexus forbids the access.
    Conflict,
    Go,
}

/// One logical unit's reservation state.
#[derive(Default)]
pub struct Reservations {
    st: Mutex<State>,
    /// A reservation is held or a unit attention is owed: what a
    /// command's check must look at under the lock. Stored by every
    /// [`Locked`] as it lets go, so it follows each change.
    heard: AtomicBool,
}

/// The state under the lock; letting go of it updates
/// [`Reservations::heard`] (while still holding the lock).
struct Locked<'a> {
    st: MutexGuard<'a, State>,
    heard: &'a AtomicBool,
}

impl Deref for Locked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.st
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.st
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let st = &self.st;
        let heard = !st.ua.is_empty() || st.resv.is_some() || st.reserve6.is_some();
        self.heard.store(heard, Ordering::Release);
    }
}

impl Reservations {
    fn lock(&self) -> Locked<'_> {
        // A panic elsewhere cannot leave the state half-updated: every
        // operation is a few assignments. Go on with it.
        Locked {
            st: self.st.lock().unwrap_or_else(|e| e.into_inner()),
            heard: &self.heard,
        }
    }

    /// A table of nexus `n` opened on the unit when it had `blocks` blocks
    /// (a resize nobody noticed yet is owed to the nexuses attached before).
    pub(crate) fn attach(&self, n: &Nexus, blocks: u64) {
        let mut st = self.lock();
        st.resized(blocks);
        st.attached.push(n.clone());
    }

    /// A table noticed the unit now has `blocks` blocks: the first to
    /// notice a resize owes CAPACITY DATA HAS CHANGED to every nexus.
    pub(crate) fn resized(&self, blocks: u64) {
        self.lock().resized(blocks);
    }

    /// The nexus is gone (logout, connection loss): its SPC-2 reservation
    /// goes with it; persistent ones stay.
    pub(crate) fn detach(&self, n: &str) {
        let mut st = self.lock();
        if let Some(at) = st.attached.iter().position(|x| &**x == n) {
            st.attached.remove(at);
        }
        if st.reserve6.as_deref() == Some(n) && !st.attached.iter().any(|x| &**x == n) {
            st.reserve6 = None;
        }
        let st = &mut *st;
        let attached = &st.attached;
        st.ua.retain(|(x, _)| attached.iter().any(|a| a == x));
    }

    /// A LUN or target reset: the SPC-2 reservation is released and every
    /// attached nexus, `by` included, is owed POWER ON, RESET once, however
    /// many tables (reactors, queues) it has on the unit. Whether `by` is
    /// attached (else its table must tell itself).
    pub(crate) fn reset(&self, by: &str) -> bool {
        let mut st = self.lock();
        st.reserve6 = None;
        let all: Vec<Nexus> = st.attached.clone();
        all.iter().for_each(|o| st.owe(o, asc::POWER_ON_RESET));
        all.iter().any(|x| &**x == by)
    }

    /// Owes `code` to nexus `n` once, if it is attached (a nexus that has
    /// gone is owed nothing).
    pub(crate) fn tell(&self, n: &str, code: (u8, u8)) {
        let mut st = self.lock();
        if let Some(x) = st.attached.iter().find(|x| &***x == n).cloned() {
            st.owe(&x, code);
        }
    }

    /// Owes `code` to every attached nexus but `by`.
    pub(crate) fn tell_others(&self, by: &str, code: (u8, u8)) {
        let mut st = self.lock();
        let others: Vec<Nexus> = st
            .attached
            .iter()
            .filter(|x| &***x != by)
            .cloned()
            .collect();
        others.iter().for_each(|o| st.owe(o, code));
    }

    /// What the unit says to a command of nexus `n` needing access `a`
    /// before it runs: the unit attention owed to `n` (taken; only when
    /// `ua`, the command is not one that attentions pass), else whether a
    /// reservation conflicts. One lock for both: every command asks.
    pub(crate) fn check(&self, n: &str, ua: bool, a: Access) -> Check {
        // Nothing held or owed: no conflict and no attention, without the
        // lock (a change racing this command is ordered after it).
        if !self.heard.load(Ordering::Acquire) {
            return Check::Go;
        }
        let mut st = self.lock();
        if ua {
            if let Some(at) = st.ua.iter().position(|(x, _)| &**x == n) {
                return Check::Attention(st.ua.remove(at).1);
            }
        }
        if st.conflicts(n, a) {
            Check::Conflict
        } else {
            Check::Go
        }
    }

    /// RESERVE(6/10): refused while another nexus holds either kind.
    pub(crate) fn reserve6(&self, n: &Nexus) -> bool {
        let mut st = self.lock();
        if st.resv.is_some() || st.reserve6.as_ref().is_some_and(|h| h != n) {
            return false;
        }
        st.reserve6 = Some(n.clone());
        true
    }

    /// RELEASE(6/10): releases `n`'s reservation; another's stays (GOOD).
    pub(crate) fn release6(&self, n: &str) -> bool {
        let mut st = self.lock();
        if st.resv.is_some() {
            return false;
        }
        if st.reserve6.as_deref() == Some(n) {
            st.reserve6 = None;
        }
        true
    }

    /// PERSISTENT RESERVE OUT with its 24-byte basic parameter list.
    pub(crate) fn out(
        &self,
        n: &Nexus,
        sa: u8,
        (scope, ty): (u8, u8),
        key: u64,
        sa_key: u64,
    ) -> Result<(), PrError> {
        let mut st = self.lock();
        let mine = st.key_of(n);
        match sa {
            // REGISTER, REGISTER AND IGNORE EXISTING KEY.
            0 | 6 => {
                if sa == 0 && key != mine.unwrap_or(0) {
                    return Err(PrError::Conflict);
                }
                register(&mut st, n, mine, sa_key);
                Ok(())
            }
            1..=5 if mine != Some(key) => Err(PrError::Conflict),
            1 | 2 | 4 | 5 if scope != 0 => Err(PrError::InvalidCdb),
            1 | 4 | 5 if !matches!(ty, 1 | 3 | 5..=8) => Err(PrError::InvalidCdb),
            // RESERVE.
            1 => match &st.resv {
                None => {
                    st.resv = Some((n.clone(), ty));
                    Ok(())
                }
                Some((_, t)) if *t == ty && st.is_holder(n) => Ok(()),
                Some(_) => Err(PrError::Conflict),
            },
            2 => release(&mut st, n, ty),
            // CLEAR.
            3 => {
                let others = st.others(n);
                others.iter().for_each(|o| st.owe(o, RESV_PREEMPTED));
                st.regs.clear();
                st.resv = None;
                st.generation = st.generation.wrapping_add(1);
                Ok(())
            }
            // PREEMPT, PREEMPT AND ABORT (no task outlives its command).
            4 | 5 => preempt(&mut st, n, ty, sa_key),
            _ => Err(PrError::InvalidCdb),
        }
    }

    /// PERSISTENT RESERVE IN: the data for service action `sa` into `out`
    /// (its full length, which may exceed `out`); `None` for an unknown
    /// service action.
    pub(crate) fn read(&self, sa: u8, out: &mut Vec<u8>) -> Option<()> {
        let st = self.lock();
        out.clear();
        out.extend_from_slice(&st.generation.to_be_bytes());
        match sa {
            0 => {
                out.extend_from_slice(&(8 * st.regs.len() as u32).to_be_bytes());
                st.regs
                    .iter()
                    .for_each(|r| out.extend_from_slice(&r.1.to_be_bytes()));
            }
            1 => match &st.resv {
                None => out.extend_from_slice(&0u32.to_be_bytes()),
                Some((h, t)) => {
                    out.extend_from_slice(&16u32.to_be_bytes());
                    let key = if all_registrants(*t) {
                        0
                    } else {
                        st.key_of(h).unwrap_or(0)
                    };
                    out.extend_from_slice(&key.to_be_bytes());
                    out.extend_from_slice(&[0, 0, 0, 0, 0, *t, 0, 0]);
                }
            },
            2 => {
                // REPORT CAPABILITIES: CRH, TMV, every type but the obsolete.
                out.clear();
                out.extend_from_slice(&[0, 8, 0x10, 0x80, 0xea, 0x01, 0, 0]);
            }
            3 => {
                out.extend_from_slice(&[0; 4]);
                for (x, k) in &st.regs {
                    out.extend_from_slice(&k.to_be_bytes());
                    out.extend_from_slice(&[0; 4]);
                    let (holder, ty) = match &st.resv {
                        Some((_, t)) if st.is_holder(x) => (1, *t),
                        _ => (0, 0),
                    };
                    out.extend_from_slice(&[holder, ty, 0, 0, 0, 0, 0, 1]);
                    let tid = transport_id(x);
                    out.extend_from_slice(&(tid.len() as u32).to_be_bytes());
                    out.extend_from_slice(&tid);
                }
                let n = (out.len() - 8) as u32;
                out[4..8].copy_from_slice(&n.to_be_bytes());
            }
            _ => return None,
        }
        Some(())
    }
}

/// REGISTER (and IGNORE EXISTING KEY) once the key checked out: a new
/// registration, a changed key, or (key 0) an unregistration.
fn register(st: &mut State, n: &Nexus, mine: Option<u64>, sa_key: u64) {
    match (mine, sa_key) {
        (None, 0) => return,
        (None, k) => st.regs.push((n.clone(), k)),
        (Some(_), 0) => st.unregister(n),
        (Some(_), k) => st
            .regs
            .iter_mut()
            .filter(|r| r.0 == *n)
            .for_each(|r| r.1 = k),
    }
    st.generation = st.generation.wrapping_add(1);
}

/// RELEASE by a registered nexus: nothing unless it holds the reservation;
/// the type must be the one held. Registrants of a shared type are told.
fn release(st: &mut State, n: &Nexus, ty: u8) -> Result<(), PrError> {
    match st.resv.clone() {
        Some((_, t)) if st.is_holder(n) => {
            if t != ty {
                return Err(PrError::InvalidRelease);
            }
            st.resv = None;
            if t != WRITE_EXCLUSIVE && t != EXCLUSIVE_ACCESS {
                let others = st.others(n);
                others.iter().for_each(|o| st.owe(o, RESV_RELEASED));
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

fn preempt(st: &mut State, n: &Nexus, ty: u8, sa_key: u64) -> Result<(), PrError> {
    let held = st.resv.clone();
    let holder_key = match &held {
        Some((_, t)) if all_registrants(*t) => Some(0),
        Some((h, _)) => st.key_of(h),
        None => None,
    };
    if holder_key == Some(sa_key) {
        // Preempting the reservation: it moves to `n` with the new type.
        if sa_key == 0 {
            let others = st.others(n);
            st.regs.retain(|r| r.0 == *n);
            others.iter().for_each(|o| st.owe(o, REGS_PREEMPTED));
        } else {
            st.preempt_key(sa_key, n);
        }
        st.resv = Some((n.clone(), ty));
    } else {
        if sa_key == 0 {
            return Err(PrError::InvalidParam);
        }
        if st.preempt_key(sa_key, n) == 0 {
            return Err(PrError::Conflict);
        }
    }
    st.generation = st.generation.wrapping_add(1);
    Ok(())
}

/// An iSCSI TransportID (SPC-4 §7.6.4.6, format 01b) for a nexus name:
/// the name, NUL-terminated, padded to a multiple of 4, at least 24 bytes.
fn transport_id(n: &str) -> Vec<u8> {
    let len = (n.len() + 1).next_multiple_of(4).max(20);
    let mut v = vec![0x45, 0];
    v.extend_from_slice(&(len as u16).to_be_bytes());
    v.extend_from_slice(n.as_bytes());
    v.resize(4 + len, 0);
    v
}

/// PERSISTENT RESERVE IN: the service action's data, cut at `alloc_len`.
pub(crate) async fn execute_in<D: DataPath>(
    lu: &Lun,
    sa: u8,
    alloc_len: u16,
    data: &mut D,
) -> Result<Outcome, XferError> {
    let mut b = Vec::with_capacity(64);
    if lu.shared.pr.read(sa, &mut b).is_none() {
        return Ok(Outcome::invalid_field_at(1, Some(4), data.expected_len()));
    }
    b.truncate(alloc_len as usize);
    crate::spc::send_in(data, &b).await
}

/// Bytes of the basic PERSISTENT RESERVE OUT parameter list.
const PROUT_PARAM_LEN: u32 = 24;

/// PERSISTENT RESERVE OUT: reads the parameter list, applies it.
pub(crate) async fn execute_out<D: DataPath>(
    lu: &Lun,
    nexus: &Nexus,
    (sa, scope, ty): (u8, u8, u8),
    param_len: u32,
    data: &mut D,
) -> Result<Outcome, XferError> {
    let exp = data.expected_len();
    if param_len != PROUT_PARAM_LEN || exp < PROUT_PARAM_LEN {
        // SPEC_I_PT lists (longer) are not offered; shorter is an error.
        return Ok(Outcome::check(
            SenseKey::IllegalRequest,
            asc::PARAM_LIST_LENGTH_ERROR,
            exp,
        ));
    }
    let mut p = [0u8; PROUT_PARAM_LEN as usize];
    if data.data_out(0, &mut p).await? != p.len() {
        return Ok(Outcome::check(
            SenseKey::IllegalRequest,
            asc::PARAM_LIST_LENGTH_ERROR,
            exp,
        ));
    }
    let resid = exp - PROUT_PARAM_LEN;
    // SPEC_I_PT, ALL_TG_PT and APTPL (byte 20) are not offered
    // (REPORT CAPABILITIES says so).
    if p[20] & 0x0d != 0 {
        return Ok(Outcome::check(
            SenseKey::IllegalRequest,
            asc::INVALID_FIELD_IN_PARAM_LIST,
            resid,
        ));
    }
    let key = u64::from_be_bytes(p[0..8].try_into().unwrap_or_default());
    let sa_key = u64::from_be_bytes(p[8..16].try_into().unwrap_or_default());
    Ok(
        match lu.shared.pr.out(nexus, sa, (scope, ty), key, sa_key) {
            Ok(()) => Outcome::good(resid),
            Err(PrError::Conflict) => Outcome::conflict(resid),
            Err(PrError::InvalidCdb) => Outcome::invalid_field(resid),
            Err(PrError::InvalidParam) => Outcome::check(
                SenseKey::IllegalRequest,
                asc::INVALID_FIELD_IN_PARAM_LIST,
                resid,
            ),
            Err(PrError::InvalidRelease) => {
                Outcome::check(SenseKey::IllegalRequest, INVALID_RELEASE, resid)
            }
        },
    )
}

/// INVALID RELEASE OF PERSISTENT RESERVATION.
const INVALID_RELEASE: (u8, u8) = (0x26, 0x04);

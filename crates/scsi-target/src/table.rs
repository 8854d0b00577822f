//! The LUN table of one target on one reactor, and command dispatch: LUN
//! lookup, REPORT LUNS, unit attentions, then the SPC or SBC executor.

use ustor_scsi_proto::cdb::{CdbError, Command};
use ustor_scsi_proto::inquiry::STD_INQUIRY_LEN;
use ustor_scsi_proto::lun::encode_report_luns;
use ustor_scsi_proto::sense::asc;
use ustor_scsi_proto::{Sense, SenseKey};

use crate::data::{DataPath, XferError};
use crate::lu::Lun;
use crate::outcome::Outcome;
use crate::pr::{Access, Check, Nexus};
use crate::{pr, sbc, spc};

/// Most LUNs one table holds (bounds REPORT LUNS data).
pub const MAX_LUNS: usize = 256;

/// Logical units by LUN, for one I_T nexus on one reactor.
#[derive(Default)]
pub struct LunTable {
    luns: Vec<(u64, Lun)>,
    /// The I_T nexus this table serves (reservations are per nexus).
    nexus: Nexus,
}

/// Why a LUN could not be added.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    #[error("LUN {0} exists")]
    Exists(u64),
    #[error("at most {MAX_LUNS} LUNs")]
    Full,
}

impl LunTable {
    pub fn new() -> LunTable {
        LunTable::default()
    }

    /// A table of these units as they are (no unit attention is raised);
    /// for a transport that rebuilds its table from a configuration. Later
    /// duplicates of a LUN and LUNs beyond [`MAX_LUNS`] are dropped.
    pub fn from_luns(luns: impl IntoIterator<Item = (u64, Lun)>) -> LunTable {
        let mut t = LunTable::default();
        for (l, lu) in luns {
            if t.luns.len() < MAX_LUNS && t.get(l).is_none() {
                let at = t.luns.partition_point(|(x, _)| *x < l);
                t.luns.insert(at, (l, lu));
            }
        }
        t
    }

    /// Names the I_T nexus this table serves (iSCSI: initiator name and
    /// ISID) and attaches it to each unit's reservations; when the table
    /// is dropped the nexus is gone (its RESERVE(6) reservation with it).
    pub fn set_nexus(&mut self, nexus: &str) {
        self.nexus = Nexus::from(nexus);
        for (_, lu) in &self.luns {
            lu.shared.pr.attach(&self.nexus, lu.known_blocks());
        }
    }

    /// Adds a LUN; the others get REPORTED LUNS DATA HAS CHANGED.
    pub fn add(&mut self, lun: u64, lu: Lun) -> Result<(), TableError> {
        if self.get(lun).is_some() {
            return Err(TableError::Exists(lun));
        }
        if self.luns.len() >= MAX_LUNS {
            return Err(TableError::Full);
        }
        self.luns_changed();
        let at = self.luns.partition_point(|(l, _)| *l < lun);
        self.luns.insert(at, (lun, lu));
        Ok(())
    }

    /// Removes a LUN; the others get REPORTED LUNS DATA HAS CHANGED.
    pub fn remove(&mut self, lun: u64) -> Option<Lun> {
        let at = self.luns.iter().position(|(l, _)| *l == lun)?;
        let (_, lu) = self.luns.remove(at);
        self.luns_changed();
        Some(lu)
    }

    fn luns_changed(&self) {
        let s = Sense::new(SenseKey::UnitAttention, asc::REPORTED_LUNS_CHANGED);
        for (_, lu) in &self.luns {
            lu.set_ua(Some(s));
        }
    }

    /// The I_T nexus this table serves.
    pub(crate) fn nexus(&self) -> &Nexus {
        &self.nexus
    }

    pub fn get(&self, lun: u64) -> Option<&Lun> {
        self.luns.iter().find(|(l, _)| *l == lun).map(|(_, lu)| lu)
    }

    pub fn luns(&self) -> impl Iterator<Item = (u64, &Lun)> {
        self.luns.iter().map(|(l, lu)| (*l, lu))
    }

    /// A target reset: every LUN is reset.
    pub fn reset_all(&self) {
        for (_, lu) in &self.luns {
            self.reset_unit(lu);
        }
    }

    /// A LUN reset; `false` if there is no such LUN.
    pub fn reset_lun(&self, lun: u64) -> bool {
        self.get(lun).map(|lu| self.reset_unit(lu)).is_some()
    }

    /// POWER ON, RESET for every nexus of the unit, once per nexus however
    /// many tables it has (SAM-5: a unit attention is per I_T nexus);
    /// RESERVE(6) released.
    fn reset_unit(&self, lu: &Lun) {
        if !lu.shared.pr.reset(&self.nexus) {
            // No nexus named: this table is the only one to tell.
            lu.set_ua(Some(Sense::new(
                SenseKey::UnitAttention,
                asc::POWER_ON_RESET,
            )));
        }
    }

    /// CAPACITY DATA HAS CHANGED after a resize, once per I_T nexus: the
    /// first table of the unit to notice owes it to every nexus attached
    /// (the unit remembers the capacity it told them); a table with no
    /// nexus named tells itself.
    fn capacity_ua(&self, lu: &Lun) -> Option<Sense> {
        let n = lu.resized()?;
        if self.nexus.is_empty() {
            return Some(Sense::new(SenseKey::UnitAttention, asc::CAPACITY_CHANGED));
        }
        lu.shared.pr.resized(n);
        None
    }

    /// Owes the I_T nexus `nexus` (this table's or another's on the same
    /// units) the unit attention `code` on the LUNs `which` selects, once
    /// however many tables it has; a nexus no table serves is owed nothing.
    pub fn tell(&self, nexus: &str, code: (u8, u8), which: impl Fn(u64) -> bool) {
        for (_, lu) in self.luns.iter().filter(|(l, _)| which(*l)) {
            lu.shared.pr.tell(nexus, code);
        }
    }

    /// Executes one CDB addressed to `lun`. SCSI failures come back as an
    /// [`Outcome`] with sense (descriptor format when the unit's D_SENSE
    /// is set); only a transport failure is an error.
    pub async fn execute<D: DataPath>(
        &self,
        lun: u64,
        cdb: &[u8],
        data: &mut D,
    ) -> Result<Outcome, XferError> {
        let o = self.dispatch(lun, cdb, data).await?;
        Ok(match self.get(lun) {
            Some(lu) => o.with_descriptor_sense(lu.shared.mode.d_sense()),
            None => o,
        })
    }

    async fn dispatch<D: DataPath>(
        &self,
        lun: u64,
        cdb: &[u8],
        data: &mut D,
    ) -> Result<Outcome, XferError> {
        let exp = data.expected_len();
        let parsed = Command::parse(cdb);
        if let Ok(Command::ReportLuns { alloc_len, .. }) = parsed {
            return self.report_luns(lun, alloc_len, data).await;
        }
        let Some(lu) = self.get(lun) else {
            // No logical unit here: INQUIRY says so with qualifier 3 (SPC).
            if let Ok(Command::Inquiry { page: None, .. }) = parsed {
                let mut b = [0u8; STD_INQUIRY_LEN];
                b[0] = 0x7f;
                return spc::send_in(data, &b).await;
            }
            return Ok(Outcome::check(
                SenseKey::IllegalRequest,
                asc::LUN_NOT_SUPPORTED,
                exp,
            ));
        };
        let c = match parsed {
            Ok(c) => c,
            Err(CdbError::UnsupportedOpcode(_)) => {
                return Ok(Outcome::check(
                    SenseKey::IllegalRequest,
                    asc::INVALID_OPCODE,
                    exp,
                ))
            }
            Err(_) => return Ok(Outcome::invalid_field(exp)),
        };
        if protection_requested(cdb) || anchor_requested(cdb) {
            // No protection information: RDPROTECT/WRPROTECT/VRPROTECT must
            // be zero (SBC-3 §5.x, "if the logical unit does not support
            // protection information").
            return Ok(Outcome::invalid_field(exp));
        }
        let attentions = !matches!(c, Command::Inquiry { .. } | Command::RequestSense { .. });
        if attentions {
            if let Some(ua) = lu.ua.take().or_else(|| self.capacity_ua(lu)) {
                return Ok(Outcome::sense(ua, exp));
            }
        }
        // The unit's attentions for this nexus and its reservations, under
        // one lock of the unit's state.
        match lu.shared.pr.check(&self.nexus, attentions, access(&c)) {
            Check::Attention(ua) => return Ok(Outcome::sense(ua, exp)),
            Check::Conflict => return Ok(Outcome::conflict(exp)),
            Check::Go => {}
        }
        if lu.shared.mode.swp() && writes_medium(&c) {
            return Ok(Outcome::check(
                SenseKey::DataProtect,
                SOFTWARE_WRITE_PROTECTED,
                exp,
            ));
        }
        match c {
            Command::PersistentReserveIn {
                service_action,
                alloc_len,
            } => pr::execute_in(lu, service_action, alloc_len, data).await,
            Command::PersistentReserveOut {
                service_action,
                scope,
                pr_type,
                param_len,
            } => {
                let sa = (service_action, scope, pr_type);
                pr::execute_out(lu, &self.nexus, sa, param_len, data).await
            }
            Command::ModeSelect {
                long,
                pf,
                sp,
                param_len,
            } => crate::mode::select(lu, &self.nexus, (long, pf, sp), param_len, data).await,
            Command::ExtendedCopy {
                service_action: 0,
                param_len,
            } => crate::xcopy::extended_copy(lu, &self.nexus, param_len, data).await,
            Command::ExtendedCopy { .. } => Ok(Outcome::invalid_field_at(1, Some(4), exp)),
            Command::ReceiveCopyResults {
                service_action,
                list_id,
                alloc_len,
            } => {
                let sa = (service_action, list_id);
                crate::xcopy::receive_results(lu, &self.nexus, sa, alloc_len, data).await
            }
            Command::Reserve if !lu.shared.pr.reserve6(&self.nexus) => Ok(Outcome::conflict(exp)),
            Command::Release if !lu.shared.pr.release6(&self.nexus) => Ok(Outcome::conflict(exp)),
            Command::Reserve | Command::Release => Ok(Outcome::good(exp)),
            Command::Read { .. }
            | Command::Write { .. }
            | Command::WriteAndVerify { .. }
            | Command::Verify { .. }
            | Command::SynchronizeCache { .. }
            | Command::Unmap { .. }
            | Command::WriteSame10 { .. }
            | Command::WriteSame16 { .. }
            | Command::PreFetch { .. }
            | Command::OrWrite { .. }
            | Command::CompareAndWrite { .. }
            | Command::GetLbaStatus { .. } => sbc::execute(lu, c, data).await,
            _ => spc::execute(lu, c, data).await,
        }
    }

    async fn report_luns<D: DataPath>(
        &self,
        lun: u64,
        alloc_len: u32,
        data: &mut D,
    ) -> Result<Outcome, XferError> {
        let mut list = [0u64; MAX_LUNS];
        let n = self.luns.len();
        for (slot, (l, _)) in list.iter_mut().zip(&self.luns) {
            *slot = *l;
        }
        let mut buf = [0u8; 8 + 8 * MAX_LUNS];
        let want = (alloc_len as usize).min(8 + 8 * n);
        let len = encode_report_luns(&list[..n], &mut buf[..want]);
        if let Some(lu) = self.get(lun) {
            // REPORT LUNS clears the "LUNs changed" attention it answers.
            if lu
                .ua()
                .is_some_and(|s| s.code() == asc::REPORTED_LUNS_CHANGED)
            {
                lu.set_ua(None);
            }
        }
        spc::send_in(data, &buf[..len]).await
    }
}

impl Drop for LunTable {
    fn drop(&mut self) {
        for (_, lu) in &self.luns {
            lu.shared.pr.detach(&self.nexus);
            lu.shared.copies.forget(&self.nexus);
        }
    }
}

/// LOGICAL UNIT SOFTWARE WRITE PROTECTED (SWP in the control page).
const SOFTWARE_WRITE_PROTECTED: (u8, u8) = (0x27, 0x02);

/// Whether a command changes the medium (refused while SWP is set).
fn writes_medium(c: &Command) -> bool {
    use Command::*;
    matches!(
        c,
        Write { .. }
            | WriteAndVerify { .. }
            | WriteSame10 { .. }
            | WriteSame16 { .. }
            | Unmap { .. }
            | OrWrite { .. }
            | CompareAndWrite { .. }
            | ExtendedCopy { .. }
    )
}

/// How a command touches the medium, for reservation conflicts (SPC-4
/// table 185; RESERVE/RELEASE check their own).
fn access(c: &Command) -> Access {
    use Command::*;
    match c {
        Inquiry { .. }
        | RequestSense { .. }
        | ReportLuns { .. }
        | ReportSupportedOpcodes { .. }
        | TestUnitReady
        | ReadCapacity10
        | ReadCapacity16 { .. }
        | Reserve
        | Release => Access::Always,
        PersistentReserveIn { .. } | PersistentReserveOut { .. } => Access::Persistent,
        Read { .. }
        | Verify { .. }
        | PreFetch { .. }
        | GetLbaStatus { .. }
        | ModeSense { .. }
        | ReadDefectData { .. }
        | ReceiveCopyResults { .. } => Access::Read,
        _ => Access::Write,
    }
}

/// Whether WRITE SAME asks for anchored blocks (ANCHOR, byte 1 bit 4):
/// not offered (VPD B2 says ANC_SUP 0).
fn anchor_requested(cdb: &[u8]) -> bool {
    cdb.len() > 1 && matches!(cdb[0], 0x41 | 0x93) && cdb[1] & 0x10 != 0
}

/// Whether a block command's protect field (CDB byte 1, bits 7..5) is set.
pub(crate) fn protection_requested(cdb: &[u8]) -> bool {
    // READ, WRITE, VERIFY, WRITE AND VERIFY (10/12/16), WRITE SAME (10/16).
    // ORWRITE(16), COMPARE AND WRITE.
    const OPS: [u8; 16] = [
        0x28, 0x2a, 0x2f, 0x2e, 0xa8, 0xaa, 0xaf, 0xae, 0x88, 0x8a, 0x8f, 0x8e, 0x41, 0x93, 0x8b,
        0x89,
    ];
    cdb.len() > 1 && OPS.contains(&cdb[0]) && cdb[1] & 0xe0 != 0
}

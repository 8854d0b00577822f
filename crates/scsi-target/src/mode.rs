//! The changeable mode parameters of a logical unit (shared by its I_T
//! nexuses) and MODE SELECT(6/10): the control page's D_SENSE (sense in
//! descriptor format) and SWP (software write protect) may be changed;
//! every other field of the pages we report must come back as it is.

use std::sync::atomic::{AtomicBool, Ordering};

use ustor_scsi_proto::sense::asc;
use ustor_scsi_proto::SenseKey;

use crate::data::{DataPath, XferError};
use crate::lu::Lun;
use crate::outcome::Outcome;

pub(crate) const PAGE_CACHING: u8 = 0x08;
pub(crate) const PAGE_CONTROL: u8 = 0x0a;
/// Control page byte 2 bit 2, byte 4 bit 3.
pub(crate) const D_SENSE: u8 = 0x04;
pub(crate) const SWP: u8 = 0x08;

/// MODE PARAMETERS CHANGED, for the unit's other nexuses.
const PARAMS_CHANGED: (u8, u8) = (0x2a, 0x01);

#[derive(Default)]
pub(crate) struct ModeParams {
    d_sense: AtomicBool,
    swp: AtomicBool,
}

impl ModeParams {
    pub(crate) fn d_sense(&self) -> bool {
        self.d_sense.load(Ordering::Relaxed)
    }

    pub(crate) fn swp(&self) -> bool {
        self.swp.load(Ordering::Relaxed)
    }
}

/// The control page (12 bytes) as MODE SENSE reports it; `changeable`:
/// the mask of what MODE SELECT may change.
pub(crate) fn control_page(lu: &Lun, changeable: bool) -> [u8; 12] {
    let mut p = [0u8; 12];
    p[0] = PAGE_CONTROL;
    p[1] = 0x0a;
    let m = &lu.shared.mode;
    if changeable || m.d_sense() {
        p[2] |= D_SENSE;
    }
    if changeable || m.swp() {
        p[4] |= SWP;
    }
    p
}

/// The caching page (20 bytes): WCE mirrors the bdev, nothing changeable.
pub(crate) fn caching_page(lu: &Lun, changeable: bool) -> [u8; 20] {
    let mut p = [0u8; 20];
    p[0] = PAGE_CACHING;
    p[1] = 0x12;
    if lu.can_flush() && lu.write_cache && !changeable {
        p[2] = 0x04;
    }
    p
}

fn bad_param(resid: u32) -> Outcome {
    Outcome::check(
        SenseKey::IllegalRequest,
        asc::INVALID_FIELD_IN_PARAM_LIST,
        resid,
    )
}

/// Most parameter-list bytes MODE SELECT takes (header, one block
/// descriptor, our two pages, with room to spare).
const MAX_PARAM: usize = 256;

/// MODE SELECT(6/10) (`long`): page format only, nothing saved.
pub(crate) async fn select<D: DataPath>(
    lu: &Lun,
    nexus: &str,
    (long, pf, sp): (bool, bool, bool),
    param_len: u16,
    data: &mut D,
) -> Result<Outcome, XferError> {
    let exp = data.expected_len();
    if sp || (!pf && param_len > 0) {
        return Ok(Outcome::invalid_field_at(
            1,
            Some(if sp { 0 } else { 4 }),
            exp,
        ));
    }
    let mut p = [0u8; MAX_PARAM];
    let want = (param_len as usize).min(exp as usize);
    if want > MAX_PARAM {
        return Ok(Outcome::check(
            SenseKey::IllegalRequest,
            asc::PARAM_LIST_LENGTH_ERROR,
            exp,
        ));
    }
    let n = data.data_out(0, &mut p[..want]).await?;
    let resid = exp.saturating_sub(n as u32);
    let (hdr, bdl) = match long {
        true if n >= 8 => (8, u16::from_be_bytes([p[6], p[7]]) as usize),
        false if n >= 4 => (4, p[3] as usize),
        _ if n == 0 => return Ok(Outcome::good(resid)),
        _ => return Ok(bad_param(resid)),
    };
    let mut at = hdr + bdl;
    let (mut d_sense, mut swp) = (lu.shared.mode.d_sense(), lu.shared.mode.swp());
    while at + 2 <= n {
        let (code, len) = (p[at] & 0x3f, p[at + 1] as usize);
        let page = match p.get(at..at + 2 + len) {
            Some(pg) if at + 2 + len <= n && p[at] & 0x40 == 0 => pg,
            _ => return Ok(bad_param(resid)),
        };
        match code {
            PAGE_CONTROL if len == 0x0a => {
                // Everything but D_SENSE and SWP must match what we report.
                let mut cur = control_page(lu, false);
                cur[2] = (cur[2] & !D_SENSE) | (page[2] & D_SENSE);
                cur[4] = (cur[4] & !SWP) | (page[4] & SWP);
                if page != cur {
                    return Ok(bad_param(resid));
                }
                d_sense = page[2] & D_SENSE != 0;
                swp = page[4] & SWP != 0;
            }
            PAGE_CACHING if len == 0x12 && *page == caching_page(lu, false)[..] => {}
            _ => return Ok(bad_param(resid)),
        }
        at += 2 + len;
    }
    let m = &lu.shared.mode;
    let was = (
        m.d_sense.swap(d_sense, Ordering::Relaxed),
        m.swp.swap(swp, Ordering::Relaxed),
    );
    if was != (d_sense, swp) {
        lu.shared.pr.tell_others(nexus, PARAMS_CHANGED);
    }
    Ok(Outcome::good(resid))
}

//! Per-command state, preallocated: one [`Task`] per mid-layer slot (the
//! low 16 bits of the tag), so the data path never allocates or hashes.
//! The task keeps the command's iovecs (borrowed from the mid-layer until
//! the command is reported or dropped by a TMF/reset) and walks them to
//! place Data-In and to gather Data-Out without copying.

use std::ops::Range;

use ustor_scsi::lld::{Tag, TransportError};
use ustor_scsi::ScsiStatus;

use crate::wire::Bhs;

/// Sense bytes kept per task (SPC's largest sense is 252 bytes).
pub const SENSE_MAX: usize = 252;

/// Where a task is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskState {
    /// No command in the slot.
    Free,
    /// Sent (or queued to be sent) and not answered yet.
    Active,
    /// Answered; waiting for `poll` to report it.
    Done,
}

/// A burst of Data-Out to send: unsolicited (TTT reserved) or for an R2T.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Burst {
    pub ttt: u32,
    /// Next byte offset to send.
    pub off: u32,
    /// End of the burst (exclusive).
    pub end: u32,
    pub datasn: u32,
}

/// One command of the session.
pub struct Task {
    pub tag: Tag,
    pub state: TaskState,
    pub lun: [u8; 8],
    pub lun_no: u64,
    pub cmdsn: u32,
    pub iov: *const libc::iovec,
    pub iovcnt: usize,
    pub data_len: u32,
    pub read: bool,
    pub write: bool,
    /// The SCSI Command PDU, built at queuecommand, sent by the sender.
    pub bhs: Bhs,
    /// The command PDU still waits for the sender.
    pub cmd_pending: bool,
    /// Immediate data carried by the command PDU.
    pub imm: u32,
    /// Data-Out being sent, and an R2T that came while it was.
    pub out: Option<Burst>,
    pub next_r2t: Option<Burst>,
    /// In the sender's ready queue.
    pub queued: bool,
    /// Data-In bytes placed.
    pub received: u32,
    pub status: Result<ScsiStatus, TransportError>,
    pub sense: [u8; SENSE_MAX],
    pub sense_len: usize,
    pub resid: u32,
}

impl Default for Task {
    fn default() -> Task {
        Task {
            tag: 0,
            state: TaskState::Free,
            lun: [0; 8],
            lun_no: 0,
            cmdsn: 0,
            iov: std::ptr::null(),
            iovcnt: 0,
            data_len: 0,
            read: false,
            write: false,
            bhs: Bhs::default(),
            cmd_pending: false,
            imm: 0,
            out: None,
            next_r2t: None,
            queued: false,
            received: 0,
            status: Ok(ScsiStatus::Good),
            sense: [0; SENSE_MAX],
            sense_len: 0,
            resid: 0,
        }
    }
}

impl Task {
    /// The command's data segments.
    pub fn iovecs(&self) -> &[libc::iovec] {
        if self.iov.is_null() || self.iovcnt == 0 {
            return &[];
        }
        // SAFETY: the mid-layer keeps the iovec array alive while the task
        // is Active or Done (the LLD contract); Free tasks have a null iov.
        unsafe { std::slice::from_raw_parts(self.iov, self.iovcnt) }
    }

    /// Fills `out` with the pieces of the data buffer covering `r`;
    /// returns how many were written and the bytes they cover (less than
    /// `r`'s length only if `out` ran out or the buffer is shorter).
    pub fn slices(&self, r: Range<usize>, out: &mut [libc::iovec]) -> (usize, usize) {
        let (mut n, mut covered) = (0, 0);
        let mut skip = r.start;
        let mut left = r.end.saturating_sub(r.start);
        for v in self.iovecs() {
            if left == 0 || n == out.len() {
                break;
            }
            if skip >= v.iov_len {
                skip -= v.iov_len;
                continue;
            }
            let k = (v.iov_len - skip).min(left);
            out[n] = libc::iovec {
                // SAFETY: skip < iov_len, so the pointer stays in the segment.
                iov_base: unsafe { (v.iov_base as *mut u8).add(skip) }.cast(),
                iov_len: k,
            };
            n += 1;
            covered += k;
            left -= k;
            skip = 0;
        }
        (n, covered)
    }

    /// CRC32C continued over the buffer bytes in `r`.
    pub fn crc(&self, crc: u32, r: Range<usize>) -> u32 {
        let mut v = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; crate::MAX_SEGS];
        let (n, _) = self.slices(r, &mut v);
        v[..n].iter().fold(crc, |c, s| {
            // SAFETY: each slice lies inside the command's buffer (see `slices`).
            let b = unsafe { std::slice::from_raw_parts(s.iov_base as *const u8, s.iov_len) };
            crc32c::crc32c_append(c, b)
        })
    }

    /// Copies the unsent bytes `r` of this task's buffer into `dst` (used
    /// only when a half-sent PDU outlives its command).
    pub fn copy_out(&self, r: Range<usize>, dst: &mut Vec<u8>) {
        let mut v = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; crate::MAX_SEGS];
        let (n, _) = self.slices(r, &mut v);
        for s in &v[..n] {
            // SAFETY: as in `crc`.
            dst.extend_from_slice(unsafe {
                std::slice::from_raw_parts(s.iov_base as *const u8, s.iov_len)
            });
        }
    }

    /// Back to Free, dropping every pointer into the command.
    pub fn clear(&mut self) {
        self.state = TaskState::Free;
        self.iov = std::ptr::null();
        self.iovcnt = 0;
        self.out = None;
        self.next_r2t = None;
        self.cmd_pending = false;
        self.sense_len = 0;
    }
}

//! Zero-copy read replies (`fs_export`'s `send_zc`): which replies leave
//! with SENDMSG_ZC, what stays pinned until the kernel's notification, and
//! the counters the notifications feed.
//!
//! A read reply's payload is the region itself (iovecs into the mapping).
//! With a plain `sendmsg` the kernel copies it into socket buffers during
//! the call; with SENDMSG_ZC it pins the pages and reads them until the
//! notification (for TCP: until the client acknowledged the data). In
//! that window:
//! - a block the read covers is never handed to another file: the group
//!   holds a [`crate::Fs::pin_send`], which defers freed blocks (as a
//!   planned write does) until the notification releases it;
//! - a write to the same file's block in place (another request, in flight
//!   together with the read) may show through, as it may in the plain path
//!   between planning and the send: requests in flight together have no
//!   order. A write the client issues after it received the reply cannot
//!   change what it received: TCP took the client's acknowledgement before
//!   that request, so no retransmission of the changed page reaches it.

use std::rc::Rc;
use std::sync::Arc;

use ustor_net::zc::{ZcDone, ZcSink};
use ustor_net::PduGroup;

use super::{ExportSvc, SEND_ZC_MIN};
use crate::fs::ReadSeg;

/// Whether a read reply of these segments should leave zero-copy, and if
/// so takes the pin its group will hold (`false` when the export does not
/// ask, the reply is small, or the volume is busy: a plain send then,
/// safe without a pin since it copies during the call).
pub(super) fn hold(svc: &ExportSvc, segs: &[ReadSeg], g: &mut PduGroup) -> bool {
    if !svc.send_zc {
        return false;
    }
    let total: usize = segs.iter().map(crate::serve::seg_len).sum();
    if total < SEND_ZC_MIN {
        return false;
    }
    let Some(mut v) = svc.vol.try_lock() else {
        return false;
    };
    v.fs.pin_send();
    g.want_zero_copy();
    true
}

/// The driver's report of a group sent zero-copy: its pins released, the
/// counters moved. Holds the export (and so the mapping) until the last
/// notification, even past the connection's end.
pub(super) fn sink(svc: &Arc<ExportSvc>) -> Option<ZcSink> {
    if !svc.send_zc {
        return None;
    }
    let svc = svc.clone();
    Some(Rc::new(move |d: ZcDone| {
        let mut v = svc.vol.lock();
        for _ in 0..d.holds {
            v.fs.unpin_send();
        }
        v.st.zero_copy_sends += d.sends as u64;
        v.st.zero_copy_sends_copied += d.copied as u64;
        if d.sends > 0 && d.copied == 0 {
            v.st.kernel_copied_bytes = v.st.kernel_copied_bytes.saturating_sub(d.raw_bytes);
            v.st.zero_copy_bytes += d.raw_bytes;
        }
    }))
}

//! The sans-IO harness of the connection protocol: a byte stream run
//! through the handshake's checks and [`FsProto`] as the driver would,
//! without a socket (the fuzz target `fs_server` and the proptests).

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use ustor_net::driver::{Protocol, Recv, RecvEvent};
use ustor_net::{PduGroup, Staging};

use super::{mac_ok, proto_errno, run_job, FsProto, FsReply, St, MAX_HELLO, STAGING_LEN};
use crate::proto::{self, Op, Request, HEADER_LEN, NONCE_LEN};
use crate::server::ExportSvc;

/// Runs a byte stream through the server's request path without a socket,
/// as the driver would (each stage receives all it may, up to its `max`,
/// as a receive finding the whole stream already sent; payloads received
/// into the region, which must find nothing of theirs staged; skips),
/// after the handshake's checks on its first two frames (Hello,
/// then an Auth checked against `secret`). Returns the replies queued. The
/// fuzz target `fs_server` and a proptest run this; it must never panic.
pub fn replay_session(fs: crate::Fs, secret: &[u8], read_only: bool, data: &[u8]) -> usize {
    let mut d = data;
    let mut take = |n: usize| -> Option<Vec<u8>> {
        let n = n.min(d.len());
        let (h, t) = d.split_at(n);
        d = t;
        (n > 0).then(|| h.to_vec())
    };
    // Handshake: the same decoding and checks as `handshake`.
    let sn = [9u8; NONCE_LEN];
    let mut cn = [0u8; NONCE_LEN];
    for op in [Op::Hello, Op::Auth] {
        let Some(raw) = take(HEADER_LEN).filter(|r| r.len() == HEADER_LEN) else {
            return 0;
        };
        let raw: [u8; HEADER_LEN] = raw.try_into().expect("header");
        let max = if op == Op::Hello {
            MAX_HELLO
        } else {
            NONCE_LEN
        };
        let Ok(h) = proto::decode_header(&raw).map_err(|e| proto_errno(&e)) else {
            return 0;
        };
        if h.op != op || h.len as usize > max {
            return 0;
        }
        let body = take(h.len as usize).unwrap_or_default();
        match proto::decode_request(&h, &body) {
            Ok(Request::Hello { nonce, .. }) => cn = nonce,
            Ok(Request::Auth { mac }) => {
                if !secret.is_empty() && !mac_ok(secret, &cn, &sn, &mac) {
                    return 0;
                }
            }
            _ => return 0,
        }
    }
    let mut fs = fs;
    let region = fs.region_mut();
    let base = region.as_mut_ptr();
    let size = region.len() as u64;
    let vol = crate::server::Volume {
        name: "fuzz".into(),
        path: std::path::PathBuf::new(),
        size,
        may_fault: false,
        inner: std::sync::Mutex::new(crate::server::Inner {
            fs,
            st: crate::serve::Stats::default(),
        }),
        base,
    };
    let svc = Arc::new(ExportSvc {
        vol: Arc::new(vol),
        read_only,
        copy_writes: false,
        send_zc: false,
        secret: secret.to_vec(),
        auth_failures: Default::default(),
        max_in_flight: Default::default(),
        reads_offloaded: Default::default(),
        offloaded: Default::default(),
    });
    let p = FsProto {
        svc,
        st: RefCell::new(St::Idle),
        close_after: Cell::new(false),
        in_flight: Cell::new(0),
        align: Cell::new(false),
        committing: RefCell::new(Vec::new()),
    };
    let mut st = Staging::new(STAGING_LEN, ustor_net::Rewind::Lazy);
    let mut g = PduGroup::new();
    let (mut ev, mut replies) = (RecvEvent::Next, 0);
    // Budget: every round consumes input or ends (a Next-only loop cannot
    // happen: Next always stages).
    for _ in 0..(data.len() + 4) * 4 {
        ev = match p.apply(ev, &mut st) {
            Recv::Stage { need, max } => {
                // As `Staging::fill`: no receive while `need` is staged.
                let missing = need.saturating_sub(st.avail());
                if missing > 0 {
                    let want = max.max(need).min(STAGING_LEN.max(need)) - st.avail();
                    match take(want) {
                        Some(b) if b.len() >= missing => st.stage_bytes(&b),
                        _ => break,
                    }
                }
                RecvEvent::Staged
            }
            Recv::Payload { buf, off, len, .. } => {
                // A payload byte in staging would have to be copied.
                assert_eq!(st.avail(), 0, "payload bytes were staged");
                let Some(mut buf) = buf else { break };
                match take(len) {
                    Some(b) if b.len() == len => {
                        buf.spare_mut()[off..off + len].copy_from_slice(&b);
                        RecvEvent::Payload(buf)
                    }
                    _ => break,
                }
            }
            Recv::Skip(n) => {
                let staged = st.avail().min(n as usize);
                st.consume(staged);
                let n = n as usize - staged;
                match take(n) {
                    Some(b) if b.len() == n => RecvEvent::Skipped,
                    None if n == 0 => RecvEvent::Skipped,
                    _ => break,
                }
            }
            Recv::Reply(r) | Recv::Interim(r) => {
                replies += 1;
                drain(&p, r, &mut g);
                RecvEvent::Next
            }
            // The pool's work, done here in order: nothing stays committing.
            Recv::Dispatch(j) => {
                let r = run_job(&p.svc, j);
                p.committing.borrow_mut().clear();
                replies += 1;
                drain(&p, r, &mut g);
                RecvEvent::Next
            }
            _ => break,
        };
    }
    p.on_close();
    let inner = p.svc.vol.lock();
    debug_assert_eq!(inner.st.copied_bytes, 0);
    replies
}

/// Encodes a reply into groups and drops them (the sans-IO harness).
fn drain(p: &FsProto, r: FsReply, g: &mut PduGroup) {
    let mut r = Some(r);
    while let Some(x) = r.take() {
        if let Err(back) = p.encode(x, g) {
            g.clear();
            r = Some(back);
        }
    }
    g.clear();
}

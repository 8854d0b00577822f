//! Internal commands of a host (control path: scan, bring-up, TMF
//! follow-ups): one command run with the retry rules in a slot of its own,
//! its buffer owned by the slot until the LLD is done with it.

use super::{Host, Owner, SlotState};
use crate::cdb::Cdb;
use crate::lld::{DataDir, Nexus, TransportError};
use crate::mid::retry::Failure;
use crate::sense::Sense;
use crate::status::ScsiStatus;

impl Host {
    /// Runs one command with the retry rules and returns its outcome
    /// (control path: scan, bring-up, `scsi_execute`).
    pub async fn execute(&self, nexus: Nexus, cdb: Cdb, dir: DataDir, buf: Vec<u8>) -> Outcome {
        let dev = self
            .devices
            .borrow()
            .iter()
            .find(|d| d.nexus == nexus)
            .cloned();
        let i = SlotAlloc { host: self }.await;
        let s = &self.slots[i as usize];
        *s.dev.borrow_mut() = dev.inspect(|d| d.inflight.set(d.inflight.get() + 1));
        *s.owner.borrow_mut() = Owner::Waiter {
            waker: None,
            buf,
            dropped: false,
        };
        let ptr = match &mut *s.owner.borrow_mut() {
            Owner::Waiter { buf, .. } => (buf.as_mut_ptr(), buf.len()),
            _ => (std::ptr::null_mut(), 0),
        };
        self.build(i, cdb, dir, ptr.0, ptr.1);
        let mut cmd = s.cmd.get();
        cmd.nexus = nexus;
        s.cmd.set(cmd);
        self.issue(i);
        WaitDone {
            host: self,
            i,
            done: false,
        }
        .await
    }
}

/// What an internal command came back with.
#[derive(Debug)]
pub struct Outcome {
    pub status: Result<ScsiStatus, TransportError>,
    pub failure: Option<Failure>,
    pub sense: Option<Sense>,
    pub sense_bytes: Vec<u8>,
    pub data: Vec<u8>,
    pub resid: u32,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.failure.is_none()
    }

    /// The data-in bytes actually transferred.
    pub fn data_in(&self) -> &[u8] {
        let n = self.data.len().saturating_sub(self.resid as usize);
        &self.data[..n]
    }
}

struct SlotAlloc<'a> {
    host: &'a Host,
}

impl std::future::Future for SlotAlloc<'_> {
    type Output = u16;
    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<u16> {
        match self.host.alloc() {
            Some(i) => std::task::Poll::Ready(i),
            None => {
                self.host
                    .slot_waiters
                    .borrow_mut()
                    .push_back(cx.waker().clone());
                std::task::Poll::Pending
            }
        }
    }
}

struct WaitDone<'a> {
    host: &'a Host,
    i: u16,
    done: bool,
}

impl std::future::Future for WaitDone<'_> {
    type Output = Outcome;
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Outcome> {
        let s = &self.host.slots[self.i as usize];
        if s.state.get() != SlotState::Done {
            if let Owner::Waiter { waker, .. } = &mut *s.owner.borrow_mut() {
                *waker = Some(cx.waker().clone());
            }
            return std::task::Poll::Pending;
        }
        let owner = std::mem::replace(&mut *s.owner.borrow_mut(), Owner::None);
        let data = match owner {
            Owner::Waiter { buf, .. } => buf,
            _ => Vec::new(),
        };
        let out = Outcome {
            status: s.status.get(),
            failure: s.failure.get(),
            sense: s.sense(),
            sense_bytes: s.sense_bytes(),
            data,
            resid: s.resid.get(),
        };
        self.done = true;
        self.host.free_slot(self.i);
        std::task::Poll::Ready(out)
    }
}

impl Drop for WaitDone<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // The caller went away: the buffer stays in the slot until the LLD
        // is done with it, then the slot frees itself.
        let s = &self.host.slots[self.i as usize];
        if s.state.get() == SlotState::Done {
            self.host.free_slot(self.i);
        } else if let Owner::Waiter { dropped, waker, .. } = &mut *s.owner.borrow_mut() {
            *dropped = true;
            *waker = None;
        }
    }
}

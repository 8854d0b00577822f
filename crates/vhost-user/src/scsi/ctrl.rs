//! The control queue (task management functions, asynchronous
//! notification queries) and the event queue (hot-plug and hot-remove
//! events) of a vhost-user-scsi controller.
//!
//! Task management finds commands by tag in every request queue's task
//! table (`tasks`). ABORT TASK asks that one command to abort: one that
//! has not started is answered `VIRTIO_SCSI_S_ABORTED` without running;
//! one that only moves data to the driver (a read) and is at the bdev
//! stops waiting for it and is answered ABORTED at once (the bdev keeps
//! its buffer until the device is done, no guest memory is written after
//! the answer: the data reaches guest memory only by a copy from that
//! buffer); one that may change the medium (a write) cannot be called
//! back, so the TMF waits for that command alone. Either way it answers
//! FUNCTION COMPLETE once the command's own answer is in the used ring
//! (SAM: the command was aborted, or it completed); a tag not in the task
//! set is FUNCTION COMPLETE at once. QUERY
//! TASK answers FUNCTION SUCCEEDED while that tag runs. ABORT TASK SET,
//! CLEAR TASK SET, LOGICAL UNIT RESET and I_T NEXUS RESET ask every
//! command of the target to abort and complete once none is left; the
//! resets then raise POWER ON, RESET on the unit (the queues apply it
//! before the next command). Control requests are rare: each runs as its
//! own task, so a TMF waiting for I/O does not hold the queue.

use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_scsi as vs;

use super::device::ScsiDevice;
use super::ring::Ring;
use super::wire::{self, resp, Chain, CtrlReq, EVENT_LEN};
use crate::start::VringStart;

/// How long a TMF waits for the commands it covers before it is rejected.
const TMF_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) async fn run_control(s: VringStart<ScsiDevice>) {
    let Some(ring) = Ring::open(s).await else {
        return;
    };
    let r = ring.clone();
    ring.serve(Duration::ZERO, true, || take_control(&r)).await;
    ring.finish().await;
}

fn take_control(ring: &Rc<Ring>) -> usize {
    let mut n = 0;
    loop {
        let mut chain = Chain::default();
        let Some(ok) = ring.pop(&mut chain) else {
            return n;
        };
        n += 1;
        ring.inflight.set(ring.inflight.get() + 1);
        let r = ring.clone();
        ustor_runtime::spawn(async move {
            let len = if ok.is_ok() {
                control(&r, &chain).await
            } else {
                0
            };
            let mem = r.mem.borrow().clone();
            r.complete(&mem, chain.head, len);
            r.inflight.set(r.inflight.get() - 1);
        });
    }
}

/// Answers one control request; the bytes written.
async fn control(ring: &Ring, chain: &Chain) -> u32 {
    let req = {
        let mem = ring.mem.borrow();
        wire::ctrl_req(chain, mem.map())
    };
    match req {
        CtrlReq::Tmf { subtype, lun, tag } => {
            let response = tmf(&ring.dev, subtype, &lun, tag).await;
            let mem = ring.mem.borrow();
            chain.write(mem.map(), 0, &[response]);
            wire::TMF_RESP_LEN as u32
        }
        CtrlReq::An { .. } => {
            // No asynchronous events are offered: event_actual 0.
            let mem = ring.mem.borrow();
            chain.write(mem.map(), 0, &[0, 0, 0, 0, resp::OK]);
            wire::AN_RESP_LEN as u32
        }
        CtrlReq::Bad => 0,
    }
}

/// Runs one task management function; its response code.
async fn tmf(dev: &ScsiDevice, subtype: u32, lun: &[u8; 8], tag: u64) -> u8 {
    let Some(a) = wire::decode_lun(lun) else {
        return resp::BAD_TARGET;
    };
    let t = a.target as usize;
    if dev.targets()[t].is_none() {
        return resp::BAD_TARGET;
    }
    if a.lun != 0 {
        return resp::INCORRECT_LUN;
    }
    tracing::debug!("vhost-scsi: TMF {subtype} for target {t} (tag {tag:#x})");
    let target = a.target;
    match subtype {
        vs::VIRTIO_SCSI_T_TMF_ABORT_TASK => abort_task(dev, target, tag).await,
        vs::VIRTIO_SCSI_T_TMF_ABORT_TASK_SET
        | vs::VIRTIO_SCSI_T_TMF_CLEAR_TASK_SET
        | vs::VIRTIO_SCSI_T_TMF_LOGICAL_UNIT_RESET
        | vs::VIRTIO_SCSI_T_TMF_I_T_NEXUS_RESET => {
            for tb in dev.task_tables() {
                tb.each_of(target, |f| {
                    tb.ask_abort(f);
                });
            }
            dev.wake_request_rings();
            if !drained(dev, t).await {
                return resp::FUNCTION_REJECTED;
            }
            if matches!(
                subtype,
                vs::VIRTIO_SCSI_T_TMF_LOGICAL_UNIT_RESET | vs::VIRTIO_SCSI_T_TMF_I_T_NEXUS_RESET
            ) {
                dev.resets[t].fetch_add(1, Ordering::AcqRel);
            }
            resp::FUNCTION_COMPLETE
        }
        vs::VIRTIO_SCSI_T_TMF_QUERY_TASK => {
            let found = dev
                .task_tables()
                .iter()
                .any(|tb| tb.find(target, tag).is_some());
            if found {
                resp::FUNCTION_SUCCEEDED
            } else {
                resp::FUNCTION_COMPLETE
            }
        }
        vs::VIRTIO_SCSI_T_TMF_QUERY_TASK_SET => {
            if dev.commands_in_flight(a.target) > 0 {
                resp::FUNCTION_SUCCEEDED
            } else {
                resp::FUNCTION_COMPLETE
            }
        }
        // CLEAR ACA (no ACA is established) and unknown functions.
        _ => resp::FUNCTION_REJECTED,
    }
}

/// ABORT TASK: the command `tag` of `target`, wherever it runs.
async fn abort_task(dev: &ScsiDevice, target: u8, tag: u64) -> u8 {
    let found = dev
        .task_tables()
        .into_iter()
        .find_map(|tb| tb.find(target, tag).map(|f| (tb, f)));
    // Not in the task set (never sent, or already answered).
    let Some((tb, f)) = found else {
        return resp::FUNCTION_COMPLETE;
    };
    tb.ask_abort(f);
    // Its ring wakes the command if it can stop early.
    dev.wake_request_rings();
    let deadline = Instant::now() + TMF_TIMEOUT;
    while tb.running(f) {
        if Instant::now() >= deadline {
            return resp::FUNCTION_REJECTED;
        }
        ustor_runtime::sleep(Duration::from_micros(200)).await;
    }
    resp::FUNCTION_COMPLETE
}

/// Waits until target `t` has no command in flight (false: timed out).
async fn drained(dev: &ScsiDevice, t: usize) -> bool {
    let deadline = Instant::now() + TMF_TIMEOUT;
    while dev.commands_in_flight(t as u8) > 0 {
        if Instant::now() >= deadline {
            return false;
        }
        ustor_runtime::sleep(Duration::from_micros(200)).await;
    }
    true
}

pub(crate) async fn run_events(s: VringStart<ScsiDevice>) {
    let Some(ring) = Ring::open(s).await else {
        return;
    };
    ring.dev.event_queue(Some(ring.kick.clone()));
    let mut chain = Chain::default();
    // The driver's buffers wait in the ring for events: a chain left
    // there is no work (false), a kick or a new event is.
    ring.serve(Duration::ZERO, false, || deliver(&ring, &mut chain))
        .await;
    ring.dev.event_queue(None);
    ring.finish().await;
}

/// Puts pending events into the driver's buffers; how many.
fn deliver(ring: &Ring, chain: &mut Chain) -> usize {
    let dev = &ring.dev;
    let mut n = 0;
    while dev.has_events() {
        let Some(ok) = ring.pop(chain) else {
            break;
        };
        let Some((ev, missed)) = dev.pop_event() else {
            ring.complete(&ring.mem.borrow(), chain.head, 0);
            break;
        };
        let mem = ring.mem.borrow();
        if ok.is_err() || chain.wr_len < EVENT_LEN {
            // A buffer that cannot hold an event goes back empty.
            ring.complete(&mem, chain.head, 0);
            dev.unpop_event(ev, missed);
            continue;
        }
        chain.write(mem.map(), 0, &ev.encode(missed));
        ring.complete(&mem, chain.head, EVENT_LEN as u32);
        n += 1;
    }
    n
}

//! Workloads without data: `flush` and `unmap`. Each queue slot issues one
//! flush or unmap of `bs` at a time, walking the bdev in order (SYNCHRONIZE
//! CACHE and UNMAP on a SCSI disk, deallocation on NVMe).
//!
//! With `--verify` every slot first writes its own units with
//! self-checking blocks, then reads each unit back after the flush or unmap
//! that covered it: a flush must leave the blocks intact, an unmap must
//! leave zeroes (the run refuses a bdev that does not promise that, see
//! [`super::BenchError::UnmapNotZeroing`]). Only the flush or unmap is
//! timed; the read back is not part of its latency.

use std::rc::Rc;

use ustor_bdev::{BdevError, IoChannel, IoType};
use ustor_runtime::{ticks, IoBuf};

use super::{CoreState, Shared, SlotPlan};
use crate::verify;

/// One queue slot of a flush or unmap workload (`kind`).
pub(super) async fn slot(
    kind: IoType,
    ch: IoChannel,
    plan: SlotPlan,
    core: Rc<CoreState>,
    sh: Rc<Shared>,
) {
    let cfg = &sh.cfg;
    let mut buf = if cfg.verify {
        let buf = IoBuf::alloc(cfg.bs).await;
        Some(super::prefill(&ch, plan, &core, &sh, buf).await)
    } else {
        None
    };
    let deadline = core.wait_start().await;
    let mut seq = 0u64;
    loop {
        let t0 = ticks::now();
        if t0 >= deadline {
            break;
        }
        // Verified slots walk their own units; others share the reactor's
        // cursor over the whole bdev, as sequential reads and writes do.
        let unit = if cfg.verify {
            let u = seq;
            seq = (seq + 1) % plan.units;
            u
        } else {
            core.next_in_order(plan.units)
        };
        let lba = (plan.start + unit) * sh.bpi;
        let r = match kind {
            IoType::Unmap => ch.unmap(lba, sh.bpi).await,
            _ => ch.flush(lba, sh.bpi).await,
        };
        core.record(ticks::now().saturating_sub(t0), r.is_ok(), false);
        if matches!(r, Err(BdevError::Removed)) {
            break;
        }
        if r.is_ok() {
            if let Some(b) = buf.take() {
                buf = Some(read_back(kind, &ch, lba, b, &core, &sh).await);
            }
        }
        // A driver that completes inline never makes this task wait.
        ustor_runtime::yield_now().await;
    }
}

/// Reads a unit after its flush or unmap and checks what it holds.
async fn read_back(
    kind: IoType,
    ch: &IoChannel,
    lba: u64,
    buf: IoBuf,
    core: &CoreState,
    sh: &Shared,
) -> IoBuf {
    let (r, buf) = ch.read(lba, sh.bpi, buf).await;
    if r.is_err() {
        core.errors.set(core.errors.get() + 1);
        return buf;
    }
    let bs = ch.block_size() as usize;
    let bad = if kind == IoType::Unmap {
        buf.iter().position(|b| *b != 0).map(|at| {
            (
                lba + (at / bs) as u64,
                "unmapped block does not read as zeroes",
            )
        })
    } else {
        verify::check(&buf, bs, lba, sh.cfg.seed, 1)
            .err()
            .map(|m| (m.lba, m.what))
    };
    if let Some((at, what)) = bad {
        core.mismatch(at, what);
    }
    buf
}

//! A minimal virtual bdev for tests: a 2-way stripe built on
//! [`ustor_bdev::Children`]. Strip `k` of the stripe is strip `k / 2` of
//! base `k % 2`; each piece of an I/O becomes one child I/O on the base's
//! channel over the parent's own buffers; an I/O inside one strip is
//! forwarded whole (`IoHandle::forward`).
#![allow(dead_code)]

use std::sync::Arc;

use serde_json::Value;
use ustor_bdev::{
    Bdev, BdevChannel, BdevError, BdevInfo, ControlError, Desc, IoChannel, IoHandle, IoType,
    Registry,
};

pub struct StripeBdev {
    info: BdevInfo,
    bases: [Desc; 2],
    strip: u64,
}

/// Creates stripe `name` over bases `a` and `b` (same block size) with
/// strips of `strip` blocks; `max_transfer_blocks` makes the layer above
/// split (0: none).
pub fn create(
    reg: &Registry,
    name: &str,
    a: &str,
    b: &str,
    strip: u64,
    max_transfer_blocks: u32,
) -> Result<(), ControlError> {
    let open = |n: &str| -> Result<Desc, ControlError> {
        let d = reg.open(n, true, |_| {})?;
        d.claim_exclusive(name)?;
        Ok(d)
    };
    let bases = [open(a)?, open(b)?];
    let (ia, ib) = (bases[0].info(), bases[1].info());
    assert_eq!(
        ia.block_size, ib.block_size,
        "stripe bases differ in block size"
    );
    let per_base = ia.num_blocks.min(ib.num_blocks) / strip * strip;
    let info = BdevInfo {
        name: name.into(),
        uuid: uuid::Uuid::new_v4(),
        product_name: "Stripe disk".into(),
        module: "stripe",
        block_size: ia.block_size,
        num_blocks: 2 * per_base,
        required_alignment: ia.required_alignment.max(ib.required_alignment),
        max_transfer_blocks,
        optimal_boundary_blocks: 0,
        write_cache: ia.write_cache || ib.write_cache,
        unmap_reads_zero: ia.unmap_reads_zero && ib.unmap_reads_zero,
        memory_resident: ia.memory_resident && ib.memory_resident,
    };
    reg.register(Arc::new(StripeBdev { info, bases, strip }))?;
    Ok(())
}

struct StripeChannel {
    bases: [IoChannel; 2],
    strip: u64,
    bs: u64,
}

impl BdevChannel for StripeChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        let within = d.offset_blocks % self.strip;
        if !matches!(d.kind, IoType::Flush | IoType::Reset) && within + d.num_blocks <= self.strip {
            // Inside one strip: forwarded whole (falls back to a child when
            // the base would split it).
            let k = d.offset_blocks / self.strip;
            return io.forward(&self.bases[(k % 2) as usize], k / 2 * self.strip + within);
        }
        let kids = io.into_children();
        if matches!(d.kind, IoType::Flush | IoType::Reset) {
            for b in &self.bases {
                let n = if d.kind == IoType::Reset {
                    0
                } else {
                    b.num_blocks()
                };
                kids.submit(b, d.kind, 0, n, 0);
            }
            return;
        }
        let (mut lba, end) = (d.offset_blocks, d.offset_blocks + d.num_blocks);
        while lba < end {
            let (k, within) = (lba / self.strip, lba % self.strip);
            let n = (self.strip - within).min(end - lba);
            let base = &self.bases[(k % 2) as usize];
            let at = (lba - d.offset_blocks) * self.bs;
            kids.submit(base, d.kind, k / 2 * self.strip + within, n, at);
            lba += n;
        }
    }
}

impl Bdev for StripeBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }
    fn io_type_supported(&self, t: IoType) -> bool {
        self.bases.iter().all(|b| b.io_type_supported(t))
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        Ok(Box::new(StripeChannel {
            bases: [self.bases[0].channel()?, self.bases[1].channel()?],
            strip: self.strip,
            bs: self.info.block_size as u64,
        }))
    }
    fn config_json(&self) -> Value {
        Value::Null
    }
}

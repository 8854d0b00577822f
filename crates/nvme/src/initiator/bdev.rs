//! A remote namespace as a bdev: `<ctrlr>n<nsid>`. Each reactor that opens
//! a channel gets its own I/O queue pair, connected lazily on that reactor.

use std::rc::Rc;
use std::sync::Arc;

use serde_json::{json, Value};
use ustor_bdev::{Bdev, BdevChannel, BdevError, BdevInfo, IoHandle, IoType};

use super::ctrlr::{Ctrlr, NsInfo};
use super::qpair::{self, Qp};

pub(crate) struct NvmeBdev {
    ctrlr: Arc<Ctrlr>,
    ns: NsInfo,
    info: BdevInfo,
}

impl NvmeBdev {
    pub fn new(ctrlr: Arc<Ctrlr>, ns: NsInfo) -> NvmeBdev {
        let bs = ns.block_size;
        // NLB is 16 bits; MDTS caps the transfer too.
        let mut max_blocks = 65536u32;
        let mdts = ctrlr.mdts_bytes();
        if mdts > 0 {
            max_blocks = max_blocks.min(mdts / bs);
        }
        // The NGUID as the bdev's UUID (parsed through serde, so this crate
        // needs no uuid dependency of its own); nil when the namespace has none.
        // Mixed with the controller name: the same namespace reached through
        // two controllers (or a loopback target in this process) must not
        // collide in the registry.
        let mut g = ns.nguid;
        let k = crate::wire::crc(ctrlr.p.name.as_bytes()).to_le_bytes();
        for (b, x) in g.iter_mut().zip(k.iter().cycle()) {
            *b ^= x;
        }
        let text = format!(
            "{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
            g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9], g[10], g[11], g[12], g[13], g[14], g[15]
        );
        let uuid = serde_json::from_value(Value::String(text)).unwrap_or_default();
        let info = BdevInfo {
            name: format!("{}n{}", ctrlr.p.name, ns.nsid),
            uuid,
            product_name: "NVMe disk".into(),
            module: "nvme",
            block_size: bs,
            num_blocks: ns.num_blocks,
            required_alignment: 1,
            max_transfer_blocks: max_blocks,
            optimal_boundary_blocks: 0,
            write_cache: false,
            // The remote namespace decides; promise nothing.
            unmap_reads_zero: false,
            memory_resident: false,
        };
        NvmeBdev { ctrlr, ns, info }
    }

    pub fn name(&self) -> &str {
        &self.info.name
    }
}

struct NvmeChannel {
    qp: Rc<Qp>,
}

impl BdevChannel for NvmeChannel {
    fn submit(&self, io: IoHandle) {
        self.qp.submit(io);
    }
    fn outstanding(&self) -> usize {
        self.qp.outstanding()
    }
}

impl Drop for NvmeChannel {
    fn drop(&mut self) {
        self.qp.close();
    }
}

impl Bdev for NvmeBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }

    fn io_type_supported(&self, t: IoType) -> bool {
        matches!(
            t,
            IoType::Read
                | IoType::Write
                | IoType::Flush
                | IoType::WriteZeroes
                | IoType::Unmap
                | IoType::Reset
        )
    }

    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        let qid = self.ctrlr.alloc_qid().ok_or(BdevError::Io(libc::EBUSY))?;
        let qp = Qp::new(self.ctrlr.clone(), self.ns.nsid, qid);
        ustor_runtime::spawn(qpair::drive(qp.clone()));
        Ok(Box::new(NvmeChannel { qp }))
    }

    fn config_json(&self) -> Value {
        // The controller's attach call recreates every namespace bdev.
        Value::Null
    }

    fn driver_info(&self) -> Value {
        json!({"nvme": {"ctrlr": self.ctrlr.p.name, "nsid": self.ns.nsid,
            "trid": {"trtype": "TCP", "traddr": self.ctrlr.addr.ip().to_string(),
                     "trsvcid": self.ctrlr.addr.port().to_string(), "subnqn": self.ctrlr.p.subnqn}}})
    }
}

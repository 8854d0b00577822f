//! `scsi_vfio_attach_host` {pci_address, driver, reactor?, cmd_timeout_ms?,
//! tmf_timeout_ms?} and
//! `scsi_vfio_detach_host` {pci_address}: userspace PCI SCSI HBAs over
//! VFIO (crates/scsi-vfio) as hosts of the SCSI mid-layer. Attached hosts
//! appear in the scsi subsystem's save_config.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use ustor_rpc::{parse_params, RpcError, RPC_RUNTIME};
use ustor_scsi::lld::TransportError;
use ustor_scsi::mid::HostConfig;

use super::Ctx;

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Attach {
    /// Full PCI address, e.g. `0000:00:04.0`, bound to vfio-pci.
    pci_address: String,
    /// `virtio-scsi`.
    driver: String,
    /// Reactor that owns the host (its rings, its DMA-mapped buffer pool).
    #[serde(default)]
    reactor: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cmd_timeout_ms: Option<u64>,
    /// How long a TMF (abort, LUN reset) may take before it counts as
    /// failed and error handling escalates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tmf_timeout_ms: Option<u64>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Detach {
    pci_address: String,
}

fn attach(c: &Ctx, p: &Attach) -> Result<u32, RpcError> {
    if p.reactor >= c.rt.num_reactors() {
        return Err(RpcError::invalid_param(
            "reactor",
            format!("no reactor {}", p.reactor),
        ));
    }
    let mut hc = HostConfig::default();
    if let Some(t) = p.cmd_timeout_ms {
        hc.cmd_timeout_ms = t;
    }
    let mut opts = ustor_scsi_vfio::Options::default();
    if let Some(t) = p.tmf_timeout_ms {
        if t == 0 {
            return Err(RpcError::invalid_param("tmf_timeout_ms", "must be > 0"));
        }
        opts.tmf_timeout = std::time::Duration::from_millis(t);
    }
    // Every reactor's pool is mapped, so I/O that another reactor's
    // bdev channel sends to this host is zero-copy too.
    opts.pools = c
        .rt
        .call_all(|_| ustor_runtime::buf::pool_region().map(|r| (r.iov_base as usize, r.iov_len)))
        .unwrap_or_default()
        .into_iter()
        .flatten()
        .collect();
    // The LLD is made on its reactor and can only report a TransportError
    // there: the driver's own message comes back through `why`.
    let why: Arc<Mutex<Option<(i32, String)>>> = Arc::default();
    let (w, bdf, driver) = (why.clone(), p.pci_address.clone(), p.driver.clone());
    let r = c.scsi.add_host(p.reactor, hc, move || {
        ustor_scsi_vfio::attach(&bdf, &driver, opts).map_err(|e| {
            let errno = e.errno();
            *w.lock().unwrap_or_else(|e| e.into_inner()) = Some((errno, e.to_string()));
            TransportError::NoDevice
        })
    });
    match r {
        Ok(host) => Ok(host),
        Err(e) => Err(match why.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some((errno, msg)) => RpcError::errno_msg(errno, msg),
            None => RpcError::errno_msg(e.errno(), format!("{}: {e}", p.pci_address)),
        }),
    }
}

pub fn register(
    ctx: &Ctx,
    attached: Arc<Mutex<Vec<Value>>>,
) -> Result<(), ustor_rpc::RegisterError> {
    let hosts: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let (at, hs) = (attached.clone(), hosts.clone());
    ctx.method("scsi_vfio_attach_host", RPC_RUNTIME, move |c, params| {
        let p: Attach = parse_params(params.clone())?;
        let mut h = hs.lock().unwrap_or_else(|e| e.into_inner());
        if h.contains_key(&p.pci_address) {
            return Err(RpcError::errno_msg(
                libc::EEXIST,
                format!("{} is already attached", p.pci_address),
            ));
        }
        let host = attach(c, &p)?;
        h.insert(p.pci_address.clone(), host);
        at.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(json!({"method": "scsi_vfio_attach_host", "params": params}));
        Ok(json!(host))
    })?;
    ctx.method("scsi_vfio_detach_host", RPC_RUNTIME, move |c, params| {
        let p: Detach = parse_params(params)?;
        let mut h = hosts.lock().unwrap_or_else(|e| e.into_inner());
        let Some(&host) = h.get(&p.pci_address) else {
            return Err(RpcError::errno_msg(
                libc::ENODEV,
                format!("{} is not attached", p.pci_address),
            ));
        };
        c.scsi.remove_host(host).map_err(|e| {
            RpcError::errno_msg(e.errno(), format!("detach {}: {e}", p.pci_address))
        })?;
        h.remove(&p.pci_address);
        attached
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|v| {
                v["method"] != "scsi_vfio_attach_host"
                    || v["params"]["pci_address"] != p.pci_address
            });
        Ok(json!(true))
    })?;
    Ok(())
}

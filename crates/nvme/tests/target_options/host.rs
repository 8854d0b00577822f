//! The initiator side: a runtime and registry without a target.
use std::sync::{mpsc, Arc};
use std::time::Duration;

use ustor_bdev::{BdevError, Registry};
use ustor_nvme::initiator::{
    attach_controller, detach_controller, io_queue_stats, AttachParams, DetachParams,
    InitiatorError,
};
use ustor_runtime::{IoBuf, Runtime, RuntimeHandle};

pub struct Host {
    pub handle: RuntimeHandle,
    pub registry: Arc<Registry>,
    _rt: Option<Runtime>,
}

/// A runtime of its own (for a fake controller).
pub fn host() -> Host {
    let rt = super::common::two_reactors();
    let registry = Registry::new(Some(rt.handle()));
    Host {
        handle: rt.handle(),
        registry,
        _rt: Some(rt),
    }
}

/// The target's runtime and registry (for the real target).
pub fn beside(e: &super::Env) -> Host {
    Host {
        handle: e.rt.handle(),
        registry: e.registry.clone(),
        _rt: None,
    }
}

impl Host {
    pub fn attach_with(&self, p: &AttachParams) -> Result<String, InitiatorError> {
        Ok(attach_controller(&self.handle, &self.registry, p)?[0].clone())
    }

    pub fn attach(&self, name: &str, port: u16, digests: bool) -> Result<String, InitiatorError> {
        let mut p = AttachParams::tcp(name, "127.0.0.1", &port.to_string(), super::NQN);
        p.hdgst = digests;
        p.ddgst = digests;
        p.reconnect_delay_sec = 1;
        p.ctrlr_loss_timeout_sec = 10;
        self.attach_with(&p)
    }

    pub fn detach(&self, name: &str) {
        detach_controller(&DetachParams { name: name.into() }).unwrap();
    }

    /// Writes `data` at block `slba` through the bdev, then reads it
    /// back; the read data. Bounded: a hang fails the test.
    pub fn write_read(
        &self,
        bdev: &str,
        slba: u64,
        data: Option<Vec<u8>>,
        len: usize,
    ) -> Result<Vec<u8>, BdevError> {
        let (reg, name, h) = (self.registry.clone(), bdev.to_string(), self.handle.clone());
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let r = h.block_on(1, move || async move {
                let d = reg.open(&name, true, |_| {}).expect("open");
                let ch = d.channel()?;
                if let Some(data) = data {
                    let mut b = IoBuf::alloc(data.len()).await;
                    b.copy_from_slice(&data);
                    let nb = (data.len() / 512) as u64;
                    ch.write(slba, nb, b).await.0?;
                }
                let mut b = IoBuf::alloc(len).await;
                b.fill(0xee);
                let (r, b) = ch.read(slba, (len / 512) as u64, b).await;
                r?;
                Ok::<_, BdevError>(b[..].to_vec())
            });
            let _ = tx.send(r.expect("reactor"));
        });
        rx.recv_timeout(Duration::from_secs(30))
            .expect("I/O through the initiator hung")
    }

    /// The I/O queues' coalescing raises and lowers, summed.
    pub fn adaptive_moves(&self, name: &str) -> (u64, u64) {
        let st = io_queue_stats(name).unwrap();
        st.iter().fold((0, 0), |a, q| {
            (a.0 + q.coalesce.raises, a.1 + q.coalesce.lowers)
        })
    }
}

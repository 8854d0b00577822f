//! One running ustor instance: reactors, bdev registry, targets, the RPC
//! method table and the control thread. `serve`, `bench` and tests build
//! one of these.

use std::sync::Arc;

use ustor_bdev::Registry;
use ustor_nbd::server::NbdServer;
use ustor_rpc::MethodTable;
use ustor_runtime::{Runtime, RuntimeConfig, RuntimeHandle};

use crate::control::Control;
use crate::targets::{self, IscsiTarget, NbdTarget, NvmfTarget, Stopped, Target, VhostTarget};

/// How long shutdown lets the targets' connections drain, all together.
pub const DRAIN_BUDGET: std::time::Duration = std::time::Duration::from_secs(2);

pub struct App {
    pub registry: Arc<Registry>,
    pub nbd: Arc<NbdServer>,
    /// The file service (its writes are durable when answered: nothing to
    /// flush at exit).
    pub fs: Arc<ustor_fs::server::FsServer>,
    pub nvmf: ustor_nvme::nvmf::Target,
    /// The vhost-user controllers (`ustor serve -S DIR` sets their socket
    /// directory).
    pub vhost: Arc<ustor_vhost::VhostTarget>,
    /// Every protocol target, in the order shutdown stops them.
    pub targets: Vec<Arc<dyn Target>>,
    pub table: MethodTable,
    pub rt: RuntimeHandle,
    pub cfg: RuntimeConfig,
    // Dropped last: the runtime outlives every user of its handle above.
    _control: Control,
    runtime: Option<Runtime>,
}

impl App {
    /// Starts the reactors and registers every RPC method.
    pub fn start(cfg: RuntimeConfig) -> std::io::Result<App> {
        let runtime = Runtime::start(cfg.clone())?;
        let rt = runtime.handle();
        let registry = Registry::new(Some(rt.clone()));
        ustor_bdev::modules::register_builtin(&registry)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        ustor_vbdev::register(&registry).map_err(|e| std::io::Error::other(e.to_string()))?;
        let nbd = Arc::new(NbdServer::new(rt.clone()));
        let fs = Arc::new(ustor_fs::server::FsServer::new(rt.clone()));
        let iscsi = Arc::new(ustor_iscsi_target::IscsiTarget::new(
            rt.clone(),
            registry.clone(),
        ));
        let nvmf = ustor_nvme::nvmf::Target::new(rt.clone(), registry.clone());
        let scsi = ustor_scsi::ScsiStack::new(rt.clone(), registry.clone());
        let vhost = Arc::new(ustor_vhost::VhostTarget::new(rt.clone(), registry.clone()));
        let table = MethodTable::new();
        let control = Control::start()?;
        let ctx = crate::methods::Ctx {
            rt: rt.clone(),
            registry: registry.clone(),
            nbd: nbd.clone(),
            fs: fs.clone(),
            iscsi: iscsi.clone(),
            nvmf: nvmf.clone(),
            scsi,
            vhost: vhost.clone(),
            table: table.clone(),
            ctl: control.sender(),
        };
        crate::methods::register_all(&ctx).map_err(|e| std::io::Error::other(e.to_string()))?;
        let targets: Vec<Arc<dyn Target>> = vec![
            Arc::new(NbdTarget(nbd.clone())),
            Arc::new(NvmfTarget(nvmf.clone())),
            Arc::new(IscsiTarget(iscsi)),
            Arc::new(VhostTarget(vhost.clone())),
        ];
        for t in &targets {
            t.start()?;
        }
        Ok(App {
            registry,
            nbd,
            fs,
            nvmf,
            vhost,
            targets,
            table,
            rt,
            cfg,
            _control: control,
            runtime: Some(runtime),
        })
    }

    /// Stops every target, lets their connections drain (bounded by
    /// [`DRAIN_BUDGET`]), flushes every bdev, and stops the reactors.
    /// Returns how each target ended (empty if already shut down).
    pub fn shutdown(&mut self) -> Vec<Stopped> {
        if self.runtime.is_none() {
            return Vec::new();
        }
        let stopped = targets::stop_all(&self.targets, DRAIN_BUDGET);
        self.fs.stop();
        self.flush_all();
        if let Some(mut rt) = self.runtime.take() {
            rt.stop();
        }
        stopped
    }

    /// Flushes every bdev that takes a flush (durability of all
    /// acknowledged writes at exit).
    fn flush_all(&self) {
        for e in self.registry.list() {
            let name = e.info().name.clone();
            if let Ok(desc) = self.registry.open(&name, true, |_| {}) {
                let r = self.rt.block_on(0, move || async move {
                    match desc.channel() {
                        Ok(ch) if ch.supports(ustor_bdev::IoType::Flush) => {
                            ch.flush(0, ch.num_blocks()).await
                        }
                        Ok(_) => Ok(()),
                        Err(e) => Err(e),
                    }
                });
                if let Ok(Err(e)) = r {
                    tracing::warn!("flushing {name} at exit: {e}");
                }
            }
        }
    }
}

impl Drop for App {
    fn drop(&mut self) {
        if self.runtime.is_some() {
            self.shutdown();
        }
    }
}

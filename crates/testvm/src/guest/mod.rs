//! Booting one guest: the [`GuestBuilder`] options, the QEMU command line,
//! the per-run initramfs (test script, environment, shares), the timeout,
//! and reading the exit status back from the serial log.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::assets::{self, Assets};
use crate::cpio::CpioWriter;
use crate::error::{GuestError, Result};
use crate::lock::FileLock;
use crate::qmp::{Action, Hooks, HostFn};

/// The line init prints after the test script returns.
pub const EXIT_MARKER: &str = "USTOR-GUEST-EXIT=";
/// Prefix of the `key=value` lines scripts report with `kv` (tests/guest/lib.sh).
pub const KV_MARKER: &str = "USTOR-KV ";

/// Helpers every guest script can source as `/ustor/lib.sh`.
const GUEST_LIB: &str = include_str!("../../../../tests/guest/lib.sh");

/// Guest RAM default: room for the ~60 MB initramfs, page cache for a
/// 64–256 MB test disk and the tools, without making memfd sharing costly.
const DEFAULT_MEMORY_MIB: u32 = 768;
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Path of a script in the workspace's `tests/guest/` directory.
pub fn guest_script(name: &str) -> PathBuf {
    assets::workspace_root().join("tests/guest").join(name)
}

#[derive(Debug, Clone)]
enum Script {
    Inline(String),
    File(PathBuf),
}

/// Describes one guest run. Build it, then call [`GuestBuilder::run`].
#[derive(Debug, Clone)]
pub struct GuestBuilder {
    script: Option<Script>,
    env: Vec<(String, String)>,
    files: Vec<(String, Vec<u8>)>,
    binaries: Vec<PathBuf>,
    /// Socket and queue count of each vhost-user-blk device.
    vhost_user_blk: Vec<(PathBuf, u16)>,
    vhost_user_scsi: Vec<PathBuf>,
    /// QEMU reconnects to vhost-user sockets (`reconnect=1`).
    vhost_user_reconnect: bool,
    vhost_user_packed: bool,
    scsi_disks: Vec<PathBuf>,
    shares: Vec<(PathBuf, String)>,
    timeout: Duration,
    cpus: u32,
    memory_mib: u32,
    cmdline: Vec<String>,
    qemu_args: Vec<String>,
    log_file: Option<PathBuf>,
    iommu: bool,
    /// What to do when the script prints `USTOR-QMP NAME`.
    qmp_actions: Vec<(String, Action)>,
}

impl Default for GuestBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl GuestBuilder {
    pub fn new() -> Self {
        GuestBuilder {
            script: None,
            env: Vec::new(),
            files: Vec::new(),
            binaries: Vec::new(),
            vhost_user_blk: Vec::new(),
            vhost_user_scsi: Vec::new(),
            vhost_user_reconnect: false,
            vhost_user_packed: false,
            scsi_disks: Vec::new(),
            shares: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            // One vCPU: CI has two cores and the server under test needs one.
            cpus: 1,
            memory_mib: DEFAULT_MEMORY_MIB,
            cmdline: Vec::new(),
            qemu_args: Vec::new(),
            log_file: None,
            iommu: false,
            qmp_actions: Vec::new(),
        }
    }

    /// The test script's text (run by busybox `sh` as `/ustor/test.sh`).
    pub fn script(mut self, text: impl Into<String>) -> Self {
        self.script = Some(Script::Inline(text.into()));
        self
    }

    /// A host file to run as the test script (read when the guest starts).
    pub fn script_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.script = Some(Script::File(path.into()));
        self
    }

    /// An environment variable for the script. Names must be shell
    /// identifiers; values may hold anything (they are single-quoted).
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Passes on to the guest script each of `keys` that is set in this
    /// process's environment (how benchmark runners forward their knobs).
    pub fn env_from_host(mut self, keys: &[&str]) -> Self {
        for k in keys {
            if let Ok(v) = std::env::var(k) {
                self = self.env(*k, v);
            }
        }
        self
    }

    /// The run's wall-clock limit from `GUEST_TIMEOUT_S` when set, else
    /// `default_s` seconds.
    pub fn timeout_from_env(self, default_s: u64) -> Self {
        let s = std::env::var("GUEST_TIMEOUT_S")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default_s);
        self.timeout(Duration::from_secs(s))
    }

    /// An extra file at `/ustor/<name>` in the guest.
    pub fn file(mut self, name: impl Into<String>, contents: impl Into<Vec<u8>>) -> Self {
        self.files.push((name.into(), contents.into()));
        self
    }

    /// Ships a host executable to `/ustor/bin/<file name>` (a stripped
    /// copy when `strip` is available) with every shared library `ldd`
    /// lists for it, at the host's paths (the base image has only the
    /// tools' libraries).
    pub fn binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.binaries.push(path.into());
        self
    }

    /// A vhost-user-blk device served on this unix socket (`/dev/vdX` in the
    /// guest, in the order added). Guest RAM becomes a shared memfd.
    pub fn vhost_user_blk(self, socket: impl Into<PathBuf>) -> Self {
        self.vhost_user_blk_queues(socket, 1)
    }

    /// [`Self::vhost_user_blk`] with `queues` virtqueues (`num-queues`).
    pub fn vhost_user_blk_queues(mut self, socket: impl Into<PathBuf>, queues: u16) -> Self {
        self.vhost_user_blk.push((socket.into(), queues));
        self
    }

    /// QEMU reconnects to its vhost-user sockets every second after the
    /// backend goes away (`-chardev socket,...,reconnect=1`), so a
    /// backend may be killed and started again under a running guest.
    pub fn vhost_user_reconnect(mut self) -> Self {
        self.vhost_user_reconnect = true;
        self
    }

    /// The vhost-user devices use packed virtqueues (`packed=on`; the
    /// backend must offer VIRTIO_F_RING_PACKED).
    pub fn vhost_user_packed(mut self) -> Self {
        self.vhost_user_packed = true;
        self
    }

    /// A vhost-user-scsi controller served on this unix socket.
    pub fn vhost_user_scsi(mut self, socket: impl Into<PathBuf>) -> Self {
        self.vhost_user_scsi.push(socket.into());
        self
    }

    /// A raw host file as a disk on a virtio-scsi controller (`/dev/sdX`).
    pub fn virtio_scsi_disk(mut self, file: impl Into<PathBuf>) -> Self {
        self.scsi_disks.push(file.into());
        self
    }

    /// A host directory shared over 9p and mounted at `/mnt/share` (the
    /// first) or `/mnt/shareN`.
    pub fn share_dir(self, dir: impl Into<PathBuf>) -> Self {
        let n = self.shares.len();
        let mnt = if n == 0 {
            "/mnt/share".to_string()
        } else {
            format!("/mnt/share{n}")
        };
        self.share_dir_at(dir, mnt)
    }

    /// A host directory shared over 9p and mounted at `mountpoint`.
    pub fn share_dir_at(mut self, dir: impl Into<PathBuf>, mountpoint: impl Into<String>) -> Self {
        self.shares.push((dir.into(), mountpoint.into()));
        self
    }

    /// Wall-clock limit for the whole run, boot included.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn cpus(mut self, cpus: u32) -> Self {
        self.cpus = cpus.max(1);
        self
    }

    pub fn memory_mib(mut self, mib: u32) -> Self {
        self.memory_mib = mib.max(128);
        self
    }

    /// An extra kernel command-line word.
    pub fn kernel_arg(mut self, arg: impl Into<String>) -> Self {
        self.cmdline.push(arg.into());
        self
    }

    /// Extra QEMU arguments, appended verbatim.
    pub fn qemu_arg(mut self, arg: impl Into<String>) -> Self {
        self.qemu_args.push(arg.into());
        self
    }

    /// Also copy the serial log to this file (kept after the run).
    /// A q35 machine with an emulated Intel IOMMU (`intel-iommu`, before
    /// every other device), for VFIO in the guest; add
    /// `kernel_arg("intel_iommu=on")` and devices with
    /// `iommu_platform=on` (virtio) on `bus=pcie.0`.
    pub fn iommu(mut self) -> Self {
        self.iommu = true;
        self
    }

    pub fn log_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.log_file = Some(path.into());
        self
    }

    /// When the script prints `USTOR-QMP name` (lib.sh: `qmp name`), send
    /// `commands` (QMP JSON, e.g. `{"execute": "device_del", ...}`) on the
    /// guest's QMP socket, once; see [`crate::qmp`].
    pub fn on_qmp(mut self, name: impl Into<String>, commands: &[&str]) -> Self {
        let cmds = commands.iter().map(|c| c.to_string()).collect();
        self.qmp_actions.push((name.into(), Action::Qmp(cmds)));
        self
    }

    /// When the script prints `USTOR-QMP name` (lib.sh: `qmp name`), run
    /// `action` on the host, once, while the guest runs: for peers outside
    /// QEMU that the guest's disks reach (an NBD server's bdevs, say). What
    /// it returns goes to [`GuestOutcome::host_replies`].
    pub fn on_host(
        mut self,
        name: impl Into<String>,
        action: impl Fn() -> String + Send + Sync + 'static,
    ) -> Self {
        let f = HostFn(std::sync::Arc::new(action));
        self.qmp_actions.push((name.into(), Action::Host(f)));
        self
    }

    /// Boots the guest, runs the script and waits for power-off. Guest runs
    /// are serialized machine-wide; the timeout starts once this run holds
    /// the lock.
    pub fn run(&self) -> Result<GuestOutcome> {
        self.validate()?;
        let script = match &self.script {
            None => return Err(GuestError::Invalid("no script given".into())),
            Some(Script::Inline(s)) => s.clone(),
            Some(Script::File(p)) => fs::read_to_string(p)
                .map_err(|e| GuestError::io(format!("read guest script {}", p.display()), e))?,
        };
        let assets = assets::ensure()?;
        let qemu = qemu_binary()?;
        let cache = assets::cache_dir();
        let _lock = FileLock::exclusive(&cache.join("run.lock"))?;

        let dir = tempfile::Builder::new()
            .prefix("ustor-guest-")
            .tempdir()
            .map_err(|e| GuestError::io("create guest run dir", e))?;
        let initrd = dir.path().join("initrd.cpio");
        self.write_initrd(&assets, &script, &initrd)?;
        let serial = dir.path().join("serial.log");
        let qemu_out = dir.path().join("qemu.out");
        let mut cmd = Command::new(&qemu);
        cmd.args(self.qemu_argv(&assets, &initrd, &serial));
        let out = File::create(&qemu_out)
            .map_err(|e| GuestError::io(format!("create {}", qemu_out.display()), e))?;
        let err = out
            .try_clone()
            .map_err(|e| GuestError::io("dup qemu output file", e))?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);

        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .map_err(|e| GuestError::io(format!("spawn `{}`", assets::describe(&cmd)), e))?;
        let mut hooks = Hooks::new(&self.qmp_actions, qmp_socket(&serial));
        // Some(Ok(status)): exited; Some(Err(e)): cannot wait; None: timed out.
        let waited = testkit::try_wait_for(self.timeout, || {
            hooks.poll(&serial);
            child.try_wait().transpose()
        });
        let status = match waited {
            Some(Ok(status)) => Some(status),
            None => None,
            Some(Err(e)) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(GuestError::io("wait for qemu", e));
            }
        };
        let duration = started.elapsed();
        if status.is_none() {
            // Child::kill sends SIGKILL to exactly the PID we spawned.
            let _ = child.kill();
            let _ = child.wait();
        }
        let log = read_log(&serial);
        if let Some(copy) = &self.log_file {
            fs::write(copy, &log)
                .map_err(|e| GuestError::io(format!("copy serial log to {}", copy.display()), e))?;
        }
        let exit_code = parse_exit(&log);
        let (Some(_), Some(exit_code)) = (status, exit_code) else {
            // The run dir is deleted on return; keep the log where a CI job
            // can collect it.
            let log_path = keep_failed_log(&cache, &log);
            return Err(match status {
                None => GuestError::Timeout {
                    timeout: self.timeout,
                    log,
                    log_path,
                },
                Some(status) => GuestError::NoExitMarker {
                    status: status.to_string(),
                    qemu_stderr: fs::read_to_string(&qemu_out)
                        .unwrap_or_default()
                        .trim()
                        .to_string(),
                    log,
                    log_path,
                },
            });
        };
        Ok(GuestOutcome {
            exit_code,
            log,
            duration,
            qmp_replies: hooks.replies,
            host_replies: hooks.host_replies,
        })
    }

    fn validate(&self) -> Result<()> {
        for b in &self.binaries {
            if b.file_name().is_none() || !b.is_file() {
                return Err(GuestError::Invalid(format!(
                    "binary {} is not a file",
                    b.display()
                )));
            }
        }
        for (k, _) in &self.env {
            let ok = !k.is_empty()
                && !k.starts_with(|c: char| c.is_ascii_digit())
                && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !ok {
                return Err(GuestError::Invalid(format!(
                    "env name {k:?} is not a shell identifier"
                )));
            }
        }
        for (name, _) in &self.files {
            if name.is_empty() || name.contains("..") || name.starts_with('/') {
                return Err(GuestError::Invalid(format!(
                    "file name {name:?} must be relative"
                )));
            }
        }
        // QEMU splits option values at commas; a path with one would be
        // misparsed rather than rejected.
        let paths = self
            .vhost_user_blk
            .iter()
            .map(|(p, _)| p)
            .chain(&self.vhost_user_scsi)
            .chain(&self.scsi_disks)
            .chain(self.shares.iter().map(|(p, _)| p));
        for p in paths {
            if p.to_string_lossy().contains(',') {
                return Err(GuestError::Invalid(format!(
                    "path {} contains a comma",
                    p.display()
                )));
            }
            if !p.exists() {
                return Err(GuestError::Invalid(format!(
                    "{} does not exist",
                    p.display()
                )));
            }
        }
        Ok(())
    }

    /// The base initramfs followed by a second archive with this run's
    /// files: the kernel unpacks concatenated archives in order.
    fn write_initrd(&self, assets: &Assets, script: &str, path: &Path) -> Result<()> {
        fs::copy(&assets.initramfs, path)
            .map_err(|e| GuestError::io(format!("copy {}", assets.initramfs.display()), e))?;
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| GuestError::io(format!("open {}", path.display()), e))?;
        let mut w = CpioWriter::new(std::io::BufWriter::new(file));
        let mut env = String::new();
        for (k, v) in &self.env {
            env.push_str(&format!("export {k}={}\n", shell_quote(v)));
        }
        let shares: String = self
            .shares
            .iter()
            .enumerate()
            .map(|(i, (_, mnt))| format!("ustor{i} {mnt}\n"))
            .collect();
        let io = |e| GuestError::io(format!("append run files to {}", path.display()), e);
        w.file("ustor/test.sh", 0o755, script.as_bytes())
            .map_err(io)?;
        w.file("ustor/lib.sh", 0o644, GUEST_LIB.as_bytes())
            .map_err(io)?;
        w.file("ustor/env", 0o644, env.as_bytes()).map_err(io)?;
        w.file("ustor/shares", 0o644, shares.as_bytes())
            .map_err(io)?;
        let modules = self.device_modules().join(" ");
        w.file("ustor/modules", 0o644, modules.as_bytes())
            .map_err(io)?;
        for (name, data) in &self.files {
            w.file(&format!("ustor/{name}"), 0o644, data).map_err(io)?;
        }
        for bin in &self.binaries {
            ship_binary(&mut w, bin, path)?;
        }
        let mut out = w.finish().map_err(io)?;
        out.flush().map_err(io)?;
        Ok(())
    }

    /// Drivers init loads for this run's devices, beyond the boot set.
    fn device_modules(&self) -> Vec<&'static str> {
        let mut m = Vec::new();
        if !self.vhost_user_blk.is_empty() {
            m.push("virtio_blk");
        }
        if !self.scsi_disks.is_empty() || !self.vhost_user_scsi.is_empty() {
            m.push("virtio_scsi");
        }
        if !self.shares.is_empty() {
            m.extend(["9pnet_virtio", "9p"]);
        }
        m
    }

    fn qemu_argv(&self, assets: &Assets, initrd: &Path, serial: &Path) -> Vec<String> {
        let mut cmdline = vec![
            "console=ttyS0".to_string(),
            // Reboot on panic; -no-reboot turns that into QEMU exiting, so a
            // crashed guest ends the run at once instead of at the timeout.
            "panic=-1".into(),
            "oops=panic".into(),
            // Under TCG on a loaded host the boot-time timer check can miss
            // ticks and panic ("IO-APIC + timer doesn't work!").
            "no_timer_check".into(),
            "quiet".into(),
            "loglevel=4".into(),
            "rdinit=/init".into(),
        ];
        cmdline.extend(self.cmdline.iter().cloned());
        let mut a: Vec<String> = [
            "-no-user-config",
            "-nodefaults",
            "-no-reboot",
            // KVM is never used: the host's /dev/kvm (PVM) cannot run a
            // stock kernel, and TCG behaves the same on every CI machine.
            "-accel",
            "tcg,thread=multi",
            "-cpu",
            "max",
            "-display",
            "none",
            "-monitor",
            "none",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if self.iommu {
            // The IOMMU must exist before the devices behind it.
            a.extend(["-M".into(), "q35".into()]);
            a.extend(["-device".into(), "intel-iommu,intremap=off".into()]);
        } else {
            a.extend(["-M".into(), "pc".into()]);
        }
        a.extend(["-smp".into(), self.cpus.to_string()]);
        a.extend(["-m".into(), format!("{}M", self.memory_mib)]);
        a.extend(["-serial".into(), format!("file:{}", serial.display())]);
        if self
            .qmp_actions
            .iter()
            .any(|(_, act)| matches!(act, Action::Qmp(_)))
        {
            let sock = qmp_socket(serial);
            a.extend([
                "-qmp".into(),
                format!("unix:{},server=on,wait=off", sock.display()),
            ]);
        }
        a.extend(["-kernel".into(), assets.vmlinux.display().to_string()]);
        a.extend(["-initrd".into(), initrd.display().to_string()]);
        a.extend(["-append".into(), cmdline.join(" ")]);
        a.extend([
            "-netdev".into(),
            "user,id=net0".into(),
            "-device".into(),
            "virtio-net-pci,netdev=net0".into(),
        ]);
        if !self.vhost_user_blk.is_empty() || !self.vhost_user_scsi.is_empty() {
            // vhost-user backends map guest RAM, so it must be a shareable fd.
            a.extend([
                "-object".into(),
                format!(
                    "memory-backend-memfd,id=mem,size={}M,share=on",
                    self.memory_mib
                ),
                "-numa".into(),
                "node,memdev=mem".into(),
            ]);
        }
        let reconnect = if self.vhost_user_reconnect {
            ",reconnect=1"
        } else {
            ""
        };
        let packed = if self.vhost_user_packed {
            ",packed=on"
        } else {
            ""
        };
        for (i, (sock, queues)) in self.vhost_user_blk.iter().enumerate() {
            a.extend([
                "-chardev".into(),
                format!("socket,id=vublk{i},path={}{reconnect}", sock.display()),
                "-device".into(),
                format!("vhost-user-blk-pci,chardev=vublk{i},num-queues={queues}{packed}"),
            ]);
        }
        for (i, sock) in self.vhost_user_scsi.iter().enumerate() {
            a.extend([
                "-chardev".into(),
                format!("socket,id=vuscsi{i},path={}{reconnect}", sock.display()),
                "-device".into(),
                format!("vhost-user-scsi-pci,chardev=vuscsi{i}{packed}"),
            ]);
        }
        if !self.scsi_disks.is_empty() {
            a.extend(["-device".into(), "virtio-scsi-pci,id=scsi0".into()]);
        }
        for (i, disk) in self.scsi_disks.iter().enumerate() {
            a.extend([
                "-drive".into(),
                format!(
                    "file={},if=none,format=raw,id=sd{i},cache=writeback",
                    disk.display()
                ),
                "-device".into(),
                format!("scsi-hd,drive=sd{i},bus=scsi0.0,channel=0,scsi-id={i},lun=0"),
            ]);
        }
        for (i, (dir, _)) in self.shares.iter().enumerate() {
            a.extend([
                "-fsdev".into(),
                format!("local,id=fs{i},path={},security_model=none", dir.display()),
                "-device".into(),
                format!("virtio-9p-pci,fsdev=fs{i},mount_tag=ustor{i}"),
            ]);
        }
        a.extend(self.qemu_args.iter().cloned());
        a
    }
}

/// What a finished guest run produced.
#[derive(Debug, Clone)]
pub struct GuestOutcome {
    /// The test script's exit status (init's own failures are 200+).
    pub exit_code: i32,
    /// The whole serial log: kernel messages, script output, markers.
    pub log: String,
    /// Wall time from QEMU start to its exit.
    pub duration: Duration,
    /// The reply line of each QMP command [`GuestBuilder::on_qmp`] sent.
    pub qmp_replies: Vec<String>,
    /// What each [`GuestBuilder::on_host`] action that ran returned.
    pub host_replies: Vec<String>,
}

impl GuestOutcome {
    /// `Ok(self)` if the script exited 0, else [`GuestError::ScriptFailed`]
    /// with the log, so a test can write `guest.run()?.success()?`.
    pub fn success(self) -> Result<Self> {
        if self.exit_code == 0 {
            Ok(self)
        } else {
            Err(GuestError::ScriptFailed {
                code: self.exit_code,
                log: self.log,
            })
        }
    }

    pub fn log_contains(&self, needle: &str) -> bool {
        self.log.contains(needle)
    }

    /// The last value a script reported with `kv KEY VALUE`.
    pub fn value(&self, key: &str) -> Option<&str> {
        let prefix = format!("{KV_MARKER}{key}=");
        self.log
            .lines()
            .rev()
            .find_map(|l| l.find(&prefix).map(|i| l[i + prefix.len()..].trim()))
    }

    /// Guest uptime (seconds) when init started the script: the boot cost.
    pub fn boot_seconds(&self) -> Option<f64> {
        self.log
            .lines()
            .find_map(|l| l.split("USTOR-GUEST-START uptime=").nth(1))
            .and_then(|v| v.trim().parse().ok())
    }
}

/// The run's QMP socket, beside its serial log.
fn qmp_socket(serial: &Path) -> PathBuf {
    serial.with_file_name("qmp.sock")
}

/// `$USTOR_TESTVM_QEMU`, else `qemu-system-x86_64` from PATH.
pub(crate) fn qemu_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("USTOR_TESTVM_QEMU") {
        return Ok(PathBuf::from(p));
    }
    assets::which("qemu-system-x86_64").ok_or_else(|| {
        GuestError::MissingTool("qemu-system-x86_64 not in PATH (Debian: qemu-system-x86)".into())
    })
}

/// Copies a failed run's serial log to `<cache>/logs/` and returns its path
/// (empty if even that failed: the log is still in the error itself).
fn keep_failed_log(cache: &Path, log: &str) -> PathBuf {
    let dir = cache.join("logs");
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let path = dir.join(format!("guest-{secs}-{}.log", std::process::id()));
    prune_logs(&dir, KEPT_LOGS_MAX);
    match fs::create_dir_all(&dir).and_then(|_| fs::write(&path, log)) {
        Ok(()) => path,
        Err(_) => PathBuf::new(),
    }
}

/// Failed-run logs kept in the cache; the oldest go first.
const KEPT_LOGS_MAX: usize = 50;

fn prune_logs(dir: &Path, keep: usize) {
    let Ok(rd) = fs::read_dir(dir) else {
        return;
    };
    // Names embed the time, so name order is age order.
    let mut logs: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    logs.sort();
    let excess = logs.len().saturating_sub(keep.saturating_sub(1));
    for old in &logs[..excess] {
        let _ = fs::remove_file(old);
    }
}

fn read_log(path: &Path) -> String {
    // Serial output uses CRLF; a guest killed mid-write can leave bad UTF-8.
    fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).replace('\r', ""))
        .unwrap_or_default()
}

/// The status from the last exit marker line, if any.
fn parse_exit(log: &str) -> Option<i32> {
    log.lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix(EXIT_MARKER))
        .and_then(|v| v.trim().parse().ok())
}

fn shell_quote(v: &str) -> String {
    format!("'{}'", v.replace('\'', "'\\''"))
}

/// Writes `bin` (stripped when possible) and its shared libraries into the
/// run archive; `initrd` names the archive, whose directory is scratch.
fn ship_binary<W: Write>(w: &mut CpioWriter<W>, bin: &Path, initrd: &Path) -> Result<()> {
    let name = bin
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let scratch = initrd.with_file_name(format!("{name}.stripped"));
    // A debug build is mostly debug info; the guest needs none of it.
    let stripped = Command::new("strip")
        .arg("-o")
        .arg(&scratch)
        .arg(bin)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let src = if stripped { scratch.as_path() } else { bin };
    let data = fs::read(src).map_err(|e| GuestError::io(format!("read {}", src.display()), e))?;
    let io = |e| GuestError::io(format!("append {} to the run archive", bin.display()), e);
    w.file(&format!("ustor/bin/{name}"), 0o755, &data)
        .map_err(io)?;
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .map_err(|e| GuestError::io(format!("ldd {}", bin.display()), e))?;
    for lib in ldd_paths(&String::from_utf8_lossy(&out.stdout)) {
        // Follow symlinks: the archive gets the library under the name
        // the loader asks for.
        let data = fs::read(&lib).map_err(|e| GuestError::io(format!("read {lib}"), e))?;
        w.file(lib.trim_start_matches('/'), 0o755, &data)
            .map_err(io)?;
    }
    Ok(())
}

/// The absolute library paths in `ldd` output (`libx.so => /path (0x..)`
/// and the loader's own `/lib64/ld-linux-x86-64.so.2 (0x..)`).
fn ldd_paths(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| {
            let p = match l.split_once("=>") {
                Some((_, r)) => r.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            p.starts_with('/').then(|| p.to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests;

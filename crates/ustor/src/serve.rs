//! `ustor serve`: start the reactors and the RPC server, load a config (or
//! the embedded default: a 1 GiB malloc bdev exported on 127.0.0.1), print
//! what is served and how to reach it, and run until SIGINT/SIGTERM; SIGHUP
//! reloads the config file (see `service`), and systemd hears of readiness,
//! reloads and the stop through sd_notify.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;
use ustor_rpc::{ServerConfig, RPC_RUNTIME, RPC_STARTUP};

use crate::app::App;
use crate::RuntimeArgs;

/// `println!` that ignores a closed stdout: the banner and the shutdown lines
/// are for a person watching, and a service manager (or `ustor serve | head`)
/// may have closed stdout; that must not panic the server halfway through
/// its clean shutdown.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

#[derive(clap::Args)]
pub struct ServeArgs {
    /// JSON config (SPDK format) to load at start.
    #[arg(short = 'c', long = "config")]
    config: Option<PathBuf>,
    /// RPC socket path.
    #[arg(short = 'r', long = "rpc-socket", default_value = crate::rpc_cmd::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Directory for the vhost-user controllers' sockets (a controller's
    /// socket is DIR/<ctrlr>); default: the current directory, as SPDK.
    #[arg(short = 'S', long = "vhost-sock-dir", value_name = "DIR")]
    vhost_sock_dir: Option<PathBuf>,
    /// Start only the RPC server; load config after framework_start_init.
    #[arg(long)]
    wait_for_rpc: bool,
    /// Log level (error, warn, info, debug, trace).
    #[arg(long, default_value = "info")]
    log_level: String,
    /// Log line format: text for people, json (one object per line) for log
    /// shippers.
    #[arg(long, value_enum, default_value_t = crate::LogFormat::Text)]
    log_format: crate::LogFormat,
    /// NBD port of the embedded default config.
    #[arg(long, default_value_t = 10809)]
    nbd_port: u16,
    /// NVMe/TCP port of the embedded default config.
    #[arg(long, default_value_t = 4420)]
    nvmf_port: u16,
    /// iSCSI port of the embedded default config.
    #[arg(long, default_value_t = 3260)]
    iscsi_port: u16,
    /// Size of the default malloc bdev in MiB.
    #[arg(long, default_value_t = 1024)]
    default_size_mib: u64,
    /// Serve Prometheus metrics on http://ADDR/metrics (e.g. 127.0.0.1:9100); off by default.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    #[command(flatten)]
    rt: RuntimeArgs,
}

/// Signals are blocked in every thread and taken with sigwait here, so no
/// handler runs inside a reactor.
fn block_signals() -> libc::sigset_t {
    // SAFETY: plain sigset manipulation and pthread_sigmask on our thread
    // (inherited by every thread started afterwards).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn wait_signal(set: &libc::sigset_t) -> i32 {
    let mut sig = 0;
    // SAFETY: sigwait on a set we built; writes the signal number.
    unsafe { libc::sigwait(set, &mut sig) };
    sig
}

/// NQN of the default config's NVMe-oF subsystem.
const DEFAULT_NQN: &str = "nqn.2026-11.io.ustor:malloc0";
/// IQN of the default config's iSCSI target node.
const DEFAULT_IQN: &str = "iqn.2026-11.io.ustor:malloc0";

fn default_config(app: &App, a: &ServeArgs) -> Result<(), String> {
    let t = Duration::from_secs(30);
    let call = |m: &str, p: serde_json::Value| {
        app.table
            .call_blocking(m, p, t)
            .map_err(|e| format!("{m}: {}", e.message))
    };
    let bs = 512u64;
    call(
        "bdev_malloc_create",
        json!({"name": "Malloc0", "num_blocks": (a.default_size_mib << 20) / bs, "block_size": bs}),
    )?;
    call(
        "nbd_server_start",
        json!({"listen_address": {"traddr": "127.0.0.1", "trsvcid": a.nbd_port.to_string()}}),
    )?;
    call(
        "nbd_export_create",
        json!({"name": "Malloc0", "bdev_name": "Malloc0", "description": "ustor default malloc bdev"}),
    )?;
    call("nvmf_create_transport", json!({"trtype": "TCP"}))?;
    call(
        "nvmf_create_subsystem",
        json!({"nqn": DEFAULT_NQN, "allow_any_host": true, "serial_number": "USTOR0000000000001", "model_number": "ustor malloc"}),
    )?;
    call(
        "nvmf_subsystem_add_ns",
        json!({"nqn": DEFAULT_NQN, "namespace": {"bdev_name": "Malloc0"}}),
    )?;
    let listen = json!({"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": a.nvmf_port.to_string()});
    call(
        "nvmf_subsystem_add_listener",
        json!({"nqn": DEFAULT_NQN, "listen_address": listen}),
    )?;
    call(
        "iscsi_create_portal_group",
        json!({"tag": 1, "portals": [{"host": "127.0.0.1", "port": a.iscsi_port.to_string()}]}),
    )?;
    call(
        "iscsi_create_initiator_group",
        json!({"tag": 1, "initiators": ["ANY"], "netmasks": ["ANY"]}),
    )?;
    call(
        "iscsi_create_target_node",
        json!({"name": DEFAULT_IQN, "alias_name": "ustor malloc0",
               "pg_ig_maps": [{"pg_tag": 1, "ig_tag": 1}],
               "luns": [{"bdev_name": "Malloc0", "lun_id": 0}], "queue_depth": 64}),
    )?;
    Ok(())
}

/// The iSCSI target nodes and the portals they are reached on, from the
/// target's own RPC answers (the bound ports, so `--iscsi-port 0` shows the
/// port the kernel chose).
fn print_iscsi(app: &App) {
    let get = |m: &str| {
        app.table
            .call_blocking(m, serde_json::Value::Null, Duration::from_secs(5))
            .unwrap_or_default()
    };
    let (groups, nodes) = (
        get("iscsi_get_portal_groups"),
        get("iscsi_get_target_nodes"),
    );
    let portals = |tag: &serde_json::Value| -> Vec<String> {
        let g = groups.as_array().into_iter().flatten();
        g.filter(|g| &g["tag"] == tag)
            .flat_map(|g| g["portals"].as_array().cloned().unwrap_or_default())
            .map(|p| {
                format!(
                    "{}:{}",
                    p["host"].as_str().unwrap_or(""),
                    p["port"].as_str().unwrap_or("")
                )
            })
            .collect()
    };
    for n in nodes.as_array().into_iter().flatten() {
        let name = n["name"].as_str().unwrap_or("");
        for m in n["pg_ig_maps"].as_array().into_iter().flatten() {
            for p in portals(&m["pg_tag"]) {
                say!("  iSCSI target {name} on {p}");
                say!("    iscsi-ls -s iscsi://{p}");
                say!("    iscsi-inq iscsi://{p}/{name}/0");
                say!("    iscsiadm -m discovery -t st -p {p}");
            }
        }
    }
}

fn print_banner(app: &App, a: &ServeArgs, metrics: Option<std::net::SocketAddr>) {
    say!(
        "ustor {} serving on reactors {:?} ({} mode)",
        env!("CARGO_PKG_VERSION"),
        app.cfg.cores,
        app.cfg.poll_mode
    );
    say!(
        "  RPC socket: {}   (ustor rpc -s {} bdev_get_bdevs)",
        a.socket.display(),
        a.socket.display()
    );
    for e in app.registry.list() {
        let i = e.info();
        say!(
            "  bdev {}: {} x {} B ({} MiB, {})",
            i.name,
            i.num_blocks,
            i.block_size,
            i.size_bytes() >> 20,
            i.module
        );
    }
    if let Some(addr) = app.nbd.local_addr() {
        for x in app.nbd.get_exports() {
            say!("  NBD export `{}` (bdev {}) on {addr}", x.name, x.bdev_name);
            say!("    nbdinfo nbd://{addr}/{}", x.name);
            say!("    qemu-img info nbd://{addr}/{}", x.name);
            say!(
                "    nbd-client {} {} -N {} /dev/nbd0",
                addr.ip(),
                addr.port(),
                x.name
            );
        }
    }
    for sub in app.nvmf.nvmf_get_subsystems() {
        for l in &sub.listen_addresses {
            if sub.subtype.eq_ignore_ascii_case("nvme") {
                say!(
                    "  NVMe/TCP subsystem {} on {}:{}",
                    sub.nqn,
                    l.traddr,
                    l.trsvcid
                );
                say!("    nvme discover -t tcp -a {} -s {}", l.traddr, l.trsvcid);
                say!(
                    "    nvme connect -t tcp -a {} -s {} -n {}",
                    l.traddr,
                    l.trsvcid,
                    sub.nqn
                );
            }
        }
    }
    print_iscsi(app);
    for c in app.vhost.controllers(None).unwrap_or_default() {
        say!(
            "  vhost-user-blk controller {} (bdev {}) on {}",
            c.ctrlr,
            c.bdev,
            c.socket.display()
        );
        say!(
            "    qemu ... -chardev socket,id=vu0,path={} -device vhost-user-blk-pci,chardev=vu0",
            c.socket.display()
        );
    }
    for c in app.vhost.scsi_controllers(None) {
        say!(
            "  vhost-user-scsi controller {} ({} targets) on {}",
            c.ctrlr,
            c.targets.len(),
            c.socket.display()
        );
    }
    if let Some(m) = metrics {
        say!(
            "  Prometheus metrics on http://{m}/metrics   (ustor top -s {} for a live view)",
            a.socket.display()
        );
    }
    if a.config.is_none() && !a.wait_for_rpc {
        say!(
            "Default disk: Malloc0, {} MiB of RAM, used only as it is written \
             (--default-size-mib N to change; -c FILE for your own config).",
            a.default_size_mib
        );
    }
    say!("Stop with Ctrl-C (SIGINT) or SIGTERM; a second signal forces exit.");
}

/// SIGHUP: apply the `-c` file again, creating what does not exist yet.
fn reload(app: &App, a: &ServeArgs) {
    let Some(path) = &a.config else {
        tracing::warn!("SIGHUP: no config file (-c) to reload; ignored");
        return;
    };
    crate::service::notify(&format!(
        "RELOADING=1\nMONOTONIC_USEC={}\nSTATUS=reloading {}",
        crate::service::monotonic_usec(),
        path.display()
    ));
    match crate::service::reload(&app.table, path) {
        Ok(r) => tracing::info!(
            config = %path.display(),
            created = r.created,
            existed = r.existed,
            failed = r.failed,
            "reloaded {}: {} calls applied, {} objects already there, {} failed",
            path.display(),
            r.created,
            r.existed,
            r.failed
        ),
        Err(e) => tracing::error!(config = %path.display(), "reload failed: {e}"),
    }
    crate::service::notify("READY=1\nSTATUS=serving");
}

pub fn run(a: ServeArgs) -> i32 {
    crate::init_logging(&a.log_level, a.log_format);
    let sigs = block_signals();
    let cfg = match a.rt.config("0") {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ustor serve: {e}");
            return 2;
        }
    };
    let mut app = match App::start(cfg) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ustor serve: starting reactors: {e}");
            return 1;
        }
    };
    if let Some(d) = &a.vhost_sock_dir {
        if !d.is_dir() {
            eprintln!("ustor serve: -S {}: not a directory", d.display());
            app.shutdown();
            return 2;
        }
        app.vhost.set_socket_dir(d);
    }
    if a.wait_for_rpc {
        app.table.set_state(RPC_STARTUP);
        app.table.init_begun();
    }
    let start_server =
        |app: &App| match ustor_rpc::start(ServerConfig::with_path(&a.socket), app.table.clone()) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("ustor serve: RPC server on {}: {e}", a.socket.display());
                None
            }
        };
    // With --wait-for-rpc the socket is the way in, so it opens first.
    // Otherwise it opens only once the config is applied: a client that
    // connects must never see a half-built configuration (an export not
    // yet created, a bdev still being populated).
    let mut server = None;
    if a.wait_for_rpc {
        let Some(s) = start_server(&app) else {
            app.shutdown();
            return 1;
        };
        server = Some(s);
        say!("waiting for framework_start_init on {}", a.socket.display());
        while app.table.state() != RPC_RUNTIME {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let loaded = match &a.config {
        Some(path) => ustor_rpc::load_config(path)
            .map_err(|e| e.to_string())
            .and_then(|calls| {
                ustor_rpc::apply_config(&app.table, &calls, |c| {
                    crate::methods::undo_in(&app.registry, c)
                })
                .map_err(|e| e.to_string())
            }),
        None if a.wait_for_rpc => Ok(0),
        None => default_config(&app, &a).map(|_| 3),
    };
    // A configuration of base bdevs brings back the arrays on them: wait
    // for examine before clients can connect (SPDK's loader does too).
    let loaded = loaded
        .and_then(|n| crate::methods::vbdev::settle_examine(&app.rt, &app.registry).map(|()| n));
    if let Err(e) = loaded {
        eprintln!("ustor serve: {e}");
        if let Some(s) = server {
            s.shutdown();
        }
        app.shutdown();
        return 1;
    }
    app.table.init_done();
    let server = match server {
        Some(s) => s,
        None => match start_server(&app) {
            Some(s) => s,
            None => {
                app.shutdown();
                return 1;
            }
        },
    };
    let mut metrics = None;
    if let Some(addr) = a.metrics {
        let src = crate::metrics::Sources {
            table: app.table.clone(),
            registry: app.registry.clone(),
        };
        match crate::metrics::MetricsServer::start(addr, src, Default::default()) {
            Ok(m) => metrics = Some(m),
            Err(e) => {
                eprintln!("ustor serve: metrics listener on {addr}: {e}");
                server.shutdown();
                app.shutdown();
                return 1;
            }
        }
    }
    print_banner(&app, &a, metrics.as_ref().map(|m| m.local_addr()));
    crate::service::notify("READY=1\nSTATUS=serving");
    let sig = loop {
        match wait_signal(&sigs) {
            libc::SIGHUP => reload(&app, &a),
            s => break s,
        }
    };
    crate::service::notify("STOPPING=1\nSTATUS=draining targets");
    tracing::info!("signal {sig}: shutting down (send another to force exit)");
    // A second signal during the graceful shutdown forces exit.
    std::thread::spawn(move || {
        let s = loop {
            match wait_signal(&sigs) {
                libc::SIGHUP => continue,
                s => break s,
            }
        };
        eprintln!("signal {s} during shutdown: forcing exit");
        std::process::exit(130);
    });
    if let Some(mut m) = metrics {
        m.shutdown();
    }
    server.shutdown();
    for t in app.shutdown() {
        let how = if t.drained {
            "drained"
        } else {
            "still busy at the deadline"
        };
        say!("ustor: target {} stopped ({how})", t.name);
    }
    say!("ustor: stopped cleanly");
    0
}

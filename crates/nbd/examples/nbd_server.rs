//! A standalone NBD server over a malloc bdev, for benchmarks and manual
//! tests until the `ustor` binary wires the RPCs:
//!
//! `nbd_server [--cores 0,1] [--port 10809] [--size-mib 1024] [--block-size 512]
//!  [--poll-mode adaptive] [--idle-us 1000]`
//!
//! `--idle-us` is the adaptive mode's busy-poll period before a reactor
//! sleeps. Prints `listening on HOST:PORT` and serves until killed
//! (SIGTERM/SIGINT), then prints the server's stats as JSON and the
//! reactors' loop counters on stderr.

use std::sync::Arc;

use ustor_bdev::modules::{malloc, RamOpts};
use ustor_bdev::Registry;
use ustor_nbd::server::{ExportCreateParams, ListenAddress, NbdServer, ServerStartParams};
use ustor_runtime::{parse_cores, PollMode, Runtime, RuntimeConfig};

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.windows(2)
        .find(|w| w[0] == name)
        .map(|w| w[1].clone())
        .unwrap_or_else(|| default.to_string())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let cores = parse_cores(&arg(&args, "--cores", "0"))?;
    let port = arg(&args, "--port", "10809");
    let size_mib: u64 = arg(&args, "--size-mib", "1024").parse()?;
    let block_size: u32 = arg(&args, "--block-size", "512").parse()?;
    let poll_mode: PollMode = arg(&args, "--poll-mode", "adaptive").parse()?;
    let defaults = RuntimeConfig::default();
    let idle_us: u64 = arg(
        &args,
        "--idle-us",
        &defaults.idle_period.as_micros().to_string(),
    )
    .parse()?;
    let rt = Runtime::start(RuntimeConfig {
        cores,
        poll_mode,
        idle_period: std::time::Duration::from_micros(idle_us),
        ..defaults
    })?;
    let registry = Registry::new(Some(rt.handle()));
    let opts = RamOpts {
        name: "Malloc0".into(),
        num_blocks: (size_mib << 20) / u64::from(block_size),
        block_size,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    };
    malloc::create(&registry, opts)?;
    let server: Arc<NbdServer> = Arc::new(NbdServer::new(rt.handle()));
    let bound = server.start(&ServerStartParams {
        listen_address: ListenAddress {
            traddr: "127.0.0.1".into(),
            trsvcid: port,
        },
        max_connections: 256,
    })?;
    let params = ExportCreateParams {
        name: "malloc".into(),
        bdev_name: "Malloc0".into(),
        read_only: false,
        description: "malloc bdev".into(),
    };
    server.export_create(&registry, &params)?;
    println!("listening on {}:{}", bound.traddr, bound.trsvcid);
    wait_for_signal();
    println!("{}", serde_json::to_string(&server.get_stats()?)?);
    for r in rt.handle().stats()? {
        eprintln!(
            "reactor {}: loops {} sleeps {} wakeups {} naps {} naps_early {} tasks_polled {} submits {} completions {} busy_ms {} idle_ms {}",
            r.reactor,
            r.loops,
            r.sleeps,
            r.wakeups,
            r.naps,
            r.naps_early,
            r.tasks_polled,
            r.submits,
            r.completions,
            r.busy_ns / 1_000_000,
            r.idle_ns / 1_000_000
        );
    }
    Ok(())
}

fn wait_for_signal() {
    // SAFETY: block SIGINT/SIGTERM in this thread, then wait for one; the
    // reactor threads were started before and keep their own masks.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        let mut sig = 0;
        libc::sigwait(&set, &mut sig);
    }
}

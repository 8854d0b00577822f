//! `ustor bench`: creates (or loads) the bdev, runs the workload on the
//! reactors and prints a table (or JSON). Exit status 1 on any I/O error or
//! verify mismatch.

use std::io::IsTerminal;
use std::time::Duration;

use ustor_bench::{BenchConfig, Pattern};

use crate::app::App;
use crate::RuntimeArgs;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Bdev name (from --config) or inline spec: null:1G, malloc:256M,
    /// uring:/dev/loop0, uring:/path/file.
    #[arg(long, short = 'b')]
    bdev: String,
    /// read, write, randread, randwrite, randrw, flush, unmap (flush and
    /// unmap: one command of --bs at a time, in order).
    #[arg(long = "workload", short = 'w', default_value = "randread")]
    workload: String,
    /// Percent reads for randrw.
    #[arg(long, default_value_t = 50)]
    rwmixread: u32,
    /// I/O size (4096, 4K, 128K, 1M).
    #[arg(long, default_value = "4K")]
    bs: String,
    /// Queue depth per core.
    #[arg(long, short = 'q', default_value_t = 32)]
    qd: usize,
    /// Seconds to run.
    #[arg(long, short = 't', default_value_t = 5.0)]
    time: f64,
    /// Write self-checking blocks and check every read (read workloads
    /// write their region once first, before the timed run; flush, unmap:
    /// read each unit back after its flush or unmap).
    #[arg(long)]
    verify: bool,
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    /// Block size of inline null/malloc bdevs.
    #[arg(long, default_value_t = 512)]
    block_size: u32,
    /// JSON config to create bdevs from before the run.
    #[arg(short = 'c', long = "config")]
    config: Option<std::path::PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    #[arg(long, default_value = "warn")]
    log_level: String,
    #[command(flatten)]
    rt: RuntimeArgs,
}

pub fn run(a: BenchArgs) -> i32 {
    crate::init_logging(&a.log_level, crate::LogFormat::Text);
    let fail = |m: String| {
        eprintln!("ustor bench: {m}");
        2
    };
    let pattern: Pattern = match a.workload.parse() {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let Some(bs) = ustor_bdev::parse_size(&a.bs).filter(|b| *b > 0) else {
        return fail(format!("bad --bs `{}`", a.bs));
    };
    if a.rwmixread > 100 {
        return fail("--rwmixread must be 0..=100".into());
    }
    let cfg = match a.rt.config("0") {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let app = match App::start(cfg) {
        Ok(x) => x,
        Err(e) => return fail(format!("starting reactors: {e}")),
    };
    if let Some(path) = &a.config {
        let r = ustor_rpc::load_config(path)
            .map_err(|e| e.to_string())
            .and_then(|calls| {
                ustor_rpc::apply_config(&app.table, &calls, |c| {
                    crate::methods::undo_in(&app.registry, c)
                })
                .map_err(|e| e.to_string())
            });
        if let Err(e) = r {
            return fail(e);
        }
    }
    let name = match ustor_bench::spec::create(&app.registry, &a.bdev, a.block_size) {
        Ok(n) => n,
        Err(e) => return fail(e.to_string()),
    };
    let bc = BenchConfig {
        bdev: name,
        pattern,
        rwmixread: a.rwmixread,
        bs: bs as usize,
        qd: a.qd,
        time: Duration::from_secs_f64(a.time.max(0.01)),
        verify: a.verify,
        seed: a.seed,
    };
    let tty = std::io::stdout().is_terminal() && !a.json;
    let report = ustor_bench::run(&app.rt, &app.registry, &bc, |t, ios| {
        if tty {
            println!(
                "  {t:>5.1} s  {ios:>12} I/Os  {:>10.0} IOPS avg",
                ios as f64 / t.max(1e-9)
            );
        } else {
            // Scripts see the run under way (`--log-level info`).
            tracing::info!(seconds = t, ios, "bench progress");
        }
    });
    if a.config.is_some() {
        log_scsi_hosts(&app);
    }
    match report {
        Ok(r) => {
            if a.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&r.to_json()).unwrap_or_default()
                );
            } else {
                print!("{}", r.table());
            }
            if r.clean() {
                0
            } else {
                1
            }
        }
        Err(e) => fail(e.to_string()),
    }
}

/// With `--log-level info`, the SCSI hosts a config attached and their
/// counters after the run: a script sees how the I/O went (zero-copy or
/// bounced, error handling steps) without an RPC socket.
fn log_scsi_hosts(app: &App) {
    let t = Duration::from_secs(5);
    for m in ["scsi_get_hosts", "scsi_get_stats"] {
        match app.table.call_blocking(m, serde_json::Value::Null, t) {
            Ok(v) if v.as_array().is_some_and(|h| !h.is_empty()) => {
                tracing::info!(method = m, result = %v, "scsi hosts after the run");
            }
            _ => {}
        }
    }
}

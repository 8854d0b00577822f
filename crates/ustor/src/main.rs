//! The `ustor` command: `serve` (the target), `rpc` / `save-config` /
//! `load-config` (the control client), `bench` (the in-process benchmark),
//! `top` (the live view).

mod app;
mod bench_cmd;
mod control;
mod docgen;
mod fs_cmd;
mod fs_mount;
mod methods;
mod metrics;
mod rpc_cmd;
mod serve;
mod service;
mod targets;
mod top;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "ustor",
    version,
    about = "ustor: a userspace storage I/O stack"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the storage server (reactors, bdevs, targets, RPC socket).
    Serve(serve::ServeArgs),
    /// Call one JSON-RPC method: `ustor rpc METHOD [--key value ...] [--json '{...}']`.
    Rpc(rpc_cmd::RpcArgs),
    /// Print the running server's configuration (SPDK's save_config).
    SaveConfig(rpc_cmd::SocketArg),
    /// Apply a JSON config file to a running server (SPDK's load_config).
    LoadConfig(rpc_cmd::LoadArgs),
    /// Benchmark a bdev from inside the reactors (like SPDK's bdevperf).
    Bench(bench_cmd::BenchArgs),
    /// Live view of a running server: reactors, bdevs, targets (like spdk_top).
    Top(top::TopArgs),
    /// File service tools: `ustor fs format|check REGION`, `ustor fs mount`.
    Fs(fs_cmd::FsArgs),
    /// Print a shell completion script: `ustor completions bash`.
    Completions(docgen::CompletionsArgs),
    /// Write the man pages (generated from these flags) to a directory.
    #[command(hide = true)]
    Manpages(docgen::ManpagesArgs),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Serve(a) => serve::run(a),
        Cmd::Rpc(a) => rpc_cmd::run(a),
        Cmd::SaveConfig(a) => rpc_cmd::save(a),
        Cmd::LoadConfig(a) => rpc_cmd::load(a),
        Cmd::Bench(a) => bench_cmd::run(a),
        Cmd::Top(a) => top::run(a),
        Cmd::Fs(a) => fs_cmd::run(a),
        Cmd::Completions(a) => docgen::completions(a),
        Cmd::Manpages(a) => docgen::manpages(a),
    };
    std::process::exit(code);
}

/// Shared runtime flags of `serve` and `bench`.
#[derive(clap::Args, Clone, Debug)]
pub struct RuntimeArgs {
    /// Reactor cores as a hex mask (0x3).
    #[arg(long, short = 'm')]
    pub cpumask: Option<String>,
    /// Reactor cores as a list (0,1 or 0-3).
    #[arg(long)]
    pub cores: Option<String>,
    /// poll, interrupt or adaptive.
    #[arg(long, default_value = "adaptive")]
    pub poll_mode: String,
    /// Buffer pool per reactor, in MiB.
    #[arg(long, default_value_t = 64)]
    pub mem_size: usize,
    /// Adaptive mode: longest idle spin before a reactor sleeps, in microseconds
    /// (the spin adapts below it, and is skipped while CPUs are oversubscribed).
    #[arg(long, default_value_t = 1000)]
    pub idle_us: u64,
    /// Do not pin reactors to their cores.
    #[arg(long)]
    pub no_pin: bool,
}

impl RuntimeArgs {
    pub fn config(&self, default_cores: &str) -> Result<ustor_runtime::RuntimeConfig, String> {
        let spec = self
            .cpumask
            .as_deref()
            .or(self.cores.as_deref())
            .unwrap_or(default_cores);
        let cores = ustor_runtime::parse_cores(spec)?;
        let n = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        if let Some(c) = cores.iter().find(|c| **c >= n.max(1) && !self.no_pin) {
            return Err(format!(
                "core {c} does not exist on this machine ({n} CPUs)"
            ));
        }
        Ok(ustor_runtime::RuntimeConfig {
            cores,
            pin: !self.no_pin,
            poll_mode: self.poll_mode.parse()?,
            idle_period: std::time::Duration::from_micros(self.idle_us),
            bufs: ustor_runtime::BufPoolConfig {
                mem_bytes: self.mem_size << 20,
                ..Default::default()
            },
            ..Default::default()
        })
    }
}

/// How log lines are written (to stderr, one line per event).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// `2026-11-26T19:00:00Z  INFO nbd: connection from 127.0.0.1:5000 accepted`
    Text,
    /// One JSON object per line (timestamp, level, target, fields with the
    /// object names: bdev, export, listener, peer, ...), for log shippers.
    Json,
}

/// Writes to stdout; a closed stdout (`ustor ... | head`, a service manager
/// that closed it) is an exit code, not a panic.
pub fn write_stdout(buf: &[u8]) -> i32 {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(buf).and_then(|()| out.flush()) {
        Ok(()) => 0,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => 0,
        Err(e) => {
            eprintln!("ustor: stdout: {e}");
            1
        }
    }
}

pub fn init_logging(level: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => b.try_init(),
        LogFormat::Json => b.json().try_init(),
    };
}

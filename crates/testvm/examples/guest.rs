//! Runs one guest script by hand and prints the serial log:
//! `cargo run -p ustor-testvm --example guest -- SCRIPT [KEY=VALUE...]`.
//! Options by environment: GUEST_TIMEOUT_S, GUEST_SCSI_DISK, GUEST_SHARE,
//! GUEST_VHOST_USER_BLK, GUEST_CPUS, GUEST_KERNEL_ARGS.

use std::time::Duration;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let script = args.next().ok_or("usage: guest SCRIPT [KEY=VALUE...]")?;
    let mut b = testvm::GuestBuilder::new().script_file(script);
    for kv in args {
        let (k, v) = kv
            .split_once('=')
            .ok_or("arguments after the script are KEY=VALUE")?;
        b = b.env(k, v);
    }
    let secs = std::env::var("GUEST_TIMEOUT_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    b = b.timeout(Duration::from_secs(secs));
    if let Ok(p) = std::env::var("GUEST_SCSI_DISK") {
        b = b.virtio_scsi_disk(p);
    }
    if let Ok(p) = std::env::var("GUEST_SHARE") {
        b = b.share_dir(p);
    }
    if let Ok(p) = std::env::var("GUEST_VHOST_USER_BLK") {
        b = b.vhost_user_blk(p);
    }
    if let Ok(args) = std::env::var("GUEST_KERNEL_ARGS") {
        for a in args.split_whitespace() {
            b = b.kernel_arg(a);
        }
    }
    if let Some(n) = std::env::var("GUEST_CPUS")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        b = b.cpus(n);
    }
    let out = b.run()?;
    print!("{}", out.log);
    eprintln!(
        "exit {} in {:?} (boot {:?}s)",
        out.exit_code,
        out.duration,
        out.boot_seconds()
    );
    std::process::exit(out.exit_code);
}

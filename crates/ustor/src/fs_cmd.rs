//! `ustor fs check REGION`: verifies the layout of a file-service region
//! (crates/fs) offline and exits non-zero when it is not consistent.

use clap::{Args, Subcommand};

#[derive(Args)]
pub struct FsArgs {
    #[command(subcommand)]
    cmd: FsCmd,
}

#[derive(Subcommand)]
enum FsCmd {
    /// Verify a region's layout (superblock, block bitmap).
    Check {
        /// The region: a file (e.g. under /dev/shm) or a DAX device.
        region: std::path::PathBuf,
    },
}

pub fn run(a: FsArgs) -> i32 {
    let FsCmd::Check { region } = a.cmd;
    let bytes = match std::fs::read(&region) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("ustor fs check: {}: {e}", region.display());
            return 2;
        }
    };
    match ustor_fs::check(&bytes) {
        Ok(g) => {
            println!("{}: clean ({} blocks)", region.display(), g.blocks);
            0
        }
        Err(e) => {
            eprintln!("{}: {e}", region.display());
            1
        }
    }
}

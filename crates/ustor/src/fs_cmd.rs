//! `ustor fs format REGION SIZE` and `ustor fs check REGION`: make a
//! file-service region (crates/fs) and verify one offline (non-zero exit
//! when it is not consistent).

use clap::{Args, Subcommand};

#[derive(Args)]
pub struct FsArgs {
    #[command(subcommand)]
    cmd: FsCmd,
}

#[derive(Subcommand)]
enum FsCmd {
    /// Create (or overwrite) a region file of SIZE bytes with an empty file
    /// system, or format a whole block device (SIZE optional: the device's).
    Format {
        /// The region: a file (e.g. under /dev/shm) or a block device.
        region: std::path::PathBuf,
        /// Its size in bytes (for a block device: at most its size; the
        /// whole device is used).
        size: Option<u64>,
    },
    /// Verify a region: superblock, inodes, directories, link counts, block
    /// ownership and bitmap (a committed redo log is replayed on a copy).
    Check {
        /// The region: a file (e.g. under /dev/shm) or a block device.
        region: std::path::PathBuf,
    },
    /// Mount an export through FUSE and serve it until unmounted (umount
    /// MOUNTPOINT) or interrupted.
    Mount(crate::fs_mount::MountArgs),
}

pub fn run(a: FsArgs) -> i32 {
    let region = match a.cmd {
        FsCmd::Check { region } => region,
        FsCmd::Format { region, size } => return format(&region, size),
        FsCmd::Mount(m) => return crate::fs_mount::run(m),
    };
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

fn format(region: &std::path::Path, size: Option<u64>) -> i32 {
    let size = match size {
        Some(s) => s,
        None if ustor_fs::media::is_block_device(region) => 0,
        None => {
            eprintln!(
                "ustor fs format: {}: SIZE is needed for a file",
                region.display()
            );
            return 2;
        }
    };
    let r = ustor_fs::MappedFile::create(region, size)
        .map_err(ustor_fs::FsError::from)
        .and_then(|m| ustor_fs::Fs::format(Box::new(m)));
    match r {
        Ok(fs) => {
            let st = fs.statfs();
            println!(
                "{}: {} data blocks, {} inodes",
                region.display(),
                st.blocks,
                st.files
            );
            0
        }
        Err(e) => {
            eprintln!("ustor fs format: {}: {e}", region.display());
            1
        }
    }
}

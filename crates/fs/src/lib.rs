//! ustor-fs: the remote zero-copy file service (issue 23). This first cut owns
//! the region layout only: a superblock at offset 0, a block bitmap, and 4 KiB
//! data blocks, formatted and checked over a byte slice (the mapped region).
//! Inodes, the namespace, crash ordering and the wire protocol come later.

pub mod layout;

pub use layout::{check, format, FsError, Geometry, BLOCK_SIZE, MAGIC};

//! The offline checker (`ustor fs check REGION`): replays a committed redo
//! log on a private copy (what the next open would do), then verifies the
//! superblock, every inode, every directory entry, link counts, that every
//! inode is reachable from the root, that no block has two owners and that
//! the bitmap marks exactly the blocks in use.

use std::collections::VecDeque;

use crate::fs::{bmap_in, owned_blocks};
use crate::inode::Inode;
use crate::layout::{bit, check_superblock, read_u64, Geometry, BLOCK_SIZE, INODE_SIZE, ROOT_INO};
use crate::ns::{DIRENT_SIZE, NAME_MAX};
use crate::tx::{replay, Tx};
use crate::FsError;

fn bad(s: String) -> FsError {
    FsError::Corrupt(s)
}

/// Verifies `region`; returns its geometry when it is consistent.
pub fn check(region: &[u8]) -> Result<Geometry, FsError> {
    let g = check_superblock(region)?;
    let mut copy = region.to_vec();
    replay(&mut copy, &g)?;
    let r = &copy[..];
    let ino_at = |n: u64| Inode::decode(&r[g.inode_off(n)..][..INODE_SIZE]);
    let mut owned = vec![false; g.blocks as usize];
    owned[..g.data_start() as usize].fill(true);
    for n in 1..g.inodes() {
        let i = ino_at(n);
        if i.is_free() {
            continue;
        }
        if i.kind().is_none() || i.nlink == 0 {
            return Err(bad(format!(
                "inode {n}: mode {:o} nlink {}",
                i.mode, i.nlink
            )));
        }
        for b in owned_blocks(r, &g, &i)? {
            if std::mem::replace(&mut owned[b as usize], true) {
                return Err(bad(format!("block {b} has two owners")));
            }
        }
    }
    for b in g.data_start()..g.blocks {
        if bit(r, &g, b) != owned[b as usize] {
            return Err(bad(format!("bitmap bit of block {b} is wrong")));
        }
    }
    check_tree(r, &g)?;
    Ok(g)
}

/// Walks the directory tree from the root: entries, parents, link counts,
/// reachability.
fn check_tree(r: &[u8], g: &Geometry) -> Result<(), FsError> {
    let ino_at = |n: u64| Inode::decode(&r[g.inode_off(n)..][..INODE_SIZE]);
    let root = ino_at(ROOT_INO);
    if !root.is_dir() || root.parent != ROOT_INO {
        return Err(bad("root is not a directory".into()));
    }
    let mut refs = vec![0u32; g.inodes() as usize];
    let mut seen = vec![false; g.inodes() as usize];
    seen[ROOT_INO as usize] = true;
    let mut queue = VecDeque::from([ROOT_INO]);
    let tx = Tx::default();
    while let Some(dn) = queue.pop_front() {
        let d = ino_at(dn);
        if d.size % BLOCK_SIZE as u64 != 0 {
            return Err(bad(format!("directory {dn} size {}", d.size)));
        }
        let mut subdirs = 0;
        for k in 0..d.size / BLOCK_SIZE as u64 {
            let b = bmap_in(r, &tx, &d, k) as usize;
            if b == 0 {
                return Err(bad(format!("directory {dn} has a hole")));
            }
            for s in 0..BLOCK_SIZE / DIRENT_SIZE {
                let o = b * BLOCK_SIZE + s * DIRENT_SIZE;
                let n = read_u64(r, o);
                if n == 0 {
                    continue;
                }
                let len = r[o + 8] as usize;
                let name = &r[o + 9..o + 9 + len.min(NAME_MAX)];
                if len == 0 || len > NAME_MAX || name.contains(&b'/') || name.contains(&0) {
                    return Err(bad(format!("directory {dn}: bad name")));
                }
                if n >= g.inodes() || ino_at(n).is_free() {
                    return Err(bad(format!("directory {dn}: entry to free inode {n}")));
                }
                refs[n as usize] += 1;
                let c = ino_at(n);
                if c.is_dir() {
                    subdirs += 1;
                    if c.parent != dn || seen[n as usize] {
                        return Err(bad(format!("directory {n} linked twice or wrong parent")));
                    }
                }
                if !std::mem::replace(&mut seen[n as usize], true) && c.is_dir() {
                    queue.push_back(n);
                }
            }
        }
        if d.nlink != 2 + subdirs {
            return Err(bad(format!(
                "directory {dn}: nlink {} for {subdirs} subdirectories",
                d.nlink
            )));
        }
    }
    for n in 1..g.inodes() {
        let i = ino_at(n);
        if i.is_free() {
            continue;
        }
        if !seen[n as usize] {
            return Err(bad(format!("inode {n} is not reachable from the root")));
        }
        if !i.is_dir() && i.nlink != refs[n as usize] {
            return Err(bad(format!(
                "inode {n}: nlink {} but {} entries",
                i.nlink, refs[n as usize]
            )));
        }
    }
    Ok(())
}

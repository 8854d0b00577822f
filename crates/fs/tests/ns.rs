//! The namespace and data path on a volatile region: every operation's
//! result, its errors, and `check` clean after each sequence.

use ustor_fs::{check, FileKind, Fs, FsError, ReadSeg, SetAttr, BLOCK_SIZE, ROOT_INO};

fn fresh(blocks: usize) -> Fs {
    Fs::format(Box::new(vec![0u8; blocks * BLOCK_SIZE])).unwrap()
}

fn clean(fs: &Fs) {
    check(fs.region()).unwrap();
}

fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|k| (k as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn write_read_across_direct_indirect_and_double_indirect() {
    let mut fs = fresh(4096);
    let f = fs.create(ROOT_INO, b"big", 0o644, 1, 2).unwrap();
    let a = pattern(1, 3 * BLOCK_SIZE + 100);
    let b = pattern(2, 1 << 20);
    fs.write(f.ino, 10, &a).unwrap();
    // 5 MiB lies behind the double indirect block (7 + 512 blocks < 1280).
    fs.write(f.ino, 5 << 20, &b).unwrap();
    let mut got = vec![0u8; a.len()];
    assert_eq!(fs.read(f.ino, 10, &mut got).unwrap(), a.len());
    assert_eq!(got, a);
    let mut got = vec![0u8; b.len()];
    fs.read(f.ino, 5 << 20, &mut got).unwrap();
    assert_eq!(got, b);
    let attr = fs.getattr(f.ino).unwrap();
    assert_eq!(attr.size, (5 << 20) + b.len() as u64);
    // The hole between reads as zeros and is a Zero segment (no blocks).
    let plan = fs.read_plan(f.ino, 1 << 20, 8192).unwrap();
    assert_eq!(plan, vec![ReadSeg::Zero(8192)]);
    // Reads stop at the end of the file.
    let mut tail = vec![0u8; 100];
    assert_eq!(fs.read(f.ino, attr.size - 10, &mut tail).unwrap(), 10);
    clean(&fs);
}

#[test]
fn truncate_frees_blocks_and_zeroes_the_tail() {
    let mut fs = fresh(4096);
    let before = fs.statfs().bfree;
    let f = fs.create(ROOT_INO, b"t", 0o600, 0, 0).unwrap();
    fs.write(f.ino, 0, &pattern(3, 3 << 20)).unwrap();
    assert!(fs.statfs().bfree < before - 700);
    fs.setattr(
        f.ino,
        SetAttr {
            size: Some(5000),
            ..Default::default()
        },
    )
    .unwrap();
    clean(&fs);
    fs.setattr(
        f.ino,
        SetAttr {
            size: Some(9000),
            ..Default::default()
        },
    )
    .unwrap();
    let mut got = vec![0u8; 9000];
    fs.read(f.ino, 0, &mut got).unwrap();
    assert_eq!(&got[..5000], &pattern(3, 5000)[..]);
    assert!(got[5000..].iter().all(|&b| b == 0));
    fs.setattr(
        f.ino,
        SetAttr {
            size: Some(0),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        fs.statfs().bfree,
        before - 1,
        "only the root directory's block stays"
    );
    fs.unlink(ROOT_INO, b"t").unwrap();
    assert_eq!(fs.statfs().bfree, before - 1);
    clean(&fs);
}

#[test]
fn namespace_operations_and_their_errors() {
    let mut fs = fresh(1024);
    let d = fs.mkdir(ROOT_INO, b"d", 0o755, 0, 0).unwrap();
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, 3);
    let a = fs.create(d.ino, b"a", 0o644, 0, 0).unwrap();
    fs.write(a.ino, 0, b"hello").unwrap();
    assert_eq!(fs.create(d.ino, b"a", 0o644, 0, 0), Err(FsError::Exists));
    assert_eq!(fs.lookup(d.ino, b"a").unwrap().ino, a.ino);
    assert_eq!(fs.lookup(d.ino, b"..").unwrap().ino, ROOT_INO);
    assert_eq!(fs.lookup(d.ino, b"zz"), Err(FsError::NotFound));
    assert_eq!(fs.lookup(a.ino, b"x"), Err(FsError::NotDir));
    assert_eq!(
        fs.create(d.ino, &[b'n'; 300], 0o644, 0, 0),
        Err(FsError::NameTooLong)
    );
    assert_eq!(fs.create(d.ino, b"a/b", 0o644, 0, 0), Err(FsError::Invalid));
    // Hard link, then unlink one name: the data stays.
    fs.link(a.ino, ROOT_INO, b"hard").unwrap();
    assert_eq!(fs.getattr(a.ino).unwrap().nlink, 2);
    assert_eq!(fs.link(d.ino, ROOT_INO, b"dirlink"), Err(FsError::Perm));
    fs.unlink(d.ino, b"a").unwrap();
    let mut b = [0u8; 5];
    fs.read(a.ino, 0, &mut b).unwrap();
    assert_eq!(&b, b"hello");
    // Symlinks.
    let s = fs.symlink(ROOT_INO, b"s", b"d/../hard", 0, 0).unwrap();
    assert_eq!(fs.readlink(s.ino).unwrap(), b"d/../hard");
    assert_eq!(fs.readlink(a.ino), Err(FsError::Invalid));
    // rmdir and unlink refuse the wrong kind.
    fs.create(d.ino, b"x", 0o644, 0, 0).unwrap();
    assert_eq!(fs.rmdir(ROOT_INO, b"d"), Err(FsError::NotEmpty));
    assert_eq!(fs.unlink(ROOT_INO, b"d"), Err(FsError::IsDir));
    assert_eq!(fs.rmdir(ROOT_INO, b"hard"), Err(FsError::NotDir));
    fs.unlink(d.ino, b"x").unwrap();
    fs.rmdir(ROOT_INO, b"d").unwrap();
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, 2);
    assert_eq!(fs.getattr(d.ino), Err(FsError::NotFound));
    // setattr keeps the file type.
    let at = fs
        .setattr(
            a.ino,
            SetAttr {
                mode: Some(0o4700),
                uid: Some(9),
                mtime_ns: Some(42),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!((at.mode, at.uid, at.mtime_ns), (0o104700, 9, 42));
    let st = fs.statfs();
    assert!(st.bfree < st.blocks && st.ffree < st.files);
    clean(&fs);
}

#[test]
fn rename_moves_replaces_and_refuses_loops() {
    let mut fs = fresh(1024);
    let p = fs.mkdir(ROOT_INO, b"p", 0o755, 0, 0).unwrap();
    let q = fs.mkdir(p.ino, b"q", 0o755, 0, 0).unwrap();
    let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap();
    let g = fs.create(q.ino, b"g", 0o644, 0, 0).unwrap();
    fs.write(g.ino, 0, &pattern(7, 10_000)).unwrap();
    let free = fs.statfs().bfree;
    // Over an existing file: the old target's blocks are freed.
    fs.rename(ROOT_INO, b"f", q.ino, b"g").unwrap();
    assert_eq!(fs.lookup(q.ino, b"g").unwrap().ino, f.ino);
    assert_eq!(fs.getattr(g.ino), Err(FsError::NotFound));
    assert_eq!(fs.statfs().bfree, free + 3);
    // A directory into its own subtree.
    assert_eq!(
        fs.rename(ROOT_INO, b"p", q.ino, b"p2"),
        Err(FsError::Invalid)
    );
    // A directory to another parent: link counts follow.
    fs.rename(p.ino, b"q", ROOT_INO, b"q").unwrap();
    assert_eq!(fs.lookup(q.ino, b"..").unwrap().ino, ROOT_INO);
    assert_eq!(fs.getattr(p.ino).unwrap().nlink, 2);
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, 4);
    // Over an empty directory, but not over a non-empty one or a file.
    fs.create(p.ino, b"inside", 0o644, 0, 0).unwrap();
    assert_eq!(
        fs.rename(ROOT_INO, b"q", ROOT_INO, b"p"),
        Err(FsError::NotEmpty)
    );
    fs.unlink(p.ino, b"inside").unwrap();
    fs.rename(ROOT_INO, b"q", ROOT_INO, b"p").unwrap();
    assert_eq!(fs.lookup(ROOT_INO, b"p").unwrap().ino, q.ino);
    assert_eq!(fs.getattr(p.ino), Err(FsError::NotFound));
    assert_eq!(fs.getattr(ROOT_INO).unwrap().nlink, 3);
    clean(&fs);
    fs.create(ROOT_INO, b"file", 0o644, 0, 0).unwrap();
    assert_eq!(
        fs.rename(ROOT_INO, b"p", ROOT_INO, b"file"),
        Err(FsError::NotDir)
    );
    assert_eq!(
        fs.rename(ROOT_INO, b"file", ROOT_INO, b"p"),
        Err(FsError::IsDir)
    );
    // The same inode under both names: nothing happens.
    fs.link(f.ino, ROOT_INO, b"f2").unwrap();
    fs.rename(q.ino, b"g", ROOT_INO, b"f2").unwrap();
    assert_eq!(fs.getattr(f.ino).unwrap().nlink, 2);
    clean(&fs);
}

#[test]
fn readdir_pages_with_cookies_and_directories_grow() {
    let mut fs = fresh(2048);
    for k in 0..100 {
        fs.create(ROOT_INO, format!("n{k:03}").as_bytes(), 0o644, 0, 0)
            .unwrap();
    }
    fs.mkdir(ROOT_INO, b"sub", 0o755, 0, 0).unwrap();
    let mut names = Vec::new();
    let mut cookie = 0;
    loop {
        let page = fs.readdir(ROOT_INO, cookie, 7).unwrap();
        let Some(last) = page.last() else { break };
        cookie = last.next;
        names.extend(page.into_iter().map(|e| (e.name, e.kind)));
    }
    assert_eq!(names.len(), 101);
    assert!(names.contains(&(b"sub".to_vec(), FileKind::Dir)));
    assert!(names.contains(&(b"n099".to_vec(), FileKind::File)));
    clean(&fs);
}

#[test]
fn full_region_reports_no_space_and_stays_consistent() {
    let mut fs = fresh(256);
    let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap();
    let r = fs.write(f.ino, 0, &pattern(1, 2 << 20));
    assert_eq!(r, Err(FsError::NoSpace));
    clean(&fs);
    fs.unlink(ROOT_INO, b"f").unwrap();
    clean(&fs);
}

/// `st_blocks` after writes comes from a count kept per inode (a write's
/// reply no longer walks the block map): it must match a walk of the map
/// (a freshly opened copy of the region keeps no count) after writes that
/// link data, indirect and double-indirect blocks, overwrites that link
/// none, holes filled, and a truncate between them.
#[test]
fn blocks_kept_by_writes_match_the_block_map() {
    let mut fs = fresh(4096);
    let f = fs.create(ROOT_INO, b"f", 0o644, 1, 2).unwrap();
    let walked = |fs: &Fs| {
        let copy = Fs::open(Box::new(fs.region().to_vec())).unwrap();
        copy.getattr(f.ino).unwrap().blocks
    };
    let steps: &[(u64, usize)] = &[
        (0, BLOCK_SIZE),
        (0, BLOCK_SIZE),                          // overwrite: nothing linked
        (20 * BLOCK_SIZE as u64, 100),            // indirect block + one data block
        (10 * BLOCK_SIZE as u64, 3 * BLOCK_SIZE), // holes under the indirect
        (5 << 20, 2 * BLOCK_SIZE),                // double indirect, its indirect
        (5 << 20, BLOCK_SIZE),                    // overwrite again
    ];
    for (k, &(off, n)) in steps.iter().enumerate() {
        fs.write(f.ino, off, &pattern(k as u8, n)).unwrap();
        assert_eq!(fs.getattr(f.ino).unwrap().blocks, walked(&fs), "step {k}");
        if k == 3 {
            let cut = SetAttr {
                size: Some(12 * BLOCK_SIZE as u64),
                ..Default::default()
            };
            fs.setattr(f.ino, cut).unwrap();
            assert_eq!(fs.getattr(f.ino).unwrap().blocks, walked(&fs), "truncate");
        }
    }
    // Blocks 0, 10, 11 and the indirect survive the cut; then the double
    // indirect, its indirect and two data blocks: 8 blocks of 8 sectors.
    assert_eq!(fs.getattr(f.ino).unwrap().blocks, 8 * 8);
    clean(&fs);
}

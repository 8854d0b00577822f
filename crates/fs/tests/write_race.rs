//! Writes whose payload is still being received while other requests run
//! (the server's zero-copy path: `begin_write`, payload into the planned
//! ranges, `finish_write`): blocks freed meanwhile are not handed to
//! another file, and a write whose inode changed is redone on the current
//! inode (a counted copy), leaving a clean region.

use ustor_fs::{check, Fs, SetAttr, BLOCK_SIZE, ROOT_INO};

fn fresh(blocks: usize) -> Fs {
    Fs::format(Box::new(vec![0u8; blocks * BLOCK_SIZE])).unwrap()
}

/// What a transport does: the payload lands in the planned ranges.
fn land(fs: &mut Fs, segs: &[(usize, usize)], data: &[u8]) {
    let mut at = 0;
    for &(o, n) in segs {
        fs.region_mut()[o..o + n].copy_from_slice(&data[at..at + n]);
        at += n;
    }
}

fn read_all(fs: &Fs, ino: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    assert_eq!(fs.read(ino, 0, &mut b).unwrap(), len);
    b
}

#[test]
fn freed_blocks_wait_for_planned_writes_and_conflicts_are_redone() {
    let mut fs = fresh(1024);
    let f = fs.create(ROOT_INO, b"f", 0o644, 0, 0).unwrap().ino;
    fs.write(f, 0, &[1u8; 2 * BLOCK_SIZE]).unwrap();
    // A write into f's existing blocks is planned; its payload is "on the
    // wire" while f is truncated and another file written.
    let plan = fs.begin_write(f, 0, 2 * BLOCK_SIZE).unwrap();
    let segs = plan.segs.clone();
    let free0 = fs.statfs().bfree;
    let trunc = SetAttr {
        size: Some(0),
        ..SetAttr::default()
    };
    fs.setattr(f, trunc).unwrap();
    // f's blocks are not free yet: g gets others.
    assert_eq!(fs.statfs().bfree, free0);
    let g = fs.create(ROOT_INO, b"g", 0o644, 0, 0).unwrap().ino;
    fs.write(g, 0, &[2u8; 2 * BLOCK_SIZE]).unwrap();
    let a = vec![3u8; 2 * BLOCK_SIZE];
    land(&mut fs, &segs, &a);
    // f changed since the plan: the write is redone on the truncated f.
    fs.finish_write(plan).unwrap();
    assert_eq!(fs.conflict_copied, (2 * BLOCK_SIZE) as u64);
    assert_eq!(read_all(&fs, f, 2 * BLOCK_SIZE), a);
    assert_eq!(read_all(&fs, g, 2 * BLOCK_SIZE), vec![2u8; 2 * BLOCK_SIZE]);
    check(fs.region()).unwrap();

    // Two writes planned on one hole: the second to finish is redone, and
    // the first one's blocks stay the file's.
    let h = fs.create(ROOT_INO, b"h", 0o644, 0, 0).unwrap().ino;
    let p1 = fs.begin_write(h, 0, BLOCK_SIZE).unwrap();
    let p2 = fs.begin_write(h, BLOCK_SIZE as u64, BLOCK_SIZE).unwrap();
    let (s1, s2) = (p1.segs.clone(), p2.segs.clone());
    land(&mut fs, &s1, &[4u8; BLOCK_SIZE]);
    land(&mut fs, &s2, &[5u8; BLOCK_SIZE]);
    fs.finish_write(p1).unwrap();
    fs.finish_write(p2).unwrap();
    let mut want = vec![4u8; BLOCK_SIZE];
    want.extend_from_slice(&[5u8; BLOCK_SIZE]);
    assert_eq!(read_all(&fs, h, 2 * BLOCK_SIZE), want);
    check(fs.region()).unwrap();

    // An aborted write (client gone) gives its fresh blocks back.
    let before = fs.statfs().bfree;
    let p = fs
        .begin_write(h, 8 * BLOCK_SIZE as u64, 4 * BLOCK_SIZE)
        .unwrap();
    assert!(fs.statfs().bfree < before);
    fs.abort_write(p);
    assert_eq!(fs.statfs().bfree, before);
    check(fs.region()).unwrap();
}

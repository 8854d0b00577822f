//! The FUSE wire decoder (`ustor_fs_client::ll`): every request the mount
//! handles, encoded here as the kernel lays it out on /dev/fuse (struct
//! layouts of include/uapi/linux/fuse.h), decodes to what was encoded; the
//! same request split as a ring entry carries it (per-op header in
//! `op_in`, the rest in the payload) decodes the same; arbitrary,
//! truncated and corrupted buffers give an error (EINVAL or ENOSYS),
//! never a panic; reply bodies have the kernel's struct sizes. The same
//! decoder runs under `cargo fuzz run fuse_request`.

use proptest::prelude::*;
use ustor_fs_client::ll::{self, opcode, reply, AttrOut, Op, SetattrIn, WireError};

fn le32(v: u32) -> [u8; 4] {
    v.to_le_bytes()
}
fn le64(v: u64) -> [u8; 8] {
    v.to_le_bytes()
}

/// The per-op header and the rest, as the kernel sends `op`.
fn args(op: &Op<'_>) -> (u32, Vec<u8>, Vec<u8>) {
    let mut h = Vec::new();
    let mut r = Vec::new();
    let z = |r: &mut Vec<u8>, n: &[u8]| {
        r.extend_from_slice(n);
        r.push(0);
    };
    let code = match *op {
        Op::Lookup { name } => {
            z(&mut r, name);
            opcode::LOOKUP
        }
        Op::Forget { nlookup } => {
            h.extend(le64(nlookup));
            opcode::FORGET
        }
        Op::Getattr { fh } => {
            h.extend(le32(fh.is_some() as u32));
            h.extend(le32(0));
            h.extend(le64(fh.unwrap_or(0)));
            opcode::GETATTR
        }
        Op::Setattr(s) => {
            for v in [s.valid, 0] {
                h.extend(le32(v));
            }
            for v in [s.fh, s.size, 0, s.atime, s.mtime, 0] {
                h.extend(le64(v));
            }
            for v in [s.atimensec, s.mtimensec, 0, s.mode, 0, s.uid, s.gid, 0] {
                h.extend(le32(v));
            }
            opcode::SETATTR
        }
        Op::Symlink { name, target } => {
            z(&mut r, name);
            z(&mut r, target);
            opcode::SYMLINK
        }
        Op::Mkdir { mode, umask, name } => {
            h.extend(le32(mode));
            h.extend(le32(umask));
            z(&mut r, name);
            opcode::MKDIR
        }
        Op::Unlink { name } => {
            z(&mut r, name);
            opcode::UNLINK
        }
        Op::Rename {
            newdir,
            flags,
            name,
            newname,
        } => {
            h.extend(le64(newdir));
            h.extend(le32(flags));
            h.extend(le32(0));
            z(&mut r, name);
            z(&mut r, newname);
            opcode::RENAME2
        }
        Op::Link { oldnodeid, name } => {
            h.extend(le64(oldnodeid));
            z(&mut r, name);
            opcode::LINK
        }
        Op::Open { flags } => {
            h.extend(le32(flags));
            h.extend(le32(0));
            opcode::OPEN
        }
        Op::Read { fh, offset, size } | Op::Readdir { fh, offset, size } => {
            h.extend(le64(fh));
            h.extend(le64(offset));
            for v in [size, 0] {
                h.extend(le32(v));
            }
            h.extend(le64(0));
            h.extend(le64(0));
            if matches!(op, Op::Read { .. }) {
                opcode::READ
            } else {
                opcode::READDIR
            }
        }
        Op::Write {
            fh,
            offset,
            write_flags,
            data,
        } => {
            h.extend(le64(fh));
            h.extend(le64(offset));
            h.extend(le32(data.len() as u32));
            h.extend(le32(write_flags));
            h.extend(le64(0));
            h.extend(le64(0));
            r.extend_from_slice(data);
            opcode::WRITE
        }
        Op::Release { fh, flags } => {
            h.extend(le64(fh));
            h.extend(le32(flags));
            h.extend(le32(0));
            h.extend(le64(0));
            opcode::RELEASE
        }
        Op::Fsync { fh, datasync } => {
            h.extend(le64(fh));
            h.extend(le32(datasync as u32));
            h.extend(le32(0));
            opcode::FSYNC
        }
        Op::Create {
            flags,
            mode,
            umask,
            name,
        } => {
            for v in [flags, mode, umask, 0] {
                h.extend(le32(v));
            }
            z(&mut r, name);
            opcode::CREATE
        }
        Op::Statfs => opcode::STATFS,
        ref other => panic!("not generated: {other:?}"),
    };
    (code, h, r)
}

/// A /dev/fuse buffer: in header, per-op header, rest.
fn frame(code: u32, unique: u64, nodeid: u64, h: &[u8], r: &[u8]) -> Vec<u8> {
    let len = (ll::IN_HEADER_LEN + h.len() + r.len()) as u32;
    let mut b = Vec::new();
    b.extend(le32(len));
    b.extend(le32(code));
    b.extend(le64(unique));
    b.extend(le64(nodeid));
    for v in [1000u32, 1000, 42] {
        b.extend(le32(v));
    }
    b.extend([0u8; 4]);
    b.extend_from_slice(h);
    b.extend_from_slice(r);
    b
}

fn name() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(1u8..=255, 1..64)
}

fn any_op(n1: Vec<u8>, n2: Vec<u8>, data: Vec<u8>, a: u64, b: u64, c: u32, k: u8) -> Vec<u8> {
    // Encoded right away: `Op` borrows the names.
    let (n1, n2, d) = (&n1[..], &n2[..], &data[..]);
    let op = match k % 17 {
        0 => Op::Lookup { name: n1 },
        1 => Op::Forget { nlookup: a },
        2 => Op::Getattr {
            fh: (a % 2 == 0).then_some(b),
        },
        3 => Op::Setattr(SetattrIn {
            valid: c,
            fh: a,
            size: b,
            atime: a ^ b,
            mtime: b.rotate_left(7),
            atimensec: c % 1_000_000_000,
            mtimensec: (c / 3) % 1_000_000_000,
            mode: c & 0o7777,
            uid: c ^ 5,
            gid: c ^ 9,
        }),
        4 => Op::Symlink {
            name: n1,
            target: n2,
        },
        5 => Op::Mkdir {
            mode: c,
            umask: 0o22,
            name: n1,
        },
        6 => Op::Unlink { name: n1 },
        7 => Op::Rename {
            newdir: a,
            flags: c,
            name: n1,
            newname: n2,
        },
        8 => Op::Link {
            oldnodeid: a,
            name: n1,
        },
        9 => Op::Open { flags: c },
        10 => Op::Read {
            fh: a,
            offset: b,
            size: c,
        },
        11 => Op::Readdir {
            fh: a,
            offset: b,
            size: c,
        },
        12 => Op::Write {
            fh: a,
            offset: b,
            write_flags: c & 7,
            data: d,
        },
        13 => Op::Release { fh: a, flags: c },
        14 => Op::Fsync {
            fh: a,
            datasync: c % 2 == 1,
        },
        15 => Op::Create {
            flags: c,
            mode: 0o100644,
            umask: 0o22,
            name: n1,
        },
        _ => Op::Statfs,
    };
    let (code, h, r) = args(&op);
    let buf = frame(code, a, b, &h, &r);
    // Both transports decode it to `op`.
    let (hd, got) = ll::decode(&buf).expect("a well-formed request decodes");
    assert_eq!((hd.opcode, hd.unique, hd.nodeid, hd.pid), (code, a, b, 42));
    assert_eq!(got, op);
    let mut op_in = h.clone();
    op_in.resize(128, 0xA5); // a ring entry's op_in area is 128 bytes
    assert_eq!(ll::decode_op(code, &op_in, &r).expect("ring layout"), op);
    buf
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_request_round_trips_on_both_transports(
        n1 in name(), n2 in name(),
        data in proptest::collection::vec(any::<u8>(), 0..4096),
        a in any::<u64>(), b in any::<u64>(), c in any::<u32>(), k in any::<u8>(),
    ) {
        let buf = any_op(n1, n2, data, a, b, c, k);
        // Every truncation is refused (length mismatch), never a panic.
        for cut in 0..buf.len() {
            prop_assert!(ll::decode(&buf[..cut]).is_err());
        }
        // With the header's length fixed up, a truncated argument list is
        // an EINVAL (or decodes when what is cut was not needed: never for
        // a name or a write's data).
        for cut in ll::IN_HEADER_LEN..buf.len() {
            let mut t = buf[..cut].to_vec();
            t[0..4].copy_from_slice(&(cut as u32).to_le_bytes());
            if let Err(e) = ll::decode(&t) {
                prop_assert_eq!(e.errno(), libc::EINVAL);
            }
        }
    }

    #[test]
    fn arbitrary_and_corrupted_buffers_never_panic(
        mut bytes in proptest::collection::vec(any::<u8>(), 0..512),
        code in 0u32..60, flip in any::<usize>(),
    ) {
        let _ = ll::decode(&bytes);
        if bytes.len() >= ll::IN_HEADER_LEN {
            let n = bytes.len() as u32;
            bytes[0..4].copy_from_slice(&n.to_le_bytes());
            bytes[4..8].copy_from_slice(&code.to_le_bytes());
            let _ = ll::decode(&bytes);
            let i = flip % bytes.len();
            bytes[i] ^= 0xFF;
            let _ = ll::decode(&bytes);
        }
        let split = flip % (bytes.len() + 1);
        let _ = ll::decode_op(code, &bytes[..split], &bytes[split..]);
    }
}

#[test]
fn names_without_nul_unknown_ops_and_short_headers_get_their_errno() {
    let no_nul = frame(opcode::LOOKUP, 1, 1, &[], b"abc");
    assert_eq!(ll::decode(&no_nul), Err(WireError::Name(opcode::LOOKUP)));
    let empty = frame(opcode::UNLINK, 1, 1, &[], b"\0");
    assert_eq!(ll::decode(&empty).unwrap_err().errno(), libc::EINVAL);
    let unknown = frame(39, 1, 1, &[], &[]); // IOCTL: not served
    assert_eq!(ll::decode(&unknown), Err(WireError::Unknown(39)));
    assert_eq!(ll::decode(&unknown).unwrap_err().errno(), libc::ENOSYS);
    let short = frame(opcode::READ, 1, 1, &[0; 20], &[]);
    assert!(matches!(
        ll::decode(&short),
        Err(WireError::Arg { need: 40, .. })
    ));
    // A write whose size says more than came.
    let mut h = vec![0u8; 40];
    h[16..20].copy_from_slice(&100u32.to_le_bytes());
    let w = frame(opcode::WRITE, 1, 1, &h, &[7; 10]);
    assert!(matches!(
        ll::decode(&w),
        Err(WireError::Arg {
            need: 100,
            got: 10,
            ..
        })
    ));
    // A batch forget whose count overflows what came.
    let mut bf = vec![0u8; 8];
    bf[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
    let f = frame(opcode::BATCH_FORGET, 1, 0, &bf, &[0; 32]);
    assert!(ll::decode(&f).is_err());
    // Extension bytes after the arguments are not part of the name.
    let mut ext = frame(
        opcode::LOOKUP,
        1,
        1,
        &[],
        b"n\0\x01\x02\x03\x04\x05\x06\x07\x08",
    );
    ext[36..38].copy_from_slice(&1u16.to_le_bytes());
    assert_eq!(ll::decode(&ext).unwrap().1, Op::Lookup { name: b"n" });
}

#[test]
fn init_reads_both_flag_words_and_replies_ask_for_io_uring_in_flags2() {
    let mut h = Vec::new();
    for v in [7u32, 45, 131072, ll::init_flags::INIT_EXT as u32, 1 << 9] {
        h.extend(le32(v));
    }
    h.resize(64, 0);
    let full = frame(opcode::INIT, 1, 0, &h, &[]);
    let (_, op) = ll::decode(&full).unwrap();
    let Op::Init {
        major,
        minor,
        flags,
        ..
    } = op
    else {
        panic!("{op:?}")
    };
    assert_eq!((major, minor), (7, 45));
    assert_ne!(flags & ll::init_flags::OVER_IO_URING, 0);
    // An old kernel's 16-byte INIT: no second word.
    let old = frame(opcode::INIT, 1, 0, &h[..16], &[]);
    let (_, op) = ll::decode(&old).unwrap();
    assert!(matches!(op, Op::Init { flags, .. } if flags >> 32 == 0));
    let out = reply::init(
        45,
        ll::init_flags::OVER_IO_URING | ll::init_flags::ASYNC_READ,
        1 << 20,
        256,
    );
    assert_eq!(out.len(), 64);
    let f1 = u32::from_le_bytes(out[12..16].try_into().unwrap()) as u64;
    let f2 = u32::from_le_bytes(out[32..36].try_into().unwrap());
    assert_ne!(f1 & ll::init_flags::INIT_EXT, 0, "INIT_EXT set with flags2");
    assert_eq!(f2, 1 << 9, "FUSE_OVER_IO_URING is flags2 bit 9");
    assert_eq!(u32::from_le_bytes(out[20..24].try_into().unwrap()), 1 << 20);
}

#[test]
fn reply_bodies_have_the_kernel_struct_sizes() {
    let a = AttrOut {
        ino: 5,
        size: 4096,
        mode: 0o100644,
        nlink: 1,
        ..Default::default()
    };
    let e = reply::entry(&a, (1, 0));
    assert_eq!(e.len(), 128, "fuse_entry_out");
    assert_eq!(u64::from_le_bytes(e[0..8].try_into().unwrap()), 5);
    assert_eq!(
        u64::from_le_bytes(e[48..56].try_into().unwrap()),
        4096,
        "attr.size"
    );
    assert_eq!(reply::attr(&a, (1, 0)).len(), 104, "fuse_attr_out");
    assert_eq!(reply::open(3, 2).len(), 16, "fuse_open_out");
    assert_eq!(reply::create(&a, (1, 0), 3, 2).len(), 144);
    assert_eq!(reply::write(4096).len(), 8, "fuse_write_out");
    assert_eq!(
        reply::statfs(10, 5, 100, 50, 4096, 247).len(),
        80,
        "fuse_statfs_out"
    );
    let mut d = Vec::new();
    assert!(reply::push_dirent(&mut d, 64, 7, 1, 8, b"abc"));
    assert_eq!(d.len(), 32, "a dirent padded to 8 bytes");
    assert!(!reply::push_dirent(&mut d, 64, 8, 2, 8, b"0123456789"));
    assert_eq!(d.len(), 32, "a dirent that does not fit is left out");
    let h = ll::out_header(9, libc::ENOENT, 0);
    assert_eq!(
        i32::from_le_bytes(h[4..8].try_into().unwrap()),
        -libc::ENOENT
    );
}

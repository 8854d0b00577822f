//! The request handler through encoded frames: a session of requests
//! decoded as a server would, a write received into the planned region
//! ranges, a read answered with region segments, data verified, read-only
//! exports refused, and the root's ".." staying at the root.

use ustor_fs::proto::{
    body_prefix, decode_header, decode_request, encode_request, Op, Request, HEADER_LEN, SET_SIZE,
    WRITE_PREFIX,
};
use ustor_fs::serve::{encode_reply, handle, Reply, Stats};
use ustor_fs::{Fs, FsError, ReadSeg, BLOCK_SIZE, ROOT_INO};

fn decoded(frame: &[u8]) -> (ustor_fs::proto::Header, Request<'_>) {
    let h = decode_header(frame[..HEADER_LEN].try_into().unwrap()).unwrap();
    let body = &frame[HEADER_LEN..];
    (h, decode_request(&h, &body[..body_prefix(&h)]).unwrap())
}

fn call(
    fs: &mut Fs,
    ro: bool,
    st: &mut Stats,
    ino: u64,
    req: Request<'_>,
) -> Result<Reply, FsError> {
    let f = encode_request(1, ino, &req);
    let (h, r) = decoded(&f);
    handle(fs, ro, st, h.ino, &r)
}

#[test]
fn write_then_read_through_frames_without_copies() {
    let mut fs = Fs::format(Box::new(vec![0u8; 2048 * BLOCK_SIZE])).unwrap();
    let mut st = Stats::default();
    let Reply::Attr(a) = call(
        &mut fs,
        false,
        &mut st,
        ROOT_INO,
        Request::Create {
            mode: 0o644,
            uid: 1,
            gid: 1,
            name: b"f",
        },
    )
    .unwrap() else {
        panic!("create answers an attribute")
    };
    let payload: Vec<u8> = (0..300_000u32).map(|k| (k * 13 % 251) as u8).collect();
    let mut frame = encode_request(
        7,
        a.ino,
        &Request::Write {
            off: 5,
            len: payload.len() as u32,
        },
    );
    frame.extend_from_slice(&payload);
    let (h, req) = decoded(&frame);
    let Request::Write { off, len } = req else {
        panic!("a write")
    };
    assert_eq!(h.len as usize - WRITE_PREFIX, payload.len());
    // The transport receives the payload straight into the planned ranges.
    let plan = fs.begin_write(h.ino, off, len as usize).unwrap();
    let mut src = &frame[HEADER_LEN + WRITE_PREFIX..];
    for &(o, n) in &plan.segs {
        fs.region_mut()[o..o + n].copy_from_slice(&src[..n]);
        src = &src[n..];
    }
    fs.finish_write(plan).unwrap();
    let r = call(
        &mut fs,
        false,
        &mut st,
        a.ino,
        Request::Read {
            off: 0,
            len: 400_000,
        },
    );
    let Ok(Reply::Data(segs)) = &r else {
        panic!("read answers segments")
    };
    let mut got = Vec::new();
    for s in segs {
        match *s {
            ReadSeg::Region { off, len } => got.extend_from_slice(&fs.region()[off..off + len]),
            ReadSeg::Zero(n) => got.resize(got.len() + n, 0),
        }
    }
    assert_eq!(&got[..5], &[0; 5]);
    assert_eq!(&got[5..], &payload[..]);
    let hdr = encode_reply(9, Op::Read, &r);
    let rh = decode_header(hdr[..HEADER_LEN].try_into().unwrap()).unwrap();
    assert_eq!((rh.len as usize, rh.tag, rh.ino), (payload.len() + 5, 9, 0));
    assert_eq!(st.copied_bytes, 0);
    assert_eq!(st.bytes_read, payload.len() as u64 + 5);
}

#[test]
fn read_only_exports_refuse_changes_and_the_root_is_closed() {
    let mut fs = Fs::format(Box::new(vec![0u8; 256 * BLOCK_SIZE])).unwrap();
    let mut st = Stats::default();
    call(
        &mut fs,
        false,
        &mut st,
        ROOT_INO,
        Request::Mkdir {
            mode: 0o755,
            uid: 0,
            gid: 0,
            name: b"d",
        },
    )
    .unwrap();
    let r = call(
        &mut fs,
        true,
        &mut st,
        ROOT_INO,
        Request::Create {
            mode: 0o644,
            uid: 0,
            gid: 0,
            name: b"x",
        },
    );
    assert_eq!(r, Err(FsError::ReadOnly));
    let set = Request::Setattr {
        mask: SET_SIZE,
        mode: 0,
        uid: 0,
        gid: 0,
        size: 0,
        atime_ns: 0,
        mtime_ns: 0,
    };
    assert_eq!(
        call(&mut fs, true, &mut st, ROOT_INO, set),
        Err(FsError::ReadOnly)
    );
    let hdr = encode_reply(3, Op::Create, &r);
    assert_eq!(
        decode_header(hdr[..HEADER_LEN].try_into().unwrap())
            .unwrap()
            .ino,
        30
    );
    // Reads still work on a read-only export.
    let Ok(Reply::Attr(up)) = call(
        &mut fs,
        true,
        &mut st,
        ROOT_INO,
        Request::Lookup { name: b".." },
    ) else {
        panic!("lookup answers an attribute")
    };
    assert_eq!(up.ino, ROOT_INO);
    let Ok(Reply::Entries(es)) = call(
        &mut fs,
        true,
        &mut st,
        ROOT_INO,
        Request::Readdir { cookie: 0, max: 10 },
    ) else {
        panic!("readdir answers entries")
    };
    assert_eq!(es.len(), 1);
    assert_eq!(es[0].name, b"d");
    assert_eq!(st.errors, 2);
    // An inode number out of range is not found, never a panic.
    assert_eq!(
        call(&mut fs, false, &mut st, u64::MAX, Request::Getattr),
        Err(FsError::NotFound)
    );
}

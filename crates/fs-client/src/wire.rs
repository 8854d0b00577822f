//! Decoders of the reply bodies (the inverse of `ustor_fs::serve`'s
//! encoders) and the handshake's MAC. Every decoder refuses a short or
//! over-long body with `ClientError::Protocol` rather than panicking.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use ustor_fs::proto::NONCE_LEN;
use ustor_fs::proto::{Request, SET_ATIME, SET_GID, SET_MODE, SET_MTIME, SET_SIZE, SET_UID};
use ustor_fs::{Attr, DirEntry, FileKind, SetAttr, StatFs};

use crate::{ClientError, Result};

/// Bytes of an encoded attribute (`serve::encode_attr`).
pub const ATTR_LEN: usize = 64;
/// Bytes of an encoded statfs reply.
pub const STATFS_LEN: usize = 40;

struct Rd<'a>(&'a [u8]);

impl<'a> Rd<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(ClientError::Protocol("reply body truncated".into()));
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Ok(h)
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn end(&self) -> Result<()> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ClientError::Protocol("trailing bytes in reply".into()))
        }
    }
}

fn attr_from(r: &mut Rd<'_>) -> Result<Attr> {
    let (ino, size, blocks) = (r.u64()?, r.u64()?, r.u64()?);
    let (atime_ns, mtime_ns, ctime_ns) = (r.u64()? as i64, r.u64()? as i64, r.u64()? as i64);
    Ok(Attr {
        ino,
        size,
        blocks,
        atime_ns,
        mtime_ns,
        ctime_ns,
        mode: r.u32()?,
        uid: r.u32()?,
        gid: r.u32()?,
        nlink: r.u32()?,
    })
}

/// Decodes an attribute reply.
/// The Setattr request for the fields `a` sets (a mask bit per field),
/// whatever transport carries it.
pub fn setattr_request(a: &SetAttr) -> Request<'static> {
    let bit = |o: bool, b: u32| if o { b } else { 0 };
    let mask = bit(a.mode.is_some(), SET_MODE)
        | bit(a.uid.is_some(), SET_UID)
        | bit(a.gid.is_some(), SET_GID)
        | bit(a.size.is_some(), SET_SIZE)
        | bit(a.atime_ns.is_some(), SET_ATIME)
        | bit(a.mtime_ns.is_some(), SET_MTIME);
    Request::Setattr {
        mask,
        mode: a.mode.unwrap_or(0),
        uid: a.uid.unwrap_or(0),
        gid: a.gid.unwrap_or(0),
        size: a.size.unwrap_or(0),
        atime_ns: a.atime_ns.unwrap_or(0),
        mtime_ns: a.mtime_ns.unwrap_or(0),
    }
}

pub fn decode_attr(b: &[u8]) -> Result<Attr> {
    let mut r = Rd(b);
    let a = attr_from(&mut r)?;
    r.end()?;
    Ok(a)
}

/// Decodes a readdir reply: a count, then {next cookie, inode, kind, name}.
pub fn decode_entries(b: &[u8]) -> Result<Vec<DirEntry>> {
    let mut r = Rd(b);
    let n = r.u32()? as usize;
    // Each entry is at least 20 bytes: a count beyond that is a lie.
    let mut v = Vec::with_capacity(n.min(b.len() / 20));
    for _ in 0..n {
        let (next, ino) = (r.u64()?, r.u64()?);
        let kind = match r.take(1)?[0] {
            0 => FileKind::File,
            1 => FileKind::Dir,
            2 => FileKind::Symlink,
            k => return Err(ClientError::Protocol(format!("unknown file kind {k}"))),
        };
        let len = r.u16()? as usize;
        let name = r.take(len)?.to_vec();
        v.push(DirEntry {
            next,
            ino,
            name,
            kind,
        });
    }
    r.end()?;
    Ok(v)
}

/// Decodes a statfs reply.
pub fn decode_statfs(b: &[u8]) -> Result<StatFs> {
    let mut r = Rd(b);
    let (blocks, bfree, files, ffree) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
    let s = StatFs {
        blocks,
        bfree,
        files,
        ffree,
        bsize: r.u32()?,
        namelen: r.u32()?,
    };
    r.end()?;
    Ok(s)
}

/// Decodes a write reply: the file's attribute after the write, or nothing.
pub fn decode_write(b: &[u8]) -> Result<Option<Attr>> {
    if b.is_empty() {
        Ok(None)
    } else {
        decode_attr(b).map(Some)
    }
}

/// The Auth MAC: HMAC-SHA256 under the export's secret of the client's
/// nonce followed by the server's.
pub fn auth_mac(
    secret: &[u8],
    client: &[u8; NONCE_LEN],
    server: &[u8; NONCE_LEN],
) -> [u8; NONCE_LEN] {
    let mut m = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(client);
    m.update(server);
    m.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ustor_fs::inode::StatFs as S;
    use ustor_fs::serve::{encode_attr, encode_reply, Reply};

    fn attr() -> Attr {
        Attr {
            ino: 7,
            mode: 0o100644,
            uid: 1,
            gid: 2,
            nlink: 1,
            size: 12345,
            blocks: 32,
            atime_ns: -5,
            mtime_ns: 1_700_000_000_000_000_000,
            ctime_ns: 3,
        }
    }

    fn body(r: Reply) -> Vec<u8> {
        let f = encode_reply(1, ustor_fs::proto::Op::Getattr, &Ok(r));
        f[ustor_fs::proto::HEADER_LEN..].to_vec()
    }

    #[test]
    fn decoders_invert_the_server_encoders() {
        let mut b = Vec::new();
        encode_attr(&mut b, &attr());
        assert_eq!(b.len(), ATTR_LEN);
        assert_eq!(decode_attr(&b).unwrap(), attr());
        assert_eq!(decode_write(&b).unwrap(), Some(attr()));
        assert_eq!(decode_write(&[]).unwrap(), None);
        let es = vec![
            DirEntry {
                next: 1,
                ino: 9,
                name: b"a".to_vec(),
                kind: FileKind::File,
            },
            DirEntry {
                next: 2,
                ino: 10,
                name: vec![b'x'; 247],
                kind: FileKind::Dir,
            },
            DirEntry {
                next: 3,
                ino: 11,
                name: b"l".to_vec(),
                kind: FileKind::Symlink,
            },
        ];
        assert_eq!(
            decode_entries(&body(Reply::Entries(es.clone()))).unwrap(),
            es
        );
        let s = S {
            bsize: 4096,
            blocks: 100,
            bfree: 50,
            files: 10,
            ffree: 5,
            namelen: 247,
        };
        let b = body(Reply::StatFs(s));
        assert_eq!(b.len(), STATFS_LEN);
        assert_eq!(decode_statfs(&b).unwrap(), s);
    }

    #[test]
    fn malformed_bodies_are_protocol_errors_never_panics() {
        let mut b = Vec::new();
        encode_attr(&mut b, &attr());
        for n in 0..b.len() {
            assert!(matches!(
                decode_attr(&b[..n]),
                Err(ClientError::Protocol(_))
            ));
        }
        b.push(0);
        assert!(decode_attr(&b).is_err());
        // A count promising more entries than the body holds.
        assert!(decode_entries(&u32::MAX.to_le_bytes()).is_err());
        let mut e = 1u32.to_le_bytes().to_vec();
        e.extend_from_slice(&[0; 16]);
        e.push(9); // unknown kind
        e.extend_from_slice(&[1, 0, b'a']);
        assert!(decode_entries(&e).is_err());
        assert!(decode_statfs(&[0; 39]).is_err());
        assert!(decode_statfs(&[0; 41]).is_err());
        // Every prefix of a valid readdir body is refused, none panics.
        let full = body(Reply::Entries(vec![DirEntry {
            next: 1,
            ino: 2,
            name: b"abc".to_vec(),
            kind: FileKind::File,
        }]));
        for n in 0..full.len() {
            assert!(decode_entries(&full[..n]).is_err());
        }
    }

    #[test]
    fn mac_depends_on_secret_and_both_nonces() {
        let (c, s) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let m = auth_mac(b"k", &c, &s);
        assert_eq!(m, auth_mac(b"k", &c, &s));
        assert_ne!(m, auth_mac(b"K", &c, &s));
        assert_ne!(m, auth_mac(b"k", &s, &c));
        // RFC 4231 test case 2 checks the construction itself.
        let mut h = Hmac::<Sha256>::new_from_slice(b"Jefe").unwrap();
        h.update(b"what do ya want for nothing?");
        let out: [u8; 32] = h.finalize().into_bytes().into();
        assert_eq!(out[..4], [0x5b, 0xdc, 0xc1, 0x46]);
    }
}

//! A minimal NBD client over a blocking `TcpStream` that allocates nothing
//! once connected: fixed request slots with their own buffers, replies
//! matched by cookie (= slot index). Used where the client shares a process
//! with the server and must not disturb what the test measures (the
//! counting-allocator test).

use std::io::{self, Read, Write};
use std::net::TcpStream;

use ustor_nbd::wire::{
    self, client_flags, cmd, opt, rep, IHAVEOPT, NBD_MAGIC, OPTION_REPLY_MAGIC, REQUEST_MAGIC,
    SIMPLE_REPLY_MAGIC, STRUCTURED_REPLY_MAGIC,
};

const HDR: usize = 28;
/// Structured reply chunk type of read data.
const CHUNK_OFFSET_DATA: u16 = 1;

/// One request slot: `buf` holds the request header and, for writes, the
/// payload right after it; reads land in `buf[HDR..]`.
struct Slot {
    buf: Vec<u8>,
    busy: bool,
    read: bool,
    len: usize,
}

pub struct RawClient {
    sock: TcpStream,
    slots: Vec<Slot>,
    pub size: u64,
    pub structured: bool,
}

fn bad(msg: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn be64(b: &[u8]) -> u64 {
    let mut a = [0; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

impl RawClient {
    /// Connects and negotiates `export`: `NBD_OPT_GO` after
    /// `NBD_OPT_STRUCTURED_REPLY` when `structured`, else `EXPORT_NAME`.
    /// `depth` slots of `max_len` payload bytes each.
    pub fn connect(
        port: u16,
        export: &str,
        structured: bool,
        depth: usize,
        max_len: usize,
    ) -> io::Result<Self> {
        let mut sock = TcpStream::connect(("127.0.0.1", port))?;
        sock.set_nodelay(true)?;
        let mut greeting = [0u8; 18];
        sock.read_exact(&mut greeting)?;
        if be64(&greeting) != NBD_MAGIC || be64(&greeting[8..]) != IHAVEOPT {
            return Err(bad("bad greeting"));
        }
        let flags = client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES;
        sock.write_all(&flags.to_be_bytes())?;
        let size = if structured {
            send_option(&mut sock, opt::STRUCTURED_REPLY, &[])?;
            expect_ack(&mut sock)?;
            let mut go = Vec::new();
            go.extend_from_slice(&(export.len() as u32).to_be_bytes());
            go.extend_from_slice(export.as_bytes());
            go.extend_from_slice(&0u16.to_be_bytes());
            send_option(&mut sock, opt::GO, &go)?;
            let mut size = None;
            loop {
                let (kind, payload) = option_reply(&mut sock)?;
                match kind {
                    rep::ACK => break,
                    // NBD_INFO_EXPORT: info type 0, size, flags.
                    rep::INFO if payload.len() == 12 && payload[..2] == [0, 0] => {
                        size = Some(be64(&payload[2..]))
                    }
                    rep::INFO => {}
                    _ => return Err(bad("NBD_OPT_GO refused")),
                }
            }
            size.ok_or_else(|| bad("no NBD_INFO_EXPORT"))?
        } else {
            send_option(&mut sock, opt::EXPORT_NAME, export.as_bytes())?;
            let mut r = [0u8; 10];
            sock.read_exact(&mut r)?;
            be64(&r)
        };
        let slots = (0..depth)
            .map(|_| Slot {
                buf: vec![0; HDR + max_len],
                busy: false,
                read: false,
                len: 0,
            })
            .collect();
        Ok(Self {
            sock,
            slots,
            size,
            structured,
        })
    }

    pub fn depth(&self) -> usize {
        self.slots.len()
    }

    pub fn is_busy(&self, slot: usize) -> bool {
        self.slots[slot].busy
    }

    /// The payload area of `slot`: fill it before `write`, read it after a
    /// read completed.
    pub fn data(&mut self, slot: usize) -> &mut [u8] {
        let len = self.slots[slot].buf.len();
        &mut self.slots[slot].buf[HDR..len]
    }

    fn send(&mut self, slot: usize, command: u16, offset: u64, len: usize) -> io::Result<()> {
        let s = &mut self.slots[slot];
        assert!(!s.busy && len <= s.buf.len() - HDR);
        let h = &mut s.buf[..HDR];
        h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        h[4..6].copy_from_slice(&0u16.to_be_bytes());
        h[6..8].copy_from_slice(&command.to_be_bytes());
        h[8..16].copy_from_slice(&(slot as u64).to_be_bytes());
        h[16..24].copy_from_slice(&offset.to_be_bytes());
        h[24..28].copy_from_slice(&(len as u32).to_be_bytes());
        s.busy = true;
        s.read = command == cmd::READ;
        s.len = len;
        let end = if command == cmd::WRITE {
            HDR + len
        } else {
            HDR
        };
        self.sock.write_all(&s.buf[..end])
    }

    /// Sends a READ of `len` bytes at `offset` on `slot`.
    pub fn read(&mut self, slot: usize, offset: u64, len: usize) -> io::Result<()> {
        self.send(slot, cmd::READ, offset, len)
    }

    /// Sends a WRITE of `data(slot)[..len]` at `offset`.
    pub fn write(&mut self, slot: usize, offset: u64, len: usize) -> io::Result<()> {
        self.send(slot, cmd::WRITE, offset, len)
    }

    /// Waits for the next reply; returns its slot and NBD error (0 = ok).
    pub fn complete(&mut self) -> io::Result<(usize, u32)> {
        let mut h = [0u8; 20];
        self.sock.read_exact(&mut h[..16])?;
        let magic = be32(&h);
        let (slot, error) = if magic == SIMPLE_REPLY_MAGIC {
            let slot = be64(&h[8..]) as usize;
            let error = be32(&h[4..]);
            let s = self.slots.get_mut(slot).ok_or_else(|| bad("bad cookie"))?;
            if error == 0 && s.read {
                self.sock.read_exact(&mut s.buf[HDR..HDR + s.len])?;
            }
            (slot, error)
        } else if magic == STRUCTURED_REPLY_MAGIC {
            self.sock.read_exact(&mut h[16..20])?;
            let kind = u16::from_be_bytes([h[6], h[7]]);
            let slot = be64(&h[8..]) as usize;
            let len = be32(&h[16..]) as usize;
            let s = self.slots.get_mut(slot).ok_or_else(|| bad("bad cookie"))?;
            // Only one chunk per request is expected: read data flagged done.
            if kind != CHUNK_OFFSET_DATA || len != 8 + s.len || h[5] & 1 == 0 {
                return Err(bad("unexpected structured chunk"));
            }
            let mut off = [0u8; 8];
            self.sock.read_exact(&mut off)?;
            self.sock.read_exact(&mut s.buf[HDR..HDR + s.len])?;
            (slot, 0)
        } else {
            return Err(bad("bad reply magic"));
        };
        let s = &mut self.slots[slot];
        if !s.busy {
            return Err(bad("reply for an idle slot"));
        }
        s.busy = false;
        Ok((slot, error))
    }

    /// Sends NBD_CMD_DISC.
    pub fn disconnect(mut self) -> io::Result<()> {
        let mut h = [0u8; HDR];
        h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        h[6..8].copy_from_slice(&cmd::DISC.to_be_bytes());
        self.sock.write_all(&h)?;
        self.slots.clear();
        Ok(())
    }
}

fn send_option(sock: &mut TcpStream, option: u32, data: &[u8]) -> io::Result<()> {
    let mut m = Vec::with_capacity(16 + data.len());
    m.extend_from_slice(&IHAVEOPT.to_be_bytes());
    m.extend_from_slice(&option.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    sock.write_all(&m)
}

fn option_reply(sock: &mut TcpStream) -> io::Result<(u32, Vec<u8>)> {
    let mut h = [0u8; wire::OPTION_REPLY_HEADER_LEN];
    sock.read_exact(&mut h)?;
    if be64(&h) != OPTION_REPLY_MAGIC {
        return Err(bad("bad option reply magic"));
    }
    let kind = be32(&h[12..]);
    let mut payload = vec![0; be32(&h[16..]) as usize];
    sock.read_exact(&mut payload)?;
    Ok((kind, payload))
}

fn expect_ack(sock: &mut TcpStream) -> io::Result<()> {
    match option_reply(sock)? {
        (rep::ACK, _) => Ok(()),
        _ => Err(bad("option not acknowledged")),
    }
}

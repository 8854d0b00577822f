//! A blocking raw-TCP NBD client for protocol tests: negotiates with
//! `NBD_OPT_GO` (after `NBD_OPT_STRUCTURED_REPLY` when asked), sends any
//! request header with any flags, and parses simple and structured replies
//! back into [`Reply`] values while keeping the wire bytes of each chunk, so
//! tests can assert both.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use ustor_nbd::wire::*;

pub struct Client {
    sock: TcpStream,
    /// Export size and transmission flags from `NBD_INFO_EXPORT`.
    pub size: u64,
    pub flags: u16,
    pub structured: bool,
    /// Lengths of READs sent and not yet answered, by cookie (a simple
    /// reply says nothing about whether data follows).
    reads: HashMap<u64, u32>,
}

/// One structured chunk as received.
#[derive(Debug, Clone)]
pub struct Chunk {
    pub header: ChunkHeader,
    /// The 20 header bytes followed by the payload, exactly as sent.
    pub bytes: Vec<u8>,
}

impl Chunk {
    pub fn payload(&self) -> &[u8] {
        &self.bytes[CHUNK_HEADER_LEN..]
    }
}

/// A whole reply to one request.
#[derive(Debug, Clone)]
pub struct Reply {
    pub cookie: u64,
    /// 0 for success; else the NBD errno of the (first) error.
    pub error: u32,
    /// Read data (simple reply payload or `OFFSET_DATA` contents).
    pub data: Vec<u8>,
    /// Empty for a simple reply.
    pub chunks: Vec<Chunk>,
}

impl Client {
    pub fn connect(port: u16, export: &str, structured: bool) -> Client {
        Self::connect_with(port, export, structured, None).0
    }

    /// Like [`Client::connect`], and when `meta` is given, sends
    /// `NBD_OPT_SET_META_CONTEXT` with those queries (after structured
    /// replies) before `NBD_OPT_GO`; returns the contexts the server
    /// selected as (id, name).
    pub fn connect_with(
        port: u16,
        export: &str,
        structured: bool,
        meta: Option<&[&str]>,
    ) -> (Client, Vec<(u32, String)>) {
        let mut sock = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        sock.set_nodelay(true).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut g = [0u8; GREETING_LEN];
        sock.read_exact(&mut g).expect("greeting");
        Greeting::decode(&g).expect("greeting decodes");
        let flags = client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES;
        sock.write_all(&flags.to_be_bytes()).unwrap();
        let mut c = Client {
            sock,
            size: 0,
            flags: 0,
            structured,
            reads: HashMap::new(),
        };
        if structured {
            c.option(opt::STRUCTURED_REPLY, &[]);
            assert_eq!(c.option_reply().0, rep::ACK);
        }
        let mut contexts = Vec::new();
        if let Some(queries) = meta {
            let mut p = Vec::new();
            MetaContextRequest::encode(export, queries, &mut p);
            c.option(opt::SET_META_CONTEXT, &p);
            loop {
                let (t, payload) = c.option_reply();
                match t {
                    rep::ACK => break,
                    rep::META_CONTEXT => {
                        let m = MetaContextReply::decode(&payload).expect("meta context reply");
                        contexts.push((m.id, m.name.to_string()));
                    }
                    other => panic!("NBD_OPT_SET_META_CONTEXT answered {other:#x}"),
                }
            }
        }
        let mut p = Vec::new();
        InfoRequest::encode(export, &[], &mut p);
        c.option(opt::GO, &p);
        loop {
            let (t, payload) = c.option_reply();
            match t {
                rep::ACK => break,
                rep::INFO => {
                    if let Ok(InfoReply::Export { size, flags }) = InfoReply::decode(&payload) {
                        c.size = size;
                        c.flags = flags;
                    }
                }
                other => panic!("NBD_OPT_GO answered {other:#x}"),
            }
        }
        assert_ne!(
            c.flags & transmission_flags::HAS_FLAGS,
            0,
            "no NBD_INFO_EXPORT"
        );
        (c, contexts)
    }

    pub fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }

    fn option(&mut self, option: u32, payload: &[u8]) {
        let h = OptionHeader {
            option,
            length: payload.len() as u32,
        };
        self.send(&h.encode());
        self.send(payload);
    }

    fn option_reply(&mut self) -> (u32, Vec<u8>) {
        let h = OptionReplyHeader::decode(&self.read_n(OPTION_REPLY_HEADER_LEN)).unwrap();
        (h.reply_type, self.read_n(h.length as usize))
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.sock.write_all(bytes).expect("send");
    }

    pub fn read_n(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0; n];
        self.sock.read_exact(&mut v).expect("read");
        v
    }

    /// The 28 bytes of a request header (for building bursts); records a
    /// READ so its reply can be parsed.
    pub fn header(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        length: u32,
        cookie: u64,
    ) -> [u8; 28] {
        if kind == cmd::READ {
            self.reads.insert(cookie, length);
        }
        RequestHeader {
            flags,
            kind,
            cookie,
            offset,
            length,
        }
        .encode()
    }

    /// Sends a request without payload.
    pub fn request(&mut self, kind: u16, flags: u16, offset: u64, length: u32, cookie: u64) {
        let h = self.header(kind, flags, offset, length, cookie);
        self.send(&h);
    }

    /// Sends a WRITE: header and payload in one `write`.
    pub fn write(&mut self, flags: u16, offset: u64, data: &[u8], cookie: u64) {
        let mut m = self
            .header(cmd::WRITE, flags, offset, data.len() as u32, cookie)
            .to_vec();
        m.extend_from_slice(data);
        self.send(&m);
    }

    /// Reads the next whole reply (all chunks up to the one flagged done).
    pub fn reply(&mut self) -> Reply {
        let head = self.read_n(4);
        let magic = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
        if magic == SIMPLE_REPLY_MAGIC {
            let mut b = head;
            b.extend(self.read_n(SIMPLE_REPLY_LEN - 4));
            let r = SimpleReply::decode(&b).unwrap();
            let len = self.reads.remove(&r.cookie);
            let data = match len {
                Some(n) if r.error == 0 => self.read_n(n as usize),
                _ => Vec::new(),
            };
            return Reply {
                cookie: r.cookie,
                error: r.error,
                data,
                chunks: Vec::new(),
            };
        }
        assert_eq!(magic, STRUCTURED_REPLY_MAGIC, "bad reply magic");
        let mut bytes = head;
        let mut reply: Option<Reply> = None;
        loop {
            bytes.extend(self.read_n(CHUNK_HEADER_LEN - 4));
            let header = ChunkHeader::decode(&bytes).unwrap();
            bytes.extend(self.read_n(header.length as usize));
            let r = reply.get_or_insert_with(|| Reply {
                cookie: header.cookie,
                error: 0,
                data: Vec::new(),
                chunks: Vec::new(),
            });
            assert_eq!(r.cookie, header.cookie, "chunks of two replies interleaved");
            let payload = &bytes[CHUNK_HEADER_LEN..];
            match ChunkPayload::decode(header.kind, payload).expect("chunk decodes") {
                ChunkPayload::OffsetData { data, .. } => r.data.extend_from_slice(data),
                // The first error is the reply's.
                ChunkPayload::Error { error, .. } | ChunkPayload::ErrorOffset { error, .. }
                    if r.error == 0 =>
                {
                    r.error = error
                }
                _ => {}
            }
            r.chunks.push(Chunk { header, bytes });
            if header.is_done() {
                break;
            }
            bytes = self.read_n(4);
        }
        let r = reply.expect("at least one chunk");
        self.reads.remove(&r.cookie);
        r
    }

    /// Sends a payload-less request and returns its reply.
    pub fn call(&mut self, kind: u16, flags: u16, offset: u64, length: u32, cookie: u64) -> Reply {
        self.request(kind, flags, offset, length, cookie);
        let r = self.reply();
        assert_eq!(r.cookie, cookie);
        r
    }

    /// Writes `data` at `offset` and returns the NBD error (0 = ok).
    pub fn write_wait(&mut self, flags: u16, offset: u64, data: &[u8], cookie: u64) -> u32 {
        self.write(flags, offset, data, cookie);
        let r = self.reply();
        assert_eq!(r.cookie, cookie);
        r.error
    }

    /// Reads `length` bytes at `offset`, asserting success.
    pub fn read_ok(&mut self, offset: u64, length: u32, cookie: u64) -> Vec<u8> {
        let r = self.call(cmd::READ, 0, offset, length, cookie);
        assert_eq!(r.error, 0, "read {offset}+{length} failed");
        assert_eq!(r.data.len(), length as usize);
        r.data
    }

    /// True when the server closes the connection (EOF or reset) within a
    /// second without sending anything more; false if it sends a byte or
    /// keeps the connection open.
    pub fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        self.sock
            .set_read_timeout(Some(Duration::from_secs(1)))
            .unwrap();
        let r = self.sock.read(&mut b);
        self.sock
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        match r {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        }
    }

    /// Sends NBD_CMD_DISC and waits for the server to close.
    pub fn disconnect(mut self) {
        self.request(cmd::DISC, 0, 0, 0, 0);
        let mut b = [0u8; 1];
        assert!(
            matches!(self.sock.read(&mut b), Ok(0) | Err(_)),
            "server sent data after DISC"
        );
    }
}

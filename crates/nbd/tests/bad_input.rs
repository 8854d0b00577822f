//! Bad clients over raw TCP: each is answered or disconnected, and the
//! server goes on serving others.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use ustor_nbd::wire::*;

struct Raw(TcpStream);

impl Raw {
    /// Connected, greeting read, client flags sent.
    fn connect(port: u16) -> Raw {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut r = Raw(s);
        let g = r.read_n(GREETING_LEN);
        assert_eq!(Greeting::decode(&g).unwrap().handshake_flags, 3);
        r
    }

    fn handshake(port: u16, structured: bool) -> Raw {
        let mut r = Raw::connect(port);
        r.send(&3u32.to_be_bytes());
        if structured {
            r.option(opt::STRUCTURED_REPLY, &[]);
            assert_eq!(r.reply().0, rep::ACK);
        }
        let mut p = Vec::new();
        InfoRequest::encode("mem", &[], &mut p);
        r.option(opt::GO, &p);
        loop {
            let (t, _) = r.reply();
            if t == rep::ACK {
                return r;
            }
            assert_eq!(t, rep::INFO);
        }
    }

    fn send(&mut self, b: &[u8]) {
        self.0.write_all(b).expect("send");
    }

    fn read_n(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0; n];
        self.0.read_exact(&mut v).expect("read");
        v
    }

    fn option(&mut self, option: u32, payload: &[u8]) {
        self.send(
            &OptionHeader {
                option,
                length: payload.len() as u32,
            }
            .encode(),
        );
        self.send(payload);
    }

    fn reply(&mut self) -> (u32, Vec<u8>) {
        let h = OptionReplyHeader::decode(&self.read_n(OPTION_REPLY_HEADER_LEN)).unwrap();
        (h.reply_type, self.read_n(h.length as usize))
    }

    fn request(&mut self, kind: u16, offset: u64, length: u32, cookie: u64) {
        self.send(
            &RequestHeader {
                flags: 0,
                kind,
                cookie,
                offset,
                length,
            }
            .encode(),
        );
    }

    fn simple_reply(&mut self) -> SimpleReply {
        SimpleReply::decode(&self.read_n(SIMPLE_REPLY_LEN)).unwrap()
    }

    /// True when the server closed the connection (EOF or reset).
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.0.read(&mut b), Ok(0) | Err(_))
    }
}

#[test]
fn garbage_instead_of_client_flags_is_dropped() {
    let f = common::start(1 << 20, 1);
    let mut r = Raw::connect(f.port);
    r.send(b"GET / HTTP/1.0\r\n\r\n");
    assert!(r.closed());
    // The server still serves.
    let mut ok = Raw::handshake(f.port, false);
    ok.request(cmd::READ, 0, 512, 1);
    assert_eq!(ok.simple_reply().error, 0);
}

#[test]
fn garbage_option_magic_is_dropped() {
    let f = common::start(1 << 20, 1);
    let mut r = Raw::connect(f.port);
    r.send(&3u32.to_be_bytes());
    r.send(b"NOTMAGIC\0\0\0\x07\0\0\0\0");
    assert!(r.closed());
}

#[test]
fn unknown_starttls_and_oversized_options() {
    let f = common::start(1 << 20, 1);
    let mut r = Raw::connect(f.port);
    r.send(&3u32.to_be_bytes());
    r.option(0x1234, b"whatever");
    assert_eq!(r.reply().0, rep::ERR_UNSUP);
    r.option(opt::STARTTLS, &[]);
    assert_eq!(r.reply().0, rep::ERR_POLICY);
    // 1 MiB option: read, discarded, refused; connection stays.
    r.option(opt::SET_META_CONTEXT, &vec![0u8; 1 << 20]);
    assert_eq!(r.reply().0, rep::ERR_TOO_BIG);
    r.option(opt::LIST, &[]);
    let (t, p) = r.reply();
    assert_eq!(t, rep::SERVER);
    assert_eq!(ServerReply::decode(&p).unwrap().name, "mem");
    assert_eq!(r.reply().0, rep::ACK);
    // Past the hard cap: the server hangs up without reading it.
    r.send(
        &OptionHeader {
            option: opt::GO,
            length: u32::MAX,
        }
        .encode(),
    );
    assert!(r.closed());
}

#[test]
fn out_of_range_requests_keep_the_connection() {
    let f = common::start(1 << 20, 1);
    let mut r = Raw::handshake(f.port, false);
    r.request(cmd::READ, 1 << 20, 512, 1);
    assert_eq!(
        r.simple_reply(),
        SimpleReply {
            error: 22,
            cookie: 1
        }
    );
    r.request(cmd::READ, 1, 512, 2);
    assert_eq!(
        r.simple_reply(),
        SimpleReply {
            error: 22,
            cookie: 2
        }
    );
    r.request(99, 0, 0, 3);
    assert_eq!(
        r.simple_reply(),
        SimpleReply {
            error: 22,
            cookie: 3
        }
    );
    // Write past the end: payload drained, ENOSPC, still in sync.
    r.request(cmd::WRITE, 1 << 20, 4096, 4);
    r.send(&[0xee; 4096]);
    assert_eq!(
        r.simple_reply(),
        SimpleReply {
            error: 28,
            cookie: 4
        }
    );
    r.request(cmd::WRITE, 0, 512, 5);
    r.send(&[0xab; 512]);
    assert_eq!(
        r.simple_reply(),
        SimpleReply {
            error: 0,
            cookie: 5
        }
    );
    r.request(cmd::READ, 0, 512, 6);
    assert_eq!(
        r.simple_reply(),
        SimpleReply {
            error: 0,
            cookie: 6
        }
    );
    assert_eq!(r.read_n(512), vec![0xab; 512]);
    // BLOCK_STATUS without a context.
    r.request(cmd::BLOCK_STATUS, 0, 512, 7);
    assert_eq!(
        r.simple_reply(),
        SimpleReply {
            error: 22,
            cookie: 7
        }
    );
    r.request(cmd::DISC, 0, 0, 8);
    assert!(r.closed());
}

#[test]
fn structured_errors_and_reads() {
    let f = common::start(1 << 20, 1);
    let mut r = Raw::handshake(f.port, true);
    r.request(cmd::READ, 1 << 20, 512, 1);
    let h = ChunkHeader::decode(&r.read_n(CHUNK_HEADER_LEN)).unwrap();
    assert_eq!(
        (h.kind, h.cookie, h.is_done()),
        (reply::TYPE_ERROR, 1, true)
    );
    let p = r.read_n(h.length as usize);
    assert_eq!(
        ChunkPayload::decode(h.kind, &p),
        Ok(ChunkPayload::Error {
            error: 22,
            message: ""
        })
    );
    r.request(cmd::READ, 512, 1024, 2);
    let h = ChunkHeader::decode(&r.read_n(CHUNK_HEADER_LEN)).unwrap();
    assert_eq!(
        (h.kind, h.length, h.is_done()),
        (reply::TYPE_OFFSET_DATA, 1032, true)
    );
    let p = r.read_n(h.length as usize);
    assert_eq!(&p[..8], &512u64.to_be_bytes());
}

#[test]
fn bad_request_magic_disconnects() {
    let f = common::start(1 << 20, 1);
    let mut r = Raw::handshake(f.port, false);
    r.send(&[0x55; REQUEST_HEADER_LEN]);
    assert!(r.closed());
}

#[test]
fn oversized_write_disconnects() {
    let f = common::start(1 << 20, 1);
    let mut r = Raw::handshake(f.port, false);
    r.request(cmd::WRITE, 0, (32 << 20) + 512, 1);
    assert!(r.closed());
    let stats = f.server.get_stats().unwrap();
    assert_eq!(stats.protocol_errors, 1);
}

#[test]
fn client_vanishing_mid_write() {
    let f = common::start(1 << 20, 2);
    for _ in 0..8 {
        let mut r = Raw::handshake(f.port, false);
        r.request(cmd::WRITE, 0, 1 << 20, 1);
        r.send(&[1; 1000]);
        drop(r);
    }
    let mut ok = Raw::handshake(f.port, false);
    ok.request(cmd::READ, 0, 1000 & !511, 1);
    assert_eq!(ok.simple_reply().error, 0);
    // The torn writes never reached the device.
    assert_eq!(ok.read_n(512), vec![0; 512]);
    drop(ok);
    let closed = testkit::try_wait_for(Duration::from_secs(10), || {
        (f.server.connections() == 0).then_some(())
    });
    assert!(
        closed.is_some(),
        "connections leaked: {}",
        f.server.connections()
    );
}

//! Conformance with the NBD protocol document (`doc/proto.md` of the NBD
//! project), over raw TCP against an in-process server: one test per rule
//! the server once broke, each citing the sentence it checks. Where the
//! document leaves a choice open, the tests follow what qemu-nbd and nbdkit
//! do, and say so.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::client::Client;
use ustor_nbd::server::{ExportCreateParams, ListenAddress, NbdServer, ServerStartParams};
use ustor_nbd::wire::*;
use ustor_nbd::NbdErrno;
use ustor_runtime::{PollMode, Runtime, RuntimeConfig};

/// Largest option payload the server parses (`Limits::default()`); one byte
/// more is read and discarded instead.
const MAX_OPTION_PAYLOAD: usize = 64 * 1024;

/// A client in option haggling: greeting read, client flags sent.
struct Haggler(TcpStream);

impl Haggler {
    fn connect(port: u16) -> Haggler {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut h = Haggler(s);
        Greeting::decode(&h.read_n(GREETING_LEN)).expect("greeting");
        let flags = client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES;
        h.0.write_all(&flags.to_be_bytes()).unwrap();
        h
    }

    fn read_n(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0; n];
        self.0.read_exact(&mut v).expect("read");
        v
    }

    fn option(&mut self, option: u32, payload: &[u8]) {
        let h = OptionHeader {
            option,
            length: payload.len() as u32,
        };
        let mut m = h.encode().to_vec();
        m.extend_from_slice(payload);
        self.0.write_all(&m).expect("send option");
    }

    /// The next option reply: (option it answers, reply type, payload).
    fn reply(&mut self) -> (u32, u32, Vec<u8>) {
        let h = OptionReplyHeader::decode(&self.read_n(OPTION_REPLY_HEADER_LEN)).unwrap();
        (h.option, h.reply_type, self.read_n(h.length as usize))
    }

    /// Reply types up to and including the final one (ACK or an error).
    fn replies(&mut self, option: u32) -> Vec<u32> {
        let mut types = Vec::new();
        loop {
            let (o, t, _) = self.reply();
            assert_eq!(o, option, "reply to the wrong option");
            types.push(t);
            if t == rep::ACK || t & rep::ERR_BIT != 0 {
                return types;
            }
        }
    }

    /// True when the server closes within a second without sending more.
    fn closed(&mut self) -> bool {
        self.0
            .set_read_timeout(Some(Duration::from_secs(1)))
            .unwrap();
        let mut b = [0u8; 1];
        match self.0.read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        }
    }
}

fn meta_payload(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut p = Vec::new();
    MetaContextRequest::encode(export, queries, &mut p);
    p
}

/// "There is no reply to an `NBD_CMD_DISC`." (Request types,
/// `NBD_CMD_DISC`): the server closes instead of answering, even when the
/// flags are ones DISC does not take. qemu-nbd ("we're going to disconnect
/// without a reply, whether or not flags, from, or len are bogus") and
/// nbdkit both check for DISC before validating flags.
#[test]
fn disc_with_bad_flags_closes_without_reply() {
    let f = common::start(1 << 20, 1);
    for (structured, flags) in [
        (false, cmd_flags::REQ_ONE),
        (true, cmd_flags::NO_HOLE | cmd_flags::FAST_ZERO),
    ] {
        let mut c = Client::connect(f.port, "mem", structured);
        c.request(cmd::DISC, flags, 0, 0, 9);
        assert!(
            c.closed(),
            "DISC with flags {flags:#x} was answered or left the connection open"
        );
    }
}

/// "The server MUST handle all outstanding requests, shut down the TLS
/// session (if one is running), and close the TCP session." (Request types,
/// `NBD_CMD_DISC`): a read still at the device when DISC arrives is answered
/// in full before the server closes.
#[test]
fn disc_answers_requests_in_flight() {
    const DELAY: Duration = Duration::from_millis(200);
    let (f, _probe) = common::start_slow_reads(DELAY);
    let mut c = Client::connect(f.port, "fault", true);
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    assert_eq!(c.write_wait(0, 0, &data, 1), 0);
    let t0 = Instant::now();
    let mut m = c.header(cmd::READ, 0, 0, 4096, 2).to_vec();
    m.extend_from_slice(&c.header(cmd::DISC, 0, 0, 0, 3));
    c.send(&m);
    let r = c.reply();
    assert_eq!((r.cookie, r.error), (2, 0));
    assert_eq!(r.data, data);
    assert!(
        t0.elapsed() >= DELAY,
        "the read did not wait for the device"
    );
    assert!(c.closed(), "the server did not close after DISC");
}

/// "The client desires to abort the negotiation and terminate the session.
/// The server MUST reply with `NBD_REP_ACK`." and "a server SHOULD ignore
/// any data sent by the client rather than rejecting the request as
/// invalid." (`NBD_OPT_ABORT`): data too large to parse is skipped, then
/// acknowledged, and the session ends.
#[test]
fn abort_with_oversized_data_is_acked() {
    let f = common::start(1 << 20, 1);
    let mut h = Haggler::connect(f.port);
    h.option(opt::ABORT, &vec![0xaa; MAX_OPTION_PAYLOAD + 1]);
    let (option, t, _) = h.reply();
    assert_eq!((option, t), (opt::ABORT, rep::ACK));
    assert!(h.closed(), "the session went on after NBD_OPT_ABORT");
}

/// "Issuing this command replaces all previously-set metadata contexts
/// (including when this command fails)" (`NBD_OPT_SET_META_CONTEXT`): a SET
/// refused as too big leaves no context selected, so a later
/// `NBD_CMD_BLOCK_STATUS` gets "Servers SHOULD reply with `NBD_EINVAL` to
/// clients sending `NBD_CMD_BLOCK_STATUS` without selecting at least one
/// metadata context."
#[test]
fn oversized_set_meta_context_clears_the_selection() {
    let f = common::start(1 << 20, 1);
    let mut h = Haggler::connect(f.port);
    h.option(opt::STRUCTURED_REPLY, &[]);
    assert_eq!(h.replies(opt::STRUCTURED_REPLY), vec![rep::ACK]);
    h.option(
        opt::SET_META_CONTEXT,
        &meta_payload("mem", &["base:allocation"]),
    );
    assert_eq!(
        h.replies(opt::SET_META_CONTEXT),
        vec![rep::META_CONTEXT, rep::ACK]
    );
    // A well-formed request whose query is far too long to parse.
    let long = format!("x-pad:{}", "a".repeat(MAX_OPTION_PAYLOAD));
    h.option(
        opt::SET_META_CONTEXT,
        &meta_payload("mem", &["base:allocation", &long]),
    );
    assert_eq!(h.replies(opt::SET_META_CONTEXT), vec![rep::ERR_TOO_BIG]);
    let mut go = Vec::new();
    InfoRequest::encode("mem", &[], &mut go);
    h.option(opt::GO, &go);
    assert_eq!(
        *h.replies(opt::GO).last().unwrap(),
        rep::ACK,
        "NBD_OPT_GO failed"
    );
    let req = RequestHeader {
        flags: 0,
        kind: cmd::BLOCK_STATUS,
        cookie: 5,
        offset: 0,
        length: 4096,
    };
    h.0.write_all(&req.encode()).unwrap();
    let chunk = ChunkHeader::decode(&h.read_n(CHUNK_HEADER_LEN)).unwrap();
    let payload = h.read_n(chunk.length as usize);
    assert_eq!(
        (chunk.kind, chunk.cookie, chunk.is_done()),
        (reply::TYPE_ERROR, 5, true),
        "BLOCK_STATUS answered with a context the failed SET replaced"
    );
    assert_eq!(
        ChunkPayload::decode(chunk.kind, &payload),
        Ok(ChunkPayload::Error {
            error: NbdErrno::Inval.code(),
            message: ""
        })
    );
}

/// "The presence of the option length in every option allows the server to
/// skip any options presented by the client that it does not understand."
/// and `NBD_REP_ERR_UNSUP`: "The option sent by the client is unknown by
/// this server implementation". An unknown option is unsupported whatever
/// its length (qemu-nbd and nbdkit skip its data and answer
/// `NBD_REP_ERR_UNSUP`); options that take no data are invalid with data of
/// any length ("the server SHOULD reject a request that includes data with
/// `NBD_REP_ERR_INVALID`", `NBD_OPT_LIST` and `NBD_OPT_STRUCTURED_REPLY`).
#[test]
fn oversized_options_get_the_answer_their_kind_gets() {
    let f = common::start(1 << 20, 1);
    let mut h = Haggler::connect(f.port);
    let big = vec![0x55; MAX_OPTION_PAYLOAD + 1];
    for (option, answer) in [
        (0x7777, rep::ERR_UNSUP),
        (opt::EXTENDED_HEADERS, rep::ERR_UNSUP),
        (opt::LIST, rep::ERR_INVALID),
        (opt::STRUCTURED_REPLY, rep::ERR_INVALID),
        (opt::STARTTLS, rep::ERR_INVALID),
        (opt::GO, rep::ERR_TOO_BIG),
    ] {
        h.option(option, &big);
        assert_eq!(h.replies(option), vec![answer], "option {option:#x}");
    }
    // Still in sync, and STRUCTURED_REPLY was not negotiated by the
    // oversized one.
    h.option(opt::LIST, &[]);
    assert_eq!(h.replies(opt::LIST), vec![rep::SERVER, rep::ACK]);
    h.option(opt::SET_META_CONTEXT, &meta_payload("mem", &[]));
    assert_eq!(h.replies(opt::SET_META_CONTEXT), vec![rep::ERR_INVALID]);
}

/// What the scripted device reports for every block-status query.
type Script = common::mem::Script;

struct Scripted {
    script: Script,
    port: u16,
    _server: NbdServer,
    _rt: Runtime,
}

fn start_scripted() -> Scripted {
    let rt = Runtime::start(RuntimeConfig {
        cores: vec![0],
        pin: false,
        poll_mode: PollMode::Adaptive,
        ..RuntimeConfig::default()
    })
    .expect("runtime starts");
    let registry = ustor_bdev::Registry::new(Some(rt.handle()));
    let script: Script = Arc::default();
    common::mem::create(&registry, "scripted", 1 << 20, 512, Some(script.clone()));
    let server = NbdServer::new(rt.handle());
    let r = server
        .start(&ServerStartParams {
            listen_address: ListenAddress {
                traddr: "127.0.0.1".into(),
                trsvcid: "0".into(),
            },
            max_connections: 8,
        })
        .expect("server starts");
    server
        .export_create(
            &registry,
            &ExportCreateParams {
                name: "map".into(),
                bdev_name: "scripted".into(),
                read_only: false,
                description: String::new(),
            },
        )
        .expect("export");
    Scripted {
        script,
        port: r.trsvcid.parse().unwrap(),
        _server: server,
        _rt: rt,
    }
}

fn ext(length: u32, flags: u32) -> BlockDescriptor {
    BlockDescriptor { length, flags }
}

/// `NBD_REPLY_TYPE_BLOCK_STATUS`: "If the client did not use the flag, and
/// the server replies with N extents, then the sum of the *length* fields
/// of the first N-1 extents (if any) MUST be less than the requested
/// length", descriptors are "(unsigned, MUST be nonzero)", and with
/// `NBD_CMD_FLAG_REQ_ONE` "every reply chunk MUST contain exactly one
/// descriptor, and that descriptor MUST NOT exceed the *length* of the
/// original request". The device may know more than was asked (or report
/// nonsense); the server sends only what the rules allow.
#[test]
fn block_status_extents_obey_the_length_rules() {
    let s = start_scripted();
    let (mut c, contexts) = Client::connect_with(s.port, "map", true, Some(&["base:allocation"]));
    assert_eq!(contexts.len(), 1);
    let id = contexts[0].0;
    let data = state::HOLE | state::ZERO;
    let status = |c: &mut Client, flags: u16, length: u32, cookie: u64| {
        let r = c.call(cmd::BLOCK_STATUS, flags, 0, length, cookie);
        assert_eq!(r.error, 0);
        assert_eq!(r.chunks.len(), 1);
        let chunk = &r.chunks[0];
        assert!(chunk.header.is_done());
        match ChunkPayload::decode(chunk.header.kind, chunk.payload()) {
            Ok(ChunkPayload::BlockStatus {
                context_id,
                descriptors,
            }) => {
                assert_eq!(context_id, id);
                block_descriptors(descriptors).collect::<Vec<_>>()
            }
            other => panic!("not a block status chunk: {other:?}"),
        }
    };
    // Four extents known, 1024 bytes asked: the second reaches the end.
    *s.script.lock().unwrap() = vec![ext(512, 0), ext(512, data), ext(512, 0), ext(4096, data)];
    assert_eq!(
        status(&mut c, 0, 1024, 1),
        vec![ext(512, 0), ext(512, data)]
    );
    // The last extent may run past the request.
    assert_eq!(
        status(&mut c, 0, 1536, 2),
        vec![ext(512, 0), ext(512, data), ext(512, 0)]
    );
    // A zero-length first extent: only the always-true "allocated" answer
    // for the request remains.
    *s.script.lock().unwrap() = vec![ext(0, data), ext(512, data)];
    assert_eq!(status(&mut c, 0, 2048, 3), vec![ext(2048, 0)]);
    // A zero-length extent later on ends the list before it.
    *s.script.lock().unwrap() = vec![ext(512, data), ext(0, 0), ext(512, 0)];
    assert_eq!(status(&mut c, 0, 2048, 4), vec![ext(512, data)]);
    // REQ_ONE: one extent, no longer than asked.
    *s.script.lock().unwrap() = vec![ext(8192, data), ext(512, 0)];
    assert_eq!(
        status(&mut c, cmd_flags::REQ_ONE, 1024, 5),
        vec![ext(1024, data)]
    );
    c.disconnect();
}

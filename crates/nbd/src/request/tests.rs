//! Request validation tests with byte vectors.

use super::*;
use crate::export::BlockSizes;

const SIZE: u64 = 1 << 20;

fn params() -> TransmissionParams {
    TransmissionParams {
        size_bytes: SIZE,
        block_sizes: BlockSizes {
            min: 512,
            preferred: 4096,
            max_payload: 1 << 17,
        },
        flags: tf::HAS_FLAGS
            | tf::SEND_FLUSH
            | tf::SEND_FUA
            | tf::SEND_TRIM
            | tf::SEND_WRITE_ZEROES
            | tf::SEND_FAST_ZERO
            | tf::SEND_DF,
        structured: true,
        base_allocation: Some(1),
        block_size_agreed: true,
    }
}

fn req(kind: u16, flags: u16, offset: u64, length: u32) -> [u8; REQUEST_HEADER_LEN] {
    RequestHeader {
        flags,
        kind,
        cookie: 0x1234,
        offset,
        length,
    }
    .encode()
}

fn refused(r: Result<Request, RequestError>) -> (NbdErrno, u32) {
    match r {
        Err(RequestError::Refused {
            cookie: 0x1234,
            errno,
            discard,
            ..
        }) => (errno, discard),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn valid_commands() {
    let p = params();
    let ok = |b: [u8; 28]| decode(&b, &p).unwrap().command;
    assert_eq!(
        ok(req(cmd::READ, cmd_flags::DF, 512, 4096)),
        Command::Read {
            offset: 512,
            length: 4096,
            df: true
        }
    );
    assert_eq!(
        ok(req(cmd::WRITE, cmd_flags::FUA, 0, 512)),
        Command::Write {
            offset: 0,
            length: 512,
            fua: true
        }
    );
    assert_eq!(ok(req(cmd::FLUSH, 0, 0, 0)), Command::Flush);
    assert_eq!(
        ok(req(cmd::TRIM, 0, 4096, 8192)),
        Command::Trim {
            offset: 4096,
            length: 8192,
            fua: false
        }
    );
    assert_eq!(
        ok(req(
            cmd::WRITE_ZEROES,
            cmd_flags::NO_HOLE | cmd_flags::FAST_ZERO,
            0,
            1 << 19
        )),
        Command::WriteZeroes {
            offset: 0,
            length: 1 << 19,
            fua: false,
            no_hole: true,
            fast: true
        }
    );
    assert_eq!(
        ok(req(cmd::CACHE, 0, 0, 4096)),
        Command::Cache {
            offset: 0,
            length: 4096
        }
    );
    assert_eq!(
        ok(req(cmd::BLOCK_STATUS, cmd_flags::REQ_ONE, 0, 4096)),
        Command::BlockStatus {
            offset: 0,
            length: 4096,
            req_one: true,
            context_id: 1
        }
    );
    assert_eq!(ok(req(cmd::DISC, 0, 0, 0)), Command::Disconnect);
    // DISC is never answered, so never refused: flags it does not take and
    // nonzero offset and length still disconnect.
    assert_eq!(
        ok(req(cmd::DISC, cmd_flags::REQ_ONE | 0x8000, 1, 3)),
        Command::Disconnect
    );
    // FUA is accepted on any command once advertised.
    assert!(matches!(
        ok(req(cmd::READ, cmd_flags::FUA, 0, 512)),
        Command::Read { .. }
    ));
    // Whole export, up to the last byte.
    assert!(matches!(
        ok(req(cmd::READ, 0, SIZE - 512, 512)),
        Command::Read { .. }
    ));
}

#[test]
fn bad_magic_is_fatal() {
    let mut b = req(cmd::READ, 0, 0, 512);
    b[0] ^= 1;
    let e = decode(&b, &params()).unwrap_err();
    assert!(matches!(e, RequestError::BadMagic(_)));
    assert!(e.is_fatal());
    let good = req(cmd::READ, 0, 0, 512);
    assert_eq!(decode(&good[..10], &params()), Err(RequestError::Truncated));
}

#[test]
fn unknown_command_and_flags() {
    let p = params();
    assert_eq!(refused(decode(&req(8, 0, 0, 0), &p)), (NbdErrno::Inval, 0));
    assert_eq!(
        refused(decode(&req(0xffff, 0, 0, 0), &p)),
        (NbdErrno::Inval, 0)
    );
    assert_eq!(
        refused(decode(&req(cmd::READ, 1 << 7, 0, 512), &p)),
        (NbdErrno::Inval, 0)
    );
    assert_eq!(
        refused(decode(&req(cmd::READ, cmd_flags::NO_HOLE, 0, 512), &p)),
        (NbdErrno::Inval, 0)
    );
    assert_eq!(
        refused(decode(&req(cmd::BLOCK_STATUS, cmd_flags::DF, 0, 512), &p)),
        (NbdErrno::Inval, 0)
    );
    // A refused write still tells how much payload to drain.
    assert_eq!(
        refused(decode(&req(cmd::WRITE, cmd_flags::REQ_ONE, 0, 4096), &p)),
        (NbdErrno::Inval, 4096)
    );
    // DF only with structured replies.
    let simple = TransmissionParams {
        structured: false,
        flags: p.flags & !tf::SEND_DF,
        ..p
    };
    assert_eq!(
        refused(decode(&req(cmd::READ, cmd_flags::DF, 0, 512), &simple)),
        (NbdErrno::Inval, 0)
    );
    // FAST_ZERO only when advertised.
    let slow = TransmissionParams {
        flags: p.flags & !tf::SEND_FAST_ZERO,
        ..p
    };
    assert_eq!(
        refused(decode(
            &req(cmd::WRITE_ZEROES, cmd_flags::FAST_ZERO, 0, 512),
            &slow
        )),
        (NbdErrno::Inval, 0)
    );
}

#[test]
fn ranges_and_alignment() {
    let p = params();
    for kind in [cmd::READ, cmd::TRIM, cmd::CACHE, cmd::BLOCK_STATUS] {
        assert_eq!(
            refused(decode(&req(kind, 0, SIZE, 512), &p)).0,
            NbdErrno::Inval,
            "kind {kind}"
        );
        assert_eq!(
            refused(decode(&req(kind, 0, u64::MAX - 100, 512), &p)).0,
            NbdErrno::Inval
        );
        assert_eq!(
            refused(decode(&req(kind, 0, 1, 512), &p)).0,
            NbdErrno::Inval
        );
        assert_eq!(
            refused(decode(&req(kind, 0, 0, 100), &p)).0,
            NbdErrno::Inval
        );
    }
    assert_eq!(
        refused(decode(&req(cmd::WRITE, 0, SIZE, 512), &p)),
        (NbdErrno::NoSpc, 512)
    );
    assert_eq!(
        refused(decode(&req(cmd::WRITE, 0, u64::MAX - 511, 512), &p)),
        (NbdErrno::NoSpc, 512)
    );
    assert_eq!(
        refused(decode(&req(cmd::WRITE_ZEROES, 0, SIZE - 512, 1024), &p)).0,
        NbdErrno::NoSpc
    );
    assert_eq!(
        refused(decode(&req(cmd::WRITE, 0, 3, 512), &p)),
        (NbdErrno::Inval, 512)
    );
}

#[test]
fn size_limits() {
    let p = params();
    let max = p.block_sizes.max_payload;
    assert_eq!(
        refused(decode(&req(cmd::READ, 0, 0, max + 512), &p)).0,
        NbdErrno::Overflow
    );
    let simple = TransmissionParams {
        structured: false,
        ..p
    };
    assert_eq!(
        refused(decode(&req(cmd::READ, 0, 0, max + 512), &simple)).0,
        NbdErrno::Inval
    );
    // Oversized write up to the drain cap: refused, payload drained.
    assert_eq!(
        refused(decode(&req(cmd::WRITE, 0, 0, max + 512), &p)),
        (NbdErrno::Inval, max + 512)
    );
    assert_eq!(
        refused(decode(&req(cmd::WRITE, 0, 0, MAX_DISCARD_PAYLOAD), &p)).1,
        MAX_DISCARD_PAYLOAD
    );
    // Past it: disconnect.
    let e = decode(&req(cmd::WRITE, 0, 0, MAX_DISCARD_PAYLOAD + 1), &p).unwrap_err();
    assert_eq!(e, RequestError::PayloadTooLarge(MAX_DISCARD_PAYLOAD + 1));
    assert!(e.is_fatal());
    // Effect-only commands may exceed the payload limit.
    assert!(decode(&req(cmd::TRIM, 0, 0, 1 << 20), &p).is_ok());
}

#[test]
fn read_only_and_unadvertised() {
    let p = params();
    let ro = TransmissionParams {
        flags: tf::HAS_FLAGS | tf::READ_ONLY | tf::SEND_FLUSH,
        ..p
    };
    assert_eq!(
        refused(decode(&req(cmd::WRITE, 0, 0, 512), &ro)),
        (NbdErrno::Perm, 512)
    );
    assert_eq!(
        refused(decode(&req(cmd::TRIM, 0, 0, 512), &ro)).0,
        NbdErrno::Perm
    );
    assert_eq!(
        refused(decode(&req(cmd::WRITE_ZEROES, 0, 0, 512), &ro)).0,
        NbdErrno::Perm
    );
    // FUA is not advertised on a read-only export.
    assert_eq!(
        refused(decode(&req(cmd::READ, cmd_flags::FUA, 0, 512), &ro)).0,
        NbdErrno::Inval
    );
    assert!(decode(&req(cmd::READ, 0, 0, 512), &ro).is_ok());
    let bare = TransmissionParams {
        flags: tf::HAS_FLAGS,
        base_allocation: None,
        ..p
    };
    assert_eq!(
        refused(decode(&req(cmd::FLUSH, 0, 0, 0), &bare)).0,
        NbdErrno::Inval
    );
    assert_eq!(
        refused(decode(&req(cmd::TRIM, 0, 0, 512), &bare)).0,
        NbdErrno::Inval
    );
    assert_eq!(
        refused(decode(&req(cmd::WRITE_ZEROES, 0, 0, 512), &bare)).0,
        NbdErrno::Inval
    );
    assert_eq!(
        refused(decode(&req(cmd::BLOCK_STATUS, 0, 0, 512), &bare)).0,
        NbdErrno::Inval
    );
    // CACHE is accepted unadvertised (clients send it anyway).
    assert!(decode(&req(cmd::CACHE, 0, 0, 512), &bare).is_ok());
}

#[test]
fn zero_length_requests() {
    let p = params();
    assert!(decode(&req(cmd::READ, 0, SIZE, 0), &p).is_ok());
    assert!(decode(&req(cmd::WRITE, 0, 0, 0), &p).is_ok());
    assert_eq!(
        refused(decode(&req(cmd::BLOCK_STATUS, 0, 0, 0), &p)).0,
        NbdErrno::Inval
    );
}

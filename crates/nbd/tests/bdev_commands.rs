//! Commands against real bdev exports over raw TCP, checked on the wire and
//! in the server's counters: a failed read's `ERROR_OFFSET` chunk, CACHE,
//! FUA, FLUSH and WRITE_ZEROES (with NO_HOLE and FAST_ZERO), and the exact
//! payload-copy counts of small and large writes.

mod common;

use common::client::Client;
use common::fault::{FaultOpts, Probe};
use common::{start_bdev, start_fault};
use ustor_nbd::server::COPY_MAX;
use ustor_nbd::wire::{
    cmd, cmd_flags, reply, transmission_flags as tf, CHUNK_HEADER_LEN, STRUCTURED_REPLY_MAGIC,
};

const EIO: u32 = 5;
const EINVAL: u32 = 22;
const ENOTSUP: u32 = 95;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i / 512) as u8))
        .collect()
}

/// The exact bytes of a final `ERROR_OFFSET` chunk without a message.
fn error_offset_chunk(cookie: u64, error: u32, offset: u64) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&reply::FLAG_DONE.to_be_bytes());
    b.extend_from_slice(&reply::TYPE_ERROR_OFFSET.to_be_bytes());
    b.extend_from_slice(&cookie.to_be_bytes());
    b.extend_from_slice(&14u32.to_be_bytes());
    b.extend_from_slice(&error.to_be_bytes());
    b.extend_from_slice(&0u16.to_be_bytes());
    b.extend_from_slice(&offset.to_be_bytes());
    assert_eq!(b.len(), CHUNK_HEADER_LEN + 14);
    b
}

/// Blocks 16..24 (bytes 8 KiB..12 KiB) fail reads; blocks 64..72 fail
/// writes.
fn faulty() -> (common::BdevFixture, std::sync::Arc<Probe>) {
    start_fault(
        1 << 20,
        512,
        1,
        FaultOpts {
            fail_reads: Some(16..24),
            fail_writes: Some(64..72),
            native_write_zeroes: true,
            ..FaultOpts::default()
        },
    )
}

#[test]
fn failed_read_is_an_error_offset_chunk() {
    let (f, _probe) = faulty();
    let mut c = Client::connect(f.port, "fault", true);
    assert_eq!(c.read_ok(0, 4096, 1), vec![0; 4096]);
    // 4 KiB..12 KiB: the device fails the whole I/O.
    let r = c.call(cmd::READ, 0, 4096, 8192, 7);
    assert_eq!(r.chunks.len(), 1, "{r:?}");
    assert_eq!(r.chunks[0].bytes, error_offset_chunk(7, EIO, 4096));
    assert_eq!(
        r.chunks[0].header.length as usize,
        r.chunks[0].payload().len()
    );
    assert!(r.data.is_empty());
    // The offset is the start of the failed range, inside the request.
    let r = c.call(cmd::READ, cmd_flags::DF, 8192, 512, 8);
    assert_eq!(r.chunks[0].bytes, error_offset_chunk(8, EIO, 8192));
    // Refusals (nothing reached the device) stay plain ERROR chunks.
    let r = c.call(cmd::READ, 0, 1 << 20, 512, 9);
    assert_eq!(r.chunks[0].header.kind, reply::TYPE_ERROR);
    assert_eq!(r.error, EINVAL);
    // The stream stays in sync and the connection usable.
    assert_eq!(c.read_ok(12288, 4096, 10), vec![0; 4096]);
    c.disconnect();
    let st = f.server.get_stats().unwrap();
    assert_eq!((st.reads, st.io_errors, st.refused), (2, 2, 1), "{st:?}");
    assert_eq!(st.bytes_read, 8192, "{st:?}");
}

#[test]
fn failed_read_without_structured_replies_sends_no_data() {
    let (f, _probe) = faulty();
    let mut c = Client::connect(f.port, "fault", false);
    let r = c.call(cmd::READ, 0, 8192, 4096, 1);
    assert_eq!((r.error, r.data.len()), (EIO, 0));
    // Had data followed, this reply would not parse.
    assert_eq!(c.read_ok(0, 512, 2), vec![0; 512]);
    c.disconnect();
}

#[test]
fn failed_write_is_not_counted_as_written() {
    let (f, probe) = faulty();
    let mut c = Client::connect(f.port, "fault", true);
    let data = pattern(1, 4096);
    assert_eq!(c.write_wait(0, 0, &data, 1), 0);
    // Blocks 64.. fail: 32 KiB.
    assert_eq!(c.write_wait(0, 32 << 10, &data, 2), EIO);
    assert_eq!(c.read_ok(0, 4096, 3), data);
    c.disconnect();
    assert_eq!(Probe::get(&probe.writes), 2);
    let st = f.server.get_stats().unwrap();
    assert_eq!(
        (st.writes, st.bytes_written, st.io_errors),
        (1, 4096, 1),
        "{st:?}"
    );
}

#[test]
fn cache_on_a_memory_bdev() {
    let f = start_bdev(8 << 20, 512, 1);
    let mut c = Client::connect(f.port, "malloc", false);
    assert!(c.has(tf::SEND_CACHE), "flags {:#x}", c.flags);
    assert_eq!(c.call(cmd::CACHE, 0, 0, 64 << 10, 1).error, 0);
    // The whole export (larger than any read could be is fine too: the
    // protocol gives clients no cache size limit).
    let size = c.size as u32;
    assert_eq!(c.call(cmd::CACHE, 0, 0, size, 2).error, 0);
    // Past the end, or unaligned: EINVAL, as for READ.
    assert_eq!(c.call(cmd::CACHE, 0, c.size - 512, 1024, 3).error, EINVAL);
    assert_eq!(c.call(cmd::CACHE, 0, c.size, 512, 4).error, EINVAL);
    assert_eq!(c.call(cmd::CACHE, 0, 100, 512, 5).error, EINVAL);
    // An unknown flag.
    assert_eq!(c.call(cmd::CACHE, cmd_flags::DF, 0, 512, 6).error, EINVAL);
    // Still usable.
    let data = pattern(9, 4096);
    assert_eq!(c.write_wait(0, 4096, &data, 7), 0);
    assert_eq!(c.read_ok(4096, 4096, 8), data);
    c.disconnect();
    let st = f.server.get_stats().unwrap();
    assert_eq!((st.caches, st.refused, st.io_errors), (2, 4, 0), "{st:?}");
}

#[test]
fn cache_is_not_advertised_for_other_bdevs() {
    let (f, _probe) = start_fault(1 << 20, 512, 1, FaultOpts::default());
    let c = Client::connect(f.port, "fault", true);
    assert!(!c.has(tf::SEND_CACHE), "flags {:#x}", c.flags);
    c.disconnect();
}

#[test]
fn fua_write_zeroes_and_flush_on_malloc() {
    let f = start_bdev(4 << 20, 512, 1);
    let mut c = Client::connect(f.port, "malloc", true);
    for flag in [tf::SEND_FUA, tf::SEND_WRITE_ZEROES, tf::SEND_FAST_ZERO] {
        assert!(c.has(flag), "{flag:#x} missing from {:#x}", c.flags);
    }
    // Malloc has no volatile cache: FLUSH is not advertised, and refused
    // if sent anyway, without harm to the connection.
    assert!(!c.has(tf::SEND_FLUSH));
    assert_eq!(c.call(cmd::FLUSH, 0, 0, 0, 1).error, EINVAL);

    let data = pattern(0x40, 64 << 10);
    assert_eq!(c.write_wait(cmd_flags::FUA, 0, &data, 2), 0);
    assert_eq!(c.read_ok(0, 64 << 10, 3), data);

    // Zero three ranges, with NO_HOLE, FAST_ZERO (malloc zeroes natively,
    // so fast zeroing succeeds) and all flags.
    let zero = |c: &mut Client, flags: u16, off: u64, cookie: u64| {
        assert_eq!(c.call(cmd::WRITE_ZEROES, flags, off, 4096, cookie).error, 0);
    };
    zero(&mut c, 0, 4096, 4);
    zero(&mut c, cmd_flags::NO_HOLE, 16 << 10, 5);
    zero(&mut c, cmd_flags::FAST_ZERO, 32 << 10, 6);
    let all = cmd_flags::FUA | cmd_flags::NO_HOLE | cmd_flags::FAST_ZERO;
    zero(&mut c, all, 48 << 10, 7);
    let mut expect = data.clone();
    for off in [4usize << 10, 16 << 10, 32 << 10, 48 << 10] {
        expect[off..off + 4096].fill(0);
    }
    assert_eq!(c.read_ok(0, 64 << 10, 8), expect);
    // Past the end: ENOSPC, as for writes.
    assert_eq!(c.call(cmd::WRITE_ZEROES, 0, c.size, 512, 9).error, 28);
    c.disconnect();
    let st = f.server.get_stats().unwrap();
    assert_eq!(
        (st.writes, st.write_zeroes, st.flushes),
        (1, 4, 0),
        "{st:?}"
    );
    assert_eq!((st.refused, st.io_errors), (2, 0), "{st:?}");
}

/// A bdev with a volatile cache and no native write-zeroes: FLUSH and FUA
/// reach the device, and FAST_ZERO fails fast with ENOTSUP.
#[test]
fn flush_fua_and_fast_zero_on_a_cached_bdev() {
    let (f, probe) = start_fault(
        4 << 20,
        512,
        1,
        FaultOpts {
            write_cache: true,
            native_write_zeroes: false,
            ..FaultOpts::default()
        },
    );
    let mut c = Client::connect(f.port, "fault", true);
    for flag in [
        tf::SEND_FLUSH,
        tf::SEND_FUA,
        tf::SEND_WRITE_ZEROES,
        tf::SEND_FAST_ZERO,
    ] {
        assert!(c.has(flag), "{flag:#x} missing from {:#x}", c.flags);
    }
    let flushes = || Probe::get(&probe.flushes);
    let data = pattern(7, 8192);
    assert_eq!(c.write_wait(0, 0, &data, 1), 0);
    assert_eq!(flushes(), 0);
    // FUA = write then flush, both before the reply.
    assert_eq!(c.write_wait(cmd_flags::FUA, 8192, &data, 2), 0);
    assert_eq!((Probe::get(&probe.writes), flushes()), (2, 1));
    assert_eq!(c.call(cmd::FLUSH, 0, 0, 0, 3).error, 0);
    assert_eq!(flushes(), 2);
    assert_eq!(f.server.get_stats().unwrap().flushes, 1);

    // FAST_ZERO: the device would zero by writing, so ENOTSUP at once,
    // with nothing written.
    let r = c.call(cmd::WRITE_ZEROES, cmd_flags::FAST_ZERO, 0, 4096, 4);
    assert_eq!(r.error, ENOTSUP);
    assert_eq!(r.chunks[0].header.kind, reply::TYPE_ERROR);
    assert_eq!(Probe::get(&probe.writes), 2);
    assert_eq!(c.read_ok(0, 8192, 5), data);
    // Without it the zeroes are written (emulated), NO_HOLE accepted, and
    // FUA flushes.
    let r = c.call(
        cmd::WRITE_ZEROES,
        cmd_flags::NO_HOLE | cmd_flags::FUA,
        0,
        4096,
        6,
    );
    assert_eq!(r.error, 0);
    assert_eq!(Probe::get(&probe.write_zeroes), 0, "not native");
    assert!(Probe::get(&probe.writes) > 2);
    assert_eq!(flushes(), 3);
    let mut expect = data.clone();
    expect[..4096].fill(0);
    assert_eq!(c.read_ok(0, 8192, 7), expect);
    c.disconnect();
    let st = f.server.get_stats().unwrap();
    assert_eq!(
        (
            st.writes,
            st.flushes,
            st.write_zeroes,
            st.refused,
            st.io_errors
        ),
        (2, 1, 1, 1, 0),
        "{st:?}"
    );
}

/// Small writes (up to COPY_MAX) are copied out of staging exactly once
/// each; large ones are received in place, with no copy once the receiver
/// reads headers exactly (after the first large write).
#[test]
fn payload_copies_are_counted_exactly() {
    const N: u64 = 16;
    let f = start_bdev(8 << 20, 512, 1);
    let mut c = Client::connect(f.port, "malloc", false);
    let small = pattern(3, 4096);
    for i in 0..N {
        assert_eq!(c.write_wait(0, i * 4096, &small, i), 0);
    }
    let st = f.server.get_stats().unwrap();
    assert_eq!((st.writes, st.bytes_written), (N, N * 4096), "{st:?}");
    assert_eq!(st.payload_copies, N, "{st:?}");
    assert_eq!(st.payload_copied_bytes, N * 4096, "{st:?}");

    // The first large write may bring its head into staging (its header
    // came with a greedy receive); from then on headers are received
    // exactly and large payloads land straight in their buffer.
    let large = pattern(5, 1 << 20);
    assert_eq!(c.write_wait(0, 1 << 20, &large[..256 << 10], 100), 0);
    let before = f.server.get_stats().unwrap();
    let sizes = [COPY_MAX + 512, 64 << 10, 256 << 10, COPY_MAX + 512, 1 << 20];
    for (i, &len) in sizes.iter().enumerate() {
        let off = (2 + i as u64) << 20;
        assert_eq!(c.write_wait(0, off, &large[..len], 200 + i as u64), 0);
    }
    let after = f.server.get_stats().unwrap();
    assert_eq!(after.writes - before.writes, sizes.len() as u64);
    assert_eq!(after.payload_copies, before.payload_copies, "{after:?}");
    assert_eq!(
        after.payload_copied_bytes, before.payload_copied_bytes,
        "{after:?}"
    );
    assert_eq!(
        c.read_ok(2 << 20, (COPY_MAX + 512) as u32, 300),
        large[..COPY_MAX + 512]
    );
    c.disconnect();
}

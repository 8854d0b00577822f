//! Transmission requests: decode a 28-byte header and validate it against
//! the negotiated export, yielding a typed [`Command`] or a typed refusal.
//!
//! This module owns the rules of the protocol's "Request types" and "Error
//! values" sections: which flags are valid for which command, range and
//! alignment checks, size limits, read-only refusals. It does no I/O and
//! never allocates, so it runs on the data path for every request.

use crate::export::BlockSizes;
use crate::wire::{
    cmd, cmd_flags, transmission_flags as tf, NbdErrno, RequestHeader, WireError,
    REQUEST_HEADER_LEN,
};

/// Write payloads up to this size are read and dropped when the request is
/// refused, keeping the connection in sync; the protocol says a payload of at
/// most 32 MiB should not be deemed a denial of service. Larger ones (beyond
/// the advertised maximum too) end the connection.
pub const MAX_DISCARD_PAYLOAD: u32 = 32 * 1024 * 1024;

/// What transmission was negotiated for one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransmissionParams {
    pub size_bytes: u64,
    pub block_sizes: BlockSizes,
    /// Transmission flags sent to the client.
    pub flags: u16,
    /// Structured replies negotiated.
    pub structured: bool,
    /// Context id of `base:allocation` if the client selected it.
    pub base_allocation: Option<u32>,
    /// The client asked for `NBD_INFO_BLOCK_SIZE` with `NBD_OPT_GO`.
    pub block_size_agreed: bool,
}

impl TransmissionParams {
    fn has(&self, flag: u16) -> bool {
        self.flags & flag != 0
    }
}

/// A validated request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub cookie: u64,
    pub command: Command,
}

/// A validated command; offsets and lengths are in bytes, in range and
/// aligned to the minimum block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// `df`: the client forbids fragmenting the reply (always honoured).
    Read {
        offset: u64,
        length: u32,
        df: bool,
    },
    /// `length` payload bytes follow the header.
    Write {
        offset: u64,
        length: u32,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        length: u32,
        fua: bool,
    },
    WriteZeroes {
        offset: u64,
        length: u32,
        fua: bool,
        no_hole: bool,
        fast: bool,
    },
    Cache {
        offset: u64,
        length: u32,
    },
    /// `length` is a hint, clipped to the export end.
    BlockStatus {
        offset: u64,
        length: u32,
        req_one: bool,
        context_id: u32,
    },
    /// `NBD_CMD_DISC`: finish in-flight requests and close.
    Disconnect,
}

/// Why a request was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// Answer `errno` for `cookie`, after reading and dropping `discard`
    /// payload bytes; the connection stays up. `kind` says whether the reply
    /// must be structured (a refused read under structured replies).
    #[error("request {cookie:#x} (type {kind}) refused: {errno}")]
    Refused {
        cookie: u64,
        kind: u16,
        errno: NbdErrno,
        discard: u32,
    },
    /// The header did not start with the request magic: the stream is lost.
    #[error("bad request magic {0:#x}")]
    BadMagic(u32),
    /// A write payload too large to drain: disconnect.
    #[error("write payload of {0} bytes past the cap")]
    PayloadTooLarge(u32),
    /// Fewer than 28 bytes (a driver bug, not peer input).
    #[error("truncated request header")]
    Truncated,
}

impl RequestError {
    /// Whether the connection must be closed.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, Self::Refused { .. })
    }
}

/// Decodes and validates one request header.
pub fn decode(bytes: &[u8], params: &TransmissionParams) -> Result<Request, RequestError> {
    let header = match RequestHeader::decode(bytes.get(..REQUEST_HEADER_LEN).unwrap_or(bytes)) {
        Ok(h) => h,
        Err(WireError::BadMagic { found }) => return Err(RequestError::BadMagic(found as u32)),
        Err(_) => return Err(RequestError::Truncated),
    };
    validate(&header, params)
}

/// Validates a decoded header against the negotiated parameters.
pub fn validate(h: &RequestHeader, params: &TransmissionParams) -> Result<Request, RequestError> {
    let payload = if h.kind == cmd::WRITE { h.length } else { 0 };
    if payload > params.block_sizes.max_payload.max(MAX_DISCARD_PAYLOAD) {
        return Err(RequestError::PayloadTooLarge(payload));
    }
    let refuse = |errno| RequestError::Refused {
        cookie: h.cookie,
        kind: h.kind,
        errno,
        discard: payload,
    };
    let command = command(h, params).map_err(refuse)?;
    Ok(Request {
        cookie: h.cookie,
        command,
    })
}

/// Flags valid for `kind` under `params`; FUA is valid on every command once
/// advertised (clients are known to set it everywhere).
fn allowed_flags(kind: u16, params: &TransmissionParams) -> u16 {
    let mut allowed = if params.has(tf::SEND_FUA) {
        cmd_flags::FUA
    } else {
        0
    };
    match kind {
        cmd::READ if params.has(tf::SEND_DF) => allowed |= cmd_flags::DF,
        cmd::WRITE_ZEROES => {
            allowed |= cmd_flags::NO_HOLE;
            if params.has(tf::SEND_FAST_ZERO) {
                allowed |= cmd_flags::FAST_ZERO;
            }
        }
        cmd::BLOCK_STATUS => allowed |= cmd_flags::REQ_ONE,
        _ => {}
    }
    allowed
}

fn command(h: &RequestHeader, params: &TransmissionParams) -> Result<Command, NbdErrno> {
    // "There is no reply to an NBD_CMD_DISC": it ends the connection whatever
    // its flags, offset and length (as in qemu-nbd and nbdkit); refusing it
    // would answer it and leave the client waiting for a close.
    if h.kind == cmd::DISC {
        return Ok(Command::Disconnect);
    }
    if h.kind > cmd::BLOCK_STATUS {
        return Err(NbdErrno::Inval);
    }
    if h.flags & !allowed_flags(h.kind, params) != 0 {
        return Err(NbdErrno::Inval);
    }
    let flag = |f: u16| h.flags & f != 0;
    let (offset, length) = (h.offset, h.length);
    let read_only = params.has(tf::READ_ONLY);
    match h.kind {
        // Offset and length of FLUSH are reserved; being lenient costs nothing.
        cmd::FLUSH if params.has(tf::SEND_FLUSH) => Ok(Command::Flush),
        cmd::FLUSH => Err(NbdErrno::Inval),
        cmd::READ => {
            check_range(params, offset, length, NbdErrno::Inval)?;
            if length > params.block_sizes.max_payload {
                // Structured replies may refuse big reads with EOVERFLOW;
                // simple replies can only fail them.
                return Err(if params.structured {
                    NbdErrno::Overflow
                } else {
                    NbdErrno::Inval
                });
            }
            Ok(Command::Read {
                offset,
                length,
                df: flag(cmd_flags::DF),
            })
        }
        cmd::WRITE => {
            writable(read_only)?;
            if length > params.block_sizes.max_payload {
                return Err(NbdErrno::Inval);
            }
            check_range(params, offset, length, NbdErrno::NoSpc)?;
            Ok(Command::Write {
                offset,
                length,
                fua: flag(cmd_flags::FUA),
            })
        }
        cmd::TRIM => {
            writable(read_only)?;
            if !params.has(tf::SEND_TRIM) {
                return Err(NbdErrno::Inval);
            }
            check_range(params, offset, length, NbdErrno::Inval)?;
            Ok(Command::Trim {
                offset,
                length,
                fua: flag(cmd_flags::FUA),
            })
        }
        cmd::WRITE_ZEROES => {
            writable(read_only)?;
            if !params.has(tf::SEND_WRITE_ZEROES) {
                return Err(NbdErrno::Inval);
            }
            check_range(params, offset, length, NbdErrno::NoSpc)?;
            Ok(Command::WriteZeroes {
                offset,
                length,
                fua: flag(cmd_flags::FUA),
                no_hole: flag(cmd_flags::NO_HOLE),
                fast: flag(cmd_flags::FAST_ZERO),
            })
        }
        // Accepted even when not advertised: some clients send it anyway,
        // and it has no semantics beyond a hint.
        cmd::CACHE => {
            check_range(params, offset, length, NbdErrno::Inval)?;
            Ok(Command::Cache { offset, length })
        }
        cmd::BLOCK_STATUS => {
            let Some(context_id) = params.base_allocation else {
                return Err(NbdErrno::Inval);
            };
            if length == 0 {
                return Err(NbdErrno::Inval);
            }
            check_range(params, offset, length, NbdErrno::Inval)?;
            Ok(Command::BlockStatus {
                offset,
                length,
                req_one: flag(cmd_flags::REQ_ONE),
                context_id,
            })
        }
        _ => Err(NbdErrno::Inval),
    }
}

fn writable(read_only: bool) -> Result<(), NbdErrno> {
    if read_only {
        Err(NbdErrno::Perm)
    } else {
        Ok(())
    }
}

/// Range and alignment. `past_end` is the errno for a range beyond the
/// export (ENOSPC for writes, EINVAL otherwise, as the protocol suggests).
fn check_range(
    params: &TransmissionParams,
    offset: u64,
    length: u32,
    past_end: NbdErrno,
) -> Result<(), NbdErrno> {
    let min = u64::from(params.block_sizes.min.max(1));
    if offset % min != 0 || u64::from(length) % min != 0 {
        return Err(NbdErrno::Inval);
    }
    match offset.checked_add(u64::from(length)) {
        Some(end) if end <= params.size_bytes => Ok(()),
        _ => Err(past_end),
    }
}

#[cfg(test)]
mod tests;

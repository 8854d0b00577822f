//! One client connection of the server: its stream decoder, its output
//! buffer and its flow-control counters. The server loop decides when to
//! call these; this module decides what a readable/writable socket means.

use crate::codec::{decode_message, encode_response, FrameError, StreamDecoder};
use crate::dispatch::{Completion, MethodTable};
use crate::errors::RpcError;
use crate::sys::send_nosignal;
use serde_json::Value;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

/// Bytes read from a socket per `read` call.
pub const READ_CHUNK_BYTES: usize = 64 << 10;
/// Reads per readiness event, so one busy client cannot hold the loop.
const READS_PER_EVENT: usize = 4;

/// Per-connection limits, copied from the server config.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max_request_bytes: usize,
    pub max_in_flight: usize,
    pub max_output_bytes: usize,
}

pub struct Conn {
    pub stream: UnixStream,
    decoder: StreamDecoder,
    out: Vec<u8>,
    out_pos: usize,
    /// Messages dispatched whose completion has not come back yet.
    pub in_flight: usize,
    /// The peer shut down its sending side (EOF seen).
    read_closed: bool,
    /// A framing error was answered; close once the output is flushed.
    closing: bool,
    /// The socket failed or the peer vanished: close now.
    pub dead: bool,
    /// epoll interest currently registered.
    pub interest: u32,
    limits: ConnLimits,
}

impl Conn {
    pub fn new(stream: UnixStream, limits: ConnLimits) -> Self {
        Conn {
            stream,
            decoder: StreamDecoder::new(limits.max_request_bytes),
            out: Vec::new(),
            out_pos: 0,
            in_flight: 0,
            read_closed: false,
            closing: false,
            dead: false,
            interest: 0,
            limits,
        }
    }

    fn out_pending(&self) -> usize {
        self.out.len() - self.out_pos
    }

    /// Whether the connection is finished and can be dropped.
    pub fn done(&self) -> bool {
        self.dead
            || (self.out_pending() == 0
                && (self.closing || (self.read_closed && self.in_flight == 0)))
    }

    /// The epoll interest this connection needs now. Reading stops while
    /// too many requests are in flight or too much output is unsent: the
    /// client's own socket buffer then pushes back on it.
    pub fn wanted_interest(&self) -> u32 {
        let mut ev = 0;
        let can_read = !self.read_closed
            && !self.closing
            && self.in_flight < self.limits.max_in_flight
            && self.out_pending() < self.limits.max_output_bytes;
        if can_read {
            ev |= libc::EPOLLIN as u32;
        }
        if self.out_pending() > 0 {
            ev |= libc::EPOLLOUT as u32;
        }
        ev
    }

    /// Read what is available (bounded), then dispatch complete requests.
    pub fn on_readable(
        &mut self,
        buf: &mut [u8],
        table: &MethodTable,
        mk: &dyn Fn() -> Completion,
    ) {
        for _ in 0..READS_PER_EVENT {
            if self.read_closed
                || self.closing
                || self.wanted_interest() & libc::EPOLLIN as u32 == 0
            {
                break;
            }
            match self.stream.read(buf) {
                Ok(0) => {
                    // A half-sent request is simply dropped with the rest.
                    if self.decoder.has_partial() {
                        tracing::debug!("RPC client disconnected mid-request");
                    }
                    self.read_closed = true;
                }
                Ok(n) => {
                    if let Err(e) = self.decoder.push(&buf[..n]) {
                        self.fail(e);
                        break;
                    }
                    self.pump(table, mk);
                    if n < buf.len() {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    self.dead = true;
                    break;
                }
            }
        }
    }

    /// Dispatch buffered complete requests while the in-flight budget
    /// allows (also called when a completion frees budget).
    pub fn pump(&mut self, table: &MethodTable, mk: &dyn Fn() -> Completion) {
        while !self.closing && !self.dead && self.in_flight < self.limits.max_in_flight {
            match self.decoder.next_value() {
                Ok(Some(v)) => {
                    self.in_flight += 1;
                    table.handle_message(decode_message(v), mk());
                }
                Ok(None) => break,
                Err(e) => self.fail(e),
            }
        }
    }

    /// Answer a framing error (id null) and close after flushing, as SPDK
    /// does: the position in the stream is lost.
    fn fail(&mut self, e: FrameError) {
        tracing::debug!("RPC client stream error: {e}");
        self.queue(&encode_response(Value::Null, Err(e.to_rpc_error())));
        self.closing = true;
    }

    /// A completion came back for this connection.
    pub fn complete(&mut self, reply: Option<Value>) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if let Some(v) = reply {
            self.queue(&v);
        }
    }

    fn queue(&mut self, v: &Value) {
        if self.dead {
            return;
        }
        if serde_json::to_writer(&mut self.out, v).is_err() {
            // Only a non-string map key could fail; Value has none.
            let e = RpcError::internal("reply could not be encoded");
            let _ = serde_json::to_writer(&mut self.out, &encode_response(Value::Null, Err(e)));
        }
        // A newline keeps replies readable with socat/nc; SPDK's client
        // skips whitespace between values.
        self.out.push(b'\n');
    }

    /// Write pending output without blocking.
    pub fn flush(&mut self) {
        while self.out_pending() > 0 && !self.dead {
            match send_nosignal(self.stream.as_raw_fd(), &self.out[self.out_pos..]) {
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => self.dead = true,
            }
        }
        if self.out_pos == self.out.len() {
            self.out.clear();
            self.out_pos = 0;
            // Give back the memory of a huge reply once it is gone.
            if self.out.capacity() > READ_CHUNK_BYTES {
                self.out.shrink_to(READ_CHUNK_BYTES);
            }
        } else if self.out_pos > READ_CHUNK_BYTES && self.out_pos * 2 > self.out.len() {
            self.out.drain(..self.out_pos);
            self.out_pos = 0;
        }
    }
}

//! The handshake (option haggling) as a synchronous state machine.
//!
//! This module owns everything between accept and the transmission phase:
//! greeting, client flags, and every option. It does no I/O. The driver (the
//! async connection task, or a unit test) loops:
//!
//! ```text
//! step = apply(Event::Start)
//! loop: send `out`; match step {
//!     Read(n)    => read exactly n bytes, step = apply(Event::Bytes(..)),
//!     Discard(n) => read and drop n bytes, step = apply(Event::Discarded),
//!     Transmission(negotiated) => enter transmission,
//!     Close(reason) => close the socket }
//! ```
//!
//! so every decision is made here and tested without sockets or bdevs
//! ("select apart from apply"). Limits bound the work a client can cause:
//! option payload size (larger ones are discarded, then answered as their
//! kind is: `NBD_REP_ERR_UNSUP` when unknown, `NBD_REP_ERR_INVALID` when the
//! option takes no data, `NBD_REP_ACK` and close for `ABORT`, else
//! `NBD_REP_ERR_TOO_BIG`; past a hard cap the connection is closed) and the
//! number of options per connection.

use crate::export::{ExportCatalog, ExportInfo};
use crate::request::TransmissionParams;
use crate::wire::{
    self, client_flags, handshake_flags, info, opt, rep, ClientFlags, ExportNameReply, Greeting,
    InfoReply, InfoRequest, MetaContextReply, MetaContextRequest, OptionHeader, ServerReply,
    BASE_ALLOCATION, CLIENT_FLAGS_LEN, OPTION_HEADER_LEN,
};

/// Context id this server gives `base:allocation` in `SET_META_CONTEXT`.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// Bounds on what one client may make the handshake do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest option payload read into memory and parsed. Every option this
    /// server understands fits in far less (strings are at most 4096 bytes).
    pub max_option_payload: u32,
    /// Larger payloads up to this size are read and discarded, then answered
    /// with `NBD_REP_ERR_TOO_BIG`; past it the client is disconnected.
    pub max_option_discard: u32,
    /// Options per connection before the client is deemed abusive.
    pub max_options: u32,
    /// Exports named in one `NBD_OPT_LIST` answer.
    pub max_list_entries: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_option_payload: 64 * 1024,
            max_option_discard: 16 * 1024 * 1024,
            max_options: 1024,
            max_list_entries: 4096,
        }
    }
}

/// Input to the state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event<'a> {
    /// The connection was accepted: emit the greeting.
    Start,
    /// Exactly the bytes the last `Step::Read` asked for.
    Bytes(&'a [u8]),
    /// The bytes the last `Step::Discard` asked for were skipped.
    Discarded,
}

/// What the driver must do next (after sending what `apply` appended).
#[derive(Debug)]
pub enum Step<H> {
    /// Read exactly this many bytes and feed them as `Event::Bytes`.
    Read(usize),
    /// Read and drop this many bytes, then feed `Event::Discarded`.
    Discard(u32),
    /// Handshake finished: serve this export.
    Transmission(Box<Negotiated<H>>),
    /// Close the connection (after sending any pending bytes).
    Close(HandshakeEnd),
}

/// Result of a successful handshake.
#[derive(Debug)]
pub struct Negotiated<H> {
    pub handle: H,
    pub info: ExportInfo,
    pub params: TransmissionParams,
}

/// Why the handshake ended without entering transmission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeEnd {
    #[error("client sent NBD_OPT_ABORT")]
    Abort,
    #[error("client flags {0:#x} not understood")]
    BadClientFlags(u32),
    #[error("bad option magic")]
    BadOptionMagic,
    #[error("NBD_OPT_EXPORT_NAME for an unknown or invalid export")]
    UnknownExport,
    #[error("option payload of {0} bytes past the hard cap")]
    OptionTooLarge(u32),
    #[error("too many options")]
    TooManyOptions,
    #[error("driver fed an event the state machine did not ask for")]
    UnexpectedEvent,
}

/// Handshake states; each waits for one kind of input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Accepted; the greeting has not been produced.
    Start,
    /// Greeting sent; waiting for the 4-byte client flags.
    ClientFlags,
    /// Waiting for a 16-byte option header.
    OptionHeader,
    /// Waiting for the payload of `option`.
    OptionPayload { option: u32 },
    /// Skipping the oversized payload of `option`.
    Discarding { option: u32 },
    /// Transmission entered or connection closed; no further input.
    Finished,
}

/// Metadata contexts selected by the last `SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MetaSelection {
    export: String,
}

/// The handshake of one connection.
#[derive(Debug)]
pub struct Negotiation {
    limits: Limits,
    state: State,
    no_zeroes: bool,
    structured: bool,
    meta: Option<MetaSelection>,
    options_seen: u32,
}

impl Negotiation {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            state: State::Start,
            no_zeroes: false,
            structured: false,
            meta: None,
            options_seen: 0,
        }
    }

    /// Advances the handshake by one event, appending bytes to send to `out`.
    pub fn apply<C: ExportCatalog>(
        &mut self,
        catalog: &C,
        event: Event<'_>,
        out: &mut Vec<u8>,
    ) -> Step<C::Handle> {
        let step = match (self.state, event) {
            (State::Start, Event::Start) => {
                let flags = handshake_flags::FIXED_NEWSTYLE | handshake_flags::NO_ZEROES;
                out.extend_from_slice(
                    &Greeting {
                        handshake_flags: flags,
                    }
                    .encode(),
                );
                self.set_state(State::ClientFlags);
                Step::Read(CLIENT_FLAGS_LEN)
            }
            (State::ClientFlags, Event::Bytes(b)) => self.on_client_flags(b),
            (State::OptionHeader, Event::Bytes(b)) => self.on_option_header(catalog, b, out),
            (State::OptionPayload { option }, Event::Bytes(b)) => {
                self.on_option(catalog, option, b, out)
            }
            (State::Discarding { option }, Event::Discarded) => self.on_discarded(option, out),
            _ => Step::Close(HandshakeEnd::UnexpectedEvent),
        };
        if matches!(step, Step::Transmission(_) | Step::Close(_)) && self.state != State::Finished {
            self.set_state(State::Finished);
        }
        step
    }

    fn set_state(&mut self, next: State) {
        debug_assert_ne!(self.state, State::Finished, "handshake already finished");
        self.state = next;
    }

    fn next_option<H>(&mut self) -> Step<H> {
        self.set_state(State::OptionHeader);
        Step::Read(OPTION_HEADER_LEN)
    }

    fn on_client_flags<H>(&mut self, bytes: &[u8]) -> Step<H> {
        let Ok(ClientFlags(flags)) = ClientFlags::decode(bytes) else {
            return Step::Close(HandshakeEnd::UnexpectedEvent);
        };
        // We advertise both bits; anything else must drop the connection.
        if flags & !(client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES) != 0 {
            return Step::Close(HandshakeEnd::BadClientFlags(flags));
        }
        self.no_zeroes = flags & client_flags::NO_ZEROES != 0;
        self.next_option()
    }

    fn on_option_header<C: ExportCatalog>(
        &mut self,
        catalog: &C,
        bytes: &[u8],
        out: &mut Vec<u8>,
    ) -> Step<C::Handle> {
        let header = match OptionHeader::decode(bytes) {
            Ok(h) => h,
            Err(wire::WireError::BadMagic { .. }) => {
                return Step::Close(HandshakeEnd::BadOptionMagic)
            }
            Err(_) => return Step::Close(HandshakeEnd::UnexpectedEvent),
        };
        self.options_seen += 1;
        if self.options_seen > self.limits.max_options {
            return Step::Close(HandshakeEnd::TooManyOptions);
        }
        let len = header.length;
        if len > self.limits.max_option_payload {
            // EXPORT_NAME cannot be answered with an error, and a name that
            // long is invalid anyway.
            if len > self.limits.max_option_discard || header.option == opt::EXPORT_NAME {
                return Step::Close(HandshakeEnd::OptionTooLarge(len));
            }
            self.set_state(State::Discarding {
                option: header.option,
            });
            return Step::Discard(len);
        }
        if len == 0 {
            return self.on_option(catalog, header.option, &[], out);
        }
        self.set_state(State::OptionPayload {
            option: header.option,
        });
        Step::Read(len as usize)
    }

    fn on_option<C: ExportCatalog>(
        &mut self,
        catalog: &C,
        option: u32,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Step<C::Handle> {
        match option {
            opt::EXPORT_NAME => return self.on_export_name(catalog, payload, out),
            opt::GO | opt::INFO => return self.on_info_or_go(catalog, option, payload, out),
            opt::ABORT => {
                // The client may not wait for this; the reply is courtesy.
                wire::put_option_reply(out, option, rep::ACK, &[]);
                return Step::Close(HandshakeEnd::Abort);
            }
            opt::LIST => self.on_list(catalog, payload, out),
            opt::STARTTLS if !payload.is_empty() => {
                self.reply_error(option, rep::ERR_INVALID, "STARTTLS takes no data", out)
            }
            // NOTLS mode: the spec asks for ERR_POLICY (or UNSUP), never TLS_REQD.
            opt::STARTTLS => self.reply_error(
                option,
                rep::ERR_POLICY,
                "TLS is not configured on this server",
                out,
            ),
            opt::STRUCTURED_REPLY if !payload.is_empty() => self.reply_error(
                option,
                rep::ERR_INVALID,
                "STRUCTURED_REPLY takes no data",
                out,
            ),
            opt::STRUCTURED_REPLY => {
                self.structured = true;
                wire::put_option_reply(out, option, rep::ACK, &[]);
            }
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
                self.on_meta_context(catalog, option, payload, out)
            }
            _ => self.reply_error(option, rep::ERR_UNSUP, "option not supported", out),
        }
        self.next_option()
    }

    /// Answers an option whose payload was too large to parse and has been
    /// skipped: what the option would get with any payload where its kind
    /// decides that, `NBD_REP_ERR_TOO_BIG` where only the size does.
    fn on_discarded<H>(&mut self, option: u32, out: &mut Vec<u8>) -> Step<H> {
        // An oversized EXPORT_NAME never gets here: it closes at once.
        match option {
            // The server "SHOULD ignore any data sent by the client" with
            // ABORT and "MUST reply with NBD_REP_ACK".
            opt::ABORT => {
                wire::put_option_reply(out, option, rep::ACK, &[]);
                return Step::Close(HandshakeEnd::Abort);
            }
            // These take no data: invalid with any.
            opt::LIST | opt::STARTTLS | opt::STRUCTURED_REPLY => {
                self.reply_error(option, rep::ERR_INVALID, "option takes no data", out)
            }
            opt::INFO | opt::GO | opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
                if option == opt::SET_META_CONTEXT {
                    // SET replaces the selection "including when this
                    // command fails".
                    self.meta = None;
                }
                self.reply_error(option, rep::ERR_TOO_BIG, "option payload too large", out)
            }
            // Unknown options are unsupported whatever their length (as in
            // qemu-nbd and nbdkit, which skip the data and say so).
            _ => self.reply_error(option, rep::ERR_UNSUP, "option not supported", out),
        }
        self.next_option()
    }

    fn reply_error(&self, option: u32, reply_type: u32, message: &str, out: &mut Vec<u8>) {
        debug_assert!(reply_type & rep::ERR_BIT != 0);
        wire::put_option_reply(out, option, reply_type, &[message.as_bytes()]);
    }

    fn negotiated<H>(&self, handle: H, info: ExportInfo, block_size_agreed: bool) -> Step<H> {
        // Contexts were selected for a named export; they apply only if the
        // client went on to that same export.
        let base_allocation = match &self.meta {
            Some(m) if m.export == info.name && info.features.has_allocation_map => {
                Some(BASE_ALLOCATION_ID)
            }
            _ => None,
        };
        let params = TransmissionParams {
            size_bytes: info.size_bytes,
            block_sizes: info.block_sizes,
            flags: info.transmission_flags(self.structured),
            structured: self.structured,
            base_allocation,
            block_size_agreed,
        };
        Step::Transmission(Box::new(Negotiated {
            handle,
            info,
            params,
        }))
    }

    fn on_export_name<C: ExportCatalog>(
        &mut self,
        catalog: &C,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Step<C::Handle> {
        let Ok(name) = wire::check_string(payload) else {
            return Step::Close(HandshakeEnd::UnknownExport);
        };
        let Some((handle, info)) = catalog.lookup(name) else {
            return Step::Close(HandshakeEnd::UnknownExport);
        };
        ExportNameReply {
            size: info.size_bytes,
            flags: info.transmission_flags(self.structured),
        }
        .put(self.no_zeroes, out);
        self.negotiated(handle, info, false)
    }

    fn on_info_or_go<C: ExportCatalog>(
        &mut self,
        catalog: &C,
        option: u32,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Step<C::Handle> {
        let Ok(request) = InfoRequest::decode(payload) else {
            self.reply_error(option, rep::ERR_INVALID, "malformed INFO/GO request", out);
            return self.next_option();
        };
        let Some((handle, info)) = catalog.lookup(request.name) else {
            self.reply_error(option, rep::ERR_UNKNOWN, "no such export", out);
            return self.next_option();
        };
        let flags = info.transmission_flags(self.structured);
        InfoReply::Export {
            size: info.size_bytes,
            flags,
        }
        .put(option, out);
        if request.asks_for(info::NAME) {
            InfoReply::Name(&info.name).put(option, out);
        }
        if request.asks_for(info::DESCRIPTION) && !info.description.is_empty() {
            InfoReply::Description(&info.description).put(option, out);
        }
        // Always sent: clients ignore what they did not ask for, and those
        // that understand it learn our alignment even without asking.
        let bs = info.block_sizes;
        InfoReply::BlockSize {
            min: bs.min,
            preferred: bs.preferred,
            max: bs.max_payload,
        }
        .put(option, out);
        wire::put_option_reply(out, option, rep::ACK, &[]);
        if option == opt::INFO {
            return self.next_option();
        }
        let agreed = request.asks_for(info::BLOCK_SIZE);
        self.negotiated(handle, info, agreed)
    }

    fn on_list<C: ExportCatalog>(&self, catalog: &C, payload: &[u8], out: &mut Vec<u8>) {
        if !payload.is_empty() {
            return self.reply_error(opt::LIST, rep::ERR_INVALID, "LIST takes no data", out);
        }
        catalog.list(self.limits.max_list_entries, &mut |name, description| {
            ServerReply { name, description }.put(opt::LIST, out);
        });
        wire::put_option_reply(out, opt::LIST, rep::ACK, &[]);
    }

    fn on_meta_context<C: ExportCatalog>(
        &mut self,
        catalog: &C,
        option: u32,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) {
        let set = option == opt::SET_META_CONTEXT;
        if set {
            // SET replaces the selection even when it fails.
            self.meta = None;
            if !self.structured {
                return self.reply_error(
                    option,
                    rep::ERR_INVALID,
                    "negotiate structured replies first",
                    out,
                );
            }
        }
        let Ok(request) = MetaContextRequest::decode(payload) else {
            return self.reply_error(
                option,
                rep::ERR_INVALID,
                "malformed meta context request",
                out,
            );
        };
        let Some((_, info)) = catalog.lookup(request.export) else {
            return self.reply_error(option, rep::ERR_UNKNOWN, "no such export", out);
        };
        let available = info.features.has_allocation_map;
        let matched = available
            && if set {
                // "base:" alone selects nothing in SET; unknown names are ignored.
                request.queries().any(|q| q == BASE_ALLOCATION)
            } else {
                request.query_count == 0
                    || request
                        .queries()
                        .any(|q| q == BASE_ALLOCATION || q == "base:")
            };
        if matched {
            // LIST answers carry id 0 (reserved); SET gives the real id.
            let id = if set { BASE_ALLOCATION_ID } else { 0 };
            MetaContextReply {
                id,
                name: BASE_ALLOCATION,
            }
            .put(option, out);
            if set {
                self.meta = Some(MetaSelection {
                    export: info.name.clone(),
                });
            }
        }
        wire::put_option_reply(out, option, rep::ACK, &[]);
    }
}

#[cfg(test)]
mod tests;

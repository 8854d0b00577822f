//! ustor's control plane: JSON-RPC 2.0 over a Unix socket, speaking SPDK's
//! dialect so that operators' scripts and SPDK's own Python client
//! (`spdk.rpc.client.JSONRPCClient`) work unchanged.
//!
//! This crate owns the transport, the protocol and the dispatch — not the
//! methods: it depends on no bdev or runtime crate. The `ustor` binary
//! registers concrete methods in a [`MethodTable`], then [`start`]s the
//! server on it.
//!
//! * [`codec`]: stream splitting and JSON-RPC message decoding (fuzzed).
//! * [`errors`]: [`RpcError`], JSON-RPC and SPDK errno codes.
//! * [`params`]: typed params with -32602 errors naming the field.
//! * [`dispatch`]: [`MethodTable`], [`Replier`], startup/runtime states.
//! * [`server`]: the epoll server thread.
//! * [`client`]: [`RpcClient`], `save_config`, pretty printing.
//! * [`config`]: SPDK-format config files, apply with rollback.
//!
//! ```no_run
//! use ustor_rpc::{MethodTable, RpcError, ServerConfig, RPC_RUNTIME};
//! let table = MethodTable::new();
//! table.register("bdev_null_create", RPC_RUNTIME, |params, reply| {
//!     // Decode, then answer now or later from any thread.
//!     std::thread::spawn(move || reply.err(RpcError::errno(libc::EEXIST)));
//! }).unwrap();
//! let server = ustor_rpc::start(ServerConfig::with_path("/tmp/u.sock"), table).unwrap();
//! server.shutdown();
//! ```

pub mod client;
pub mod codec;
pub mod config;
mod conn;
pub mod dispatch;
pub mod errors;
pub mod params;
pub mod server;
mod sys;

pub use client::{format_error, save_config, to_pretty, RpcClient};
pub use codec::{decode_message, Message, Request, StreamDecoder};
pub use config::{apply_config, load_config, CallFailure, ConfigCall, ConfigError};
pub use dispatch::{MethodTable, RegisterError, Replier, RPC_ANY_STATE, RPC_RUNTIME, RPC_STARTUP};
pub use errors::RpcError;
pub use params::{no_params, params_error, parse_params};
pub use server::{start, ServerConfig, ServerError, ServerHandle, ServerStats};

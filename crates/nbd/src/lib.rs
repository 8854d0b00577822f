//! `ustor-nbd`: an NBD (Network Block Device) server.
//!
//! The crate owns the NBD protocol as specified by the NBD project's
//! `doc/proto.md` (fixed newstyle only; no oldstyle, no TLS): the wire
//! format, the handshake, request validation and reply encoding. It is cut
//! "select apart from apply": everything here except the server's
//! connection tasks is synchronous, does no I/O, and is unit-tested with
//! byte vectors.
//!
//! - [`wire`]: byte layouts, never panicking on any input.
//! - [`export`]: export capabilities → transmission flags; the
//!   [`ExportCatalog`] seam the handshake looks exports up through.
//! - [`negotiation`]: the handshake state machine.
//! - [`request`]: transmission request validation → typed [`Command`].
//! - [`reply`]: reply headers for command outcomes.
//! - [`server`]: the async server on the ustor runtime (listener,
//!   connections, exports, stats, control-plane functions).

pub mod export;
#[doc(hidden)]
pub mod fuzzing;
pub mod negotiation;
pub mod reply;
pub mod request;
pub mod server;
pub mod wire;

pub use export::{BlockSizes, ExportCatalog, ExportFeatures, ExportInfo, StaticCatalog};
pub use negotiation::{Event, HandshakeEnd, Limits, Negotiated, Negotiation, Step};
pub use request::{Command, Request, RequestError, TransmissionParams};
pub use wire::NbdErrno;

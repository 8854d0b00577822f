//! ustor's iSCSI target (RFC 7143). Built on the connection layer
//! (`ustor_net`: listeners with a connection cap and a login timeout, the
//! receive helpers), the SCSI target core (`ustor_scsi_target`: the LUNs,
//! SBC/SPC) and the iSCSI wire code shared with the initiator
//! (`ustor_iscsi::wire`, `ustor_iscsi::chap`).
//!
//! - [`target`]: the control plane (portal, initiator and auth groups,
//!   target nodes; SPDK's RPC methods as functions), [`config`] its
//!   parameter types, [`options`] the target-wide options; `live` the
//!   connections past login, [`netmask`] initiator-group netmasks.
//! - [`login`]: login without sockets (CHAP, stages), [`negotiate`] the
//!   operational keys.
//! - `sessions`: the target's sessions across reactors (reinstatement,
//!   max_sessions, connections joining, work sent to every part of a
//!   session, resets reaching other sessions), `sess` a session's part on
//!   one reactor (task set, LUN table, connections) and what its parts
//!   share (the command window, the task order across reactors).
//! - [`session`]: the full feature phase (the receive loop), `exec` one
//!   SCSI command as a task of its own, `tasks` the session's task set
//!   (attributes, aborts), [`command`] one SCSI command's data phase
//!   (immediate, unsolicited, R2T, Data-In with phase collapse), [`pdu`]
//!   the target PDUs, [`io`] the receive side of a connection, `tx` its
//!   shared send queue (with the send timeout),
//!   [`drain`] the shutdown that asks every initiator to log out;
//!   `refuse` the answer to connections beyond the cap.

pub mod command;
pub mod config;
mod conn;
pub mod drain;
mod exec;
pub mod io;
mod live;
pub mod login;
pub mod negotiate;
pub mod netmask;
pub mod options;
pub mod pdu;
mod refuse;
mod sess;
pub mod session;
mod sessions;
pub mod target;
mod tasks;
mod tx;
mod workers;

pub use config::*;
pub use live::ConnInfo;
pub use login::Secret;
pub use options::IscsiOptions;
pub use target::{IscsiError, IscsiStats, IscsiTarget};

//! ustor's SCSI target core: executes SBC/SPC commands against bdev
//! channels and answers with a status, sense data and a residual. It knows
//! nothing about transports: iSCSI, vhost-user-scsi and the emulated HBA
//! each move data through a [`DataPath`] of their own and call
//! [`LunTable::execute`].
//!
//! - [`data`]: the data-out source / data-in sink trait, plain-buffer and
//!   iovec implementations.
//! - [`lu`]: a logical unit's identity ([`LuConfig`]) and its per-reactor
//!   state ([`Lun`]: bdev channel, pending unit attention).
//! - [`table`]: the LUN table and dispatch (REPORT LUNS, missing LUNs, unit
//!   attentions).
//! - [`fast`]: plain READ and WRITE started (and, on a bdev that answers
//!   at once, answered) in the call, for transports that map their data.
//! - `spc`, `sbc`: the command executors; `opcodes` REPORT SUPPORTED
//!   OPERATION CODES.
//! - [`outcome`]: status + sense + residual; bdev errors mapped to sense.
//! - [`pr`]: a unit's reservations (persistent and RESERVE(6)), shared by
//!   its I_T nexuses; `rmw` COMPARE AND WRITE and ORWRITE, atomic against
//!   every nexus's writes through `gate` (one write gate per unit); `xcopy`
//!   EXTENDED COPY within a unit; `mode` MODE SELECT.
//!
//! SCSI failures are CHECK CONDITION with sense, never panics or Rust
//! errors; a Rust error ([`XferError`]) means the transport failed moving
//! data. Everything runs on the reactor that owns the channels (`!Send`).

pub mod data;
pub mod fast;
#[doc(hidden)]
pub mod fuzz;
mod gate;
pub mod lu;
mod mode;
mod opcodes;
pub mod outcome;
pub mod pr;
mod rmw;
mod sbc;
mod spc;
pub mod table;
mod xcopy;

pub use data::{BufData, DataPath, Direction, IovecData, XferError};
pub use fast::{DataNow, RwPending, RwStart};
pub use lu::{LuConfig, LuShared, Lun};
pub use outcome::Outcome;
pub use sbc::{CHUNK_BYTES, MAX_UNMAP_DESCRIPTORS};
pub use table::{LunTable, TableError, MAX_LUNS};

#[cfg(test)]
pub(crate) mod test_util {
    use std::future::Future;
    use std::pin::pin;
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};

    use ustor_bdev::modules::{malloc, RamOpts};
    use ustor_bdev::{Desc, Registry};

    use crate::{LuConfig, LuShared, Lun, LunTable};

    struct Noop;
    impl Wake for Noop {
        fn wake(self: Arc<Self>) {}
    }

    /// A malloc bdev of 512-byte blocks as one logical unit that any
    /// number of I_T nexuses see, each through a table of its own (LUN 0)
    /// sharing the unit's `LuShared`.
    pub struct SharedUnit {
        pub reg: Arc<Registry>,
        pub name: String,
        desc: Desc,
        shared: Arc<LuShared>,
    }

    impl SharedUnit {
        pub fn new(tag: &str, blocks: u64) -> SharedUnit {
            let reg = Registry::new(None);
            let name = format!(
                "{tag}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            );
            let opts = RamOpts {
                name: name.clone(),
                num_blocks: blocks,
                block_size: 512,
                uuid: None,
                optimal_io_boundary: 0,
                max_transfer_blocks: 0,
            };
            malloc::create(&reg, opts).unwrap();
            let desc = reg.open(&name, true, |_| {}).unwrap();
            SharedUnit {
                reg,
                name,
                desc,
                shared: LuShared::new(),
            }
        }

        /// The table of the I_T nexus `nexus` (a second table of one
        /// nexus is that nexus on another reactor).
        pub fn table(&self, nexus: &str) -> LunTable {
            let lu = Lun::open(LuConfig::disk("SHARED DISK", 1, false), &self.desc).unwrap();
            let mut t = LunTable::from_luns([(0, lu.with_shared(self.shared.clone()))]);
            t.set_nexus(nexus);
            t
        }
    }

    /// Runs a future that never waits (malloc bdev I/O, plain buffers).
    pub fn ready<F: Future>(f: F) -> F::Output {
        let w = Waker::from(Arc::new(Noop));
        let mut cx = Context::from_waker(&w);
        let mut f = pin!(f);
        for _ in 0..1000 {
            if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
                return v;
            }
        }
        panic!("future did not complete without waiting");
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_fast;
#[cfg(test)]
mod tests_pr;

//! Per-host counters: `Cell`s on the owning reactor (no atomics on the I/O
//! path), snapshotted into a serde struct for `scsi_get_stats`.

use std::cell::Cell;

use serde::Serialize;

macro_rules! counters {
    ($($(#[$m:meta])* $name:ident),* $(,)?) => {
        /// Live counters of one host (reactor-local).
        #[derive(Default)]
        pub struct HostCounters { $(pub(crate) $name: Cell<u64>,)* }

        /// A snapshot of one host's counters.
        #[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
        pub struct HostStats { pub host: u32, $($(#[$m])* pub $name: u64,)* }

        impl HostCounters {
            pub(crate) fn snapshot(&self, host: u32) -> HostStats {
                HostStats { host, $($name: self.$name.get(),)* }
            }
        }
    };
}

counters! {
    /// Commands issued to the LLD (retries included).
    commands,
    /// Commands finished successfully.
    completed,
    /// Commands failed back to their caller.
    failed,
    /// Re-issues by the retry rules or after error handling.
    retries,
    timeouts,
    aborts,
    aborts_failed,
    device_resets,
    device_resets_failed,
    host_resets,
    host_resets_failed,
    /// Devices taken offline by error handling.
    offlined,
    eh_runs,
    unit_attentions,
    luns_changed,
    capacity_changed,
    not_ready_retries,
    busy,
    task_set_full,
    /// `queuecommand` said the queue was full.
    queue_full,
    recovered_errors,
    medium_errors,
    hardware_errors,
    transport_errors,
    /// Completions for a tag that was no longer outstanding (after abort).
    stale_completions,
    rescans,
    /// The LLD reported targets or LUNs coming or going (hot-plug events).
    hotplug_events,
    devices_added,
    devices_removed,
}

impl HostCounters {
    #[inline]
    pub(crate) fn inc(c: &Cell<u64>) {
        c.set(c.get() + 1);
    }
}

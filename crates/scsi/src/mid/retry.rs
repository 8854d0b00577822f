//! Retry rules: what the mid-layer does with a finished command, decided by
//! a pure function of (status, sense, attempt) so every rule is unit-tested
//! without a device (Linux's `scsi_decide_disposition` /
//! `scsi_check_sense`, reduced to what a disk needs).

use serde::Serialize;
use ustor_bdev::BdevError;

use crate::lld::TransportError;
use crate::sense::{asc, Sense, SenseKey};
use crate::status::ScsiStatus;

/// What to do with the command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Complete,
    /// Issue it again after `delay_ms`, if attempts remain.
    Retry {
        delay_ms: u32,
    },
    /// Give up: the failure reaches the caller (sense kept on the device).
    Fail(Failure),
}

/// Why a command failed, in the terms the bdev layer needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Failure {
    Medium,
    Hardware,
    NotSupported,
    IllegalRequest,
    DataProtect,
    Miscompare,
    NotReady,
    ReservationConflict,
    /// Retries ran out on a retryable condition.
    RetriesExhausted,
    /// Timed out and error handling gave up on it.
    TimedOut,
    Offline,
    Transport(TransportError),
    Other,
}

impl Failure {
    /// The bdev error a SCSI bdev completes with (errno kept).
    pub fn bdev_error(self) -> BdevError {
        match self {
            Failure::Medium | Failure::Hardware | Failure::Other => BdevError::Io(libc::EIO),
            Failure::NotSupported => BdevError::NotSupported,
            Failure::IllegalRequest => BdevError::Io(libc::EINVAL),
            Failure::DataProtect => BdevError::ReadOnly,
            Failure::Miscompare => BdevError::Miscompare { offset: None },
            Failure::NotReady => BdevError::Io(libc::EAGAIN),
            Failure::ReservationConflict => BdevError::Io(libc::EBADE),
            Failure::RetriesExhausted => BdevError::Io(libc::EIO),
            Failure::TimedOut => BdevError::Io(libc::ETIMEDOUT),
            Failure::Offline => BdevError::Io(libc::ENXIO),
            Failure::Transport(TransportError::Aborted) => BdevError::Aborted,
            Failure::Transport(TransportError::NoDevice) => BdevError::Io(libc::ENXIO),
            Failure::Transport(_) => BdevError::Io(libc::EIO),
        }
    }
}

/// Side effects the host records (counters, rescans).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    None,
    UnitAttention,
    LunsChanged,
    CapacityChanged,
    BecomingReady,
    Busy,
    TaskSetFull,
    Recovered,
    MediumError,
    HardwareError,
    TransportError,
    /// The transport says there is no such device (any more): a rescan
    /// finds out what is gone.
    DeviceGone,
}

/// Back-off of BUSY and TASK SET FULL: doubles per attempt from 1 ms, at most 64 ms.
pub fn busy_backoff_ms(attempt: u32) -> u32 {
    1u32 << attempt.min(6)
}

/// Decides the fate of a finished command (attempt counts from 0).
pub fn decide(
    status: Result<ScsiStatus, TransportError>,
    sense: Option<Sense>,
    attempt: u32,
) -> (Action, Event) {
    let status = match status {
        Ok(s) => s,
        Err(TransportError::NoDevice) => {
            return (
                Action::Fail(Failure::Transport(TransportError::NoDevice)),
                Event::DeviceGone,
            )
        }
        // The transport lost it: worth another try (a reconnect may be under way).
        Err(e) => {
            let _ = e;
            return (
                Action::Retry {
                    delay_ms: busy_backoff_ms(attempt),
                },
                Event::TransportError,
            );
        }
    };
    match status {
        ScsiStatus::Good | ScsiStatus::ConditionMet => (Action::Complete, Event::None),
        ScsiStatus::Busy => (
            Action::Retry {
                delay_ms: busy_backoff_ms(attempt),
            },
            Event::Busy,
        ),
        ScsiStatus::TaskSetFull => (
            Action::Retry {
                delay_ms: busy_backoff_ms(attempt),
            },
            Event::TaskSetFull,
        ),
        ScsiStatus::ReservationConflict => {
            (Action::Fail(Failure::ReservationConflict), Event::None)
        }
        ScsiStatus::TaskAborted => (Action::Retry { delay_ms: 0 }, Event::None),
        ScsiStatus::CheckCondition => match sense {
            Some(s) => check_sense(s),
            // CHECK CONDITION without usable sense: retry, bounded.
            None => (Action::Retry { delay_ms: 0 }, Event::None),
        },
        ScsiStatus::AcaActive | ScsiStatus::Other(_) => (Action::Fail(Failure::Other), Event::None),
    }
}

fn check_sense(s: Sense) -> (Action, Event) {
    match s.key {
        SenseKey::NoSense | SenseKey::RecoveredError if s.deferred => {
            (Action::Retry { delay_ms: 0 }, Event::Recovered)
        }
        // The data moved; the device only reports it had to work for it.
        SenseKey::RecoveredError => (Action::Complete, Event::Recovered),
        SenseKey::NoSense => (Action::Retry { delay_ms: 0 }, Event::None),
        SenseKey::UnitAttention => {
            let ev = match s.code() {
                asc::REPORTED_LUNS_CHANGED => Event::LunsChanged,
                asc::CAPACITY_CHANGED => Event::CapacityChanged,
                _ => Event::UnitAttention,
            };
            (Action::Retry { delay_ms: 0 }, ev)
        }
        SenseKey::NotReady => match s.code() {
            asc::BECOMING_READY => (Action::Retry { delay_ms: 100 }, Event::BecomingReady),
            _ => (Action::Fail(Failure::NotReady), Event::None),
        },
        SenseKey::AbortedCommand => (Action::Retry { delay_ms: 0 }, Event::None),
        SenseKey::MediumError => (Action::Fail(Failure::Medium), Event::MediumError),
        SenseKey::HardwareError => (Action::Fail(Failure::Hardware), Event::HardwareError),
        SenseKey::IllegalRequest => match s.code() {
            asc::INVALID_OPCODE => (Action::Fail(Failure::NotSupported), Event::None),
            asc::LUN_NOT_SUPPORTED => (
                Action::Fail(Failure::Transport(TransportError::NoDevice)),
                Event::None,
            ),
            _ => (Action::Fail(Failure::IllegalRequest), Event::None),
        },
        SenseKey::DataProtect => (Action::Fail(Failure::DataProtect), Event::None),
        SenseKey::Miscompare => (Action::Fail(Failure::Miscompare), Event::None),
        _ => (Action::Fail(Failure::Other), Event::None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cc(key: SenseKey, code: (u8, u8)) -> (Action, Event) {
        decide(
            Ok(ScsiStatus::CheckCondition),
            Some(Sense::new(key, code)),
            0,
        )
    }

    #[test]
    fn rules() {
        assert_eq!(
            decide(Ok(ScsiStatus::Good), None, 0),
            (Action::Complete, Event::None)
        );
        assert_eq!(
            cc(SenseKey::UnitAttention, asc::POWER_ON_RESET),
            (Action::Retry { delay_ms: 0 }, Event::UnitAttention)
        );
        assert_eq!(
            cc(SenseKey::UnitAttention, asc::REPORTED_LUNS_CHANGED).1,
            Event::LunsChanged
        );
        assert_eq!(
            cc(SenseKey::NotReady, asc::BECOMING_READY),
            (Action::Retry { delay_ms: 100 }, Event::BecomingReady)
        );
        assert_eq!(
            cc(SenseKey::NotReady, asc::MEDIUM_NOT_PRESENT).0,
            Action::Fail(Failure::NotReady)
        );
        assert_eq!(
            cc(SenseKey::MediumError, asc::UNRECOVERED_READ),
            (Action::Fail(Failure::Medium), Event::MediumError)
        );
        assert_eq!(
            cc(SenseKey::HardwareError, asc::INTERNAL_TARGET_FAILURE).0,
            Action::Fail(Failure::Hardware)
        );
        assert_eq!(
            cc(SenseKey::IllegalRequest, asc::INVALID_OPCODE).0,
            Action::Fail(Failure::NotSupported)
        );
        assert_eq!(cc(SenseKey::RecoveredError, (0x17, 1)).0, Action::Complete);
        assert_eq!(
            cc(SenseKey::AbortedCommand, (0, 0)).0,
            Action::Retry { delay_ms: 0 }
        );
        assert_eq!(
            decide(Ok(ScsiStatus::Busy), None, 3),
            (Action::Retry { delay_ms: 8 }, Event::Busy)
        );
        assert_eq!(
            decide(Ok(ScsiStatus::TaskSetFull), None, 20).0,
            Action::Retry { delay_ms: 64 }
        );
        assert_eq!(
            decide(Err(TransportError::Disconnected), None, 0).0,
            Action::Retry { delay_ms: 1 }
        );
        assert_eq!(Failure::Medium.bdev_error(), BdevError::Io(libc::EIO));
        assert_eq!(Failure::DataProtect.bdev_error(), BdevError::ReadOnly);
    }
}

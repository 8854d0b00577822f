//! Scriptable faults of the emulated HBA: rules matched per command, and
//! failure switches for the task management functions.

use ustor_scsi::sense::Sense;

/// What happens to a command a rule matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Never completes (the data phase does not happen); abort works.
    Timeout,
    /// Executes, but its completion is lost.
    DropCompletion,
    /// CHECK CONDITION with this sense; nothing is executed.
    Check(Sense),
    Busy,
    TaskSetFull,
}

/// Matches commands and applies a fault to some of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultRule {
    /// Only commands to this LUN (any if `None`).
    pub lun: Option<u64>,
    /// Only this opcode (any if `None`).
    pub opcode: Option<u8>,
    /// Matching commands let through before the fault applies.
    pub skip: u32,
    /// How many matching commands get the fault (0 = every one).
    pub count: u32,
    pub fault: Fault,
}

impl FaultRule {
    /// A rule for the next `count` commands with `opcode` (any LUN).
    pub fn on(opcode: u8, count: u32, fault: Fault) -> FaultRule {
        FaultRule {
            lun: None,
            opcode: Some(opcode),
            skip: 0,
            count,
            fault,
        }
    }

    /// Whether the rule applies to this command; advances its counters.
    pub(crate) fn hit(&mut self, lun: u64, opcode: u8) -> Option<Fault> {
        if self.lun.is_some_and(|l| l != lun) || self.opcode.is_some_and(|o| o != opcode) {
            return None;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return None;
        }
        match self.count {
            0 => Some(self.fault),
            1 => {
                self.count = u32::MAX; // spent
                Some(self.fault)
            }
            u32::MAX => None,
            n => {
                self.count = n - 1;
                Some(self.fault)
            }
        }
    }
}

/// Switches that make task management fail, to drive EH escalation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TmfFaults {
    pub abort_fails: bool,
    pub device_reset_fails: bool,
    pub host_reset_fails: bool,
}

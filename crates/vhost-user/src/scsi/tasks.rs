//! The task set as task management sees it: per request ring, a table
//! indexed by descriptor head of the command running there (its tag and
//! target), so ABORT TASK and QUERY TASK find a command by its tag on any
//! queue. Each table is written only by its ring's reactor, with plain
//! atomic stores (no lock, no read-modify-write per command); the control
//! queue, on any reactor, reads them.
//!
//! A slot's state word is `sequence << 16 | ABORT | target + 1` (0 in the
//! low byte: free). Every start and finish bumps the sequence, and the tag
//! is stored (release) after the slot went free and before it runs again,
//! so a reader that sees the same state word before and after reading the
//! tag read that command's tag.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

const TARGET_MASK: u64 = 0xff;
const ABORT: u64 = 0x100;
const SEQ_SHIFT: u32 = 16;

#[derive(Default)]
struct Slot {
    tag: AtomicU64,
    state: AtomicU64,
}

/// One request ring's commands by head.
pub(crate) struct TaskTable {
    slots: Box<[Slot]>,
    /// An abort was asked since the ring last looked (it then wakes the
    /// commands that can stop early).
    pending: AtomicBool,
}

/// A command found by its tag: where it runs and the state word it had.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Found {
    head: u16,
    state: u64,
}

impl TaskTable {
    pub fn new(size: u16) -> TaskTable {
        TaskTable {
            slots: (0..size.max(1)).map(|_| Slot::default()).collect(),
            pending: AtomicBool::new(false),
        }
    }

    fn slot(&self, head: u16) -> Option<&Slot> {
        self.slots.get(head as usize)
    }

    /// The ring's reactor: the command at `head` runs (`tag`, `target`).
    pub fn start(&self, head: u16, target: u8, tag: u64) {
        let Some(s) = self.slot(head) else { return };
        let seq = (s.state.load(Ordering::Relaxed) >> SEQ_SHIFT) + 1;
        s.tag.store(tag, Ordering::Release);
        s.state
            .store(seq << SEQ_SHIFT | (target as u64 + 1), Ordering::Release);
    }

    /// The ring's reactor: the command at `head` was returned used.
    pub fn finish(&self, head: u16) {
        let Some(s) = self.slot(head) else { return };
        let seq = (s.state.load(Ordering::Relaxed) >> SEQ_SHIFT) + 1;
        s.state.store(seq << SEQ_SHIFT, Ordering::Release);
    }

    /// Whether an abort was asked for the command at `head`.
    pub fn abort_asked(&self, head: u16) -> bool {
        self.slot(head)
            .is_some_and(|s| s.state.load(Ordering::Acquire) & ABORT != 0)
    }

    /// The running command of `target` with `tag`, if any.
    pub fn find(&self, target: u8, tag: u64) -> Option<Found> {
        for (head, s) in self.slots.iter().enumerate() {
            loop {
                let st = s.state.load(Ordering::Acquire);
                if st & TARGET_MASK != target as u64 + 1 {
                    break;
                }
                let t = s.tag.load(Ordering::Acquire);
                if s.state.load(Ordering::Acquire) & !ABORT != st & !ABORT {
                    continue; // the slot changed meanwhile: look again
                }
                if t == tag {
                    return Some(Found {
                        head: head as u16,
                        state: st,
                    });
                }
                break;
            }
        }
        None
    }

    /// Every running command of `target` (for the task-set functions).
    pub fn each_of(&self, target: u8, mut f: impl FnMut(Found)) {
        for (head, s) in self.slots.iter().enumerate() {
            let st = s.state.load(Ordering::Acquire);
            if st & TARGET_MASK == target as u64 + 1 {
                f(Found {
                    head: head as u16,
                    state: st,
                });
            }
        }
    }

    /// Commands running of `target` (`None`: of every target). A command
    /// counts from before it runs until its answer is in the used ring.
    pub fn count_of(&self, target: Option<u8>) -> u32 {
        let want = |st: u64| match target {
            Some(t) => st & TARGET_MASK == t as u64 + 1,
            None => st & TARGET_MASK != 0,
        };
        self.slots
            .iter()
            .filter(|s| want(s.state.load(Ordering::Acquire)))
            .count() as u32
    }

    /// Asks the command `f` names to abort; false if it already finished.
    pub fn ask_abort(&self, f: Found) -> bool {
        let Some(s) = self.slot(f.head) else {
            return false;
        };
        let cur = s.state.load(Ordering::Acquire);
        if cur >> SEQ_SHIFT != f.state >> SEQ_SHIFT {
            return false;
        }
        let asked = s
            .state
            .compare_exchange(cur, cur | ABORT, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            || s.state.load(Ordering::Acquire) >> SEQ_SHIFT == f.state >> SEQ_SHIFT;
        if asked {
            self.pending.store(true, Ordering::Release);
        }
        asked
    }

    /// The ring's reactor: whether an abort was asked since the last call.
    pub fn take_pending(&self) -> bool {
        self.pending.load(Ordering::Relaxed) && self.pending.swap(false, Ordering::AcqRel)
    }

    /// Whether the command `f` names is still running.
    pub fn running(&self, f: Found) -> bool {
        self.slot(f.head)
            .is_some_and(|s| s.state.load(Ordering::Acquire) >> SEQ_SHIFT == f.state >> SEQ_SHIFT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_found_by_tag_and_target() {
        let t = TaskTable::new(8);
        t.start(3, 1, 0xabc);
        t.start(5, 2, 0xabc);
        let f = t.find(1, 0xabc).expect("found");
        assert_eq!(f.head, 3);
        assert_eq!(t.find(2, 0xabc).map(|f| f.head), Some(5));
        assert_eq!(t.find(1, 0xabd), None);
        assert_eq!(t.find(0, 0xabc), None);
        let mut n = 0;
        t.each_of(1, |_| n += 1);
        assert_eq!(n, 1);
        assert_eq!((t.count_of(Some(1)), t.count_of(Some(0))), (1, 0));
        assert_eq!(t.count_of(None), 2);
        t.finish(3);
        assert_eq!((t.count_of(Some(1)), t.count_of(None)), (0, 1));
    }

    #[test]
    fn an_abort_marks_that_command_only_until_it_finishes() {
        let t = TaskTable::new(8);
        t.start(1, 0, 7);
        t.start(2, 0, 8);
        let f = t.find(0, 7).unwrap();
        assert!(!t.take_pending());
        assert!(t.ask_abort(f));
        assert!(t.take_pending(), "the ring is told once");
        assert!(!t.take_pending());
        assert!(t.abort_asked(1));
        assert!(!t.abort_asked(2));
        // Marked, it is still found (QUERY TASK) and running.
        assert_eq!(t.find(0, 7).map(|g| g.head), Some(1));
        assert!(t.running(f));
        t.finish(1);
        assert!(!t.running(f));
        assert!(!t.abort_asked(1));
        assert_eq!(t.find(0, 7), None);
        // The head runs a new command: the old abort does not reach it.
        t.start(1, 0, 7);
        assert!(!t.ask_abort(f));
        assert!(!t.abort_asked(1));
        // Heads beyond the table are ignored.
        t.start(99, 0, 1);
        assert_eq!(t.find(0, 1), None);
    }
}

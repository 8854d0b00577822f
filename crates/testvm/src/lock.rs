//! Whole-file advisory locks (`flock`). They serialize asset builds and
//! guest runs across threads *and* test processes: `flock` locks belong to
//! an open file description, so two `open`s in one process exclude each
//! other just as two processes do. Two TCG guests on a 2-core CI machine
//! would each run at half speed and could blow their timeouts.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::error::{GuestError, Result};

/// Holds an exclusive lock until dropped (closing the file releases it).
#[derive(Debug)]
pub struct FileLock {
    _file: File,
}

impl FileLock {
    /// Blocks until the lock on `path` (created if absent) is held.
    pub fn exclusive(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| GuestError::io(format!("open lock file {}", path.display()), e))?;
        loop {
            // SAFETY: flock on a valid, owned descriptor; no memory involved.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 {
                return Ok(FileLock { _file: file });
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(GuestError::io(format!("flock {}", path.display()), err));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn second_open_in_same_process_waits() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("l");
        let first = FileLock::exclusive(&path).expect("first lock");
        let got = Arc::new(AtomicBool::new(false));
        let got2 = Arc::clone(&got);
        let p2 = path.clone();
        let t = std::thread::spawn(move || {
            let _l = FileLock::exclusive(&p2).expect("second lock");
            got2.store(true, Ordering::SeqCst);
        });
        // A window in which a non-exclusive lock would show, not a wait.
        std::thread::sleep(Duration::from_millis(200));
        assert!(!got.load(Ordering::SeqCst), "lock was not exclusive");
        drop(first);
        t.join().expect("join");
        assert!(got.load(Ordering::SeqCst));
    }
}

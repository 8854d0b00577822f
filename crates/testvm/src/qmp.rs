//! Host actions a guest script asks for mid-run: the script prints
//! `USTOR-QMP NAME` (lib.sh: `qmp NAME`), and the host either sends the
//! QMP commands registered for NAME with [`crate::GuestBuilder::on_qmp`]
//! over QEMU's QMP socket (a `device_del` for a hot-unplug, say), or runs
//! the closure registered with [`crate::GuestBuilder::on_host`] (an RPC to
//! a host-side peer the guest's disks reach, say). Each name fires once.
//! The guest then waits for the effect it can see itself; the replies are
//! in [`crate::GuestOutcome::qmp_replies`] and
//! [`crate::GuestOutcome::host_replies`].

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// What a guest prints to ask for a registered QMP action.
pub(crate) const QMP_MARKER: &str = "USTOR-QMP ";

/// How long one QMP exchange may take.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);

/// A host-side action: runs on the test's thread while the guest runs;
/// what it returns goes to [`crate::GuestOutcome::host_replies`].
#[derive(Clone)]
pub(crate) struct HostFn(pub Arc<dyn Fn() -> String + Send + Sync>);

impl std::fmt::Debug for HostFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostFn")
    }
}

/// What a marker's name stands for.
#[derive(Clone, Debug)]
pub(crate) enum Action {
    /// QMP commands, sent in order on one session.
    Qmp(Vec<String>),
    Host(HostFn),
}

/// The registered actions of one run and what has been read of the serial
/// log so far.
pub(crate) struct Hooks {
    pending: Vec<(String, Action)>,
    socket: PathBuf,
    /// Bytes of the serial log already scanned (whole lines only).
    seen: u64,
    pub replies: Vec<String>,
    pub host_replies: Vec<String>,
}

impl Hooks {
    pub fn new(actions: &[(String, Action)], socket: PathBuf) -> Hooks {
        Hooks {
            pending: actions.to_vec(),
            socket,
            seen: 0,
            replies: Vec::new(),
            host_replies: Vec::new(),
        }
    }

    /// Scans new whole lines of the serial log for markers and runs the
    /// actions they name.
    pub fn poll(&mut self, serial: &Path) {
        if self.pending.is_empty() {
            return;
        }
        let Ok(mut f) = File::open(serial) else {
            return;
        };
        let mut text = Vec::new();
        if f.seek(SeekFrom::Start(self.seen)).is_err() || f.read_to_end(&mut text).is_err() {
            return;
        }
        let Some(end) = text.iter().rposition(|b| *b == b'\n') else {
            return;
        };
        self.seen += end as u64 + 1;
        for line in String::from_utf8_lossy(&text[..end]).lines() {
            let Some(at) = line.find(QMP_MARKER) else {
                continue;
            };
            let name = line[at + QMP_MARKER.len()..].trim();
            let Some(i) = self.pending.iter().position(|(n, _)| n == name) else {
                continue;
            };
            match self.pending.remove(i) {
                (name, Action::Qmp(cmds)) => match exchange(&self.socket, &cmds) {
                    Ok(r) => self.replies.extend(r),
                    Err(e) => self.replies.push(format!("{name}: QMP failed: {e}")),
                },
                (_, Action::Host(f)) => self.host_replies.push((f.0)()),
            }
        }
    }
}

/// Connects, leaves negotiation mode, sends each command and collects its
/// reply line (asynchronous event lines in between are skipped).
fn exchange(socket: &Path, cmds: &[String]) -> std::io::Result<Vec<String>> {
    let s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(QMP_TIMEOUT))?;
    let mut w = s.try_clone()?;
    let mut r = BufReader::new(s);
    let mut greeting = String::new();
    r.read_line(&mut greeting)?;
    let mut out = Vec::new();
    let caps = r#"{"execute": "qmp_capabilities"}"#.to_string();
    for (i, c) in std::iter::once(&caps).chain(cmds).enumerate() {
        writeln!(w, "{c}")?;
        loop {
            let mut line = String::new();
            if r.read_line(&mut line)? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            if line.contains("\"return\"") || line.contains("\"error\"") {
                if i > 0 {
                    out.push(line.trim().to_string());
                }
                break;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A QMP peer's side of one session: greeting, then an event and a
    /// reply per command; returns the commands it got.
    fn serve(l: UnixListener) -> Vec<String> {
        let (s, _) = l.accept().unwrap();
        let mut w = s.try_clone().unwrap();
        let mut r = BufReader::new(s);
        writeln!(w, r#"{{"QMP": {{"version": {{}}, "capabilities": []}}}}"#).unwrap();
        let mut got = Vec::new();
        let mut line = String::new();
        while r.read_line(&mut line).unwrap() > 0 {
            writeln!(w, r#"{{"event": "DEVICE_DELETED", "data": {{}}}}"#).unwrap();
            writeln!(w, r#"{{"return": {{}}}}"#).unwrap();
            got.push(std::mem::take(&mut line).trim().to_string());
        }
        got
    }

    #[test]
    fn markers_in_whole_lines_run_their_commands_once() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("qmp.sock");
        let serial = dir.path().join("serial.log");
        let l = UnixListener::bind(&sock).unwrap();
        let peer = std::thread::spawn(move || serve(l));
        let del = r#"{"execute": "device_del", "arguments": {"id": "d1"}}"#;
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let h2 = hits.clone();
        let host = HostFn(Arc::new(move || {
            format!(
                "host {}",
                h2.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            )
        }));
        let mut h = Hooks::new(
            &[
                ("unplug".into(), Action::Qmp(vec![del.into()])),
                ("slow".into(), Action::Host(host)),
            ],
            sock,
        );
        // A marker still being written is not acted on.
        std::fs::write(&serial, "boot\nUSTOR-QMP unpl").unwrap();
        h.poll(&serial);
        assert!(h.replies.is_empty());
        std::fs::write(
            &serial,
            "boot\nUSTOR-QMP unplug\nUSTOR-QMP unplug\nx USTOR-QMP slow\nUSTOR-QMP slow\n",
        )
        .unwrap();
        h.poll(&serial);
        h.poll(&serial);
        assert_eq!(h.replies, vec![r#"{"return": {}}"#.to_string()]);
        assert_eq!(h.host_replies, vec!["host 0".to_string()]);
        let got = peer.join().unwrap();
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].contains("qmp_capabilities"));
        assert_eq!(got[1], del);
    }
}

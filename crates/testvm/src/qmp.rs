//! Host actions a guest script asks for mid-run, over QEMU's QMP socket:
//! the script prints `USTOR-QMP NAME` (lib.sh: `qmp NAME`), and the host
//! sends the QMP commands registered for NAME with
//! [`crate::GuestBuilder::on_qmp`] (a `device_del` for a hot-unplug, say).
//! Each name fires once. The guest then waits for the effect it can see
//! itself; the replies are in [`crate::GuestOutcome::qmp_replies`].

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What a guest prints to ask for a registered QMP action.
pub(crate) const QMP_MARKER: &str = "USTOR-QMP ";

/// How long one QMP exchange may take.
const QMP_TIMEOUT: Duration = Duration::from_secs(10);

/// The registered actions of one run and what has been read of the serial
/// log so far.
pub(crate) struct Hooks {
    pending: Vec<(String, Vec<String>)>,
    socket: PathBuf,
    /// Bytes of the serial log already scanned (whole lines only).
    seen: u64,
    pub replies: Vec<String>,
}

impl Hooks {
    pub fn new(actions: &[(String, Vec<String>)], socket: PathBuf) -> Hooks {
        Hooks {
            pending: actions.to_vec(),
            socket,
            seen: 0,
            replies: Vec::new(),
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
            if let Some(i) = self.pending.iter().position(|(n, _)| n == name) {
                let (name, cmds) = self.pending.remove(i);
                match exchange(&self.socket, &cmds) {
                    Ok(r) => self.replies.extend(r),
                    Err(e) => self.replies.push(format!("{name}: QMP failed: {e}")),
                }
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
        let mut h = Hooks::new(&[("unplug".into(), vec![del.into()])], sock);
        // A marker still being written is not acted on.
        std::fs::write(&serial, "boot\nUSTOR-QMP unpl").unwrap();
        h.poll(&serial);
        assert!(h.replies.is_empty());
        std::fs::write(&serial, "boot\nUSTOR-QMP unplug\nUSTOR-QMP unplug\n").unwrap();
        h.poll(&serial);
        h.poll(&serial);
        assert_eq!(h.replies, vec![r#"{"return": {}}"#.to_string()]);
        let got = peer.join().unwrap();
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].contains("qmp_capabilities"));
        assert_eq!(got[1], del);
    }
}

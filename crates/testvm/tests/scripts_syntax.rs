//! Every guest script parses as a busybox ash script (the shell they run
//! under), checked on the host with `sh -n` so a typo fails fast without
//! booting a guest.

use std::process::Command;

#[test]
fn guest_scripts_parse() {
    let dir = testvm::assets::workspace_root().join("tests/guest");
    let shell = ["busybox", "dash", "sh"]
        .into_iter()
        .find(|s| {
            Command::new(s)
                .arg("-c")
                .arg("true")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .expect("a POSIX shell on the host");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("tests/guest") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "sh") {
            let mut cmd = Command::new(shell);
            if shell == "busybox" {
                cmd.arg("sh");
            }
            let out = cmd.arg("-n").arg(&path).output().expect("run shell");
            assert!(
                out.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 5,
        "found only {checked} scripts in {}",
        dir.display()
    );
}

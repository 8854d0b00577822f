//! The Debian package: `packaging/build-deb.sh` (cargo-deb) packages the
//! binary this test build made, `dpkg -i` installs it on this machine (and
//! `dpkg --purge` removes it again), and the installed pieces are used the
//! way an operator would: the man pages render, the bash completion loads,
//! the postinst made the `ustor` system user, and the unit's ExecStart line,
//! run as the unit's user with a NOTIFY_SOCKET (systemd need not be PID 1
//! here), says READY=1, reloads on SIGHUP and stops on SIGTERM.

mod common;

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use serde_json::{json, Value};
use ustor_rpc::RpcClient;

const PKG_FILES: &[&str] = &[
    "./usr/bin/ustor",
    "./usr/share/man/man1/ustor.1.gz",
    "./usr/share/man/man1/ustor-serve.1.gz",
    "./usr/share/man/man1/ustor-top.1.gz",
    "./usr/share/bash-completion/completions/ustor",
    "./usr/share/zsh/vendor-completions/_ustor",
    "./usr/share/fish/vendor_completions.d/ustor.fish",
    "./etc/ustor/ustor.json",
];

fn sh(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn peers() -> Result<(), String> {
    for p in ["cargo-deb", "dpkg", "dpkg-deb", "man", "bash", "setpriv"] {
        testkit::program(p)?;
    }
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        return Err("installing a .deb with dpkg -i needs root".into());
    }
    if Path::new("/var/lib/dpkg/info/ustor.list").exists() {
        return Err(
            "a ustor package is installed already; this test installs and purges its own".into(),
        );
    }
    Ok(())
}

/// Purges the package when the test ends, passed or not.
struct Installed;

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = Command::new("dpkg").args(["--purge", "ustor"]).output();
    }
}

fn unit_value<'a>(unit: &'a str, key: &str) -> &'a str {
    unit.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("unit has no {key}=: {unit}"))
}

#[test]
fn deb_installs_and_its_unit_starts() {
    testkit::require!(
        peers(),
        "cargo install cargo-deb; apt-get install man-db (.ci)"
    );
    let dir = tmpdir("deb");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // Package the binary this test build made (no second build).
    let profile_dir = Path::new(BIN).parent().unwrap().file_name().unwrap();
    assert_eq!(profile_dir, "debug", "the test packages the dev profile");
    sh(Command::new(root.join("packaging/build-deb.sh"))
        .args(["--profile", "dev", "--no-build", "-o"])
        .arg(&dir));
    let deb = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .expect("a .deb");

    let list = sh(Command::new("dpkg-deb").arg("-c").arg(&deb));
    for f in PKG_FILES {
        assert!(
            list.lines().any(|l| l.ends_with(f)),
            "{f} not in the package:\n{list}"
        );
    }
    let unit_file = list
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .find(|p| p.ends_with("systemd/system/ustor.service"))
        .unwrap_or_else(|| panic!("no unit in the package:\n{list}"))
        .trim_start_matches('.')
        .to_string();
    let conffiles = sh(Command::new("dpkg-deb")
        .arg("-I")
        .arg(&deb)
        .arg("conffiles"));
    assert!(
        conffiles.lines().any(|l| l == "/etc/ustor/ustor.json"),
        "{conffiles}"
    );

    sh(Command::new("dpkg").arg("-i").arg(&deb));
    let _purge = Installed;

    // The installed binary is the one built here; its man pages render.
    let version = sh(Command::new("/usr/bin/ustor").arg("--version"));
    assert!(version.starts_with("ustor "), "{version}");
    let man = sh(Command::new("man")
        .args(["-l", "/usr/share/man/man1/ustor-serve.1.gz"])
        .env("MANWIDTH", "80")
        .env("MANPAGER", "cat"));
    assert!(
        man.contains("rpc-socket") && man.contains("log-format"),
        "{man}"
    );
    // The bash completion loads and completes subcommands.
    let comp = sh(Command::new("bash").args([
        "-c",
        "source /usr/share/bash-completion/completions/ustor && complete -p ustor && \
         COMP_WORDS=(ustor se) COMP_CWORD=1 COMP_LINE='ustor se' COMP_POINT=8 && \
         $(complete -p ustor | sed -E 's/.*-F ([^ ]+).*/\\1/') ustor se ustor && \
         printf '%s\\n' \"${COMPREPLY[@]}\"",
    ]));
    assert!(comp.lines().any(|l| l == "serve"), "{comp}");
    // The postinst made the system user the unit runs as.
    let pw = sh(Command::new("getent").args(["passwd", "ustor"]));
    let uid: u32 = pw.split(':').nth(2).unwrap().parse().unwrap();
    assert!(uid < 1000, "not a system user: {pw}");

    let unit = std::fs::read_to_string(&unit_file).unwrap();
    assert_eq!(unit_value(&unit, "Type"), "notify");
    assert_eq!(unit_value(&unit, "User"), "ustor");
    assert_eq!(unit_value(&unit, "ExecReload"), "/bin/kill -HUP $MAINPID");
    assert_eq!(unit_value(&unit, "AmbientCapabilities"), "CAP_IPC_LOCK");
    run_unit(&dir, unit_value(&unit, "ExecStart"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs the unit's ExecStart as its user with its capability, as systemd
/// would, with two
/// changes that keep parallel tests apart: the RPC socket (RuntimeDirectory)
/// is a test directory, and the installed config's NBD port becomes 0.
fn run_unit(dir: &Path, exec: &str) {
    let run = dir.join("run");
    std::fs::create_dir_all(&run).unwrap();
    sh(Command::new("chown").arg("ustor:ustor").arg(&run));
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read("/etc/ustor/ustor.json").unwrap()).unwrap();
    let nbd = cfg["subsystems"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|s| s["subsystem"] == "nbd")
        .unwrap();
    nbd["config"][0]["params"]["listen_address"]["trsvcid"] = json!("0");
    let cfg_path = dir.join("ustor.json");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let sock = run.join("ustor.sock");
    let args: Vec<String> = exec
        .split_whitespace()
        .map(|a| match a {
            "/etc/ustor/ustor.json" => cfg_path.display().to_string(),
            "/run/ustor/ustor.sock" => sock.display().to_string(),
            a => a.to_string(),
        })
        .collect();
    assert_eq!(args[0], "/usr/bin/ustor", "{exec}");

    let notify_path = dir.join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    sh(Command::new("chmod").args(["a+rx"]).arg(dir));
    sh(Command::new("chmod").args(["a+rw"]).arg(&notify_path));
    let child = Command::new("setpriv")
        .args(["--reuid=ustor", "--regid=ustor", "--init-groups"])
        // The unit's AmbientCapabilities (registered buffers need no
        // RLIMIT_MEMLOCK with it).
        .args(["--inh-caps=+ipc_lock", "--ambient-caps=+ipc_lock", "--"])
        .args(&args)
        .args(["--no-pin"])
        .env("NOTIFY_SOCKET", &notify_path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    expect_notify(&notify, "READY=1");
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    let pw = sh(Command::new("id").args(["-u", "ustor"]));
    assert!(
        uid_line.split_whitespace().nth(1) == Some(pw.trim()),
        "{uid_line}"
    );
    let call = |m: &str, p: Value| RpcClient::connect(&sock).unwrap().call(m, p).unwrap();
    let b = call("bdev_get_bdevs", json!({"name": "Malloc0"}));
    assert_eq!(b[0]["num_blocks"], 2097152);
    assert_eq!(
        call("nbd_get_exports", Value::Null)[0]["bdev_name"],
        "Malloc0"
    );

    // ExecReload: SIGHUP applies the file again.
    // SAFETY: kill(2) on the child we started.
    unsafe { libc::kill(child.id() as i32, libc::SIGHUP) };
    expect_notify(&notify, "RELOADING=1");
    expect_notify(&notify, "READY=1");
    // SAFETY: as above.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    expect_notify(&notify, "STOPPING=1");
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

//! Unit tests of the guest runner's parsing (exit marker, output).

use super::*;

#[test]
fn exit_marker_last_wins_and_garbage_ignored() {
    assert_eq!(parse_exit("boot\nUSTOR-GUEST-EXIT=3\n"), Some(3));
    assert_eq!(
        parse_exit("USTOR-GUEST-EXIT=1\nUSTOR-GUEST-EXIT=0\n"),
        Some(0)
    );
    assert_eq!(parse_exit("USTOR-GUEST-EXIT=\n"), None);
    assert_eq!(parse_exit("no marker"), None);
}

#[test]
fn kv_values() {
    let o = GuestOutcome {
        exit_code: 0,
        log: "x\nUSTOR-KV md5=abc\n[ 1.0] USTOR-KV md5=def \nUSTOR-GUEST-START uptime=2.5\n".into(),
        duration: Duration::ZERO,
        qmp_replies: Vec::new(),
        host_replies: Vec::new(),
    };
    assert_eq!(o.value("md5"), Some("def"));
    assert_eq!(o.value("nope"), None);
    assert_eq!(o.boot_seconds(), Some(2.5));
}

#[test]
fn quoting_survives_single_quotes() {
    assert_eq!(shell_quote("a'b"), "'a'\\''b'");
}

#[test]
fn rejects_bad_env_names() {
    let b = GuestBuilder::new().script("true").env("1X", "v");
    assert!(matches!(b.validate(), Err(GuestError::Invalid(_))));
    let b = GuestBuilder::new().script("true").env("PORT_1", "v");
    assert!(b.validate().is_ok());
}

#[test]
fn ldd_paths_finds_libraries_and_loader() {
    let out = "\tlinux-vdso.so.1 (0x00007ffd)\n\tlibm.so.6 => /lib/x86_64-linux-gnu/libm.so.6 (0x1)\n\t/lib64/ld-linux-x86-64.so.2 (0x2)\n\tlibfoo.so => not found\n";
    assert_eq!(
        super::ldd_paths(out),
        vec![
            "/lib/x86_64-linux-gnu/libm.so.6",
            "/lib64/ld-linux-x86-64.so.2"
        ]
    );
}

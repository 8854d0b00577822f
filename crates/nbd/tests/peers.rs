//! Interop with real NBD clients: nbdinfo, qemu-io, qemu-img, nbdcopy, fio.

mod common;

use common::{have, run, start, stdout};

#[test]
fn nbdinfo_sees_export() {
    if !have("nbdinfo") {
        return;
    }
    let f = start(64 << 20, 2);
    let out = stdout(&run("nbdinfo", &["--size", &f.uri("mem")]));
    assert_eq!(out.trim(), (64u64 << 20).to_string());
    let out = stdout(&run(
        "nbdinfo",
        &["--list", &format!("nbd://127.0.0.1:{}", f.port)],
    ));
    assert!(out.contains("export=\"mem\""), "{out}");
    assert!(out.contains("RAM test export"), "{out}");
    let out = stdout(&run("nbdinfo", &[&f.uri("mem")]));
    for want in [
        "block_size_minimum: 512",
        "block_size_preferred: 4096",
        "can_flush: true",
        "can_multi_conn: true",
        "base:allocation",
        "is_read_only: false",
    ] {
        assert!(out.contains(want), "missing {want} in\n{out}");
    }
    let out = stdout(&run("nbdinfo", &["--map", &f.uri("mem")]));
    assert!(out.contains("data") || out.contains("0"), "{out}");
}

#[test]
fn qemu_io_patterns() {
    if !have("qemu-io") {
        return;
    }
    let f = start(64 << 20, 2);
    let uri = f.uri("mem");
    let out = stdout(&run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0xa5 0 1M",
            "-c",
            "write -P 0x5a 4M 64k",
            "-c",
            "flush",
            &uri,
        ],
    ));
    assert!(out.contains("wrote 1048576/1048576"), "{out}");
    let out = stdout(&run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-r",
            "-c",
            "read -P 0xa5 0 1M",
            "-c",
            "read -P 0x5a 4M 64k",
            "-c",
            "read -P 0 2M 64k",
            &uri,
        ],
    ));
    assert!(!out.contains("Pattern verification failed"), "{out}");
    // Write zeroes and discard.
    let out = stdout(&run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -z 0 64k",
            "-c",
            "discard 64k 64k",
            "-c",
            "read -P 0 0 64k",
            &uri,
        ],
    ));
    assert!(!out.contains("failed"), "{out}");
    let stats = f.server.get_stats().expect("stats");
    // A large write is copied only for the part a greedy receive staged
    // (at most one staging buffer), never twice.
    assert!(stats.payload_copies <= stats.writes, "{stats:?}");
    assert!(stats.writes >= 2 && stats.reads >= 3, "{stats:?}");
}

#[test]
fn qemu_img_convert_and_compare() {
    if !have("qemu-img") {
        return;
    }
    let f = start(32 << 20, 2);
    let dir = tempdir();
    let src = format!("{dir}/src.raw");
    let back = format!("{dir}/back.raw");
    random_file(&src, 32 << 20);
    let uri = f.uri("mem");
    let out = stdout(&run("qemu-img", &["info", "-f", "raw", &uri]));
    assert!(out.contains("32 MiB"), "{out}");
    run(
        "qemu-img",
        &["convert", "-n", "-f", "raw", "-O", "raw", &src, &uri],
    );
    run(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", &src, &uri],
    );
    run(
        "qemu-img",
        &["convert", "-f", "raw", "-O", "raw", &uri, &back],
    );
    run("cmp", &[&src, &back]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn nbdcopy_round_trip_256m() {
    if !have("nbdcopy") {
        return;
    }
    let f = start(256 << 20, 2);
    let dir = tempdir();
    let src = format!("{dir}/src.raw");
    let back = format!("{dir}/back.raw");
    random_file(&src, 256 << 20);
    let uri = f.uri("mem");
    run("nbdcopy", &[&src, &uri]);
    run("nbdcopy", &[&uri, &back]);
    let a = stdout(&run("sha256sum", &[&src]));
    let b = stdout(&run("sha256sum", &[&back]));
    assert_eq!(a.split_whitespace().next(), b.split_whitespace().next());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fio_verify_qd1_qd32_multiconn() {
    if !have("fio") {
        return;
    }
    let f = start(64 << 20, 2);
    let uri = f.uri("mem");
    for (iodepth, jobs) in [("1", "1"), ("32", "1"), ("8", "4")] {
        let out = stdout(&run(
            "fio",
            &[
                "--name=verify",
                "--ioengine=nbd",
                &format!("--uri={uri}"),
                "--rw=randwrite",
                "--bs=4k",
                "--size=16m",
                &format!("--iodepth={iodepth}"),
                &format!("--numjobs={jobs}"),
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
                "--verify_state_save=0",
                "--offset_increment=16m",
                "--group_reporting",
            ],
        ));
        assert!(out.contains("err= 0"), "{out}");
    }
}

fn tempdir() -> String {
    let dir = format!(
        "/tmp/ustor-nbd-test-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    std::fs::create_dir_all(&dir).expect("tempdir");
    dir
}

static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn random_file(path: &str, bytes: usize) {
    run(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={path}"),
            "bs=1M",
            &format!("count={}", bytes >> 20),
            "status=none",
        ],
    );
}

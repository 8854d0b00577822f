//! Exports over a real bdev (malloc): the production I/O path end to end.

mod common;

use common::{have, run, start_bdev, stdout};
use ustor_nbd::server::{ExportCreateParams, ExportDeleteParams};

#[test]
fn malloc_export_serves_qemu_io_and_fio() {
    // The stats checked at the end count qemu-io's 1 MiB in-place write.
    if !have("qemu-io") {
        return;
    }
    let f = start_bdev(64 << 20, 512, 2);
    let uri = format!("nbd://127.0.0.1:{}/malloc", f.port);
    {
        run(
            "qemu-io",
            &[
                "-f",
                "raw",
                "-c",
                "write -P 0x3c 0 1M",
                "-c",
                "write -z 1M 1M",
                "-c",
                "flush",
                &uri,
            ],
        );
        let out = stdout(&run(
            "qemu-io",
            &[
                "-f",
                "raw",
                "-r",
                "-c",
                "read -P 0x3c 0 1M",
                "-c",
                "read -P 0 1M 1M",
                &uri,
            ],
        ));
        assert!(!out.contains("verification failed"), "{out}");
    }
    if have("fio") {
        for (iodepth, jobs) in [("1", "1"), ("32", "1"), ("8", "4")] {
            let out = stdout(&run(
                "fio",
                &[
                    "--name=verify",
                    "--ioengine=nbd",
                    &format!("--uri={uri}"),
                    "--rw=randwrite",
                    "--bs=4k",
                    "--size=8m",
                    &format!("--iodepth={iodepth}"),
                    &format!("--numjobs={jobs}"),
                    "--offset_increment=8m",
                    "--verify=crc32c",
                    "--verify_fatal=1",
                    "--verify_state_save=0",
                    "--group_reporting",
                ],
            ));
            assert!(out.contains("err= 0"), "{out}");
        }
    }
    let stats = f.server.get_stats().expect("stats");
    // Small write payloads (fio's 4 KiB) come through the staging buffer
    // and are copied once each; qemu-io's 1 MiB write lands in place.
    assert!(stats.payload_copies <= stats.writes, "{stats:?}");
    assert!(
        stats.payload_copied_bytes + (512 << 10) <= stats.bytes_written,
        "{stats:?}"
    );
    assert_eq!(stats.io_errors, 0);
}

#[test]
fn export_lifecycle_and_claims() {
    let f = start_bdev(8 << 20, 4096, 1);
    let exports = f.server.get_exports();
    assert_eq!(exports.len(), 1);
    assert_eq!(
        (exports[0].size_bytes, exports[0].block_size),
        (8 << 20, 4096)
    );
    let json = serde_json::to_value(&exports).unwrap();
    assert_eq!(json[0]["bdev_name"], "Malloc0");
    // Targets share claims: a second export of the same bdev is allowed
    // (as NBD and NVMe-oF may both export one bdev), and either claim keeps
    // the bdev from being deleted.
    let p = ExportCreateParams {
        name: "again".into(),
        bdev_name: "Malloc0".into(),
        read_only: true,
        description: String::new(),
    };
    assert!(f.server.export_create(&f.registry, &p).is_ok());
    f.server
        .export_delete(&ExportDeleteParams {
            name: "again".into(),
        })
        .unwrap();
    assert!(
        f.registry.delete("Malloc0").is_err(),
        "claimed bdev must not be deletable"
    );
    f.server
        .export_delete(&ExportDeleteParams {
            name: "malloc".into(),
        })
        .unwrap();
    assert!(f.server.get_exports().is_empty());
    // Claim released with the export: it can be exported again, read-only.
    f.server.export_create(&f.registry, &p).unwrap();
    if have("nbdinfo") {
        let out = stdout(&run(
            "nbdinfo",
            &[&format!("nbd://127.0.0.1:{}/again", f.port)],
        ));
        assert!(out.contains("is_read_only: true"), "{out}");
        assert!(out.contains("block_size_minimum: 4096"), "{out}");
    }
}

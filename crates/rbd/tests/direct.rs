//! The direct data path (`rbd_direct`: objects read and written with
//! librados, no librbd) against a real one-node Ceph cluster (one mon, one
//! memstore OSD) that this test starts with `scripts/ceph-cluster.sh` and
//! stops at exit:
//! - the same writes (scatter-gather, across object boundaries),
//!   write-zeroes and whole-object discards through a direct bdev and a
//!   librbd bdev (`rbd_direct: false`) on twin images leave both images
//!   equal to the model, read back through each bdev and with `rbd export`;
//! - an image written by `rbd import` (holes, a short last object) reads
//!   back through the direct path with its holes as zeros;
//! - images the direct path must not touch (default features: exclusive
//!   lock, object map) run on librbd, and a snapshot taken while the image
//!   is open turns the direct path off before the next write, so the
//!   snapshot keeps its data;
//! - a deleted pool's ENOENT fails direct I/O (it is not a hole).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use ustor_bdev::Registry;
use ustor_rbd::{ClusterOpts, RbdModule, RbdOpts};
use ustor_runtime::{IoBuf, PollMode, Runtime, RuntimeConfig};

use common::{rbd, start_cluster};

/// 64 KiB objects, 8 of them: small requests cross object boundaries.
const OBJ: usize = 64 << 10;
const SIZE: usize = 8 * OBJ;
const BS: u64 = 512;

/// `rbd export` of `spec` (`pool/image[@snap]`), read into memory.
fn export(conf: &str, dir: &Path, spec: &str) -> Vec<u8> {
    let f = dir.join(spec.replace(['/', '@'], "_"));
    let _ = std::fs::remove_file(&f);
    rbd(conf, &["export", spec, f.to_str().unwrap()]);
    std::fs::read(&f).unwrap()
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(2654435761).rotate_left(seed as u32) as u8 ^ seed)
        .collect()
}

struct Fixture {
    conf: String,
    dir: PathBuf,
    rt: Runtime,
    reg: Arc<Registry>,
    m: Arc<RbdModule>,
}

/// The cluster, runtime and rbd module; `None` (skip, or a panic under
/// CI=true) without Ceph's programs.
fn fixture() -> Option<Fixture> {
    let (dir, conf) = start_cluster("direct")?;
    let rt = Runtime::start(RuntimeConfig {
        cores: vec![0],
        pin: false,
        poll_mode: PollMode::Adaptive,
        bufs: ustor_runtime::BufPoolConfig {
            mem_bytes: 16 << 20,
            classes: vec![4096, 65536, 1 << 20],
        },
        ..Default::default()
    })
    .unwrap();
    let reg: Arc<Registry> = Registry::new(Some(rt.handle()));
    let m = ustor_rbd::register(&reg, Some(rt.handle())).unwrap();
    m.clusters
        .register(ClusterOpts {
            name: "c1".into(),
            config_file: Some(conf.clone()),
            ..Default::default()
        })
        .unwrap();
    Some(Fixture {
        conf,
        dir,
        rt,
        reg,
        m,
    })
}

impl Fixture {
    fn bdev(&self, name: &str, image: &str, direct: bool) -> String {
        let o: RbdOpts = serde_json::from_value(json!({"name": name, "pool_name": "rbd",
            "rbd_name": image, "block_size": BS, "cluster_name": "c1", "rbd_direct": direct}))
        .unwrap();
        self.m.create_bdev(&self.reg, o).unwrap();
        name.into()
    }

    fn data_path(&self, bdev: &str) -> String {
        let e = self.reg.get(bdev).unwrap();
        e.bdev().driver_info()["rbd"]["data_path"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// Runs `ops` on `bdev`'s channel (on the reactor) and returns its
    /// whole content read back with a two-segment read.
    fn run(&self, bdev: &str, ops: Vec<Op>) -> Vec<u8> {
        let desc = self.reg.open(bdev, true, |_| {}).unwrap();
        self.rt
            .handle()
            .block_on(0, move || async move {
                let ch = desc.channel().unwrap();
                for op in ops {
                    op.run(&ch).await;
                }
                ch.flush(0, (SIZE as u64) / BS).await.unwrap();
                let cut = 5 * OBJ - 4096;
                // Not zeros: a hole must be written as zeros, not skipped.
                let junk = |n| {
                    let mut b = IoBuf::heap(n);
                    b.fill(0xa5);
                    b
                };
                let bufs = vec![junk(cut), junk(SIZE - cut)];
                let (r, bufs) = ch.readv(0, SIZE as u64 / BS, bufs).await;
                r.unwrap();
                bufs.iter().flat_map(|b| b.to_vec()).collect()
            })
            .unwrap()
    }
}

/// One I/O of the scenario, at a byte offset.
#[derive(Clone)]
enum Op {
    /// Scatter-gather write: one buffer per part.
    Write(usize, Vec<Vec<u8>>),
    Zeroes(usize, usize),
    Discard(usize, usize),
}

impl Op {
    async fn run(self, ch: &ustor_bdev::IoChannel) {
        let blk = |b: usize| b as u64 / BS;
        match self {
            Op::Write(at, parts) => {
                let n: usize = parts.iter().map(Vec::len).sum();
                let bufs = parts
                    .iter()
                    .map(|p| {
                        let mut b = IoBuf::heap(p.len());
                        b.copy_from_slice(p);
                        b
                    })
                    .collect();
                ch.writev(blk(at), blk(n), bufs).await.0.unwrap();
            }
            Op::Zeroes(at, n) => ch.write_zeroes(blk(at), blk(n)).await.unwrap(),
            Op::Discard(at, n) => ch.unmap(blk(at), blk(n)).await.unwrap(),
        }
    }

    fn apply(&self, model: &mut [u8]) {
        match self {
            Op::Write(at, parts) => {
                let data: Vec<u8> = parts.concat();
                model[*at..*at + data.len()].copy_from_slice(&data);
            }
            Op::Zeroes(at, n) | Op::Discard(at, n) => model[*at..*at + n].fill(0),
        }
    }
}

/// One cluster for the binary: both parts in one test.
#[test]
fn direct_path_against_librbd_rbd_export_and_rbd_import() {
    let Some(f) = fixture() else { return };
    direct_and_librbd_paths_write_the_same_image(&f);
    direct_path_reads_what_rbd_import_wrote_with_holes_as_zeros(&f);
    a_deleted_pool_fails_direct_io(&f);
}

/// ENOENT from a deleted pool is an error, not a hole: a read of a written
/// and of a never-written object and a write all fail, within the op
/// timeout, and the bdev says `pool deleted`.
fn a_deleted_pool_fails_direct_io(f: &Fixture) {
    let c = &f.conf;
    let ceph = |args: &[&str]| {
        let out = Command::new("timeout")
            .args(["30", "ceph", "-c", c])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "ceph {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    ceph(&["osd", "pool", "create", "gone", "8"]);
    rbd(c, &["pool", "init", "gone"]);
    rbd(
        c,
        &[
            "create",
            "--size",
            "512K",
            "--object-size",
            "64K",
            "--image-feature",
            "layering",
            "gone/g",
        ],
    );
    let o: RbdOpts = serde_json::from_value(json!({"name": "g", "pool_name": "gone",
        "rbd_name": "g", "block_size": BS, "cluster_name": "c1"}))
    .unwrap();
    f.m.create_bdev(&f.reg, o).unwrap();
    assert_eq!(f.data_path("g"), "direct");
    f.run("g", vec![Op::Write(0, vec![pattern(11, 4096)])]);
    ceph(&[
        "osd",
        "pool",
        "delete",
        "gone",
        "gone",
        "--yes-i-really-really-mean-it",
    ]);
    let desc = f.reg.open("g", true, |_| {}).unwrap();
    let t = std::time::Instant::now();
    let errs =
        f.rt.handle()
            .block_on(0, move || async move {
                let ch = desc.channel().unwrap();
                let (r0, _) = ch.read(0, 8, IoBuf::heap(4096)).await;
                let (r1, _) = ch.read(4 * OBJ as u64 / BS, 8, IoBuf::heap(4096)).await;
                let (r2, _) = ch.write(0, 8, IoBuf::heap(4096)).await;
                [r0.is_err(), r1.is_err(), r2.is_err()]
            })
            .unwrap();
    assert_eq!(
        errs, [true; 3],
        "read written, read hole, write after the pool went"
    );
    // op_timeout_s is 30 s (ustor's default); a deleted pool
    // answers at once.
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    let e = f.reg.get("g").unwrap();
    assert_eq!(
        e.bdev().driver_info()["rbd"]["health"]["state"],
        "pool deleted"
    );
}

fn direct_and_librbd_paths_write_the_same_image(f: &Fixture) {
    let c = &f.conf;
    for img in ["d", "l"] {
        let spec = format!("rbd/{img}");
        rbd(
            c,
            &[
                "create",
                "--size",
                "512K",
                "--object-size",
                "64K",
                "--image-feature",
                "layering",
                &spec,
            ],
        );
    }
    rbd(c, &["create", "--size", "512K", "rbd/full"]);
    let (d, l) = (f.bdev("rd", "d", true), f.bdev("rl", "l", false));
    assert_eq!(f.data_path(&d), "direct");
    assert_eq!(f.data_path(&l), "librbd");
    // Default features (exclusive-lock, object-map, fast-diff): librbd.
    let full = f.bdev("rf", "full", true);
    assert_eq!(f.data_path(&full), "librbd");
    // A read-only bdev (rados would take writes librbd refuses), and one
    // with librbd's cache (compare-and-write would go through it): librbd.
    f.m.clusters
        .register(ClusterOpts {
            name: "cached".into(),
            config_file: Some(c.clone()),
            config_param: Some([("rbd_cache".to_string(), "true".to_string())].into()),
            ..Default::default()
        })
        .unwrap();
    for (name, cluster, ro) in [("ro", "c1", true), ("cached", "cached", false)] {
        let o = json!({"name": name, "pool_name": "rbd", "rbd_name": "d", "block_size": BS,
            "cluster_name": cluster, "read_only": ro});
        f.m.create_bdev(&f.reg, serde_json::from_value(o).unwrap())
            .unwrap();
        assert_eq!(f.data_path(name), "librbd", "{name}");
        f.reg.delete(name).unwrap();
    }

    let ops = vec![
        // Three segments, the middle one across the first object boundary.
        Op::Write(
            OBJ - 8192,
            vec![pattern(1, 4096), pattern(2, 8192), pattern(3, 4096)],
        ),
        // Across two boundaries, one segment.
        Op::Write(2 * OBJ - 4096, vec![pattern(4, OBJ + 8192)]),
        Op::Write(7 * OBJ, vec![pattern(5, OBJ)]),
        // Partial object, a whole one, a partial one.
        Op::Zeroes(OBJ + 4096, 2 * OBJ),
        // A whole object (removed: reads as zeros on either path).
        Op::Discard(7 * OBJ, OBJ),
        Op::Write(7 * OBJ + 512, vec![pattern(6, 1024)]),
    ];
    let mut model = vec![0u8; SIZE];
    ops.iter().for_each(|o| o.apply(&mut model));
    let via_direct = f.run(&d, ops.clone());
    let via_librbd = f.run(&l, ops);
    assert!(via_direct == model, "direct path reads back the model");
    assert!(via_librbd == model, "librbd path reads back the model");
    assert!(
        export(c, &f.dir, "rbd/d") == model,
        "rbd export of the direct path's image"
    );
    assert!(
        export(c, &f.dir, "rbd/l") == model,
        "rbd export of the librbd path's image"
    );
}

fn direct_path_reads_what_rbd_import_wrote_with_holes_as_zeros(f: &Fixture) {
    let c = &f.conf;
    // Data in object 0 and 2 (object 2 shorter than an object: the
    // image's last 3 KiB are not written by a sparse import), object 1
    // and most of 3.. holes.
    let mut src = vec![0u8; SIZE];
    src[..OBJ].copy_from_slice(&pattern(7, OBJ));
    src[2 * OBJ + 4096..2 * OBJ + 12288].copy_from_slice(&pattern(8, 8192));
    src[SIZE - 8192..SIZE - 3072].copy_from_slice(&pattern(9, 5120));
    let file = f.dir.join("import.img");
    std::fs::write(&file, &src).unwrap();
    let file = file.to_str().unwrap();
    rbd(
        c,
        &[
            "import",
            "--object-size",
            "64K",
            "--image-feature",
            "layering",
            file,
            "rbd/imp",
        ],
    );
    let i = f.bdev("ri", "imp", true);
    assert_eq!(f.data_path(&i), "direct");
    assert!(
        f.run(&i, vec![]) == src,
        "the imported image through the direct path"
    );

    // A snapshot taken while the image is open: the header watch turns the
    // direct path off, and the next write goes through librbd, which
    // preserves the snapshot's data.
    rbd(c, &["snap", "create", "rbd/imp@one"]);
    testkit::wait_until(
        "the direct path is off after a snapshot",
        Duration::from_secs(30),
        || f.data_path(&i) == "librbd",
    );
    let after = f.run(&i, vec![Op::Write(0, vec![pattern(10, OBJ)])]);
    assert!(after[..OBJ] == pattern(10, OBJ)[..]);
    assert!(
        export(c, &f.dir, "rbd/imp@one") == src,
        "the snapshot keeps the imported data"
    );
    assert!(
        export(c, &f.dir, "rbd/imp") == after,
        "the image has the write"
    );
}

//! The generic I/O path against a reference model: random reads and writes
//! with random segment layouts through malloc (split on max transfer size and
//! optimal boundary) and a uring O_DIRECT file (bounce of misaligned
//! segments) must read back exactly what a flat byte array says.

mod common;

use std::sync::Arc;

use common::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use ustor_bdev::modules::{malloc, uring, RamOpts};
use ustor_runtime::IoBuf;

#[derive(Clone, Debug)]
struct Op {
    write: bool,
    lba: u64,
    blocks: u64,
    /// Segment cut points as fractions of the I/O length (bytes).
    cuts: Vec<u16>,
    seed: u8,
}

fn op(max_blocks: u64) -> impl Strategy<Value = Op> {
    (
        any::<bool>(),
        0..256u64,
        1..=max_blocks,
        proptest::collection::vec(1u16..1000, 0..4),
        any::<u8>(),
    )
        .prop_map(|(write, lba, blocks, cuts, seed)| Op {
            write,
            lba,
            blocks,
            cuts,
            seed,
        })
}

/// Segment lengths summing to `len`, cut at the given per-mille points.
fn segments(len: usize, cuts: &[u16]) -> Vec<usize> {
    let mut pts: Vec<usize> = cuts
        .iter()
        .map(|c| len * *c as usize / 1000)
        .filter(|p| *p > 0 && *p < len)
        .collect();
    pts.sort_unstable();
    pts.dedup();
    let mut out = Vec::new();
    let mut prev = 0;
    for p in pts.into_iter().chain(std::iter::once(len)) {
        out.push(p - prev);
        prev = p;
    }
    out
}

fn run_model(
    name: &'static str,
    rt: &ustor_runtime::Runtime,
    reg: &Arc<ustor_bdev::Registry>,
    cases: u32,
) {
    let desc = Arc::new(reg.open(name, true, |_| {}).unwrap());
    let info = desc.info().clone();
    let bs = info.block_size as usize;
    let size = (info.num_blocks as usize).min(272) * bs;
    let model = Arc::new(std::sync::Mutex::new(vec![0u8; size]));
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let max_blocks = (info.num_blocks.min(272) - 256).max(1);
    let h = rt.handle();
    runner
        .run(
            &proptest::collection::vec(op(max_blocks.min(16)), 1..12),
            |ops| {
                for o in ops {
                    let segs = segments(o.blocks as usize * bs, &o.cuts);
                    let off = o.lba as usize * bs;
                    let len = o.blocks as usize * bs;
                    let desc = desc.clone();
                    let data: Vec<u8> = (0..len)
                        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(o.seed))
                        .collect();
                    let segs2 = segs.clone();
                    let wdata = data.clone();
                    let got = h
                        .block_on(0, move || async move {
                            let ch = desc.channel().unwrap();
                            let mut bufs: Vec<IoBuf> =
                                segs2.iter().map(|l| IoBuf::heap(*l)).collect();
                            if o.write {
                                let mut p = 0;
                                for b in bufs.iter_mut() {
                                    let n = b.len();
                                    b.copy_from_slice(&wdata[p..p + n]);
                                    p += n;
                                }
                                let (r, _) = ch.writev(o.lba, o.blocks, bufs).await;
                                r.map(|_| Vec::new())
                            } else {
                                let (r, bufs) = ch.readv(o.lba, o.blocks, bufs).await;
                                r.map(|_| {
                                    bufs.iter()
                                        .flat_map(|b| b.iter().copied())
                                        .collect::<Vec<u8>>()
                                })
                            }
                        })
                        .unwrap();
                    let got =
                        got.map_err(|e| TestCaseError::fail(format!("{name}: {o:?}: {e}")))?;
                    let mut m = model.lock().unwrap();
                    if o.write {
                        m[off..off + len].copy_from_slice(&data);
                    } else {
                        prop_assert!(
                            got[..] == m[off..off + len],
                            "{}: read {:?} segs {:?} differs from the model",
                            name,
                            o,
                            segs
                        );
                    }
                }
                Ok(())
            },
        )
        .unwrap();
}

#[test]
fn split_and_bounce_match_a_flat_model() {
    let rt = runtime(1);
    let reg = registry(&rt);
    let mut m = RamOpts {
        name: "split".into(),
        num_blocks: 512,
        block_size: 512,
        uuid: None,
        optimal_io_boundary: 8,
        max_transfer_blocks: 3,
    };
    malloc::create(&reg, m.clone()).unwrap();
    m.name = "plain".into();
    m.optimal_io_boundary = 0;
    m.max_transfer_blocks = 0;
    malloc::create(&reg, m).unwrap();
    let path = temp_file("model", 272 * 4096);
    uring::create(
        &reg,
        uring::UringOpts {
            name: "direct".into(),
            filename: path.to_string_lossy().into(),
            block_size: 0,
            uuid: None,
            direct: true,
            sqpoll: false,
            iopoll: false,
        },
    )
    .unwrap();
    run_model("split", &rt, &reg, 48);
    run_model("plain", &rt, &reg, 24);
    run_model("direct", &rt, &reg, 24);
    let st = reg.iostat("split").unwrap();
    assert!(st.split_ops > 0, "no I/O was split");
    let st = reg.iostat("direct").unwrap();
    assert!(st.bounce_ops > 0, "no I/O was bounced");
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

//! Compare-and-write in the generic layer, on a RAM test driver that does
//! it natively (atomically, under its one lock): a match writes the new
//! data; a miscompare reports the first differing byte and writes nothing;
//! the checks (length, read-only, range, the device's limit, no split)
//! fail before the driver sees anything; a bdev without native support
//! (malloc) says `NotSupported` and offers no size for it.

mod common;

use common::*;
use ustor_bdev::modules::{malloc, RamOpts};
use ustor_bdev::{BdevError, IoFlags, IoType};
use ustor_runtime::IoBuf;

const BS: usize = 512;

async fn filled(blocks: usize, lba: u64, seed: u64) -> IoBuf {
    let mut b = IoBuf::alloc(blocks * BS).await;
    pattern(&mut b, lba, seed);
    b
}

fn kinds(ops: &Ops) -> Vec<IoType> {
    std::mem::take(&mut *ops.lock().unwrap())
        .into_iter()
        .map(|o| o.0)
        .collect()
}

#[test]
fn compare_and_write_writes_on_match_and_reports_the_first_difference() {
    let rt = runtime(1);
    let reg = registry(&rt);
    // Max transfer 4 blocks: a longer compare-and-write must not split.
    let ops = TraceBdev::create(&reg, "t0", 256, false, 4);
    let desc = reg.open("t0", true, |_| {}).unwrap();
    let ro = reg.open("t0", false, |_| {}).unwrap();
    rt.handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            assert!(ch.supports(IoType::CompareAndWrite));
            assert_eq!(ch.max_compare_and_write_blocks(), u64::MAX);
            let old = filled(2, 10, 1).await;
            let (r, old) = ch.write(10, 2, old).await;
            r.unwrap();
            kinds(&ops);

            // A match: the new data is on the medium.
            let new = filled(2, 10, 2).await;
            let want_new = new.to_vec();
            let (r, old, new) = ch.compare_and_write(10, 2, old, new, IoFlags::NONE).await;
            r.unwrap();
            assert_eq!(kinds(&ops), [IoType::CompareAndWrite]);
            let (r, back) = ch.read(10, 2, IoBuf::alloc(2 * BS).await).await;
            r.unwrap();
            assert_eq!(&back[..], &want_new[..]);

            // The medium holds `new`; a compare buffer that first differs
            // from it at byte 700 miscompares there and writes nothing.
            let _ = old;
            let mut cmp = new;
            cmp[700] ^= 0xff;
            cmp[900] ^= 0xff;
            let (r, _, _) = ch
                .compare_and_write(10, 2, cmp, filled(2, 10, 3).await, IoFlags::NONE)
                .await;
            assert_eq!(r, Err(BdevError::Miscompare { offset: Some(700) }));
            let (r, back) = ch.read(10, 2, back).await;
            r.unwrap();
            assert_eq!(&back[..], &want_new[..], "a miscompare wrote");
            kinds(&ops);

            // Checks before the driver: lengths, range, no split.
            let (r, _, _) = ch
                .compare_and_write(
                    10,
                    2,
                    filled(1, 0, 0).await,
                    filled(2, 0, 0).await,
                    IoFlags::NONE,
                )
                .await;
            assert_eq!(
                r,
                Err(BdevError::BadLength {
                    got: 3 * BS as u64,
                    want: 4 * BS as u64
                })
            );
            let (r, _, _) = ch
                .compare_and_write(
                    255,
                    2,
                    filled(2, 0, 0).await,
                    filled(2, 0, 0).await,
                    IoFlags::NONE,
                )
                .await;
            assert!(matches!(r, Err(BdevError::OutOfRange { .. })), "{r:?}");
            // 8 blocks over a 4-block max transfer: never split.
            let (r, _, _) = ch
                .compare_and_write(
                    0,
                    8,
                    filled(8, 0, 0).await,
                    filled(8, 0, 0).await,
                    IoFlags::NONE,
                )
                .await;
            assert_eq!(r, Err(BdevError::Io(libc::EINVAL)));
            assert_eq!(kinds(&ops), [], "refused I/O reached the driver");

            // Read-only descriptor.
            let ch = ro.channel().unwrap();
            let (r, _, _) = ch
                .compare_and_write(
                    10,
                    1,
                    filled(1, 0, 0).await,
                    filled(1, 0, 0).await,
                    IoFlags::NONE,
                )
                .await;
            assert_eq!(r, Err(BdevError::ReadOnly));
            assert_eq!(kinds(&ops), []);
        })
        .unwrap();
}

#[test]
fn malloc_has_no_native_compare_and_write() {
    let rt = runtime(1);
    let reg = registry(&rt);
    let o = RamOpts {
        name: "m0".into(),
        num_blocks: 64,
        block_size: BS as u32,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    };
    malloc::create(&reg, o).unwrap();
    let desc = reg.open("m0", true, |_| {}).unwrap();
    rt.handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            assert!(!ch.supports(IoType::CompareAndWrite));
            assert_eq!(ch.max_compare_and_write_blocks(), 0);
            let (r, _, _) = ch
                .compare_and_write(
                    0,
                    1,
                    filled(1, 0, 0).await,
                    filled(1, 0, 0).await,
                    IoFlags::NONE,
                )
                .await;
            assert_eq!(r, Err(BdevError::NotSupported));
        })
        .unwrap();
}

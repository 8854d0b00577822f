//! The target core's data path allocates nothing: WRITE and READ commands
//! (4 KiB and 64 KiB, some with FUA) through `LunTable::execute` over a
//! malloc bdev on a reactor, data moved through caller-owned iovecs and
//! checked, under a counting global allocator with zero allocations (on
//! any thread) once warmed up.

use ustor_bdev::modules::{malloc, RamOpts};
use ustor_bdev::Registry;
use ustor_runtime::{IoBuf, PollMode, Runtime, RuntimeConfig};
use ustor_scsi_proto::cdb::Cdb;
use ustor_scsi_target::{Direction, IovecData, LuConfig, Lun, LunTable, Outcome};

#[global_allocator]
static ALLOC: testkit::CountingAlloc = testkit::CountingAlloc::new();

const BS: u32 = 512;

fn fill(b: &mut [u8], seed: u64) {
    for (i, c) in b.chunks_mut(8).enumerate() {
        let v = (seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64).to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
}

/// One command over `buf` as its only iovec.
async fn run(t: &LunTable, cdb: Cdb, dir: Direction, buf: &mut IoBuf) -> Outcome {
    let iov = [libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }];
    // SAFETY: `buf` outlives the command and nothing else touches it.
    let mut d = unsafe { IovecData::new(dir, &iov) };
    t.execute(0, cdb.as_bytes(), &mut d)
        .await
        .expect("no transport error")
}

/// `rounds` of write, read back, compare, at 4 KiB and 64 KiB.
async fn rounds(t: &LunTable, w: &mut IoBuf, r: &mut IoBuf, n: u64) -> Result<(), String> {
    for round in 0..n {
        let len = if round % 2 == 0 { 4096 } else { 65536 };
        let blocks = (len / BS as usize) as u16;
        let lba = (round * 128) % 8000;
        w.set_len(len);
        r.set_len(len);
        fill(w, round);
        let fua = round % 3 == 0;
        let o = run(
            t,
            Cdb::write_10(lba as u32, blocks, fua),
            Direction::ToDevice,
            w,
        )
        .await;
        let o2 = run(
            t,
            Cdb::read_10(lba as u32, blocks, false),
            Direction::FromDevice,
            r,
        )
        .await;
        if o != Outcome::good(0) || o2 != Outcome::good(0) || w[..] != r[..] {
            return Err(format!("round {round}: {o:?} {o2:?} or data differs"));
        }
    }
    Ok(())
}

#[test]
fn read_write_through_the_core_allocate_nothing() {
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
    .expect("runtime");
    let reg = Registry::new(Some(rt.handle()));
    let opts = RamOpts {
        name: "core-alloc".into(),
        num_blocks: 8192,
        block_size: BS,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    };
    malloc::create(&reg, opts).unwrap();
    let desc = reg.open("core-alloc", true, |_| {}).unwrap();
    let res = rt
        .handle()
        .block_on(0, move || async move {
            let lu = Lun::open(LuConfig::disk("ALLOC", 0, true), &desc).unwrap();
            let t = LunTable::from_luns([(0, lu)]);
            let mut w = IoBuf::alloc(65536).await;
            let mut r = IoBuf::alloc(65536).await;
            rounds(&t, &mut w, &mut r, 100).await?;
            ALLOC.set_window(true);
            let res = rounds(&t, &mut w, &mut r, 10_000).await;
            ALLOC.set_window(false);
            res
        })
        .unwrap();
    res.unwrap();
    assert_eq!(ALLOC.allocations(), 0, "the core allocated per command");
}

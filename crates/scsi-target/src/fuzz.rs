//! The body of the target core's CDB fuzz target, shared with a proptest:
//! an arbitrary CDB with arbitrary data-out runs against a small malloc
//! bdev; the core must answer with a status and never panic. It runs the
//! command's future to completion on the calling thread (malloc I/O never
//! waits).

use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Wake, Waker};

use ustor_bdev::modules::{malloc, RamOpts};
use ustor_bdev::{Desc, Registry};

use crate::{BufData, Direction, LuConfig, Lun, LunTable, Outcome};

struct Noop;
impl Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

fn run<F: Future>(f: F) -> Option<F::Output> {
    let w = Waker::from(Arc::new(Noop));
    let mut cx = Context::from_waker(&w);
    let mut f = pin!(f);
    (0..1000).find_map(|_| match f.as_mut().poll(&mut cx) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    })
}

fn desc() -> &'static Desc {
    static D: OnceLock<(Arc<Registry>, Desc)> = OnceLock::new();
    let (_, d) = D.get_or_init(|| {
        let reg = Registry::new(None);
        let opts = RamOpts {
            name: "scsi-target-fuzz".into(),
            num_blocks: 64,
            block_size: 512,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        };
        malloc::create(&reg, opts).expect("malloc bdev");
        let d = reg.open("scsi-target-fuzz", true, |_| {}).expect("open");
        (reg, d)
    });
    d
}

/// Executes `data` split as [dir byte, expected length byte, CDB (16), data-out...].
pub fn cdb(data: &[u8]) -> Option<Outcome> {
    let (head, rest) = data.split_at(data.len().min(2));
    let (cdb, out) = rest.split_at(rest.len().min(16));
    let dir = match head.first().copied().unwrap_or(0) % 3 {
        0 => Direction::None,
        1 => Direction::ToDevice,
        _ => Direction::FromDevice,
    };
    let expected = head.get(1).copied().unwrap_or(0) as u32 * 512;
    let mut d = BufData {
        dir,
        expected,
        out: out.to_vec(),
        input: Vec::new(),
    };
    let mut t = LunTable::new();
    let lu = Lun::open(LuConfig::disk("FUZZ", 1, true), desc()).ok()?;
    t.add(0, lu).ok()?;
    let o = run(t.execute(0, cdb, &mut d))?.ok()?;
    assert!(
        d.input.len() <= expected as usize,
        "data-in beyond the expected length"
    );
    Some(o)
}

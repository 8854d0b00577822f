//! Crash consistency: a media that keeps only what was persisted (a power
//! cut, the strictest case; a SIGKILL keeps more) stops persisting at a
//! random point of a random workload. Reopening what was persisted must give
//! a region the checker finds clean, holding every completed operation, and
//! the operation in flight either wholly or not at all (a write in flight
//! may be partly there, within its range).

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use ustor_fs::{check, Fs, FsError, Media, SetAttr, BLOCK_SIZE, ROOT_INO};

struct CrashMedia {
    live: Vec<u8>,
    durable: Arc<Mutex<Vec<u8>>>,
    budget: Arc<Mutex<usize>>,
}

impl Media for CrashMedia {
    fn bytes(&self) -> &[u8] {
        &self.live
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.live
    }
    fn persist(&self, off: usize, len: usize) -> io::Result<()> {
        let mut b = self.budget.lock().unwrap();
        if *b == 0 {
            return Err(io::Error::other("power cut"));
        }
        *b -= 1;
        self.durable.lock().unwrap()[off..off + len].copy_from_slice(&self.live[off..off + len]);
        Ok(())
    }
}

#[derive(Debug, Clone)]
enum Op {
    Create(u8),
    Write(u8, u32, u32, u8),
    Truncate(u8, u32),
    Unlink(u8),
    Rename(u8, u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..4).prop_map(Op::Create),
        (0u8..4, 0u32..200_000, 1u32..100_000, any::<u8>())
            .prop_map(|(a, b, c, d)| Op::Write(a, b, c, d)),
        (0u8..4, 0u32..150_000).prop_map(|(a, b)| Op::Truncate(a, b)),
        (0u8..4).prop_map(Op::Unlink),
        (0u8..4, 0u8..4).prop_map(|(a, b)| Op::Rename(a, b)),
    ]
}

type Model = BTreeMap<String, Vec<u8>>;

fn name(k: u8) -> String {
    format!("f{k}")
}

fn data(seed: u8, n: u32) -> Vec<u8> {
    (0..n).map(|k| (k as u8).wrapping_mul(7) ^ seed).collect()
}

fn model_apply(m: &mut Model, op: &Op) {
    match *op {
        Op::Create(k) => {
            m.entry(name(k)).or_default();
        }
        Op::Write(k, off, len, seed) => {
            if let Some(v) = m.get_mut(&name(k)) {
                let end = (off + len) as usize;
                if v.len() < end {
                    v.resize(end, 0);
                }
                v[off as usize..end].copy_from_slice(&data(seed, len));
            }
        }
        Op::Truncate(k, size) => {
            if let Some(v) = m.get_mut(&name(k)) {
                v.resize(size as usize, 0);
            }
        }
        Op::Unlink(k) => {
            m.remove(&name(k));
        }
        Op::Rename(a, b) => {
            if a != b {
                if let Some(v) = m.remove(&name(a)) {
                    m.insert(name(b), v);
                }
            }
        }
    }
}

fn fs_apply(fs: &mut Fs, op: &Op) -> Result<(), FsError> {
    let ino = |fs: &Fs, k: u8| fs.lookup(ROOT_INO, name(k).as_bytes()).map(|a| a.ino);
    let r = match *op {
        Op::Create(k) => fs
            .create(ROOT_INO, name(k).as_bytes(), 0o644, 0, 0)
            .map(|_| ()),
        Op::Write(k, off, len, seed) => {
            ino(fs, k).and_then(|i| fs.write(i, off as u64, &data(seed, len)))
        }
        Op::Truncate(k, size) => ino(fs, k).and_then(|i| {
            fs.setattr(
                i,
                SetAttr {
                    size: Some(size as u64),
                    ..Default::default()
                },
            )
            .map(|_| ())
        }),
        Op::Unlink(k) => fs.unlink(ROOT_INO, name(k).as_bytes()),
        Op::Rename(a, b) => fs.rename(ROOT_INO, name(a).as_bytes(), ROOT_INO, name(b).as_bytes()),
    };
    match r {
        Err(FsError::NotFound | FsError::Exists) => Ok(()),
        r => r,
    }
}

fn contents(fs: &Fs) -> Model {
    let mut m = Model::new();
    for e in fs.readdir(ROOT_INO, 0, usize::MAX).unwrap() {
        let a = fs.getattr(e.ino).unwrap();
        let mut v = vec![0u8; a.size as usize];
        fs.read(e.ino, 0, &mut v).unwrap();
        m.insert(String::from_utf8(e.name).unwrap(), v);
    }
    m
}

/// A write in flight may have landed partly: outside its range the file
/// must equal its state before, and its size is the before or after size.
fn partial_write_ok(got: &Model, before: &Model, after: &Model, op: &Op) -> bool {
    let Op::Write(k, off, len, _) = *op else {
        return false;
    };
    let n = name(k);
    let (Some(g), Some(b), Some(a)) = (got.get(&n), before.get(&n), after.get(&n)) else {
        return false;
    };
    let (lo, hi) = (off as usize, (off + len) as usize);
    let outside_ok = (0..g.len())
        .filter(|&i| i < lo || i >= hi)
        .all(|i| g[i] == b.get(i).copied().unwrap_or(0));
    let mut rest_g = got.clone();
    let mut rest_b = before.clone();
    rest_g.remove(&n);
    rest_b.remove(&n);
    (g.len() == b.len() || g.len() == a.len()) && outside_ok && rest_g == rest_b
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn power_cut_at_any_persist_leaves_a_clean_region(ops in proptest::collection::vec(op(), 1..24), cut in 0usize..100) {
        let mut region = vec![0u8; 1024 * BLOCK_SIZE];
        ustor_fs::format(&mut region).unwrap();
        let durable = Arc::new(Mutex::new(region.clone()));
        let budget = Arc::new(Mutex::new(cut + 1));
        let media = CrashMedia { live: region, durable: durable.clone(), budget };
        let mut fs = Fs::open(Box::new(media)).unwrap();
        let mut model = Model::new();
        let mut inflight = None;
        for o in &ops {
            match fs_apply(&mut fs, o) {
                Ok(()) => model_apply(&mut model, o),
                Err(FsError::Io(_)) => {
                    inflight = Some(o.clone());
                    break;
                }
                Err(e) => panic!("{o:?}: {e}"),
            }
        }
        drop(fs);
        let image = durable.lock().unwrap().clone();
        let fs = Fs::open(Box::new(image)).unwrap();
        prop_assert!(check(fs.region()).is_ok(), "{:?}", check(fs.region()));
        let got = contents(&fs);
        match inflight {
            None => prop_assert_eq!(got, model),
            Some(o) => {
                let mut after = model.clone();
                model_apply(&mut after, &o);
                prop_assert!(got == model || got == after || partial_write_ok(&got, &model, &after, &o),
                    "in flight {:?}", o);
            }
        }
    }
}

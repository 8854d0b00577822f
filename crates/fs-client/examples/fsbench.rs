//! QD1 latency and throughput of the file service through the client
//! library (no kernel crossing), for bench/fs.sh's `ustor_lib` column: the
//! same loop as bench/lib/nfsbench.c runs over libnfs against nfs-ganesha.
//!
//!   fsbench HOST:PORT EXPORT FILE lay SIZE_MIB
//!   fsbench HOST:PORT EXPORT FILE OP BS_KIB SIZE_MIB SECONDS
//!   (OP: randread randwrite read write; the secret from USTOR_FS_SECRET)
//!
//! Prints "iops mean_us MiB/s p50_us p99_us", as nfsbench does.

use std::time::{Duration, Instant};

use ustor_fs_client::{Client, Config};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 6 {
        eprintln!("usage: see the comment at the top of fsbench.rs");
        std::process::exit(2);
    }
    let secret = std::env::var("USTOR_FS_SECRET").unwrap_or_default();
    let c = Client::connect(Config::new(&a[1], &a[2], secret.as_bytes())).expect("connect");
    let root = ustor_fs::ROOT_INO;
    let ino = match c.lookup(root, a[3].as_bytes()) {
        Ok(at) => at.ino,
        Err(_) => {
            c.create(root, a[3].as_bytes(), 0o644, 0, 0)
                .expect("create")
                .ino
        }
    };
    let op = a[4].as_str();
    if op == "lay" {
        let size = a[5].parse::<usize>().expect("SIZE_MIB") << 20;
        let buf = vec![0x5a; 1 << 20];
        for off in (0..size).step_by(1 << 20) {
            c.write(ino, off as u64, &buf).expect("write");
        }
        return;
    }
    let bs = a[5].parse::<usize>().expect("BS_KIB") << 10;
    let size = a[6].parse::<usize>().expect("SIZE_MIB") << 20;
    let secs = Duration::from_secs_f64(a[7].parse().expect("SECONDS"));
    let (wr, rnd) = (op.contains("write"), op.starts_with("rand"));
    let buf = vec![0x5a; bs];
    let blocks = (size / bs) as u64;
    // A small xorshift: the offsets need not match nfsbench's, only be
    // spread over the file.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut off = 0u64;
    let mut lat = Vec::with_capacity(1 << 20);
    let start = Instant::now();
    while start.elapsed() < secs {
        if rnd {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            off = (x % blocks) * bs as u64;
        }
        let t = Instant::now();
        if wr {
            c.write(ino, off, &buf).expect("write");
        } else {
            let d = c.read(ino, off, bs).expect("read");
            assert_eq!(d.len(), bs, "short read");
        }
        lat.push(t.elapsed().as_secs_f64());
        if !rnd {
            off = (off + bs as u64) % (blocks * bs as u64);
        }
    }
    let el = start.elapsed().as_secs_f64();
    let n = lat.len();
    let mean = lat.iter().sum::<f64>() / n as f64;
    lat.sort_by(f64::total_cmp);
    println!(
        "{:.0} {:.1} {:.1} {:.1} {:.1}",
        n as f64 / el,
        mean * 1e6,
        n as f64 * bs as f64 / el / 1048576.0,
        lat[n / 2] * 1e6,
        lat[n * 99 / 100] * 1e6
    );
}

//! QD1 4 KiB latency through the client library over TCP or raw Ethernet
//! (AF_XDP), for bench/fs-xdp.sh: the same loop on either transport.
//!
//!   fs_xdp_lat HOST:PORT|xdp://IFNAME[@MAC]/EXPORT EXPORT OP N
//!   (OP: read write; the secret from USTOR_FS_SECRET)
//!
//! Prints "p50_us p99_us mean_us".

use std::time::Instant;

use ustor_fs_client::xdp::{XdpClient, XdpConfig};
use ustor_fs_client::{Client, Config};

enum C {
    Tcp(Client),
    Xdp(Box<XdpClient>),
}

impl C {
    fn ino(&self, name: &[u8]) -> u64 {
        let root = ustor_fs::ROOT_INO;
        match self {
            C::Tcp(c) => c
                .lookup(root, name)
                .or_else(|_| c.create(root, name, 0o644, 0, 0)),
            C::Xdp(c) => c
                .lookup(root, name)
                .or_else(|_| c.create(root, name, 0o644, 0, 0)),
        }
        .expect("file")
        .ino
    }
    fn read(&self, ino: u64, off: u64, n: usize) -> usize {
        match self {
            C::Tcp(c) => c.read(ino, off, n),
            C::Xdp(c) => c.read(ino, off, n),
        }
        .expect("read")
        .len()
    }
    fn write(&self, ino: u64, off: u64, b: &[u8]) {
        match self {
            C::Tcp(c) => c.write(ino, off, b),
            C::Xdp(c) => c.write(ino, off, b),
        }
        .expect("write");
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 5 {
        eprintln!("usage: see the comment at the top of fs_xdp_lat.rs");
        std::process::exit(2);
    }
    let secret = std::env::var("USTOR_FS_SECRET").unwrap_or_default();
    let c = if a[1].starts_with("xdp://") {
        let cfg = XdpConfig::parse(&a[1], secret.as_bytes()).expect("xdp address");
        C::Xdp(Box::new(XdpClient::connect(cfg).expect("connect")))
    } else {
        C::Tcp(Client::connect(Config::new(&a[1], &a[2], secret.as_bytes())).expect("connect"))
    };
    let n: usize = a[4].parse().expect("N");
    let ino = c.ino(b"lat");
    let buf = vec![0x5a; 4096];
    // 64 blocks laid out first, so reads hit data.
    for i in 0..64u64 {
        c.write(ino, i * 4096, &buf);
    }
    let mut lat = Vec::with_capacity(n);
    for i in 0..n as u64 {
        let off = (i % 64) * 4096;
        let t = Instant::now();
        match a[3].as_str() {
            "read" => assert_eq!(c.read(ino, off, 4096), 4096),
            _ => c.write(ino, off, &buf),
        }
        lat.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    lat.sort_by(|x, y| x.total_cmp(y));
    let mean = lat.iter().sum::<f64>() / lat.len() as f64;
    let p = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
    println!("{:.1} {:.1} {:.1}", p(0.5), p(0.99), mean);
}

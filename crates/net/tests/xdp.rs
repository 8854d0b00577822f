//! AF_XDP plumbing between two network namespaces over a veth pair (copy
//! mode, the only one a veth has): frames of our EtherType cross into the
//! receiver's UMEM at the unaligned fill addresses it posted, byte for
//! byte; a frame of another EtherType passes to the kernel (an AF_PACKET
//! socket sees it, the AF_XDP socket does not); sent buffers complete.

use std::os::fd::AsRawFd;
use std::time::Duration;

use testkit::netns::{self, VethNs};
use testkit::{require, wait_for};
use ustor_net::xdp::{self, AttachMode, Desc, XdpProgram, XskConfig, XskSocket};

const ETHERTYPE: u16 = 0x88B5;
const OTHER: u16 = 0x88B6;
const T: Duration = Duration::from_secs(10);

fn frame(ethertype: u16, fill: u8, len: usize) -> Vec<u8> {
    let mut f = vec![0u8; len];
    f[..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    f[12..14].copy_from_slice(&ethertype.to_be_bytes());
    for (i, b) in f[14..].iter_mut().enumerate() {
        *b = fill.wrapping_add(i as u8);
    }
    f
}

/// An AF_PACKET socket on `ifindex` for one EtherType (non-blocking).
fn packet_socket(ifindex: u32, proto: u16) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket(2); the descriptor is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_NONBLOCK,
            (proto.to_be()) as i32,
        )
    };
    assert!(fd >= 0, "AF_PACKET: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is new and ours.
    let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // SAFETY: all-zero is a valid sockaddr_ll.
    let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sa.sll_family = libc::AF_PACKET as u16;
    sa.sll_protocol = proto.to_be();
    sa.sll_ifindex = ifindex as i32;
    // SAFETY: a valid sockaddr_ll with its size.
    let r = unsafe {
        libc::bind(
            fd,
            (&sa as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    assert_eq!(r, 0, "bind AF_PACKET: {}", std::io::Error::last_os_error());
    owned
}

#[test]
fn frames_land_at_unaligned_fill_addresses_and_other_ethertypes_pass() {
    require!(netns::check(), "iproute2 (run as root)");
    let ns = VethNs::create().expect("namespaces");
    let (if_a, if_b) = (ns.if_a.clone(), ns.if_b.clone());
    // Receiver in a: program, socket, and an AF_PACKET socket for OTHER.
    let (prog, mut rx, pkt) = VethNs::within(&ns.a, move || {
        let idx = xdp::ifindex(&if_a).expect("ifindex a");
        let prog = XdpProgram::attach(idx, ETHERTYPE, 1, AttachMode::Generic).expect("attach");
        let rx = XskSocket::new(XskConfig::new(idx, 0), 1 << 20).expect("xsk a");
        prog.register(0, rx.as_raw_fd()).expect("register");
        (prog, rx, packet_socket(idx, OTHER))
    });
    let mut tx = VethNs::within(&ns.b, move || {
        let idx = xdp::ifindex(&if_b).expect("ifindex b");
        XskSocket::new(XskConfig::new(idx, 0), 1 << 20).expect("xsk b")
    });
    // Fill addresses at odd offsets: unaligned-chunk mode takes any byte.
    let fills: Vec<u64> = (0..4).map(|i| 8192 + 100 + i * 5000).collect();
    assert_eq!(rx.fill(&fills), fills.len());

    let frames = [
        frame(ETHERTYPE, 1, 1500),
        frame(ETHERTYPE, 7, 60),
        frame(OTHER, 9, 200),
        frame(ETHERTYPE, 3, 1000),
    ];
    let mut descs = Vec::new();
    for (i, f) in frames.iter().enumerate() {
        let addr = i as u64 * 4096;
        tx.frame_mut(addr, f.len())
            .expect("tx frame")
            .copy_from_slice(f);
        descs.push(Desc {
            addr,
            len: f.len() as u32,
        });
    }
    assert_eq!(tx.send(&descs).expect("send"), 4);

    let mut got = Vec::new();
    wait_for("three frames on the AF_XDP socket", T, || {
        rx.recv(&mut got, 8);
        (got.len() >= 3).then_some(())
    });
    assert_eq!(got.len(), 3, "only our EtherType is redirected");
    let ours = [&frames[0], &frames[1], &frames[3]];
    for ((d, want), fill) in got.iter().zip(ours).zip(&fills) {
        assert_eq!(
            d.addr,
            fill + rx.landing_offset(),
            "frame lands after the headroom"
        );
        assert_eq!(d.len as usize, want.len());
        assert_eq!(rx.frame(d.addr, want.len()).expect("in umem"), &want[..]);
    }
    let mut buf = [0u8; 2048];
    let n = wait_for("the other EtherType on AF_PACKET", T, || {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::recv(pkt.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        (n > 0).then_some(n as usize)
    });
    assert_eq!(&buf[..n], &frames[2][..]);

    let mut done = Vec::new();
    wait_for("four tx completions", T, || {
        tx.completed(&mut done, 8);
        (done.len() >= 4).then_some(())
    });
    done.sort_unstable();
    assert_eq!(done, vec![0, 4096, 8192, 12288]);
    let st = rx.stats().expect("stats");
    assert_eq!(st.rx_dropped, 0);
    assert_eq!(st.rx_invalid_descs, 0);
    drop(prog);
}

//! The XDP program that steers one EtherType to AF_XDP sockets: an XSKMAP
//! (one slot per receive queue), fifteen BPF instructions loaded with
//! bpf(2), attached to an interface with `BPF_LINK_CREATE`. Frames of our
//! EtherType go to the socket registered for their receive queue; every
//! other frame (ARP, IP, ...) passes to the kernel's stack untouched.
//!
//! No crate on crates.io loads a program without either building libbpf
//! (C) or reading an ELF object made by a BPF toolchain, so the few
//! instructions are written here and loaded through a small FFI over libc.
//! Closing the link's fd detaches the program; closing the map's fd frees
//! the map once the program is gone.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use super::XdpError;

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_MAP_TYPE_XSKMAP: u32 = 17;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_XDP: u32 = 37;
/// `XDP_FLAGS_SKB_MODE` and `XDP_FLAGS_DRV_MODE` (linux/if_link.h).
const XDP_FLAGS_SKB_MODE: u32 = 1 << 1;
const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;
const XDP_PASS: i32 = 2;
const BPF_FUNC_REDIRECT_MAP: i32 = 51;
const BPF_PSEUDO_MAP_FD: u8 = 1;

/// Where the program runs: in the driver (native) or on the generic
/// skb path every interface has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachMode {
    Generic,
    Native,
}

/// One BPF instruction (struct bpf_insn).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Insn {
    code: u8,
    /// dst in the low nibble, src in the high one.
    regs: u8,
    off: i16,
    imm: i32,
}

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: (src << 4) | dst,
        off,
        imm,
    }
}

/// The program, for an XSKMAP whose fd is `map_fd`:
/// ```text
///   r2 = ctx->data_end; r3 = ctx->data; r4 = r3 + 14
///   if r4 > r2 goto pass                  ; no full Ethernet header
///   r5 = *(u16 *)(r3 + 12)                ; EtherType, network order
///   if r5 != ethertype goto pass
///   r2 = ctx->rx_queue_index; r1 = map; r3 = XDP_PASS
///   return bpf_redirect_map(map, queue, XDP_PASS)  ; no socket: pass
/// pass:
///   return XDP_PASS
/// ```
pub fn program(map_fd: RawFd, ethertype: u16) -> Vec<Insn> {
    // The 16-bit load reads the two wire bytes little-endian.
    let wire = u16::from_le_bytes(ethertype.to_be_bytes()) as i32;
    vec![
        insn(0x61, 2, 1, 4, 0),    // r2 = *(u32 *)(r1 + 4)   data_end
        insn(0x61, 3, 1, 0, 0),    // r3 = *(u32 *)(r1 + 0)   data
        insn(0xbf, 4, 3, 0, 0),    // r4 = r3
        insn(0x07, 4, 0, 0, 14),   // r4 += 14
        insn(0x2d, 4, 2, 8, 0),    // if r4 > r2 goto pass (+8)
        insn(0x69, 5, 3, 12, 0),   // r5 = *(u16 *)(r3 + 12)
        insn(0x55, 5, 0, 6, wire), // if r5 != ethertype goto pass (+6)
        insn(0x61, 2, 1, 16, 0),   // r2 = *(u32 *)(r1 + 16)  rx_queue_index
        insn(0x18, 1, BPF_PSEUDO_MAP_FD, 0, map_fd), // r1 = map (ld_imm64)
        insn(0, 0, 0, 0, 0),
        insn(0xb7, 3, 0, 0, XDP_PASS), // r3 = XDP_PASS (the fallback action)
        insn(0x85, 0, 0, 0, BPF_FUNC_REDIRECT_MAP), // call bpf_redirect_map
        insn(0x95, 0, 0, 0, 0),        // exit
        insn(0xb7, 0, 0, 0, XDP_PASS), // pass: r0 = XDP_PASS
        insn(0x95, 0, 0, 0, 0),        // exit
    ]
}

/// `union bpf_attr`, as a zeroed block the commands fill (the kernel
/// checks that bytes past the fields it knows are zero).
#[repr(C, align(8))]
struct Attr([u8; 128]);

impl Attr {
    fn new() -> Attr {
        Attr([0; 128])
    }
    fn u32(&mut self, at: usize, v: u32) -> &mut Self {
        self.0[at..at + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(&mut self, at: usize, v: u64) -> &mut Self {
        self.0[at..at + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
}

fn bpf(cmd: libc::c_long, attr: &mut Attr, what: &'static str) -> Result<i64, XdpError> {
    // SAFETY: `attr` is a valid, writable bpf_attr-sized block; every
    // pointer stored in it refers to memory the caller keeps alive for the
    // duration of this call.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.0.as_mut_ptr(), attr.0.len()) };
    if r < 0 {
        return Err(XdpError::sys(what));
    }
    Ok(r)
}

fn fd_of(r: i64) -> OwnedFd {
    // SAFETY: the bpf(2) command returned a new file descriptor we own.
    unsafe { OwnedFd::from_raw_fd(r as RawFd) }
}

/// An attached program and its XSKMAP; dropping it detaches the program.
#[derive(Debug)]
pub struct XdpProgram {
    map: OwnedFd,
    _prog: OwnedFd,
    _link: OwnedFd,
    queues: u32,
}

impl XdpProgram {
    /// Loads the program for `ethertype` with a map of `queues` slots and
    /// attaches it to `ifindex` (in the calling thread's network
    /// namespace).
    pub fn attach(
        ifindex: u32,
        ethertype: u16,
        queues: u32,
        mode: AttachMode,
    ) -> Result<XdpProgram, XdpError> {
        let mut a = Attr::new();
        a.u32(0, BPF_MAP_TYPE_XSKMAP)
            .u32(4, 4)
            .u32(8, 4)
            .u32(12, queues.max(1));
        let map = fd_of(bpf(BPF_MAP_CREATE, &mut a, "BPF_MAP_CREATE (XSKMAP)")?);
        let insns = program(map.as_raw_fd(), ethertype);
        let license = c"GPL";
        let mut log = vec![0u8; 16 * 1024];
        let mut a = Attr::new();
        a.u32(0, BPF_PROG_TYPE_XDP)
            .u32(4, insns.len() as u32)
            .u64(8, insns.as_ptr() as u64)
            .u64(16, license.as_ptr() as u64)
            .u32(24, 1) // log_level
            .u32(28, log.len() as u32)
            .u64(32, log.as_mut_ptr() as u64)
            .u32(68, BPF_XDP); // expected_attach_type
        let prog = match bpf(BPF_PROG_LOAD, &mut a, "BPF_PROG_LOAD") {
            Ok(fd) => fd_of(fd),
            Err(XdpError::Sys { source, .. }) if source.raw_os_error() == Some(libc::EACCES) => {
                let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
                return Err(XdpError::Verifier(
                    String::from_utf8_lossy(&log[..end]).into_owned(),
                ));
            }
            Err(e) => return Err(e),
        };
        let flags = match mode {
            AttachMode::Generic => XDP_FLAGS_SKB_MODE,
            AttachMode::Native => XDP_FLAGS_DRV_MODE,
        };
        let mut a = Attr::new();
        a.u32(0, prog.as_raw_fd() as u32)
            .u32(4, ifindex)
            .u32(8, BPF_XDP)
            .u32(12, flags);
        let link = fd_of(bpf(BPF_LINK_CREATE, &mut a, "BPF_LINK_CREATE (XDP)")?);
        Ok(XdpProgram {
            map,
            _prog: prog,
            _link: link,
            queues: queues.max(1),
        })
    }

    /// Steers receive queue `queue` to the AF_XDP socket `xsk_fd`.
    pub fn register(&self, queue: u32, xsk_fd: RawFd) -> Result<(), XdpError> {
        if queue >= self.queues {
            return Err(XdpError::Config("queue beyond the map"));
        }
        let (key, val) = (queue, xsk_fd as u32);
        let mut a = Attr::new();
        a.u32(0, self.map.as_raw_fd() as u32)
            .u64(8, &key as *const u32 as u64)
            .u64(16, &val as *const u32 as u64);
        bpf(BPF_MAP_UPDATE_ELEM, &mut a, "BPF_MAP_UPDATE_ELEM (XSKMAP)").map(|_| ())
    }

    /// Stops steering `queue` (its frames pass to the kernel again).
    pub fn unregister(&self, queue: u32) -> Result<(), XdpError> {
        let key = queue;
        let mut a = Attr::new();
        a.u32(0, self.map.as_raw_fd() as u32)
            .u64(8, &key as *const u32 as u64);
        bpf(BPF_MAP_DELETE_ELEM, &mut a, "BPF_MAP_DELETE_ELEM (XSKMAP)").map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jumps_land_on_pass_and_the_ethertype_is_in_wire_order() {
        let p = program(7, 0x88B5);
        let pass = p.len() - 2;
        assert_eq!(p[pass], insn(0xb7, 0, 0, 0, XDP_PASS));
        // Jump targets are relative to the next instruction.
        assert_eq!(4 + 1 + p[4].off as usize, pass);
        assert_eq!(6 + 1 + p[6].off as usize, pass);
        // Bytes 0x88 0xB5 read as a little-endian u16.
        assert_eq!(p[6].imm, 0xB588);
        assert_eq!(p[8].imm, 7);
        assert_eq!(std::mem::size_of::<Insn>(), 8);
    }
}

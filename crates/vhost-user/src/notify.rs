//! The backend channel (VHOST_USER_SET_BACKEND_REQ_FD): the socket a
//! frontend hands over for messages from the backend, here the
//! config-change notification a resize sends
//! ([`crate::device::BlkDevice::notify_config_change`]).
//!
//! The `vhost` crate decodes SET_BACKEND_REQ_FD itself, but the `Backend`
//! handle it makes of the socket cannot send CONFIG_CHANGE_MSG (it has no
//! such method and hides its socket). So the control thread looks at each
//! message's header first (`MSG_PEEK`) and takes this one message off the
//! socket itself: a 12-byte header with no body and one descriptor.

use std::io::{Error, ErrorKind, Result};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;

/// FrontendReq::SET_BACKEND_REQ_FD.
const SET_BACKEND_REQ_FD: u32 = 21;
const HEADER_LEN: usize = 12;
/// Header flags (vhost-user spec): version 1, reply, need-reply.
const VERSION_1: u32 = 0x1;
const REPLY: u32 = 0x4;
const NEED_REPLY: u32 = 0x8;
/// Most descriptors any vhost-user message carries.
const MAX_FDS: usize = 8;

/// The parts of a message header this module reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub request: u32,
    pub flags: u32,
    pub size: u32,
}

impl Header {
    pub fn parse(b: &[u8; HEADER_LEN]) -> Header {
        let w = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Header {
            request: w(0),
            flags: w(4),
            size: w(8),
        }
    }

    /// Whether this header starts a SET_BACKEND_REQ_FD this module takes
    /// (anything else, including a malformed one, is left to the `vhost`
    /// crate's decoder and its errors).
    pub fn is_backend_req_fd(&self) -> bool {
        self.request == SET_BACKEND_REQ_FD && self.size == 0 && self.flags & 0x3 == VERSION_1
    }
}

/// When the next message on `fd` (readable now) is SET_BACKEND_REQ_FD,
/// receives it and returns the channel; `Ok(None)` when it is another
/// message (nothing is consumed). An error ends the connection.
pub fn take_backend_channel(fd: RawFd) -> Result<Option<UnixStream>> {
    let mut raw = [0u8; HEADER_LEN];
    // SAFETY: recv into a local buffer of HEADER_LEN bytes; MSG_PEEK
    // leaves the bytes (and their descriptors) on the socket.
    let n = unsafe {
        libc::recv(
            fd,
            raw.as_mut_ptr().cast(),
            HEADER_LEN,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n != HEADER_LEN as isize || !Header::parse(&raw).is_backend_req_fd() {
        return Ok(None);
    }
    let (hdr, fds) = recv_with_fds(fd)?;
    let mut files: Vec<UnixStream> = fds
        .into_iter()
        // SAFETY: each descriptor arrived with the message (SCM_RIGHTS)
        // and is owned by nobody else.
        .map(|f| unsafe { UnixStream::from_raw_fd(f) })
        .collect();
    if files.len() != 1 || !is_unix_stream(&files[0]) {
        return Err(Error::new(
            ErrorKind::InvalidData,
            "SET_BACKEND_REQ_FD without one stream socket",
        ));
    }
    if hdr.flags & NEED_REPLY != 0 {
        reply_ok(fd)?;
    }
    Ok(files.pop())
}

/// Receives one 12-byte header and the descriptors sent with it.
fn recv_with_fds(fd: RawFd) -> Result<(Header, Vec<RawFd>)> {
    let mut raw = [0u8; HEADER_LEN];
    // u64 elements keep the control buffer aligned for cmsghdr.
    let mut cbuf = [0u64; 32];
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) };
    debug_assert!(space as usize <= std::mem::size_of_val(&cbuf));
    let mut iov = libc::iovec {
        iov_base: raw.as_mut_ptr().cast(),
        iov_len: HEADER_LEN,
    };
    // SAFETY: an all-zero msghdr is valid; the pointers set below outlive
    // the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: recvmsg with buffers described by `msg`, all live here.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control buffer recvmsg filled, with the libc
    // macros that bound every header by msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let bytes = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(std::ptr::read_unaligned(data.add(i)));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if n as usize != HEADER_LEN || msg.msg_flags & libc::MSG_CTRUNC != 0 {
        for f in fds {
            // SAFETY: closing descriptors we just received and own.
            unsafe { libc::close(f) };
        }
        return Err(Error::new(
            ErrorKind::InvalidData,
            "SET_BACKEND_REQ_FD truncated",
        ));
    }
    Ok((Header::parse(&raw), fds))
}

fn is_unix_stream(s: &UnixStream) -> bool {
    use std::os::fd::AsRawFd;
    let opt = |name| {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt into a local int of the size given.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                name,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        (r == 0).then_some(v)
    };
    opt(libc::SO_DOMAIN) == Some(libc::AF_UNIX) && opt(libc::SO_TYPE) == Some(libc::SOCK_STREAM)
}

/// The REPLY_ACK answer: success (u64 0).
fn reply_ok(fd: RawFd) -> Result<()> {
    let mut m = [0u8; HEADER_LEN + 8];
    m[0..4].copy_from_slice(&SET_BACKEND_REQ_FD.to_le_bytes());
    m[4..8].copy_from_slice(&(VERSION_1 | REPLY).to_le_bytes());
    m[8..12].copy_from_slice(&8u32.to_le_bytes());
    // SAFETY: send from a local buffer of its own length.
    let n = unsafe { libc::send(fd, m.as_ptr().cast(), m.len(), libc::MSG_NOSIGNAL) };
    if n != m.len() as isize {
        return Err(Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsRawFd;

    fn send_with_fd(s: &UnixStream, hdr: &[u8], fd: Option<RawFd>) {
        let mut cbuf = [0u64; 8];
        let mut iov = libc::iovec {
            iov_base: hdr.as_ptr() as *mut _,
            iov_len: hdr.len(),
        };
        // SAFETY: test-only sendmsg with local buffers.
        unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            if let Some(fd) = fd {
                msg.msg_control = cbuf.as_mut_ptr().cast();
                msg.msg_controllen = libc::CMSG_SPACE(4) as _;
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(4) as _;
                std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut RawFd, fd);
            }
            assert_eq!(libc::sendmsg(s.as_raw_fd(), &msg, 0), hdr.len() as isize);
        }
    }

    fn header(req: u32, flags: u32, size: u32) -> Vec<u8> {
        [req, flags, size]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect()
    }

    #[test]
    fn takes_the_channel_and_answers_need_reply() {
        let (mut front, back) = UnixStream::pair().unwrap();
        let (chan_front, chan_back) = UnixStream::pair().unwrap();
        send_with_fd(
            &front,
            &header(21, VERSION_1 | NEED_REPLY, 0),
            Some(chan_back.as_raw_fd()),
        );
        drop(chan_back);
        let got = take_backend_channel(back.as_raw_fd())
            .unwrap()
            .expect("channel");
        let mut reply = [0u8; 20];
        front.read_exact(&mut reply).unwrap();
        assert_eq!(&reply[..12], &header(21, VERSION_1 | REPLY, 8)[..]);
        assert_eq!(&reply[12..], &[0u8; 8]);
        // The channel reaches the frontend's end.
        use std::io::Write;
        (&got).write_all(b"x").unwrap();
        let mut b = [0u8; 1];
        (&chan_front).read_exact(&mut b).unwrap();
        assert_eq!(&b, b"x");
    }

    #[test]
    fn other_messages_are_left_on_the_socket() {
        let (front, back) = UnixStream::pair().unwrap();
        send_with_fd(&front, &header(1, VERSION_1, 0), None);
        assert!(take_backend_channel(back.as_raw_fd()).unwrap().is_none());
        let mut b = [0u8; 12];
        (&back).read_exact(&mut b).unwrap();
        assert_eq!(&b[..], &header(1, VERSION_1, 0)[..]);
        // A SET_BACKEND_REQ_FD with a body is left to the decoder too.
        assert!(!Header::parse(&header(21, VERSION_1, 8).try_into().unwrap()).is_backend_req_fd());
    }

    #[test]
    fn without_a_socket_the_connection_ends() {
        let (front, back) = UnixStream::pair().unwrap();
        send_with_fd(&front, &header(21, VERSION_1, 0), None);
        assert!(take_backend_channel(back.as_raw_fd()).is_err());
        let (front, back) = UnixStream::pair().unwrap();
        let f = std::fs::File::open("/dev/null").unwrap();
        send_with_fd(&front, &header(21, VERSION_1, 0), Some(f.as_raw_fd()));
        assert!(take_backend_channel(back.as_raw_fd()).is_err());
    }
}

//! Connections the target's connection cap turned away: the first Login
//! Request gets a Login Response with status 0x0302 (target error, out of
//! resources, RFC 7143 §11.13.5), so the initiator learns why and may try
//! again later, instead of a bare close. Whatever else arrives, or nothing
//! within the listener's refusal time, closes the connection.

use std::os::fd::AsRawFd;

use ustor_iscsi::wire::{opcode, Bhs};
use ustor_net::listener::Refused;

use crate::io::{Received, Wire};

/// MaxRecvDataSegmentLength during login (RFC 7143 §13.12 default): the
/// most a Login Request may carry.
const LOGIN_DATA: usize = 8192;

/// Status class and detail: target error, out of resources.
const OUT_OF_RESOURCES: (u8, u8) = (3, 2);

/// Answers one refused connection and closes it.
pub(crate) async fn answer(conn: Refused) {
    let fd = conn.fd.as_raw_fd();
    let mut wire = Wire::new(fd, LOGIN_DATA);
    let got = ustor_net::time::timeout(conn.timeout, wire.recv()).await;
    if let Some(Ok(Received::Pdu(req))) = got {
        if req.opcode() == opcode::LOGIN_REQ {
            let _ = ustor_net::time::timeout(conn.timeout, wire.send(&reject(&req), &[])).await;
        }
    }
    // A receive left on the ring by the timeout would keep the socket
    // open past the drop: shut it down so the peer sees the end now.
    ustor_net::recv::shutdown(fd);
}

/// The Login Response refusing `req` (no stage change, TSIH 0).
fn reject(req: &Bhs) -> Bhs {
    let csg = (req.flags() >> 2) & 3;
    let mut b = Bhs::new(opcode::LOGIN_RESP, false, csg << 2);
    b.0[8..14].copy_from_slice(&req.0[8..14]);
    let cmdsn = req.u32_at(24);
    b.set_itt(req.itt())
        .set_u32(24, req.u32_at(28))
        .set_u32(28, cmdsn)
        .set_u32(32, cmdsn)
        .set_u8(36, OUT_OF_RESOURCES.0)
        .set_u8(37, OUT_OF_RESOURCES.1);
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use ustor_iscsi::wire::build;

    #[test]
    fn reject_echoes_the_request() {
        let req = build::login([0x80, 1, 2, 3, 4, 5], 0, 7, 9, 4, 1, 3, true);
        let r = reject(&req);
        assert_eq!(r.opcode(), opcode::LOGIN_RESP);
        assert_eq!(r.flags(), 1 << 2, "no transit, CSG kept");
        assert_eq!(&r.0[8..14], &[0x80, 1, 2, 3, 4, 5]);
        assert_eq!((r.u16_at(14), r.itt()), (0, 7));
        assert_eq!((r.u32_at(24), r.u32_at(28), r.u32_at(32)), (4, 9, 9));
        assert_eq!((r.u8_at(36), r.u8_at(37)), (3, 2));
    }
}

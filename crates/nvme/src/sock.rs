//! Socket helpers both NVMe/TCP sides use, now in the connection layer
//! (`ustor_net::recv`); re-exported here until the queues import them from
//! there.

pub(crate) use ustor_net::recv::{
    connect_blocking as connect, readable, recv_at_least, shutdown, try_recv, Seg,
};

/// Most iovecs one receive carries: data segments, a digest, the next header.
pub(crate) const MAX_RECV_IOV: usize = ustor_bdev::io::MAX_SEGMENTS + 2;
const _: () = assert!(MAX_RECV_IOV <= ustor_net::recv::MAX_RECV_IOV);

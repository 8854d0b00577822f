//! A future dropped while its I/O is in flight: the buffers stay out of the
//! pool (the device may still write them) until the last completion, then
//! go back; a future that completes hands its buffers back with the data.
//! One buffer, several buffers, and an I/O split into children.

mod common;

use std::cell::RefCell;
use std::future::{poll_fn, Future};
use std::sync::Arc;
use std::task::Poll;

use common::{registry, runtime};
use ustor_bdev::{Bdev, BdevChannel, BdevError, BdevInfo, IoChannel, IoHandle, IoType};
use ustor_runtime::IoBuf;

thread_local! {
    /// I/Os the parking driver holds on this reactor, in submission order.
    static PARKED: RefCell<Vec<IoHandle>> = const { RefCell::new(Vec::new()) };
}

/// A device that completes nothing until the test says so.
struct Parking(BdevInfo);
struct ParkingChannel;

impl BdevChannel for ParkingChannel {
    fn submit(&self, io: IoHandle) {
        PARKED.with(|p| p.borrow_mut().push(io));
    }
}

impl Bdev for Parking {
    fn info(&self) -> &BdevInfo {
        &self.0
    }
    fn io_type_supported(&self, _t: IoType) -> bool {
        true
    }
    fn create_channel(&self) -> Result<Box<dyn BdevChannel>, BdevError> {
        Ok(Box::new(ParkingChannel))
    }
    fn config_json(&self) -> serde_json::Value {
        serde_json::json!({})
    }
}

/// Completes the `n` oldest parked I/Os as a device would: each read's
/// bytes become `fill` first.
fn complete(n: usize, fill: u8) {
    let ios: Vec<IoHandle> = PARKED.with(|p| p.borrow_mut().drain(..n).collect());
    for io in ios {
        let d = io.desc();
        // SAFETY: the I/O is not completed yet, so its iovecs are valid;
        // each is `iov_len` bytes the device may write.
        for v in unsafe { d.iovecs() } {
            unsafe { std::ptr::write_bytes(v.iov_base as *mut u8, fill, v.iov_len) };
        }
        io.complete(Ok(()));
    }
}

fn parked() -> usize {
    PARKED.with(|p| p.borrow().len())
}

/// Free 4 KiB and 64 KiB pool buffers on this reactor.
fn free_bufs() -> (usize, usize) {
    let (classes, _) = ustor_runtime::buf::pool_usage().expect("on a reactor");
    let free = |size| classes.iter().find(|c| c.0 == size).expect("class").1;
    (free(4096), free(65536))
}

/// Polls `f` once; true if it is still pending.
async fn poll_once<F: Future + Unpin>(f: &mut F) -> bool {
    poll_fn(|cx| Poll::Ready(std::pin::Pin::new(&mut *f).poll(cx).is_pending())).await
}

async fn single(ch: &IoChannel) {
    let base = free_bufs();
    // Completed: the buffer comes back holding what the device wrote.
    let mut f = Box::pin(ch.read(0, 8, IoBuf::alloc(4096).await));
    assert!(poll_once(&mut f).await);
    complete(1, 0xa5);
    let (r, buf) = f.await;
    assert_eq!(r, Ok(()));
    assert!(buf.iter().all(|b| *b == 0xa5));
    drop(buf);
    assert_eq!(free_bufs(), base);
    // Dropped in flight: the buffer stays out until the device is done.
    let mut f = Box::pin(ch.read(0, 8, IoBuf::alloc(4096).await));
    assert!(poll_once(&mut f).await);
    drop(f);
    assert_eq!((free_bufs().0 + 1, parked()), (base.0, 1));
    assert_eq!(ch.outstanding(), 0);
    complete(1, 0x5a);
    assert_eq!(free_bufs(), base);
}

async fn vectored(ch: &IoChannel) {
    let base = free_bufs();
    let bufs = vec![IoBuf::alloc(4096).await, IoBuf::alloc(4096).await];
    let mut f = Box::pin(ch.writev(8, 16, bufs));
    assert!(poll_once(&mut f).await);
    drop(f);
    assert_eq!((free_bufs().0 + 2, parked()), (base.0, 1));
    complete(1, 0);
    assert_eq!(free_bufs(), base);
}

async fn split(ch: &IoChannel) {
    // 64 KiB on a device that takes at most 16 KiB (32 blocks) at a time:
    // four children of one parent.
    let base = free_bufs();
    let mut f = Box::pin(ch.read(0, 128, IoBuf::alloc(65536).await));
    assert!(poll_once(&mut f).await);
    assert_eq!(parked(), 4);
    drop(f);
    complete(3, 1);
    assert_eq!((free_bufs().1 + 1, parked()), (base.1, 1));
    complete(1, 1);
    assert_eq!(free_bufs(), base);
    // And completed: every child's bytes land in the caller's buffer.
    let mut f = Box::pin(ch.read(0, 128, IoBuf::alloc(65536).await));
    assert!(poll_once(&mut f).await);
    complete(4, 0x3c);
    let (r, buf) = f.await;
    assert_eq!(r, Ok(()));
    assert!(buf.iter().all(|b| *b == 0x3c));
}

#[test]
fn dropped_futures_leave_buffers_to_the_slot_until_completion() {
    let rt = runtime(1);
    let reg = registry(&rt);
    let info = BdevInfo {
        name: "park".into(),
        uuid: uuid::Uuid::new_v4(),
        product_name: "Parking disk".into(),
        module: "parking",
        block_size: 512,
        num_blocks: 1 << 12,
        required_alignment: 1,
        max_transfer_blocks: 32,
        optimal_boundary_blocks: 0,
        write_cache: false,
        unmap_reads_zero: false,
        memory_resident: true,
    };
    reg.register(Arc::new(Parking(info))).unwrap();
    let desc = reg.open("park", true, |_| {}).unwrap();
    rt.handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            single(&ch).await;
            vectored(&ch).await;
            split(&ch).await;
            assert_eq!((ch.outstanding(), parked()), (0, 0));
        })
        .unwrap();
}

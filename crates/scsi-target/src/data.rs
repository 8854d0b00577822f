//! How a command's data moves between the transport and the target core:
//! the [`DataPath`] trait (data-out source, data-in sink), with two ready
//! implementations: [`BufData`] (plain buffers, for tests and simple
//! transports) and [`IovecData`] (caller-owned iovecs, for an emulated HBA
//! or a guest's descriptor chain).
//!
//! The core copies between these and the bdev's pool buffers in chunks of
//! at most [`crate::CHUNK_BYTES`], so a peer-supplied transfer length never
//! sizes an allocation.

use std::future::Future;

use ustor_runtime::IoBuf;

/// Direction of a command's data phase, as the transport declared it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Direction {
    #[default]
    None,
    /// Data-out: the initiator sends (WRITE, UNMAP parameters).
    ToDevice,
    /// Data-in: the initiator receives (READ, INQUIRY).
    FromDevice,
}

/// The transport failed while moving data (the connection dropped, the
/// guest's buffer vanished): a transport error, not a SCSI status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum XferError {
    #[error("transport disconnected during the data phase")]
    Disconnected,
    #[error("data transfer failed (errno {0})")]
    Io(i32),
}

/// Where a command's data comes from and goes to. Offsets are bytes from
/// the start of the data phase; the core moves each byte range at most
/// once and in order, so a streaming transport (iSCSI R2T) can serve it.
pub trait DataPath {
    fn direction(&self) -> Direction;

    /// Bytes the initiator set aside for the data phase (its expected
    /// transfer length).
    fn expected_len(&self) -> u32;

    /// Fills `dst` with data-out bytes starting at `offset`; returns how
    /// many the initiator had (fewer at the end of its data).
    fn data_out(
        &mut self,
        offset: u32,
        dst: &mut [u8],
    ) -> impl Future<Output = Result<usize, XferError>>;

    /// The `len` data-out bytes at `offset`, when the transport holds
    /// exactly those in a buffer of their own (an iSCSI command's
    /// immediate data): handed over, not copied. `None` (the default):
    /// [`DataPath::data_out`] copies them.
    fn data_out_buf(&mut self, offset: u32, len: usize) -> Option<IoBuf> {
        let _ = (offset, len);
        None
    }

    /// The `len` data-out bytes at `offset` as at most `max` buffers over
    /// the transport's own memory, in order (a guest's scattered pages),
    /// when they lie in more than one piece of it: written from there, not
    /// copied. `None` (the default): one piece ([`DataPath::data_out_buf`])
    /// or a copy.
    fn data_out_bufs(&mut self, offset: u32, len: usize, max: usize) -> Option<Vec<IoBuf>> {
        let _ = (offset, len, max);
        None
    }

    /// A list [`DataPath::data_out_bufs`] lent, back from the bdev (for
    /// the transport to reuse).
    fn bufs_back(&mut self, bufs: Vec<IoBuf>) {
        drop(bufs);
    }

    /// Sends `src` as data-in at `offset`; returns how many bytes fit in
    /// the initiator's buffer.
    fn data_in(
        &mut self,
        offset: u32,
        src: &[u8],
    ) -> impl Future<Output = Result<usize, XferError>>;

    /// [`DataPath::data_in`] of all of `buf`, handed over: a transport that
    /// sends from the buffer itself (no copy) keeps it until sent and
    /// gives back `None`; the default sends a copy and gives it back.
    fn data_in_buf(
        &mut self,
        offset: u32,
        buf: IoBuf,
    ) -> impl Future<Output = (Result<usize, XferError>, Option<IoBuf>)> {
        async move {
            let r = self.data_in(offset, &buf).await;
            (r, Some(buf))
        }
    }

    /// The transport reports residuals (iSCSI): a READ whose transfer
    /// length differs from [`DataPath::expected_len`] moves what both
    /// allow and ends GOOD with the residual, instead of being refused.
    fn residuals(&self) -> bool {
        false
    }
}

/// Plain buffers: data-out is `out`, data-in is appended to `input` up to
/// `expected`.
#[derive(Clone, Debug, Default)]
pub struct BufData {
    pub dir: Direction,
    pub expected: u32,
    /// The initiator's data-out.
    pub out: Vec<u8>,
    /// Data-in received so far (at most `expected` bytes).
    pub input: Vec<u8>,
}

impl BufData {
    /// A command without data.
    pub fn none() -> BufData {
        BufData::default()
    }

    /// A data-in command with `expected` bytes of room.
    pub fn read(expected: u32) -> BufData {
        BufData {
            dir: Direction::FromDevice,
            expected,
            ..BufData::default()
        }
    }

    /// A data-out command carrying `out`.
    pub fn write(out: Vec<u8>) -> BufData {
        BufData {
            dir: Direction::ToDevice,
            expected: out.len() as u32,
            out,
            input: Vec::new(),
        }
    }
}

impl DataPath for BufData {
    fn direction(&self) -> Direction {
        self.dir
    }

    fn expected_len(&self) -> u32 {
        self.expected
    }

    async fn data_out(&mut self, offset: u32, dst: &mut [u8]) -> Result<usize, XferError> {
        let src = self.out.get(offset as usize..).unwrap_or(&[]);
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
        Ok(n)
    }

    async fn data_in(&mut self, offset: u32, src: &[u8]) -> Result<usize, XferError> {
        Ok(self.put_in(offset, src))
    }
}

impl BufData {
    /// Data-in at `offset`, up to `expected` bytes; the bytes taken.
    pub(crate) fn put_in(&mut self, offset: u32, src: &[u8]) -> usize {
        let room = (self.expected as usize).saturating_sub(offset as usize);
        let n = src.len().min(room);
        let end = offset as usize + n;
        if self.input.len() < end {
            self.input.resize(end, 0);
        }
        self.input[offset as usize..end].copy_from_slice(&src[..n]);
        n
    }
}

/// Caller-owned iovecs (an HBA's scatter list, a guest's descriptors).
pub struct IovecData<'a> {
    dir: Direction,
    iov: &'a [libc::iovec],
    len: u32,
}

impl<'a> IovecData<'a> {
    /// # Safety
    /// Every iovec must be valid for reads and writes of `iov_len` bytes,
    /// and not otherwise accessed, for as long as this value lives.
    pub unsafe fn new(dir: Direction, iov: &'a [libc::iovec]) -> IovecData<'a> {
        let len = iov.iter().map(|v| v.iov_len).sum::<usize>();
        IovecData {
            dir,
            iov,
            len: len.min(u32::MAX as usize) as u32,
        }
    }

    /// Calls `f(iovec byte pointer, position in the caller's buffer, n)`
    /// for the iovec bytes from `offset` on, `len` bytes at most; returns
    /// how many there were.
    fn walk(&self, offset: u32, len: usize, mut f: impl FnMut(*mut u8, usize, usize)) -> usize {
        let (mut skip, mut done) = (offset as usize, 0);
        for v in self.iov {
            if done == len {
                break;
            }
            if skip >= v.iov_len {
                skip -= v.iov_len;
                continue;
            }
            let n = (v.iov_len - skip).min(len - done);
            // SAFETY: `new`'s contract makes the iovec valid for iov_len
            // bytes, and skip + n <= iov_len.
            f(unsafe { (v.iov_base as *mut u8).add(skip) }, done, n);
            done += n;
            skip = 0;
        }
        done
    }
}

impl DataPath for IovecData<'_> {
    fn direction(&self) -> Direction {
        self.dir
    }

    fn expected_len(&self) -> u32 {
        self.len
    }

    async fn data_out(&mut self, offset: u32, dst: &mut [u8]) -> Result<usize, XferError> {
        let len = dst.len();
        Ok(self.walk(offset, len, |p, at, n| {
            // SAFETY: `p` is valid for n bytes (see `walk`); at + n <= len.
            let s = unsafe { std::slice::from_raw_parts(p, n) };
            dst[at..at + n].copy_from_slice(s);
        }))
    }

    async fn data_in(&mut self, offset: u32, src: &[u8]) -> Result<usize, XferError> {
        Ok(self.walk(offset, src.len(), |p, at, n| {
            // SAFETY: `p` is valid for n bytes (see `walk`) and not aliased
            // by `src` (the caller's own buffer).
            let d = unsafe { std::slice::from_raw_parts_mut(p, n) };
            d.copy_from_slice(&src[at..at + n]);
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<F: Future>(f: F) -> F::Output {
        crate::test_util::ready(f)
    }

    #[test]
    fn iovec_copies_across_segments() {
        let mut a = [0u8; 3];
        let mut b = [0u8; 5];
        let iov = [
            libc::iovec {
                iov_base: a.as_mut_ptr().cast(),
                iov_len: a.len(),
            },
            libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            },
        ];
        // SAFETY: a and b outlive `d` and are not touched meanwhile.
        let mut d = unsafe { IovecData::new(Direction::FromDevice, &iov) };
        assert_eq!(d.expected_len(), 8);
        assert_eq!(run(d.data_in(2, &[1, 2, 3, 4, 5, 6, 7])).unwrap(), 6);
        let mut back = [0u8; 8];
        assert_eq!(run(d.data_out(0, &mut back)).unwrap(), 8);
        assert_eq!(back, [0, 0, 1, 2, 3, 4, 5, 6]);
        assert_eq!((a, b), ([0, 0, 1], [2, 3, 4, 5, 6]));
    }

    #[test]
    fn buf_data_caps_data_in() {
        let mut d = BufData::read(4);
        assert_eq!(run(d.data_in(0, &[9; 10])).unwrap(), 4);
        assert_eq!(d.input, vec![9; 4]);
    }
}

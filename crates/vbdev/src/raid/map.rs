//! The raid data path: where a raid block lives on the members, and the
//! per-reactor channels that send each piece of an I/O as a child I/O on
//! the parent's own buffers (no copy, no allocation).
//!
//! raid0: strip `k` (of `2^shift` blocks) is strip `k / n` of member
//! `k % n`. concat: members one after the other.

use ustor_bdev::{BdevChannel, Children, IoChannel, IoDesc, IoHandle, IoType};

/// The blocks of raid0 range `[start, end)` that lie on member `i` of `n`,
/// as one member range `(offset, blocks)`: the strips of one member inside
/// a range are consecutive strips of that member, so they are contiguous
/// there. `None` when the range misses the member.
pub fn raid0_member_range(shift: u32, n: u64, i: u64, start: u64, end: u64) -> Option<(u64, u64)> {
    if start >= end {
        return None;
    }
    let mask = (1u64 << shift) - 1;
    let (s0, e0) = (start >> shift, (end - 1) >> shift);
    // First strip at or after s0 on member i, and the last at or before e0.
    let k = s0 + (i + n - s0 % n) % n;
    let kl = e0.checked_sub((e0 % n + n - i) % n)?;
    if k > e0 || kl < s0 {
        return None;
    }
    let first = ((k / n) << shift) + if k == s0 { start & mask } else { 0 };
    let last = if kl == e0 {
        ((kl / n) << shift) + ((end - 1) & mask) + 1
    } else {
        (kl / n + 1) << shift
    };
    Some((first, last - first))
}

/// A raid0 array's channel on one reactor.
pub struct Raid0Channel {
    pub members: Box<[IoChannel]>,
    pub shift: u32,
    pub bs: u64,
    /// Blocks before the data on each member (its superblock's room).
    pub off: u64,
}

impl Raid0Channel {
    /// Strip `k`'s member and the member's strip index: a shift and a mask
    /// for a power-of-two member count (no division per I/O).
    #[inline]
    fn place(&self, k: u64) -> (usize, u64) {
        let n = self.members.len() as u64;
        if n.is_power_of_two() {
            ((k & (n - 1)) as usize, k >> n.trailing_zeros())
        } else {
            ((k % n) as usize, k / n)
        }
    }

    #[inline]
    fn data(&self, kids: &Children, d: &IoDesc) {
        let mask = (1u64 << self.shift) - 1;
        let (mut lba, end) = (d.offset_blocks, d.offset_blocks + d.num_blocks);
        while lba < end {
            let (k, within) = (lba >> self.shift, lba & mask);
            let len = (mask + 1 - within).min(end - lba);
            let (m, row) = self.place(k);
            let at = (lba - d.offset_blocks) * self.bs;
            kids.submit(
                &self.members[m],
                d.kind,
                self.off + (row << self.shift) + within,
                len,
                at,
            );
            lba += len;
        }
    }
}

impl BdevChannel for Raid0Channel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        if matches!(d.kind, IoType::Read | IoType::Write) {
            let mask = (1u64 << self.shift) - 1;
            let within = d.offset_blocks & mask;
            if within + d.num_blocks <= mask + 1 {
                // Inside one strip: the member takes the I/O itself.
                let (m, row) = self.place(d.offset_blocks >> self.shift);
                return io.forward(&self.members[m], self.off + (row << self.shift) + within);
            }
        }
        let kids = io.into_children();
        match d.kind {
            IoType::Read | IoType::Write => self.data(&kids, &d),
            IoType::Reset => reset_all(&kids, &self.members),
            _ => {
                let n = self.members.len() as u64;
                let end = d.offset_blocks + d.num_blocks;
                for (i, m) in self.members.iter().enumerate() {
                    let r = raid0_member_range(self.shift, n, i as u64, d.offset_blocks, end);
                    if let Some((off, len)) = r {
                        kids.submit(m, d.kind, self.off + off, len, 0);
                    }
                }
            }
        }
    }
}

/// A concat array's channel on one reactor: member `i` holds raid blocks
/// `[starts[i], starts[i + 1])`.
pub struct ConcatChannel {
    pub members: Box<[IoChannel]>,
    /// One more entry than members: the last is the array's size.
    pub starts: Box<[u64]>,
    pub bs: u64,
    /// Blocks before the data on each member.
    pub off: u64,
}

impl BdevChannel for ConcatChannel {
    fn submit(&self, io: IoHandle) {
        let d = io.desc();
        let end = d.offset_blocks + d.num_blocks;
        if d.kind != IoType::Reset {
            // On one member: it takes the I/O itself.
            let i = self.starts.partition_point(|s| *s <= d.offset_blocks);
            if i > 0 && i < self.starts.len() && end <= self.starts[i] {
                let at = d.offset_blocks - self.starts[i - 1];
                return io.forward(&self.members[i - 1], self.off + at);
            }
        }
        let kids = io.into_children();
        if d.kind == IoType::Reset {
            return reset_all(&kids, &self.members);
        }
        for (i, m) in self.members.iter().enumerate() {
            let (a, b) = (self.starts[i], self.starts[i + 1]);
            let (s, e) = (d.offset_blocks.max(a), end.min(b));
            if s >= e {
                continue;
            }
            let at = (s - d.offset_blocks) * self.bs;
            kids.submit(m, d.kind, self.off + s - a, e - s, at);
        }
    }
}

fn reset_all(kids: &Children, members: &[IoChannel]) {
    for m in members {
        kids.submit(m, IoType::Reset, 0, 0, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::raid0_member_range;

    /// Against a block-by-block walk of the strip map.
    #[test]
    fn member_ranges_match_the_strip_map() {
        for shift in 0..4u32 {
            for n in 1..5u64 {
                for start in 0..40u64 {
                    for end in start..48u64 {
                        for i in 0..n {
                            let on: Vec<u64> = (start..end)
                                .filter(|l| (l >> shift) % n == i)
                                .map(|l| (((l >> shift) / n) << shift) + (l & ((1 << shift) - 1)))
                                .collect();
                            let want = on.first().map(|f| (*f, on.len() as u64));
                            let got = raid0_member_range(shift, n, i, start, end);
                            assert_eq!(got, want, "shift {shift} n {n} i {i} [{start},{end})");
                            if let Some((f, len)) = got {
                                assert_eq!(on.last().copied(), Some(f + len - 1));
                            }
                        }
                    }
                }
            }
        }
    }
}

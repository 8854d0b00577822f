//! The checker on arbitrary bytes: it never panics, and any region it accepts
//! has the geometry its length implies.

use proptest::prelude::*;
use ustor_fs::{check, format, Geometry, BLOCK_SIZE};

proptest! {
    #[test]
    fn check_never_panics(blocks in 0usize..40, flips in proptest::collection::vec((0usize..40 * 4096, any::<u8>()), 0..16)) {
        let mut r = vec![0u8; blocks * BLOCK_SIZE + 17];
        if format(&mut r).is_ok() {
            prop_assert!(check(&r).is_ok());
        }
        let n = r.len();
        for (off, v) in flips {
            r[off % n] ^= v;
        }
        if let Ok(g) = check(&r) {
            prop_assert_eq!(g, Geometry::for_len(n).unwrap());
        }
    }
}

//! What the protocol layer knows about an export, and the catalog seam.
//!
//! This module owns the mapping from an export's capabilities (which the
//! server derives from its bdev) to NBD transmission flags and size
//! constraints. The handshake state machine sees exports only through
//! [`ExportCatalog`], so it is unit-tested with an in-memory catalog and no
//! bdev.

use crate::wire::transmission_flags as tf;

/// Size constraints advertised with `NBD_INFO_BLOCK_SIZE` and enforced on
/// requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    /// Smallest addressable unit; offsets and lengths must be multiples.
    pub min: u32,
    /// Size at which I/O is efficient (no read-modify-write).
    pub preferred: u32,
    /// Largest READ/WRITE payload the server accepts in one request.
    pub max_payload: u32,
}

impl BlockSizes {
    /// Whether the constraints obey the protocol: powers of two, min at most
    /// 64 KiB, preferred at least max(min, 512), max payload at least
    /// preferred. A catalog that breaks these is a server bug.
    pub fn is_valid(&self) -> bool {
        self.min.is_power_of_two()
            && self.min <= 65536
            && self.preferred.is_power_of_two()
            && self.preferred >= self.min.max(512)
            && self.max_payload >= self.preferred
    }
}

/// Capabilities of an export, as the bdev behind it reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExportFeatures {
    pub read_only: bool,
    /// The bdev has a volatile cache that FLUSH makes durable; FUA is then
    /// implemented as write + flush.
    pub can_flush: bool,
    pub can_trim: bool,
    pub can_write_zeroes: bool,
    /// Write-zeroes is cheaper than writing zero buffers (so FAST_ZERO may
    /// succeed); without it a FAST_ZERO request gets `NBD_ENOTSUP`.
    pub fast_zero: bool,
    pub can_cache: bool,
    /// Flush and FUA are visible across connections (no per-connection
    /// cache), so clients may spread I/O over several connections.
    pub multi_conn: bool,
    /// The bdev can report allocation (holes, zeroes): `base:allocation`.
    pub has_allocation_map: bool,
    pub rotational: bool,
}

/// Everything the handshake needs to describe one export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub description: String,
    pub size_bytes: u64,
    pub block_sizes: BlockSizes,
    pub features: ExportFeatures,
}

impl ExportInfo {
    /// Transmission flags for this export; `structured` says whether the
    /// client negotiated structured replies (`SEND_DF` needs them).
    pub fn transmission_flags(&self, structured: bool) -> u16 {
        let f = &self.features;
        let mut flags = tf::HAS_FLAGS;
        let set = |flags: &mut u16, cond: bool, bit: u16| {
            if cond {
                *flags |= bit;
            }
        };
        set(&mut flags, f.read_only, tf::READ_ONLY);
        set(&mut flags, f.can_flush, tf::SEND_FLUSH);
        // FUA is only meaningful for writes, and only needs work when there
        // is a cache to flush; without one every write is already durable,
        // so FUA is advertised whenever the export is writable.
        set(&mut flags, !f.read_only, tf::SEND_FUA);
        set(&mut flags, f.rotational, tf::ROTATIONAL);
        set(&mut flags, !f.read_only && f.can_trim, tf::SEND_TRIM);
        let zeroes = !f.read_only && f.can_write_zeroes;
        set(&mut flags, zeroes, tf::SEND_WRITE_ZEROES);
        // Every zero request can be answered fast (success or ENOTSUP).
        set(&mut flags, zeroes, tf::SEND_FAST_ZERO);
        // Reads are always one OFFSET_DATA chunk, so DF costs nothing.
        set(&mut flags, structured, tf::SEND_DF);
        set(&mut flags, f.multi_conn, tf::CAN_MULTI_CONN);
        set(&mut flags, f.can_cache, tf::SEND_CACHE);
        flags
    }
}

/// The exports a server offers. `Handle` is what the server needs to serve
/// the chosen export after the handshake (e.g. a reference to its bdev).
pub trait ExportCatalog {
    type Handle;

    /// Looks up an export by name; the empty name selects the default export
    /// if the catalog has one.
    fn lookup(&self, name: &str) -> Option<(Self::Handle, ExportInfo)>;

    /// Calls `f` with the name and description of each export, at most
    /// `limit` times (the listing is bounded like everything else).
    fn list(&self, limit: usize, f: &mut dyn FnMut(&str, &str));
}

/// A fixed list of exports; the first is the default. Used by tests, the
/// fuzz targets, and anything that needs a catalog without a server.
#[derive(Debug, Clone, Default)]
pub struct StaticCatalog(pub Vec<ExportInfo>);

impl ExportCatalog for StaticCatalog {
    type Handle = usize;

    fn lookup(&self, name: &str) -> Option<(usize, ExportInfo)> {
        let index = if name.is_empty() {
            0
        } else {
            self.0.iter().position(|e| e.name == name)?
        };
        self.0.get(index).map(|e| (index, e.clone()))
    }

    fn list(&self, limit: usize, f: &mut dyn FnMut(&str, &str)) {
        for e in self.0.iter().take(limit) {
            f(&e.name, &e.description);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(features: ExportFeatures) -> ExportInfo {
        ExportInfo {
            name: "d".into(),
            description: String::new(),
            size_bytes: 1 << 20,
            block_sizes: BlockSizes {
                min: 512,
                preferred: 4096,
                max_payload: 1 << 21,
            },
            features,
        }
    }

    #[test]
    fn block_size_rules() {
        assert!(BlockSizes {
            min: 1,
            preferred: 4096,
            max_payload: 1 << 25
        }
        .is_valid());
        assert!(!BlockSizes {
            min: 3,
            preferred: 4096,
            max_payload: 1 << 25
        }
        .is_valid());
        assert!(!BlockSizes {
            min: 4096,
            preferred: 512,
            max_payload: 1 << 25
        }
        .is_valid());
        assert!(!BlockSizes {
            min: 512,
            preferred: 4096,
            max_payload: 1024
        }
        .is_valid());
        assert!(!BlockSizes {
            min: 1 << 17,
            preferred: 1 << 17,
            max_payload: 1 << 25
        }
        .is_valid());
    }

    #[test]
    fn flags_follow_features() {
        let all = ExportFeatures {
            can_flush: true,
            can_trim: true,
            can_write_zeroes: true,
            can_cache: true,
            multi_conn: true,
            ..Default::default()
        };
        let f = info(all).transmission_flags(true);
        for bit in [
            tf::HAS_FLAGS,
            tf::SEND_FLUSH,
            tf::SEND_FUA,
            tf::SEND_TRIM,
            tf::SEND_WRITE_ZEROES,
            tf::SEND_FAST_ZERO,
            tf::SEND_DF,
            tf::CAN_MULTI_CONN,
            tf::SEND_CACHE,
        ] {
            assert_ne!(f & bit, 0, "bit {bit:#x}");
        }
        assert_eq!(f & tf::READ_ONLY, 0);
        assert_eq!(info(all).transmission_flags(false) & tf::SEND_DF, 0);

        let ro = info(ExportFeatures {
            read_only: true,
            ..all
        })
        .transmission_flags(false);
        assert_ne!(ro & tf::READ_ONLY, 0);
        assert_eq!(
            ro & (tf::SEND_FUA | tf::SEND_TRIM | tf::SEND_WRITE_ZEROES | tf::SEND_FAST_ZERO),
            0
        );
        assert_ne!(ro & tf::SEND_FLUSH, 0);
    }
}

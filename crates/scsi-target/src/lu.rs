//! A logical unit: its identity (what INQUIRY and the VPD pages say) and,
//! per reactor, the bdev channel its commands run on plus its pending unit
//! attention.

use std::cell::Cell;
use std::sync::Arc;

use ustor_bdev::{BdevError, Desc, IoChannel, IoType};
use ustor_scsi_proto::inquiry::{BlockLimits, DeviceType};
use ustor_scsi_proto::Sense;

use crate::mode::ModeParams;
use crate::pr::Reservations;

/// What a logical unit says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LuConfig {
    pub device_type: DeviceType,
    /// INQUIRY vendor (8 characters on the wire), product (16), revision (4).
    pub vendor: String,
    pub product: String,
    pub revision: String,
    /// Unit serial number (VPD 0x80).
    pub serial: String,
    /// NAA IEEE registered identifier (VPD 0x83), 8 bytes.
    pub naa: [u8; 8],
    /// Thin provisioned (LBPME): UNMAP and WRITE SAME with UNMAP accepted.
    pub thin: bool,
    /// Block limits VPD (0xB0).
    pub limits: BlockLimits,
}

impl LuConfig {
    /// A disk with ustor's identity; `id` makes the serial and NAA unique.
    pub fn disk(product: &str, id: u32, thin: bool) -> LuConfig {
        let mut naa = [0x60, 0x01, 0x40, 0x5e, 0, 0, 0, 0];
        naa[4..8].copy_from_slice(&id.to_be_bytes());
        LuConfig {
            device_type: DeviceType::Disk,
            vendor: "USTOR".into(),
            product: product.into(),
            revision: "0001".into(),
            serial: format!("USTOR{id:08x}"),
            naa,
            thin,
            // COMPARE AND WRITE of up to 255 blocks (its CDB's limit).
            limits: BlockLimits {
                max_compare_write_blocks: 255,
                ..BlockLimits::default()
            },
        }
    }
}

/// What every I_T nexus of a logical unit sees alike: its reservations
/// and its changeable mode parameters. The transport keeps one per unit
/// and hands it to each session's [`Lun`].
#[derive(Default)]
pub struct LuShared {
    pub(crate) pr: Reservations,
    pub(crate) mode: ModeParams,
    /// EXTENDED COPY results held for RECEIVE COPY RESULTS.
    pub(crate) copies: crate::xcopy::Held,
    /// Holds writes off while a read-modify-write runs.
    pub(crate) gate: crate::gate::WriteGate,
}

impl LuShared {
    pub fn new() -> Arc<LuShared> {
        Arc::new(LuShared::default())
    }
}

/// One logical unit on one reactor (`!Send`: it holds the reactor's channel).
pub struct Lun {
    pub(crate) cfg: LuConfig,
    pub(crate) ch: IoChannel,
    /// Reported with the next command other than INQUIRY, REPORT LUNS and
    /// REQUEST SENSE, then cleared (SPC; one I_T nexus per table).
    pub(crate) ua: Cell<Option<Sense>>,
    /// The bdev has a volatile write cache (MODE SENSE's WCE).
    pub(crate) write_cache: bool,
    /// The descriptor allows writes (else MODE SENSE says write-protected).
    pub(crate) writable: bool,
    /// Answers VPD page B2 (logical block provisioning) for a thin LUN.
    pub(crate) provisioning_page: bool,
    /// State shared with the unit's other nexuses (a private one unless
    /// [`Lun::with_shared`] shares one).
    pub(crate) shared: Arc<LuShared>,
    /// Logical blocks per physical block exponent (READ CAPACITY(16)).
    pub(crate) lbppbe: u8,
    /// The capacity this nexus last heard of: when the bdev's differs (a
    /// resize), the next command gets CAPACITY DATA HAS CHANGED.
    known_blocks: Cell<u64>,
}

impl Lun {
    /// The unit for `desc`'s bdev on the calling reactor.
    pub fn open(cfg: LuConfig, desc: &Desc) -> Result<Lun, BdevError> {
        Ok(Lun {
            cfg,
            ch: desc.channel()?,
            ua: Cell::new(None),
            write_cache: desc.info().write_cache,
            writable: desc.writable(),
            provisioning_page: false,
            shared: LuShared::new(),
            lbppbe: 0,
            known_blocks: Cell::new(desc.num_blocks()),
        })
    }

    /// Offers the Logical Block Provisioning VPD page (B2) when the LUN is
    /// thin: initiators that see LBPME in READ CAPACITY(16) ask for it
    /// (libiscsi's test suite does).
    pub fn with_provisioning_page(mut self) -> Lun {
        self.provisioning_page = true;
        self
    }

    /// Shares the unit's reservation state with the tables of its other
    /// I_T nexuses (the transport keeps one per logical unit).
    pub fn with_shared(mut self, shared: Arc<LuShared>) -> Lun {
        self.shared = shared;
        self
    }

    /// Reports physical blocks of `bytes` (a power of two of at least
    /// the block size; anything else is ignored): initiators align their
    /// I/O to it.
    pub fn with_physical_block(mut self, bytes: u32) -> Lun {
        let bs = self.block_size();
        if bytes.is_power_of_two() && bytes >= bs && bs > 0 {
            self.lbppbe = (bytes / bs).trailing_zeros() as u8;
        }
        self
    }

    pub fn config(&self) -> &LuConfig {
        &self.cfg
    }

    pub fn channel(&self) -> &IoChannel {
        &self.ch
    }

    pub fn set_ua(&self, s: Option<Sense>) {
        self.ua.set(s);
    }

    pub fn ua(&self) -> Option<Sense> {
        self.ua.get()
    }

    pub(crate) fn block_size(&self) -> u32 {
        self.ch.block_size()
    }

    pub(crate) fn num_blocks(&self) -> u64 {
        self.ch.num_blocks()
    }

    /// The bdev's capacity when it differs from the one this table last
    /// noticed (a resize: SBC's CAPACITY DATA HAS CHANGED is owed); one
    /// relaxed load per command.
    pub(crate) fn resized(&self) -> Option<u64> {
        let n = self.num_blocks();
        (n != self.known_blocks.replace(n)).then_some(n)
    }

    /// The capacity this table last noticed.
    pub(crate) fn known_blocks(&self) -> u64 {
        self.known_blocks.get()
    }

    /// Whether [lba, lba+blocks) lies on the medium.
    pub(crate) fn in_range(&self, lba: u64, blocks: u64) -> bool {
        lba.checked_add(blocks)
            .is_some_and(|e| e <= self.num_blocks())
    }

    pub(crate) fn can_flush(&self) -> bool {
        self.ch.supports(IoType::Flush)
    }
}

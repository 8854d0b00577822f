//! The IOC's system interface: reset (message unit reset, then the
//! diagnostic adapter reset if the IOC does not come back READY), the
//! doorbell handshake that carries the set-up messages (IOCFacts,
//! PortFacts, IOCInit, PortEnable) before any queue exists, and the
//! bring-up sequence built from them.

use std::time::{Duration, Instant};

use ustor_vfio::Bar;

use super::wire::{self, Facts};
use super::MptError;

/// A doorbell step or a state change the IOC must make within this.
const STEP_TIMEOUT: Duration = Duration::from_secs(5);
/// Handshake replies are at most this many 16-bit words (256 bytes).
const MAX_REPLY_WORDS: usize = 128;

fn wait(what: &str, mut ok: impl FnMut() -> bool) -> Result<(), MptError> {
    let deadline = Instant::now() + STEP_TIMEOUT;
    while !ok() {
        if Instant::now() > deadline {
            return Err(MptError::Ioc(format!("timed out waiting for {what}")));
        }
        std::hint::spin_loop();
    }
    Ok(())
}

/// Doorbell register view of the IOC.
pub struct Ioc {
    pub bar: Bar,
}

impl Ioc {
    pub fn state(&self) -> u32 {
        self.bar.read32(wire::REG_DOORBELL) & wire::IOC_STATE_MASK
    }

    fn his(&self) -> u32 {
        self.bar.read32(wire::REG_INT_STATUS)
    }

    fn clear_his(&self) {
        self.bar.write32(wire::REG_INT_STATUS, 0);
    }

    /// Masks both interrupts: completions are polled.
    pub fn mask_interrupts(&self) {
        self.bar.write32(wire::REG_INT_MASK, wire::HIM_ALL);
    }

    /// Finishes a handshake reply a previous owner (firmware, a crashed
    /// process) left half-read, so the doorbell takes commands again.
    fn drain_doorbell(&self) {
        for _ in 0..MAX_REPLY_WORDS + 2 {
            if self.bar.read32(wire::REG_DOORBELL) & wire::DOORBELL_ACTIVE == 0 {
                return;
            }
            self.clear_his();
        }
    }

    /// Resets the IOC to READY: a message unit reset, and if that does not
    /// bring it READY, the diagnostic adapter reset.
    pub fn reset(&self) -> Result<(), MptError> {
        self.mask_interrupts();
        // The mask bits are read/write: a controller that does not keep
        // them does not answer at all (gone from the bus: all-ones; its
        // memory decoding off: zeroes), so no reset can reach it.
        let mask = self.bar.read32(wire::REG_INT_MASK);
        if mask & wire::HIM_ALL != wire::HIM_ALL || mask == u32::MAX {
            return Err(MptError::Ioc(format!(
                "controller failed its reset: it does not respond (interrupt mask reads \
                 {mask:#x}, doorbell {:#x})",
                self.bar.read32(wire::REG_DOORBELL)
            )));
        }
        self.drain_doorbell();
        let doorbell = (wire::F_IOC_MESSAGE_UNIT_RESET as u32) << wire::DOORBELL_FUNCTION_SHIFT;
        self.bar.write32(wire::REG_DOORBELL, doorbell);
        if wait("READY after message unit reset", || {
            self.state() == wire::IOC_STATE_READY
        })
        .is_err()
        {
            tracing::warn!("MPT IOC not READY after message unit reset: adapter reset");
            for k in wire::WRSEQ_KEYS {
                self.bar.write32(wire::REG_WRITE_SEQUENCE, k);
            }
            let diag = self.bar.read32(wire::REG_DIAGNOSTIC);
            if diag & wire::DIAG_WRITE_ENABLE == 0 {
                return Err(MptError::Ioc(format!(
                    "controller failed its reset (state {:#x}; diagnostic register locked)",
                    self.bar.read32(wire::REG_DOORBELL)
                )));
            }
            self.bar
                .write32(wire::REG_DIAGNOSTIC, diag | wire::DIAG_RESET_ADAPTER);
            wait("READY after adapter reset", || {
                self.state() == wire::IOC_STATE_READY
            })
            .map_err(|_| {
                MptError::Ioc(format!(
                    "controller failed its reset (doorbell {:#x})",
                    self.bar.read32(wire::REG_DOORBELL)
                ))
            })?;
            self.mask_interrupts();
        }
        self.clear_his();
        Ok(())
    }

    /// One doorbell handshake: sends `req` (whole dwords) and returns the
    /// reply (MsgLength dwords).
    pub fn handshake(&self, req: &[u8]) -> Result<Vec<u8>, MptError> {
        debug_assert!(req.len().is_multiple_of(4));
        if self.bar.read32(wire::REG_DOORBELL) & wire::DOORBELL_ACTIVE != 0 {
            return Err(MptError::Ioc("doorbell busy".into()));
        }
        self.clear_his();
        let dwords = (req.len() / 4) as u32;
        self.bar.write32(
            wire::REG_DOORBELL,
            ((wire::F_HANDSHAKE as u32) << wire::DOORBELL_FUNCTION_SHIFT)
                | (dwords << wire::DOORBELL_ADD_DWORDS_SHIFT),
        );
        wait("handshake start", || self.his() & wire::HIS_DOORBELL != 0)?;
        self.clear_his();
        for d in req.chunks_exact(4) {
            wait("doorbell ack", || {
                self.his() & wire::HIS_IOP_DOORBELL_STATUS == 0
            })?;
            self.bar.write32(
                wire::REG_DOORBELL,
                u32::from_le_bytes([d[0], d[1], d[2], d[3]]),
            );
        }
        let mut words: Vec<u16> = Vec::with_capacity(MAX_REPLY_WORDS);
        let mut total = 2;
        while words.len() < total {
            wait("handshake reply", || self.his() & wire::HIS_DOORBELL != 0)?;
            words.push(self.bar.read32(wire::REG_DOORBELL) as u16);
            self.clear_his();
            if words.len() == 2 {
                // MsgLength: byte 2 of the reply, in dwords.
                total = ((words[1] & 0xff) as usize * 2).clamp(2, MAX_REPLY_WORDS);
            }
        }
        // The IOC ends the reply with one more doorbell interrupt.
        let _ = wait("handshake end", || self.his() & wire::HIS_DOORBELL != 0);
        self.clear_his();
        Ok(words.iter().flat_map(|w| w.to_le_bytes()).collect())
    }

    fn checked(&self, what: &str, req: &[u8]) -> Result<Vec<u8>, MptError> {
        let r = self.handshake(req)?;
        let (_, function, _) = wire::reply_header(&r);
        let status = wire::ioc_status(&r);
        if function != req[3] || status != wire::IOCSTATUS_SUCCESS {
            return Err(MptError::Ioc(format!(
                "{what} failed (reply function {function:#x}, IOCStatus {status:#x})"
            )));
        }
        Ok(r)
    }

    /// IOCFacts and PortFacts (port 0), then IOCInit; the IOC is
    /// OPERATIONAL after this. Returns the facts, `max_devices` taken from
    /// the port.
    pub fn init(&self, reply_bytes: u16) -> Result<Facts, MptError> {
        let r = self.checked("IOCFacts", &wire::simple_request(wire::F_IOC_FACTS, 0, 0))?;
        let mut facts = wire::decode_ioc_facts(&r);
        if facts.ports == 0 || facts.request_frame_bytes < wire::SCSIIO_HEADER + wire::SGE64_LEN {
            return Err(MptError::Ioc(format!("unusable IOCFacts {facts:?}")));
        }
        let p = self.checked("PortFacts", &wire::simple_request(wire::F_PORT_FACTS, 0, 0))?;
        let port_devices = wire::decode_port_max_devices(&p).clamp(1, 255) as u8;
        facts.max_devices = port_devices;
        self.checked("IOCInit", &wire::ioc_init(port_devices, reply_bytes, 0))?;
        wait("OPERATIONAL after IOCInit", || {
            self.state() == wire::IOC_STATE_OPERATIONAL
        })?;
        Ok(facts)
    }

    /// PortEnable for port 0: the IOC starts talking to its devices.
    pub fn port_enable(&self) -> Result<(), MptError> {
        self.checked(
            "PortEnable",
            &wire::simple_request(wire::F_PORT_ENABLE, 0, 0),
        )
        .map(|_| ())
    }
}

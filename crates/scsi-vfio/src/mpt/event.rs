//! MPT event notification (MPI 1.5 EventNotification and EventAck): the
//! request that turns events on, the event replies the IOC then posts to
//! the reply FIFO (continuation replies of that one request, which the IOC
//! keeps), and what each event means for the mid-layer: a SAS device added
//! or not responding, a bus reset or a rescan request make it rescan.
//! QEMU's SAS1068 answers the request with one EVENT_CHANGE reply and sends
//! no device events (a gone disk shows as DEVICE_NOT_THERE there); a real
//! SAS1068 sends them.

use super::wire::{le32, put32};

pub const F_EVENT_NOTIFICATION: u8 = 0x07;
pub const F_EVENT_ACK: u8 = 0x08;
/// `MSG_EVENT_NOTIFY` and `MSG_EVENT_ACK` lengths.
pub const NOTIFY_REQ_LEN: usize = 12;
pub const ACK_REQ_LEN: usize = 20;

pub const EVENT_IOC_BUS_RESET: u32 = 0x04;
pub const EVENT_EXT_BUS_RESET: u32 = 0x05;
pub const EVENT_RESCAN: u32 = 0x06;
pub const EVENT_EVENT_CHANGE: u32 = 0x0a;
pub const EVENT_SAS_DEVICE_STATUS_CHANGE: u32 = 0x0f;
/// SAS device status change reason codes.
pub const RC_ADDED: u8 = 0x03;
pub const RC_NOT_RESPONDING: u8 = 0x04;
/// Where an event reply's data starts (`Data[0]`).
const DATA_OFF: usize = 28;

/// `MSG_EVENT_NOTIFY`: events on (or off), replies carrying `context`.
pub fn encode_notify(frame: &mut [u8], context: u32, on: bool) {
    let b = &mut frame[..NOTIFY_REQ_LEN];
    b.fill(0);
    b[0] = on as u8;
    b[3] = F_EVENT_NOTIFICATION;
    put32(b, 8, context);
}

/// `MSG_EVENT_ACK` for an event whose reply asked for one.
pub fn encode_ack(frame: &mut [u8], context: u32, ev: &Event) {
    let b = &mut frame[..ACK_REQ_LEN];
    b.fill(0);
    b[3] = F_EVENT_ACK;
    put32(b, 8, context);
    put32(b, 12, ev.event);
    put32(b, 16, ev.context);
}

/// The fields of an event reply (`MSG_EVENT_NOTIFY_REPLY`) the driver uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Event {
    pub event: u32,
    pub context: u32,
    pub ack_required: bool,
    /// The first data word (EVENT_CHANGE: whether events are on).
    pub data0: u32,
    /// SAS device status change: target ID and reason code.
    pub target: u8,
    pub reason: u8,
}

/// Decodes an event reply frame; missing bytes read as zero.
pub fn decode(r: &[u8]) -> Event {
    Event {
        event: le32(r, 20),
        context: le32(r, 24),
        ack_required: r.get(6).is_some_and(|b| *b != 0),
        data0: le32(r, DATA_OFF),
        target: r.get(DATA_OFF).copied().unwrap_or(0),
        reason: r.get(DATA_OFF + 2).copied().unwrap_or(0),
    }
}

/// What an event means for the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Nothing to do (logged, counted).
    None,
    /// Targets may have come or gone: the mid-layer rescans.
    Rescan,
    /// The answer to EventNotification: events are now on (or off).
    Enabled(bool),
}

pub fn effect(e: &Event) -> Effect {
    match e.event {
        EVENT_EVENT_CHANGE => Effect::Enabled(e.data0 & 0xff != 0),
        EVENT_IOC_BUS_RESET | EVENT_EXT_BUS_RESET | EVENT_RESCAN => Effect::Rescan,
        EVENT_SAS_DEVICE_STATUS_CHANGE if matches!(e.reason, RC_ADDED | RC_NOT_RESPONDING) => {
            Effect::Rescan
        }
        _ => Effect::None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An event reply frame as the IOC writes it.
    fn reply(event: u32, ack: bool, data: &[u8]) -> Vec<u8> {
        let mut r = vec![0u8; 128];
        r[0] = 1; // EventDataLength (words)
        r[2] = 7; // MsgLength
        r[3] = F_EVENT_NOTIFICATION;
        r[6] = ack as u8;
        r[7] = 0x80; // continuation reply
        put32(&mut r, 8, 65);
        put32(&mut r, 20, event);
        put32(&mut r, 24, 0x1234);
        r[DATA_OFF..DATA_OFF + data.len()].copy_from_slice(data);
        r
    }

    #[test]
    fn event_change_says_whether_events_are_on() {
        let e = decode(&reply(EVENT_EVENT_CHANGE, false, &[1, 0, 0, 0]));
        assert_eq!(effect(&e), Effect::Enabled(true));
        assert!(!e.ack_required);
        let e = decode(&reply(EVENT_EVENT_CHANGE, false, &[0, 0, 0, 0]));
        assert_eq!(effect(&e), Effect::Enabled(false));
    }

    #[test]
    fn device_added_or_gone_and_bus_resets_ask_for_a_rescan() {
        for rc in [RC_ADDED, RC_NOT_RESPONDING] {
            let e = decode(&reply(EVENT_SAS_DEVICE_STATUS_CHANGE, true, &[5, 0, rc, 0]));
            assert_eq!((e.target, e.reason), (5, rc));
            assert_eq!(effect(&e), Effect::Rescan);
            assert!(e.ack_required);
        }
        // SMART data about a device that stays: no rescan.
        let e = decode(&reply(
            EVENT_SAS_DEVICE_STATUS_CHANGE,
            false,
            &[5, 0, 0x05, 0],
        ));
        assert_eq!(effect(&e), Effect::None);
        for ev in [EVENT_IOC_BUS_RESET, EVENT_EXT_BUS_RESET, EVENT_RESCAN] {
            assert_eq!(effect(&decode(&reply(ev, false, &[]))), Effect::Rescan);
        }
        assert_eq!(effect(&decode(&reply(0x16, false, &[]))), Effect::None);
    }

    #[test]
    fn requests_carry_function_context_and_the_event_acked() {
        let mut f = [0xffu8; 64];
        encode_notify(&mut f, 65, true);
        assert_eq!(
            &f[..12],
            &[1, 0, 0, F_EVENT_NOTIFICATION, 0, 0, 0, 0, 65, 0, 0, 0]
        );
        assert_eq!(f[12], 0xff, "wrote past the request");
        let ev = decode(&reply(EVENT_SAS_DEVICE_STATUS_CHANGE, true, &[5, 0, 4, 0]));
        encode_ack(&mut f, 66, &ev);
        assert_eq!(f[3], F_EVENT_ACK);
        assert_eq!(le32(&f, 8), 66);
        assert_eq!(le32(&f, 12), EVENT_SAS_DEVICE_STATUS_CHANGE);
        assert_eq!(le32(&f, 16), 0x1234);
    }

    #[test]
    fn short_or_garbage_replies_decode_without_panicking() {
        for n in 0..40 {
            let e = decode(&vec![0xffu8; n]);
            let _ = effect(&e);
        }
        assert_eq!(decode(&[]), Event::default());
    }
}

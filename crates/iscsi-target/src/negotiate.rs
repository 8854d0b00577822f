//! Operational parameter negotiation, target side (RFC 7143 §6.2, §13):
//! each key the initiator offers gets an answer by the key's rule (list:
//! first value we support; boolean AND/OR; numerical min/max; declarative),
//! and the result lands in [`Params`]. Keys we do not know are answered
//! `NotUnderstood`; values out of range are `Reject`.

/// What the session and connection run with after login.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    pub header_digest: bool,
    pub data_digest: bool,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    /// Largest data segment we may send (the initiator's declaration).
    pub max_send_data: u32,
    /// Largest data segment we accept (our declaration).
    pub max_recv_data: u32,
    pub max_burst: u32,
    pub first_burst: u32,
    pub max_outstanding_r2t: u32,
    pub time2wait: u32,
    pub time2retain: u32,
    /// Connections the session may have (MC/S).
    pub max_connections: u32,
}

/// The target's side of the negotiation: what it offers and accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offer {
    /// Digests the node allows (`None` always allowed unless required).
    pub header_digest: DigestRule,
    pub data_digest: DigestRule,
    pub max_recv_data: u32,
    pub max_burst: u32,
    pub first_burst: u32,
    pub immediate_data: bool,
    pub initial_r2t: bool,
    pub max_outstanding_r2t: u32,
    /// Most connections per session we accept.
    pub max_connections: u32,
}

/// How a node treats a digest key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DigestRule {
    /// CRC32C when the initiator prefers it, otherwise None.
    #[default]
    Allow,
    /// Only CRC32C.
    Require,
}

impl Default for Offer {
    fn default() -> Offer {
        Offer {
            header_digest: DigestRule::Allow,
            data_digest: DigestRule::Allow,
            max_recv_data: 256 << 10,
            max_burst: 1 << 20,
            first_burst: 64 << 10,
            immediate_data: true,
            initial_r2t: false,
            max_outstanding_r2t: 1,
            max_connections: 2,
        }
    }
}

impl Params {
    /// The RFC defaults (what holds for keys never negotiated).
    pub fn defaults(offer: &Offer) -> Params {
        Params {
            header_digest: false,
            data_digest: false,
            initial_r2t: true,
            immediate_data: true,
            max_send_data: 8192,
            max_recv_data: offer.max_recv_data,
            max_burst: 262_144,
            first_burst: 65_536,
            max_outstanding_r2t: 1,
            time2wait: 2,
            time2retain: 20,
            max_connections: 1,
        }
    }
}

/// Why negotiation cannot go on (the login fails with this detail).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NegotiateError {
    #[error("no acceptable value for {0}")]
    NoAgreement(&'static str),
}

fn yes(v: &str) -> Option<bool> {
    match v {
        "Yes" => Some(true),
        "No" => Some(false),
        _ => None,
    }
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "Yes"
    } else {
        "No"
    }
}

fn number(v: &str, lo: u32, hi: u32) -> Option<u32> {
    v.parse::<u32>().ok().filter(|n| (lo..=hi).contains(n))
}

/// List rule: the initiator's first value we accept.
fn digest(v: &str, rule: DigestRule) -> Option<bool> {
    v.split(',').find_map(|choice| match choice {
        "CRC32C" => Some(true),
        "None" if rule == DigestRule::Allow => Some(false),
        _ => None,
    })
}

/// Answers one operational key; `None` when the key is not operational
/// (the caller handles login/security keys). The answer goes into `out`.
pub fn answer(
    key: &str,
    value: &str,
    offer: &Offer,
    p: &mut Params,
    out: &mut Vec<(String, String)>,
) -> Option<Result<(), NegotiateError>> {
    let mut put = |v: String| out.push((key.to_string(), v));
    let reject = "Reject".to_string();
    match key {
        "HeaderDigest" | "DataDigest" => {
            let rule = if key == "HeaderDigest" {
                offer.header_digest
            } else {
                offer.data_digest
            };
            let Some(on) = digest(value, rule) else {
                put(reject);
                return Some(Err(NegotiateError::NoAgreement(if key == "HeaderDigest" {
                    "HeaderDigest"
                } else {
                    "DataDigest"
                })));
            };
            if key == "HeaderDigest" {
                p.header_digest = on;
            } else {
                p.data_digest = on;
            }
            put(if on { "CRC32C" } else { "None" }.into());
        }
        "MaxConnections" => match number(value, 1, 65535) {
            Some(n) => {
                p.max_connections = n.min(offer.max_connections.max(1));
                put(p.max_connections.to_string());
            }
            None => put(reject),
        },
        "InitialR2T" => match yes(value) {
            Some(b) => {
                p.initial_r2t = b || offer.initial_r2t;
                put(yes_no(p.initial_r2t).into());
            }
            None => put(reject),
        },
        "ImmediateData" => match yes(value) {
            Some(b) => {
                p.immediate_data = b && offer.immediate_data;
                put(yes_no(p.immediate_data).into());
            }
            None => put(reject),
        },
        "DataPDUInOrder" | "DataSequenceInOrder" => match yes(value) {
            // OR with our Yes: always Yes.
            Some(_) => put("Yes".into()),
            None => put(reject),
        },
        "IFMarker" | "OFMarker" => match yes(value) {
            Some(_) => put("No".into()),
            None => put(reject),
        },
        "MaxRecvDataSegmentLength" => match number(value, 512, 16_777_215) {
            // Declarative: what the initiator takes in one PDU.
            Some(n) => p.max_send_data = n,
            None => put(reject),
        },
        "MaxBurstLength" => match number(value, 512, 16_777_215) {
            Some(n) => {
                p.max_burst = n.min(offer.max_burst);
                p.first_burst = p.first_burst.min(p.max_burst);
                put(p.max_burst.to_string());
            }
            None => put(reject),
        },
        "FirstBurstLength" => match number(value, 512, 16_777_215) {
            Some(n) => {
                p.first_burst = n.min(offer.first_burst).min(p.max_burst);
                put(p.first_burst.to_string());
            }
            None => put(reject),
        },
        "MaxOutstandingR2T" => match number(value, 1, 65535) {
            Some(n) => {
                p.max_outstanding_r2t = n.min(offer.max_outstanding_r2t);
                put(p.max_outstanding_r2t.to_string());
            }
            None => put(reject),
        },
        "DefaultTime2Wait" => match number(value, 0, 3600) {
            Some(n) => {
                p.time2wait = n.max(2);
                put(p.time2wait.to_string());
            }
            None => put(reject),
        },
        "DefaultTime2Retain" => match number(value, 0, 3600) {
            Some(n) => {
                p.time2retain = n.min(20);
                put(p.time2retain.to_string());
            }
            None => put(reject),
        },
        "ErrorRecoveryLevel" => match number(value, 0, 2) {
            Some(_) => put("0".into()),
            None => put(reject),
        },
        _ => return None,
    }
    Some(Ok(()))
}

/// Keys a connection that joins a session may not negotiate: the
/// session's (RFC 7143 §13, "LO"); they are answered `Irrelevant`.
pub const LEADING_ONLY: [&str; 11] = [
    "MaxConnections",
    "InitialR2T",
    "ImmediateData",
    "MaxBurstLength",
    "FirstBurstLength",
    "DefaultTime2Wait",
    "DefaultTime2Retain",
    "MaxOutstandingR2T",
    "DataPDUInOrder",
    "DataSequenceInOrder",
    "ErrorRecoveryLevel",
];

/// The parameters of a connection joining a session with `session`'s:
/// the session-wide values, the connection's own (digests, data segment
/// lengths) from `own`.
pub fn joining(session: &Params, own: &Params) -> Params {
    Params {
        header_digest: own.header_digest,
        data_digest: own.data_digest,
        max_send_data: own.max_send_data,
        max_recv_data: own.max_recv_data,
        ..*session
    }
}

/// Rules that tie keys together once all are in: FirstBurstLength never
/// exceeds MaxBurstLength whatever order the keys came in.
pub fn finish(p: &mut Params) {
    p.first_burst = p.first_burst.min(p.max_burst);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(pairs: &[(&str, &str)], offer: &Offer) -> (Params, Vec<(String, String)>) {
        let mut p = Params::defaults(offer);
        let mut out = Vec::new();
        for (k, v) in pairs {
            answer(k, v, offer, &mut p, &mut out).unwrap().unwrap();
        }
        finish(&mut p);
        (p, out)
    }

    #[test]
    fn rules_per_key() {
        let offer = Offer::default();
        let (p, out) = run(
            &[
                ("HeaderDigest", "None,CRC32C"),
                ("DataDigest", "CRC32C,None"),
                ("InitialR2T", "No"),
                ("ImmediateData", "Yes"),
                ("MaxRecvDataSegmentLength", "65536"),
                ("MaxBurstLength", "16776192"),
                ("FirstBurstLength", "262144"),
                ("DefaultTime2Wait", "0"),
                ("DefaultTime2Retain", "60"),
                ("ErrorRecoveryLevel", "2"),
                ("MaxConnections", "8"),
            ],
            &offer,
        );
        assert!(!p.header_digest && p.data_digest);
        assert!(!p.initial_r2t && p.immediate_data);
        assert_eq!(p.max_send_data, 65536);
        assert_eq!(p.max_burst, 1 << 20);
        assert_eq!(p.first_burst, 64 << 10);
        assert_eq!((p.time2wait, p.time2retain), (2, 20));
        let get = |k: &str| out.iter().find(|(x, _)| x == k).map(|(_, v)| v.as_str());
        assert_eq!(get("HeaderDigest"), Some("None"));
        assert_eq!(get("ErrorRecoveryLevel"), Some("0"));
        assert_eq!(get("MaxConnections"), Some("2"));
        assert_eq!(p.max_connections, 2);
        assert_eq!(get("MaxRecvDataSegmentLength"), None);
    }

    #[test]
    fn required_digest_refuses_none() {
        let offer = Offer {
            header_digest: DigestRule::Require,
            ..Offer::default()
        };
        let mut p = Params::defaults(&offer);
        let mut out = Vec::new();
        assert!(matches!(
            answer("HeaderDigest", "None", &offer, &mut p, &mut out),
            Some(Err(_))
        ));
        assert!(matches!(
            answer("HeaderDigest", "None,CRC32C", &offer, &mut p, &mut out),
            Some(Ok(()))
        ));
        assert!(p.header_digest);
    }

    #[test]
    fn bad_values_are_rejected() {
        let offer = Offer::default();
        let mut p = Params::defaults(&offer);
        let mut out = Vec::new();
        answer("MaxBurstLength", "12", &offer, &mut p, &mut out);
        answer("InitialR2T", "maybe", &offer, &mut p, &mut out);
        assert!(out.iter().all(|(_, v)| v == "Reject"));
        assert!(answer("X-foo", "1", &offer, &mut p, &mut out).is_none());
    }
}

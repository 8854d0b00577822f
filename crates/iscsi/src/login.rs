//! Login (RFC 7143 §6.3, §13): the security stage (AuthMethod None or CHAP,
//! one-way or mutual), the operational stage (digests, ImmediateData,
//! InitialR2T, burst lengths), and SendTargets discovery. Control path: it
//! allocates freely and runs under a deadline, so a target that accepts the
//! TCP connection and then stops answering cannot hang a reconnect.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use crate::chap::{self, ChapSecret, MutualChallenge};
use crate::conn::{connect, pdu_bytes, read_pdu, send_all, with_timeout};
use crate::wire::{build, encode_text, opcode, parse_text, LoginStatus, TargetPdu};

/// What the initiator offers and how it authenticates.
#[derive(Clone, Debug, Default)]
pub struct LoginParams<'a> {
    pub initiator: &'a str,
    /// `None` = a discovery session.
    pub target: Option<&'a str>,
    pub isid: [u8; 6],
    /// One-way CHAP: the target checks us.
    pub chap: Option<ChapSecret>,
    /// Mutual CHAP: we check the target too (needs `chap`).
    pub mutual: Option<ChapSecret>,
    pub header_digest: bool,
    pub data_digest: bool,
    pub immediate_data: bool,
    pub initial_r2t: bool,
    pub first_burst: u32,
    pub max_burst: u32,
    /// Our MaxRecvDataSegmentLength.
    pub max_recv_seg: u32,
}

/// The outcome of a successful login: sequence numbers and the values in
/// force for the session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// StatSN of the last login response (ExpStatSN = this + 1).
    pub statsn: u32,
    /// The next CmdSN (the target's ExpCmdSN).
    pub cmdsn: u32,
    pub maxcmdsn: u32,
    pub tsih: u16,
    pub header_digest: bool,
    pub data_digest: bool,
    pub immediate_data: bool,
    pub initial_r2t: bool,
    pub first_burst: u32,
    pub max_burst: u32,
    /// The target's MaxRecvDataSegmentLength: our largest data segment.
    pub max_send_seg: u32,
    /// Whether CHAP ran (and mutual CHAP verified the target).
    pub chap: bool,
    pub mutual: bool,
}

/// Why a login failed.
#[derive(Debug)]
pub enum LoginError {
    Io(io::Error),
    /// The target refused (status class, detail).
    Refused(LoginStatus),
    /// Mutual CHAP: the target's answer did not match its secret.
    TargetAuth,
    /// The target did not follow the protocol (or the configuration
    /// cannot log in to it).
    Protocol(LoginProtocol),
    Timeout,
}

/// How a login exchange went wrong, short of a refusal with a status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoginProtocol {
    #[error("mutual CHAP needs the initiator's CHAP secret too")]
    MutualWithoutChap,
    #[error("bad PDU: {0}")]
    BadPdu(#[from] crate::wire::WireError),
    #[error("unexpected PDU during login (opcode {0:#04x})")]
    UnexpectedPdu(u8),
    #[error("the target requires CHAP and no secret is configured")]
    ChapRequired,
    #[error("mutual CHAP configured but the target does not authenticate")]
    TargetSkipsAuth,
    #[error("login did not reach full feature phase")]
    NoFullFeature,
    #[error("target did not accept CHAP_A=5")]
    ChapAlgorithm,
    #[error("CHAP_I missing or not 0..255")]
    ChapId,
    #[error("CHAP_C missing or malformed")]
    ChapChallenge,
    #[error("no text response to SendTargets")]
    NoTextResponse,
    #[error("SendTargets listed no target")]
    NoTarget,
    #[error("concurrent reinstatement failed")]
    ReinstatementFailed,
}

impl From<LoginProtocol> for LoginError {
    fn from(e: LoginProtocol) -> LoginError {
        LoginError::Protocol(e)
    }
}

impl fmt::Display for LoginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoginError::Io(e) => write!(f, "login I/O error: {e}"),
            LoginError::Refused(s) => write!(f, "login refused by the target: {}", s.describe()),
            LoginError::TargetAuth => write!(
                f,
                "mutual CHAP: the target's response does not match its secret"
            ),
            LoginError::Protocol(m) => write!(f, "login protocol error: {m}"),
            LoginError::Timeout => write!(f, "login timed out"),
        }
    }
}

impl std::error::Error for LoginError {}

impl From<io::Error> for LoginError {
    fn from(e: io::Error) -> LoginError {
        LoginError::Io(e)
    }
}

impl LoginError {
    /// For the LLD contract's typed transport error.
    pub fn transport(&self) -> ustor_scsi::lld::TransportError {
        use ustor_scsi::lld::TransportError as T;
        match self {
            LoginError::Io(e) => T::Io(e.raw_os_error().unwrap_or(libc::EIO)),
            LoginError::Refused(LoginStatus::InitiatorError(1)) => {
                T::Protocol("iSCSI login: authentication failure (status 0x0201)")
            }
            LoginError::Refused(LoginStatus::InitiatorError(2)) => {
                T::Protocol("iSCSI login: authorization failure (status 0x0202)")
            }
            LoginError::Refused(LoginStatus::InitiatorError(3)) => T::NoDevice,
            LoginError::Refused(_) => T::Protocol("iSCSI login refused by the target"),
            LoginError::TargetAuth => T::Protocol("iSCSI login: mutual CHAP failed"),
            LoginError::Protocol(_) => T::Protocol("iSCSI login protocol error"),
            LoginError::Timeout => T::Io(libc::ETIMEDOUT),
        }
    }
}

/// Stage numbers (CSG/NSG).
const SECURITY: u8 = 0;
const OPERATIONAL: u8 = 1;
const FULL_FEATURE: u8 = 3;
/// Login exchanges before we give up (a budget on the loop).
const MAX_EXCHANGES: usize = 12;

/// Where the security stage is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Auth {
    /// AuthMethod offered.
    Offered,
    /// CHAP_A sent, waiting for CHAP_I/CHAP_C.
    AlgSent,
    /// CHAP_R sent (and our challenge, if mutual): waiting for transit.
    Answered,
    Done,
}

fn find<'a>(keys: &'a [(String, String)], k: &str) -> Option<&'a str> {
    keys.iter()
        .rev()
        .find(|(kk, _)| kk == k)
        .map(|(_, v)| v.as_str())
}

/// Logs in on a connected socket, bounded by `timeout`.
pub async fn login(
    fd: RawFd,
    p: &LoginParams<'_>,
    timeout: Duration,
) -> Result<Negotiated, LoginError> {
    with_timeout(timeout, login_inner(fd, p))
        .await
        .unwrap_or(Err(LoginError::Timeout))
}

async fn login_inner(fd: RawFd, p: &LoginParams<'_>) -> Result<Negotiated, LoginError> {
    let with_chap = p.chap.is_some();
    if p.mutual.is_some() && !with_chap {
        return Err(LoginProtocol::MutualWithoutChap.into());
    }
    let mut keys: Vec<(String, String)> = vec![
        ("InitiatorName".into(), p.initiator.into()),
        (
            "AuthMethod".into(),
            if with_chap { "CHAP,None" } else { "None" }.into(),
        ),
    ];
    match p.target {
        Some(t) => {
            keys.push(("SessionType".into(), "Normal".into()));
            keys.push(("TargetName".into(), t.into()));
        }
        None => keys.push(("SessionType".into(), "Discovery".into())),
    }
    let mut st = Negotiated {
        statsn: 0,
        cmdsn: 0,
        maxcmdsn: 0,
        tsih: 0,
        header_digest: false,
        data_digest: false,
        immediate_data: true,
        initial_r2t: true,
        first_burst: 65536,
        max_burst: 262_144,
        max_send_seg: 8192,
        chap: false,
        mutual: false,
    };
    let mut expstatsn = 0u32;
    let mut csg = SECURITY;
    let mut auth = Auth::Offered;
    let mut mine: Option<MutualChallenge> = None;
    for _ in 0..MAX_EXCHANGES {
        // We may leave the security stage once authentication is settled
        // (or none was offered).
        let transit = csg == OPERATIONAL || !with_chap || auth == Auth::Answered;
        let nsg = if csg == SECURITY {
            OPERATIONAL
        } else {
            FULL_FEATURE
        };
        let pairs: Vec<(&str, &str)> = keys.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let text = encode_text(&pairs);
        let mut b = build::login(p.isid, 0, 0, st.cmdsn, expstatsn, csg, nsg, transit);
        b.set_data_len(text.len());
        send_all(fd, &pdu_bytes(&b, &text)).await?;
        let (rb, data) = read_pdu(fd).await?;
        let pdu = TargetPdu::decode(&rb).map_err(LoginProtocol::BadPdu)?;
        let TargetPdu::LoginResponse {
            transit: t_transit,
            nsg: t_nsg,
            statsn,
            maxcmdsn,
            status,
            tsih,
            ..
        } = pdu
        else {
            return Err(LoginProtocol::UnexpectedPdu(rb.opcode()).into());
        };
        if status != LoginStatus::Success {
            return Err(LoginError::Refused(status));
        }
        st.statsn = statsn;
        expstatsn = statsn.wrapping_add(1);
        st.cmdsn = rb.u32_at(28);
        st.maxcmdsn = maxcmdsn;
        st.tsih = tsih;
        let got = parse_text(&data);
        keys.clear();
        if csg == SECURITY {
            match auth {
                Auth::Offered => match find(&got, "AuthMethod") {
                    Some("CHAP") if with_chap => {
                        keys.push(("CHAP_A".into(), chap::ALG_MD5.into()));
                        auth = Auth::AlgSent;
                    }
                    Some("CHAP") => return Err(LoginProtocol::ChapRequired.into()),
                    _ if p.mutual.is_some() => return Err(LoginProtocol::TargetSkipsAuth.into()),
                    _ => auth = Auth::Done,
                },
                Auth::AlgSent => {
                    keys = chap_answer(p, &got, &mut mine)?;
                    st.chap = true;
                    auth = Auth::Answered;
                }
                Auth::Answered => {
                    if let (Some(m), Some(exp)) = (&mine, &p.mutual) {
                        if !m.verify(exp, find(&got, "CHAP_N"), find(&got, "CHAP_R")) {
                            return Err(LoginError::TargetAuth);
                        }
                        st.mutual = true;
                    }
                    auth = Auth::Done;
                }
                Auth::Done => {}
            }
            if t_transit && t_nsg == OPERATIONAL {
                if p.mutual.is_some() && !st.mutual {
                    return Err(LoginError::TargetAuth);
                }
                csg = OPERATIONAL;
                keys = operational_keys(p);
            }
            continue;
        }
        apply_operational(&mut st, p, &got);
        if t_transit && t_nsg == FULL_FEATURE {
            return Ok(st);
        }
        // The target wants another exchange: we have nothing more to offer.
    }
    Err(LoginProtocol::NoFullFeature.into())
}

/// CHAP_N / CHAP_R for the target's CHAP_I / CHAP_C, and our own challenge
/// when the target is to be checked too.
fn chap_answer(
    p: &LoginParams<'_>,
    got: &[(String, String)],
    mine: &mut Option<MutualChallenge>,
) -> Result<Vec<(String, String)>, LoginError> {
    let cred = p.chap.as_ref().ok_or(LoginError::TargetAuth)?;
    if find(got, "CHAP_A") != Some(chap::ALG_MD5) {
        return Err(LoginProtocol::ChapAlgorithm.into());
    }
    let id: u8 = find(got, "CHAP_I")
        .and_then(|v| v.parse().ok())
        .ok_or(LoginProtocol::ChapId)?;
    let c = find(got, "CHAP_C")
        .and_then(chap::decode_binary)
        .ok_or(LoginProtocol::ChapChallenge)?;
    let r = chap::response(id, cred.secret.as_bytes(), &c);
    let mut keys = vec![
        ("CHAP_N".to_string(), cred.user.clone()),
        ("CHAP_R".to_string(), chap::encode_hex(&r)),
    ];
    if p.mutual.is_some() {
        let m = MutualChallenge::new()?;
        // RFC 7143 §12.1.3: never answer a challenge equal to our own.
        if c == m.challenge {
            return Err(LoginError::TargetAuth);
        }
        keys.push(("CHAP_I".into(), m.id.to_string()));
        keys.push(("CHAP_C".into(), chap::encode_hex(&m.challenge)));
        *mine = Some(m);
    }
    Ok(keys)
}

fn yes_no(b: bool) -> String {
    if b { "Yes" } else { "No" }.into()
}

fn operational_keys(p: &LoginParams<'_>) -> Vec<(String, String)> {
    let dg = |on: bool| if on { "CRC32C,None" } else { "None" }.to_string();
    let mut k = vec![
        ("HeaderDigest".to_string(), dg(p.header_digest)),
        ("DataDigest".to_string(), dg(p.data_digest)),
        (
            "MaxRecvDataSegmentLength".to_string(),
            p.max_recv_seg.to_string(),
        ),
    ];
    if p.target.is_some() {
        k.extend([
            ("InitialR2T".to_string(), yes_no(p.initial_r2t)),
            ("ImmediateData".to_string(), yes_no(p.immediate_data)),
            ("MaxBurstLength".to_string(), p.max_burst.to_string()),
            ("FirstBurstLength".to_string(), p.first_burst.to_string()),
            ("MaxOutstandingR2T".to_string(), "1".into()),
            ("MaxConnections".to_string(), "1".into()),
            ("DataPDUInOrder".to_string(), "Yes".into()),
            ("DataSequenceInOrder".to_string(), "Yes".into()),
            ("ErrorRecoveryLevel".to_string(), "0".into()),
            ("DefaultTime2Wait".to_string(), "0".into()),
            ("DefaultTime2Retain".to_string(), "0".into()),
        ]);
    }
    k
}

/// Takes the target's answers; keys it did not answer keep what we offered
/// where that is the RFC's outcome, else the RFC default.
fn apply_operational(st: &mut Negotiated, p: &LoginParams<'_>, got: &[(String, String)]) {
    let num = |k: &str| find(got, k).and_then(|v| v.parse::<u32>().ok());
    if let Some(v) = find(got, "HeaderDigest") {
        st.header_digest = v == "CRC32C";
    }
    if let Some(v) = find(got, "DataDigest") {
        st.data_digest = v == "CRC32C";
    }
    if let Some(v) = find(got, "ImmediateData") {
        st.immediate_data = v == "Yes" && p.immediate_data;
    } else {
        st.immediate_data = st.immediate_data && p.immediate_data;
    }
    if let Some(v) = find(got, "InitialR2T") {
        st.initial_r2t = v == "Yes" || p.initial_r2t;
    }
    if let Some(v) = num("FirstBurstLength") {
        st.first_burst = v.min(p.first_burst.max(512));
    }
    if let Some(v) = num("MaxBurstLength") {
        st.max_burst = v.min(p.max_burst.max(512));
    }
    if let Some(v) = num("MaxRecvDataSegmentLength") {
        // Declarative: the target's receive limit is our send limit.
        st.max_send_seg = v.clamp(512, 0x00ff_ffff);
    }
}

/// SendTargets discovery: the target names behind a portal.
pub async fn discover(
    portal: &str,
    p: &LoginParams<'_>,
    timeout: Duration,
) -> Result<Vec<String>, LoginError> {
    let stream = connect(portal, timeout).await?;
    let fd = stream.as_raw_fd();
    let mut dp = p.clone();
    dp.target = None;
    dp.header_digest = false;
    dp.data_digest = false;
    let n = login(fd, &dp, timeout).await?;
    let text = encode_text(&[("SendTargets", "All")]);
    let mut b = build::text(1, n.cmdsn, n.statsn.wrapping_add(1));
    b.set_data_len(text.len());
    send_all(fd, &pdu_bytes(&b, &text)).await?;
    let (rb, data) = with_timeout(timeout, read_pdu(fd))
        .await
        .ok_or(LoginError::Timeout)??;
    if rb.opcode() != opcode::TEXT_RESP {
        return Err(LoginProtocol::NoTextResponse.into());
    }
    let lo = build::logout(2, n.cmdsn.wrapping_add(1), rb.u32_at(24).wrapping_add(1));
    let _ = send_all(fd, &pdu_bytes(&lo, &[])).await;
    let _ = with_timeout(timeout, read_pdu(fd)).await;
    Ok(parse_text(&data)
        .into_iter()
        .filter(|(k, _)| k == "TargetName")
        .map(|(_, v)| v)
        .collect())
}

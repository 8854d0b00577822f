//! The login phase, target side, without sockets (RFC 7143 §6, §11.12-13):
//! one [`Login`] per connection takes each Login Request (header and its
//! whole, continued text) and answers a Login Response. It checks the
//! stage transitions, resolves the target node through a [`Catalog`]
//! (access by initiator name and portal group), runs CHAP (MD5, one-way or
//! mutual, `ustor_iscsi::chap`) or None by the node's policy, and
//! negotiates the operational keys ([`crate::negotiate`]).

use std::net::IpAddr;

use ustor_iscsi::chap::{self, MutualChallenge, ALG_MD5};
use ustor_iscsi::wire::{encode_text, opcode, parse_text, Bhs};

use crate::negotiate::{self, Offer, Params};

/// Login stages (CSG/NSG values).
pub const SECURITY: u8 = 0;
pub const OPERATIONAL: u8 = 1;
pub const FULL_FEATURE: u8 = 3;

/// Most bytes of login text one negotiation accepts (continued PDUs).
pub const MAX_LOGIN_TEXT: usize = 64 << 10;

/// Status class/detail of a failed login (RFC 7143 §11.13.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoginFail {
    #[error("authentication failed")]
    Auth,
    #[error("initiator not allowed")]
    Authorization,
    #[error("target not found")]
    NotFound,
    #[error("missing parameter")]
    Missing,
    #[error("session does not exist")]
    NoSession,
    #[error("too many connections in the session")]
    TooManyConnections,
    #[error("connection cannot be included in the session")]
    CantInclude,
    #[error("invalid request during login")]
    Invalid,
    #[error("unsupported version")]
    Version,
    #[error("out of resources")]
    Resources,
}

impl LoginFail {
    fn class_detail(self) -> (u8, u8) {
        match self {
            LoginFail::Auth => (2, 1),
            LoginFail::Authorization => (2, 2),
            LoginFail::NotFound => (2, 3),
            LoginFail::Version => (2, 5),
            LoginFail::TooManyConnections => (2, 6),
            LoginFail::CantInclude => (2, 8),
            LoginFail::Missing => (2, 7),
            LoginFail::NoSession => (2, 10),
            LoginFail::Invalid => (2, 11),
            LoginFail::Resources => (3, 2),
        }
    }
}

/// CHAP policy of a node or of discovery.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ChapPolicy {
    /// AuthMethod=None only.
    #[default]
    Disabled,
    /// Whatever the initiator prefers of CHAP and None.
    Optional,
    /// CHAP only; `mutual`: the initiator must challenge us too.
    Required { mutual: bool },
}

/// One CHAP credential: the initiator proves `user`/`secret`; for mutual
/// CHAP we answer as `muser`/`msecret`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Secret {
    pub user: String,
    pub secret: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub muser: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub msecret: String,
}

/// What login needs to know about the node (or discovery) it logs into.
#[derive(Clone, Debug, Default)]
pub struct Access {
    pub chap: ChapPolicy,
    pub secrets: Vec<Secret>,
    pub offer: Offer,
    pub alias: Option<String>,
}

/// Resolves names to nodes during login.
pub trait Catalog {
    type Node: Clone;
    /// The node `target` for `initiator` arriving on portal group `tag`
    /// from address `peer` (`None`: unknown, a socketless test).
    fn node(
        &self,
        target: &str,
        initiator: &str,
        tag: u32,
        peer: Option<IpAddr>,
    ) -> Result<(Self::Node, Access), LoginFail>;
    /// Access rules of discovery sessions.
    fn discovery(&self) -> Access;
    /// A new session handle (TSIH, never 0).
    fn new_tsih(&self) -> u16;
    /// The session-wide parameters of session `tsih`, which a connection
    /// of this initiator port (name, ISID), arriving for `target` on
    /// portal group `tag`, joins (MC/S or connection reinstatement).
    fn session(
        &self,
        _tsih: u16,
        _initiator: &str,
        _isid: &[u8; 6],
        _target: &str,
        _tag: u32,
    ) -> Result<Params, LoginFail> {
        Err(LoginFail::NoSession)
    }
}

/// What a finished login established.
#[derive(Clone, Debug)]
pub struct Established<N> {
    /// `None` for a discovery session.
    pub node: Option<N>,
    pub initiator: String,
    pub isid: [u8; 6],
    pub tsih: u16,
    /// The first connection of its session (the login's TSIH was 0);
    /// otherwise it joins session `tsih`.
    pub leading: bool,
    /// The connection's CID (from the final login request).
    pub cid: u16,
    pub params: Params,
    /// StatSN of the next response.
    pub statsn: u32,
    /// ExpCmdSN after login (the login's CmdSN: login does not advance it).
    pub exp_cmdsn: u32,
}

/// The answer to one request.
pub struct Answer<N> {
    pub bhs: Bhs,
    pub text: Vec<u8>,
    /// Set on the response that moves to full feature phase.
    pub done: Option<Established<N>>,
    /// The login failed: send and close.
    pub failed: bool,
}

enum Chap {
    Idle,
    WaitAlgorithm,
    WaitResponse(MutualChallenge),
    Done,
}

/// Login state of one connection.
pub struct Login<C: Catalog> {
    tag: u32,
    peer: Option<IpAddr>,
    stage: u8,
    first: bool,
    chap: Chap,
    authed: bool,
    initiator: Option<String>,
    discovery: bool,
    node: Option<C::Node>,
    access: Option<Access>,
    params: Params,
    sent_declarations: bool,
    isid: [u8; 6],
    /// The TSIH the initiator asked for (0: a new session).
    tsih: u16,
    /// The session-wide parameters of the session a non-leading login
    /// joins.
    joins: Option<Params>,
    statsn: u32,
    pending: Vec<u8>,
}

fn key<'a>(pairs: &'a [(String, String)], k: &str) -> Option<&'a str> {
    pairs.iter().find(|(x, _)| x == k).map(|(_, v)| v.as_str())
}

impl<C: Catalog> Login<C> {
    /// The initiator's address, checked against initiator-group netmasks.
    pub fn with_peer(mut self, peer: IpAddr) -> Login<C> {
        self.peer = Some(peer);
        self
    }

    /// A connection that arrived on portal group `tag`.
    pub fn new(tag: u32) -> Login<C> {
        Login {
            tag,
            peer: None,
            stage: SECURITY,
            first: true,
            chap: Chap::Idle,
            authed: false,
            initiator: None,
            discovery: false,
            node: None,
            access: None,
            params: Params::defaults(&Offer::default()),
            sent_declarations: false,
            isid: [0; 6],
            tsih: 0,
            joins: None,
            statsn: 0,
            pending: Vec::new(),
        }
    }

    /// Answers one Login Request (`req` is its BHS, `data` its text).
    pub fn step(&mut self, cat: &C, req: &Bhs, data: &[u8]) -> Answer<C::Node> {
        match self.try_step(cat, req, data) {
            Ok(a) => a,
            Err(f) => self.fail(req, f),
        }
    }

    fn header(&mut self, req: &Bhs, transit: bool, nsg: u8, tsih: u16) -> Bhs {
        let csg = self.stage;
        let flags = if transit { 0x80 } else { 0 } | (csg & 3) << 2 | (nsg & 3);
        let mut b = Bhs::new(opcode::LOGIN_RESP, false, flags);
        b.0[8..14].copy_from_slice(&req.0[8..14]);
        let cmdsn = req.u32_at(24);
        b.set_u16(14, tsih)
            .set_itt(req.itt())
            .set_u32(24, self.statsn)
            .set_u32(28, cmdsn)
            .set_u32(32, cmdsn);
        self.statsn = self.statsn.wrapping_add(1);
        b
    }

    /// The failed answer to `req` (the login ends).
    pub fn refuse(&mut self, req: &Bhs, f: LoginFail) -> Answer<C::Node> {
        self.fail(req, f)
    }

    fn fail(&mut self, req: &Bhs, f: LoginFail) -> Answer<C::Node> {
        tracing::debug!("iscsi login failed: {f}");
        let mut b = self.header(req, false, 0, 0);
        let (class, detail) = f.class_detail();
        b.set_u8(36, class).set_u8(37, detail);
        Answer {
            bhs: b,
            text: Vec::new(),
            done: None,
            failed: true,
        }
    }

    fn try_step(&mut self, cat: &C, req: &Bhs, data: &[u8]) -> Result<Answer<C::Node>, LoginFail> {
        if req.opcode() != opcode::LOGIN_REQ {
            return Err(LoginFail::Invalid);
        }
        if req.u8_at(3) > 0 {
            return Err(LoginFail::Version);
        }
        let (transit, cont) = (req.flags() & 0x80 != 0, req.flags() & 0x40 != 0);
        let (csg, nsg) = ((req.flags() >> 2) & 3, req.flags() & 3);
        if self.first {
            self.statsn = req.u32_at(28);
            self.isid.copy_from_slice(&req.0[8..14]);
            // Non-zero: a connection joins session `tsih` (checked with
            // the login keys).
            self.tsih = req.u16_at(14);
            if csg == OPERATIONAL {
                self.stage = OPERATIONAL;
            }
        }
        if csg != self.stage || (transit && (cont || nsg <= csg || nsg == 2)) {
            return Err(LoginFail::Invalid);
        }
        if self.pending.len() + data.len() > MAX_LOGIN_TEXT {
            return Err(LoginFail::Invalid);
        }
        self.pending.extend_from_slice(data);
        if cont {
            // More text follows: acknowledge and wait for the rest.
            let b = self.header(req, false, nsg, 0);
            return Ok(self.answer(b, Vec::new()));
        }
        let text = std::mem::take(&mut self.pending);
        let pairs = parse_text(&text);
        let mut out = Vec::new();
        self.login_keys(cat, &pairs, &mut out)?;
        let access = self.access.clone().unwrap_or_default();
        if self.stage == SECURITY {
            self.security(&pairs, &access, &mut out)?;
        } else if !self.authed && access.chap != ChapPolicy::Disabled {
            if matches!(access.chap, ChapPolicy::Required { .. }) {
                return Err(LoginFail::Auth);
            }
            self.authed = true;
        }
        let may_transit = transit && (self.stage == OPERATIONAL || self.authed);
        let declare = self.stage == OPERATIONAL || (may_transit && nsg == FULL_FEATURE);
        self.operational(&pairs, &access, declare, &mut out)?;
        let mut tsih = 0;
        let mut done = None;
        if may_transit && nsg == FULL_FEATURE {
            negotiate::finish(&mut self.params);
            tsih = match self.joins {
                Some(session) => {
                    self.params = negotiate::joining(&session, &self.params);
                    self.tsih
                }
                None => cat.new_tsih(),
            };
        }
        let b = self.header(req, may_transit, nsg, tsih);
        if may_transit {
            self.stage = nsg;
            if nsg == FULL_FEATURE {
                done = Some(Established {
                    node: self.node.clone(),
                    initiator: self.initiator.clone().unwrap_or_default(),
                    isid: self.isid,
                    tsih,
                    leading: self.joins.is_none(),
                    cid: req.u16_at(20),
                    params: self.params,
                    statsn: self.statsn,
                    exp_cmdsn: req.u32_at(24),
                });
            }
        }
        let text = pairs_text(&out);
        let mut a = self.answer(b, text);
        a.done = done;
        Ok(a)
    }

    fn answer(&mut self, bhs: Bhs, text: Vec<u8>) -> Answer<C::Node> {
        Answer {
            bhs,
            text,
            done: None,
            failed: false,
        }
    }

    /// InitiatorName, SessionType, TargetName: the first request names
    /// who logs in where.
    fn login_keys(
        &mut self,
        cat: &C,
        pairs: &[(String, String)],
        out: &mut Vec<(String, String)>,
    ) -> Result<(), LoginFail> {
        if !self.first {
            return Ok(());
        }
        self.first = false;
        let initiator = key(pairs, "InitiatorName").ok_or(LoginFail::Missing)?;
        self.initiator = Some(initiator.to_string());
        match key(pairs, "SessionType").unwrap_or("Normal") {
            "Discovery" if self.tsih != 0 => return Err(LoginFail::NoSession),
            "Discovery" => {
                self.discovery = true;
                self.access = Some(cat.discovery());
            }
            "Normal" => {
                let target = key(pairs, "TargetName").ok_or(LoginFail::Missing)?;
                let (node, access) = cat.node(target, initiator, self.tag, self.peer)?;
                if self.tsih != 0 {
                    let p = cat.session(self.tsih, initiator, &self.isid, target, self.tag)?;
                    self.joins = Some(p);
                }
                if let Some(a) = &access.alias {
                    out.push(("TargetAlias".into(), a.clone()));
                }
                out.push(("TargetPortalGroupTag".into(), self.tag.to_string()));
                self.node = Some(node);
                self.access = Some(access);
            }
            _ => return Err(LoginFail::Invalid),
        }
        let offer = self.access.as_ref().map(|a| a.offer).unwrap_or_default();
        self.params = Params::defaults(&offer);
        Ok(())
    }

    fn security(
        &mut self,
        pairs: &[(String, String)],
        access: &Access,
        out: &mut Vec<(String, String)>,
    ) -> Result<(), LoginFail> {
        if let Some(methods) = key(pairs, "AuthMethod") {
            let pick = methods.split(',').find(|m| {
                matches!(
                    (*m, access.chap),
                    ("None", ChapPolicy::Disabled | ChapPolicy::Optional)
                        | ("CHAP", ChapPolicy::Optional | ChapPolicy::Required { .. })
                )
            });
            match pick {
                Some("None") => {
                    self.authed = true;
                    self.chap = Chap::Done;
                    out.push(("AuthMethod".into(), "None".into()));
                }
                Some(_) => {
                    self.chap = Chap::WaitAlgorithm;
                    out.push(("AuthMethod".into(), "CHAP".into()));
                }
                None => return Err(LoginFail::Auth),
            }
            return Ok(());
        }
        match std::mem::replace(&mut self.chap, Chap::Idle) {
            Chap::WaitAlgorithm => {
                let algs = key(pairs, "CHAP_A").ok_or(LoginFail::Auth)?;
                if !algs.split(',').any(|a| a == ALG_MD5) {
                    return Err(LoginFail::Auth);
                }
                let ch = MutualChallenge::new().map_err(|_| LoginFail::Resources)?;
                out.push(("CHAP_A".into(), ALG_MD5.into()));
                out.push(("CHAP_I".into(), ch.id.to_string()));
                out.push(("CHAP_C".into(), chap::encode_hex(&ch.challenge)));
                self.chap = Chap::WaitResponse(ch);
                Ok(())
            }
            Chap::WaitResponse(ch) => {
                self.check_chap(pairs, access, &ch, out)?;
                self.chap = Chap::Done;
                self.authed = true;
                Ok(())
            }
            Chap::Done if self.authed => {
                self.chap = Chap::Done;
                Ok(())
            }
            _ => Err(LoginFail::Auth),
        }
    }

    fn check_chap(
        &self,
        pairs: &[(String, String)],
        access: &Access,
        ch: &MutualChallenge,
        out: &mut Vec<(String, String)>,
    ) -> Result<(), LoginFail> {
        let name = key(pairs, "CHAP_N").ok_or(LoginFail::Auth)?;
        let sec = access
            .secrets
            .iter()
            .find(|s| s.user == name)
            .ok_or(LoginFail::Auth)?;
        let cred = chap::ChapSecret {
            user: sec.user.clone(),
            secret: sec.secret.clone(),
        };
        if !ch.verify(&cred, Some(name), key(pairs, "CHAP_R")) {
            return Err(LoginFail::Auth);
        }
        let mutual_required = matches!(access.chap, ChapPolicy::Required { mutual: true });
        match (key(pairs, "CHAP_I"), key(pairs, "CHAP_C")) {
            (Some(id), Some(c)) => {
                let id: u8 = id.parse().map_err(|_| LoginFail::Auth)?;
                let c = chap::decode_binary(c).ok_or(LoginFail::Auth)?;
                // A challenge that repeats ours is a reflection attack.
                if c.is_empty() || c == ch.challenge || sec.msecret.is_empty() {
                    return Err(LoginFail::Auth);
                }
                let r = chap::response(id, sec.msecret.as_bytes(), &c);
                out.push(("CHAP_N".into(), sec.muser.clone()));
                out.push(("CHAP_R".into(), chap::encode_hex(&r)));
                Ok(())
            }
            (None, None) if !mutual_required => Ok(()),
            _ => Err(LoginFail::Auth),
        }
    }

    fn operational(
        &mut self,
        pairs: &[(String, String)],
        access: &Access,
        declare: bool,
        out: &mut Vec<(String, String)>,
    ) -> Result<(), LoginFail> {
        const LOGIN_KEYS: [&str; 5] = [
            "InitiatorName",
            "InitiatorAlias",
            "TargetName",
            "SessionType",
            "AuthMethod",
        ];
        for (k, v) in pairs {
            if LOGIN_KEYS.contains(&k.as_str()) || k.starts_with("CHAP_") {
                continue;
            }
            if self.joins.is_some() && negotiate::LEADING_ONLY.contains(&k.as_str()) {
                // The session's value holds.
                out.push((k.clone(), "Irrelevant".into()));
                continue;
            }
            match negotiate::answer(k, v, &access.offer, &mut self.params, out) {
                Some(Ok(())) => {}
                Some(Err(_)) => return Err(LoginFail::Invalid),
                None => out.push((k.clone(), "NotUnderstood".into())),
            }
        }
        if declare && !self.already_declared() {
            out.push((
                "MaxRecvDataSegmentLength".into(),
                self.params.max_recv_data.to_string(),
            ));
        }
        Ok(())
    }
}

impl<C: Catalog> Login<C> {
    /// Our MaxRecvDataSegmentLength goes out once per login.
    fn already_declared(&mut self) -> bool {
        std::mem::replace(&mut self.sent_declarations, true)
    }
}

fn pairs_text(out: &[(String, String)]) -> Vec<u8> {
    let refs: Vec<(&str, &str)> = out.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    encode_text(&refs)
}

#[cfg(test)]
mod tests;

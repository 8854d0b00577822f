//! Login without sockets: stages, CHAP one-way and mutual, failures.

use super::*;
use ustor_iscsi::wire::build;

struct Cat(Access);

impl Catalog for Cat {
    type Node = u32;
    fn node(
        &self,
        target: &str,
        _i: &str,
        _t: u32,
        _p: Option<std::net::IpAddr>,
    ) -> Result<(u32, Access), LoginFail> {
        if target == "iqn.t" {
            Ok((7, self.0.clone()))
        } else {
            Err(LoginFail::NotFound)
        }
    }
    fn discovery(&self) -> Access {
        Access::default()
    }
    fn new_tsih(&self) -> u16 {
        9
    }
}

/// A catalog with session 0x55 (initiator `iqn.i`, ISID ..01, on `iqn.t`
/// through portal group 1).
struct WithSession(Params);

impl Catalog for WithSession {
    type Node = u32;
    fn node(
        &self,
        target: &str,
        i: &str,
        t: u32,
        p: Option<std::net::IpAddr>,
    ) -> Result<(u32, Access), LoginFail> {
        Cat(Access::default()).node(target, i, t, p)
    }
    fn discovery(&self) -> Access {
        Access::default()
    }
    fn new_tsih(&self) -> u16 {
        9
    }
    fn session(
        &self,
        tsih: u16,
        initiator: &str,
        isid: &[u8; 6],
        target: &str,
        tag: u32,
    ) -> Result<Params, LoginFail> {
        let ours = (0x55, "iqn.i", [0x80, 0, 0, 0, 0, 1], "iqn.t");
        match (tsih, initiator, *isid, target) == ours {
            true if tag == 1 => Ok(self.0),
            true => Err(LoginFail::CantInclude),
            false => Err(LoginFail::NoSession),
        }
    }
}

/// A joining login: the session's parameters hold (its leading-only keys
/// answered Irrelevant), the connection's own are negotiated.
#[test]
fn joining_login_takes_the_session_parameters() {
    let mut session = Params::defaults(&Offer::default());
    session.max_connections = 2;
    session.max_burst = 65536;
    let cat = WithSession(session);
    let join = |tsih: u16, tag: u32, keys: &[(&str, &str)]| {
        let mut l = Login::<WithSession>::new(tag);
        let mut b = build::login([0x80, 0, 0, 0, 0, 1], tsih, 1, 0, 0, 1, 3, true);
        b.set_u16(20, 4);
        let mut all = vec![("InitiatorName", "iqn.i"), ("TargetName", "iqn.t")];
        all.extend_from_slice(keys);
        l.step(&cat, &b, &text(&all))
    };
    let a = join(
        0x55,
        1,
        &[("MaxBurstLength", "262144"), ("HeaderDigest", "CRC32C")],
    );
    let e = a.done.clone().expect("joined");
    assert!(!e.leading);
    assert_eq!((e.tsih, e.cid), (0x55, 4));
    assert_eq!(a.bhs.u16_at(14), 0x55);
    assert_eq!(get(&a, "MaxBurstLength").as_deref(), Some("Irrelevant"));
    assert_eq!(e.params.max_burst, 65536);
    assert_eq!(e.params.max_connections, 2);
    assert!(e.params.header_digest, "a connection key");
    let a = join(0x56, 1, &[]);
    assert!(a.failed);
    assert_eq!((a.bhs.u8_at(36), a.bhs.u8_at(37)), (2, 0x0a));
    let a = join(0x55, 2, &[]);
    assert_eq!((a.bhs.u8_at(36), a.bhs.u8_at(37)), (2, 0x08));
    // A discovery session has no session to join.
    let mut l = Login::<WithSession>::new(1);
    let b = build::login([0x80, 0, 0, 0, 0, 1], 0x55, 1, 0, 0, 1, 3, true);
    let keys = [("InitiatorName", "iqn.i"), ("SessionType", "Discovery")];
    let a = l.step(&cat, &b, &text(&keys));
    assert_eq!((a.bhs.u8_at(36), a.bhs.u8_at(37)), (2, 0x0a));
}

fn req(csg: u8, nsg: u8, transit: bool) -> Bhs {
    build::login([0x80, 0, 0, 0, 0, 1], 0, 1, 0, 0, csg, nsg, transit)
}

fn text(pairs: &[(&str, &str)]) -> Vec<u8> {
    encode_text(pairs)
}

fn get(a: &Answer<u32>, k: &str) -> Option<String> {
    parse_text(&a.text)
        .into_iter()
        .find(|(x, _)| x == k)
        .map(|(_, v)| v)
}

#[test]
fn none_then_operational_then_full_feature() {
    let cat = Cat(Access::default());
    let mut l = Login::<Cat>::new(1);
    let a = l.step(
        &cat,
        &req(0, 1, true),
        &text(&[
            ("InitiatorName", "iqn.i"),
            ("TargetName", "iqn.t"),
            ("AuthMethod", "None"),
        ]),
    );
    assert!(!a.failed);
    assert_eq!(a.bhs.flags() & 0x80, 0x80);
    assert_eq!(get(&a, "AuthMethod").as_deref(), Some("None"));
    assert_eq!(get(&a, "TargetPortalGroupTag").as_deref(), Some("1"));
    let a = l.step(
        &cat,
        &req(1, 3, true),
        &text(&[
            ("HeaderDigest", "CRC32C,None"),
            ("MaxBurstLength", "262144"),
            ("X-x", "1"),
        ]),
    );
    let e = a.done.clone().expect("full feature");
    assert_eq!(e.node, Some(7));
    assert_eq!(e.tsih, 9);
    assert!(e.params.header_digest);
    assert_eq!(get(&a, "X-x").as_deref(), Some("NotUnderstood"));
    assert!(get(&a, "MaxRecvDataSegmentLength").is_some());
}

fn chap_login(access: Access, mutual: Option<(&str, &str)>, secret: &str) -> bool {
    let cat = Cat(access);
    let mut l = Login::<Cat>::new(1);
    let a = l.step(
        &cat,
        &req(0, 1, false),
        &text(&[
            ("InitiatorName", "iqn.i"),
            ("TargetName", "iqn.t"),
            ("AuthMethod", "CHAP,None"),
        ]),
    );
    if a.failed || get(&a, "AuthMethod").as_deref() != Some("CHAP") {
        return false;
    }
    let a = l.step(&cat, &req(0, 1, false), &text(&[("CHAP_A", "7,5")]));
    let id: u8 = get(&a, "CHAP_I").unwrap().parse().unwrap();
    let c = chap::decode_binary(&get(&a, "CHAP_C").unwrap()).unwrap();
    let r = chap::encode_hex(&chap::response(id, secret.as_bytes(), &c));
    let mine = [5u8; 16];
    let mut keys = vec![("CHAP_N", "user"), ("CHAP_R", r.as_str())];
    let hex = chap::encode_hex(&mine);
    if mutual.is_some() {
        keys.push(("CHAP_I", "33"));
        keys.push(("CHAP_C", hex.as_str()));
    }
    let a = l.step(&cat, &req(0, 1, true), &text(&keys));
    if a.failed {
        return false;
    }
    if let Some((muser, msecret)) = mutual {
        let want = chap::encode_hex(&chap::response(33, msecret.as_bytes(), &mine));
        assert_eq!(get(&a, "CHAP_N").as_deref(), Some(muser));
        assert_eq!(get(&a, "CHAP_R"), Some(want));
    }
    a.bhs.flags() & 0x80 != 0
}

fn chap_access(mutual: bool) -> Access {
    Access {
        chap: ChapPolicy::Required { mutual },
        secrets: vec![Secret {
            user: "user".into(),
            secret: "initiator-secret".into(),
            muser: "tgt".into(),
            msecret: "target-secret".into(),
        }],
        ..Access::default()
    }
}

#[test]
fn chap_one_way_and_mutual() {
    assert!(chap_login(chap_access(false), None, "initiator-secret"));
    assert!(!chap_login(chap_access(false), None, "wrong"));
    assert!(chap_login(
        chap_access(true),
        Some(("tgt", "target-secret")),
        "initiator-secret"
    ));
    // Mutual required, the initiator does not challenge: refused.
    assert!(!chap_login(chap_access(true), None, "initiator-secret"));
}

#[test]
fn failures() {
    let cat = Cat(chap_access(false));
    let mut l = Login::<Cat>::new(1);
    let a = l.step(
        &cat,
        &req(0, 1, true),
        &text(&[("InitiatorName", "iqn.i"), ("TargetName", "nope")]),
    );
    assert!(a.failed);
    assert_eq!((a.bhs.u8_at(36), a.bhs.u8_at(37)), (2, 3));
    let mut l = Login::<Cat>::new(1);
    let a = l.step(&cat, &req(0, 1, true), &text(&[("TargetName", "iqn.t")]));
    assert_eq!((a.bhs.u8_at(36), a.bhs.u8_at(37)), (2, 7));
    // CHAP required, only None offered.
    let mut l = Login::<Cat>::new(1);
    let a = l.step(
        &cat,
        &req(0, 1, true),
        &text(&[
            ("InitiatorName", "iqn.i"),
            ("TargetName", "iqn.t"),
            ("AuthMethod", "None"),
        ]),
    );
    assert_eq!((a.bhs.u8_at(36), a.bhs.u8_at(37)), (2, 1));
    // Skipping security when CHAP is required.
    let mut l = Login::<Cat>::new(1);
    let a = l.step(
        &cat,
        &req(1, 3, true),
        &text(&[("InitiatorName", "iqn.i"), ("TargetName", "iqn.t")]),
    );
    assert!(a.failed);
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn text_strategy() -> impl Strategy<Value = Vec<u8>> {
        let key = prop::sample::select(vec![
            "InitiatorName",
            "TargetName",
            "SessionType",
            "AuthMethod",
            "CHAP_A",
            "CHAP_N",
            "CHAP_R",
            "CHAP_I",
            "CHAP_C",
            "HeaderDigest",
            "MaxBurstLength",
            "FirstBurstLength",
            "MaxRecvDataSegmentLength",
            "InitialR2T",
            "X-junk",
        ]);
        let pair = (key, "[ -~]{0,40}").prop_map(|(k, v)| format!("{k}={v}\0").into_bytes());
        prop_oneof![
            prop::collection::vec(pair, 0..8).prop_map(|v| v.concat()),
            prop::collection::vec(any::<u8>(), 0..512),
        ]
    }

    proptest! {
        /// Any sequence of login requests, well-formed keys or garbage,
        /// gets an answer (or a failure), never a panic.
        #[test]
        fn login_never_panics(
            reqs in prop::collection::vec((any::<[u8; 48]>(), text_strategy()), 1..6),
        ) {
            let cat = Cat(chap_access(true));
            let mut l = Login::<Cat>::new(1);
            for (mut h, t) in reqs {
                h[0] = (h[0] & 0x40) | opcode::LOGIN_REQ;
                let a = l.step(&cat, &Bhs(h), &t);
                if a.failed || a.done.is_some() {
                    break;
                }
            }
        }

        /// Operational keys with any value.
        #[test]
        fn keys_never_panic(k in "[A-Za-z]{1,30}", v in "[ -~]{0,64}") {
            let offer = Offer::default();
            let mut p = negotiate::Params::defaults(&offer);
            let mut out = Vec::new();
            let _ = negotiate::answer(&k, &v, &offer, &mut p, &mut out);
            for key in ["MaxBurstLength", "FirstBurstLength", "HeaderDigest", "DefaultTime2Wait"] {
                let _ = negotiate::answer(key, &v, &offer, &mut p, &mut out);
            }
            negotiate::finish(&mut p);
            prop_assert!(p.first_burst <= p.max_burst);
        }
    }
}

//! libiscsi's command-line tools against the target: discovery with
//! iscsi-ls, INQUIRY (standard and VPD) with iscsi-inq, READ CAPACITY(16)
//! with iscsi-readcapacity16, on 512- and 4096-byte LUNs.

mod common;

use common::*;
use ustor_iscsi_target::{AuthGroupParams, IscsiOptions, Secret};

#[test]
fn iscsi_ls_discovers_the_node_and_its_lun() {
    if !have("iscsi-ls") {
        return;
    }
    let f = start(64 << 20, 512);
    let out = stdout(&run("iscsi-ls", &[&format!("iscsi://{}", f.portal())]));
    assert!(
        out.contains(&format!("Target:{NODE} Portal:127.0.0.1:{},1", f.port)),
        "{out}"
    );
    let out = stdout(&run(
        "iscsi-ls",
        &["-s", &format!("iscsi://{}", f.portal())],
    ));
    assert!(out.contains("Lun:0"), "{out}");
    assert!(out.contains("Type:DIRECT_ACCESS"), "{out}");
    // libiscsi prints the size from READ CAPACITY(10) rounded down (63M).
    assert!(out.contains("(Size:6"), "{out}");
}

#[test]
fn iscsi_inq_standard_and_vpd() {
    if !have("iscsi-inq") {
        return;
    }
    let f = start(64 << 20, 512);
    let out = stdout(&run("iscsi-inq", &[&f.url(0)]));
    assert!(out.contains("Vendor:USTOR"), "{out}");
    assert!(
        out.contains("Peripheral Device Type:DIRECT_ACCESS"),
        "{out}"
    );
    let out = stdout(&run("iscsi-inq", &["-e", "1", &f.url(0)]));
    for page in ["0x80", "0x83", "0xb0", "0xb1"] {
        assert!(out.contains(&format!("Page:{page}")), "{out}");
    }
    let out = stdout(&run("iscsi-inq", &["-e", "1", "-c", "128", &f.url(0)]));
    assert!(out.contains("Unit Serial Number:[Malloc0]"), "{out}");
    let out = stdout(&run("iscsi-inq", &["-e", "1", "-c", "131", &f.url(0)]));
    assert!(out.contains("Designator Type:(3) NAA"), "{out}");
}

#[test]
fn iscsi_readcapacity16_both_block_sizes() {
    if !have("iscsi-readcapacity16") {
        return;
    }
    for (bs, size) in [(512u32, 64u64 << 20), (4096, 128 << 20)] {
        let f = start(size, bs);
        let out = stdout(&run("iscsi-readcapacity16", &[&f.url(0)]));
        assert!(
            out.contains(&format!("LOGICAL BLOCK LENGTH IN BYTES:{bs}")),
            "{out}"
        );
        let last = size / bs as u64 - 1;
        assert!(
            out.contains(&format!("RETURNED LOGICAL BLOCK ADDRESS:{last}")),
            "{out}"
        );
        assert!(out.contains(&format!("Total size:{size}")), "{out}");
    }
}

#[test]
fn discovery_session_with_chap() {
    if !have("iscsi-ls") {
        return;
    }
    let f = start_full(
        16 << 20,
        512,
        |_| {},
        |t| {
            t.create_auth_group(&AuthGroupParams {
                tag: 1,
                secrets: vec![Secret {
                    user: "disc".into(),
                    secret: "discsecret12".into(),
                    muser: String::new(),
                    msecret: String::new(),
                }],
            })
            .unwrap();
            t.set_options(IscsiOptions {
                require_chap: true,
                chap_group: 1,
                ..t.get_options()
            })
            .unwrap();
        },
    );
    let want = format!("Target:{NODE} Portal:127.0.0.1:{},1", f.port);
    // Without credentials, or with a wrong secret, the login fails.
    for url in [
        format!("iscsi://{}", f.portal()),
        format!("iscsi://disc%wrongsecret1@{}", f.portal()),
    ] {
        let out = std::process::Command::new("iscsi-ls")
            .arg(&url)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            !out.status.success() && !text.contains(&want),
            "{url}: {text}"
        );
    }
    let out = stdout(&run(
        "iscsi-ls",
        &[&format!("iscsi://disc%discsecret12@{}", f.portal())],
    ));
    assert!(out.contains(&want), "{out}");
}

//! A lean CI subset of libiscsi's conformance suite (`iscsi-test-cu`,
//! Debian libiscsi-bin) against the target: suites that must pass whole,
//! on a 512-byte and a 4096-byte LUN. The full per-suite results are in
//! docs/iscsi.md with the command that produced them.

mod common;

use std::process::Command;

use common::*;
use ustor_iscsi_target::IscsiOptions;

/// Suites that pass without a failure (a test the suite skips for a
/// command we do not offer counts as passed, as CUnit counts it). The
/// reservation suites log in a second initiator (iscsi-test-cu's default
/// `-I` name).
const SUITES: [&str; 40] = [
    "ALL.TestUnitReady",
    "ALL.ReadCapacity10",
    "ALL.ReadCapacity16",
    "ALL.Mandatory",
    "ALL.Inquiry",
    "ALL.ModeSense6",
    "ALL.Read6",
    "ALL.Read10",
    "ALL.Read12",
    "ALL.Read16",
    "ALL.Write10",
    "ALL.Write12",
    "ALL.Write16",
    "ALL.Verify10",
    "ALL.Verify12",
    "ALL.Verify16",
    "ALL.WriteVerify10",
    "ALL.WriteVerify12",
    "ALL.WriteVerify16",
    "ALL.WriteSame10",
    "ALL.WriteSame16",
    "ALL.Unmap",
    "ALL.CompareAndWrite",
    "ALL.OrWrite",
    "ALL.Prefetch10",
    "ALL.Prefetch16",
    "ALL.PrinReadKeys",
    "ALL.PrinReportCapabilities",
    "ALL.PrinServiceactionRange",
    "ALL.ProutRegister",
    "ALL.ProutReserve",
    "ALL.ProutClear",
    "ALL.ProutPreempt",
    "ALL.iSCSIcmdsn",
    "ALL.iSCSIResiduals",
    "ALL.iSCSIdatasn",
    "ALL.iSCSITMF",
    "ALL.ReportSupportedOpcodes",
    "ALL.ExtendedCopy",
    "ALL.ReceiveCopyResults",
];

/// Suites that sleep (3 s per test after a reset or a lost nexus): run
/// on the 512-byte LUN only.
const SLOW_512: [&str; 1] = ["ALL.Reserve6"];

/// GetLBAStatus.UnmapSingle expects the first descriptor for an LBA one
/// past an unmapped range to start a physical block later, which SBC-3
/// forbids (the first descriptor holds the requested LBA): it only holds
/// with one logical block per physical block, so it runs where LUNs report
/// physical blocks of their own size. See docs/iscsi.md.
const ONE_PER_PHYSICAL: [&str; 1] = ["ALL.GetLBAStatus"];

/// Runs `suites` on a LUN of `block` bytes reporting `physical`-byte
/// physical blocks (the `physical_block_size` option; 0 = its own size).
fn run_suites(block: u32, physical: u32, suites: &[&str]) {
    let f = start_full(
        64 << 20,
        block,
        |_| {},
        |t| {
            t.set_options(IscsiOptions {
                physical_block_size: physical,
                ..t.get_options()
            })
            .expect("options")
        },
    );
    let url = f.url(0);
    let mut failed = Vec::new();
    for s in suites.iter().copied() {
        let out = Command::new("iscsi-test-cu")
            .args(["--dataloss", "-S", "-s", "-t", s, &url])
            .output()
            .expect("iscsi-test-cu runs");
        if !out.status.success() {
            failed.push(format!(
                "{s}: {}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout)
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "block size {block}, physical {physical}:\n{}",
        failed.join("\n")
    );
}

#[test]
fn iscsi_test_cu_subset_512() {
    if !have("iscsi-test-cu") {
        return;
    }
    let all: Vec<&str> = SUITES.iter().chain(&SLOW_512).copied().collect();
    run_suites(512, 4096, &all);
    run_suites(512, 0, &ONE_PER_PHYSICAL);
}

#[test]
fn iscsi_test_cu_subset_4096() {
    if !have("iscsi-test-cu") {
        return;
    }
    let all: Vec<&str> = SUITES.iter().chain(&ONE_PER_PHYSICAL).copied().collect();
    run_suites(4096, 0, &all);
}

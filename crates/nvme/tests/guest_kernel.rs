//! The Linux kernel's nvme-tcp initiator (QEMU/TCG guest) against the
//! target running in this process: discovery, connect, `nvme list`,
//! id-ctrl/id-ns, O_DIRECT raw round trip, fio with crc32c verify on the
//! namespace, ext4 round trip with fsck, namespace hot-add seen through an
//! AEN, disconnect. One guest at a time (the rig serializes).

mod common;

use std::time::{Duration, Instant};

use common::*;
use testvm::{guest_script, require_guest, GuestBuilder};
use ustor_nvme::nvmf::{AddNsParams, NamespaceParams};

const BLOCKS: u64 = 131072; // 64 MiB of 512-byte blocks
const MARKER_LBA: u64 = 126976; // 62 MiB
const MARKER: &[u8] = b"USTOR-HOTADD";

/// Digests on, plus the hot-add step; helpers from lib.sh.
const SCRIPT: &str = r#". /ustor/lib.sh
set -u
addr=10.0.2.2
port=$NVME_PORT
nqn=$NVME_NQN
run modprobe nvme-tcp
run nvme discover -t tcp -a $addr -s $port > /tmp/discovery
cat /tmp/discovery
grep -q "subnqn: *$nqn\$" /tmp/discovery || die "$nqn not in discovery log"
run nvme connect -t tcp -a $addr -s $port -n "$nqn" --hdr-digest --data-digest
ctrl=
n=100
while [ -z "$ctrl" ]; do
    for c in /sys/class/nvme/nvme*; do
        [ -e "$c/subsysnqn" ] && [ "$(cat "$c/subsysnqn")" = "$nqn" ] && ctrl=$(basename "$c") && break
    done
    [ -n "$ctrl" ] && break
    n=$((n - 1)); [ $n -gt 0 ] || die "no controller"
    sleep 0.1
done
kv nvme_ctrl "$ctrl"
run nvme id-ctrl "/dev/$ctrl" > /tmp/id-ctrl
kv nvme_mn "$(awk -F: '/^mn /{gsub(/^ +| +$/, "", $2); print $2}' /tmp/id-ctrl)"
kv nvme_sn "$(awk -F: '/^sn /{gsub(/^ +| +$/, "", $2); print $2}' /tmp/id-ctrl)"
find_ns() {
    for b in /sys/block/nvme*n$1; do
        [ -e "$b" ] || continue
        case ${b##*/} in nvme*c*n*) continue ;; esac
        echo "${b##*/}"; return 0
    done
    return 1
}
n=100
until dev=$(find_ns 1); do n=$((n - 1)); [ $n -gt 0 ] || die "no ns 1"; sleep 0.1; done
wait_for "/dev/$dev"
kv nvme_dev "$dev"
run nvme list > /tmp/nvme-list
cat /tmp/nvme-list
kv list_has_dev "$(grep -c "^/dev/$dev .*USTOR0001 .*ustor test" /tmp/nvme-list)"
run nvme id-ns "/dev/$dev" > /dev/null
kv ns_size "$(size_bytes "/dev/$dev")"
raw_roundtrip "/dev/$dev" 1 4 raw_md5
# fio writes 16 MiB with crc32c verify headers at QD16 over both CPUs'
# queues, then reads every block back and checks it (exit status 1 and
# "verify:" errors on any mismatch).
/ustor/bin/fio --name=verify --filename="/dev/$dev" --ioengine=libaio --direct=1 \
    --rw=randwrite --bs=4k --iodepth=16 --numjobs=2 --offset_increment=8M --size=8M \
    --verify=crc32c --do_verify=1 --verify_fatal=1 --group_reporting > /tmp/fio.out 2>&1 \
    || { cat /tmp/fio.out; die "fio verify failed"; }
tail -n 20 /tmp/fio.out
kv fio_verify_errors "$(grep -c 'verify: bad' /tmp/fio.out)"
kv fio_phases "$(grep -c -E '^ +(READ|WRITE): bw=' /tmp/fio.out)"
fs_roundtrip "/dev/$dev" /mnt/nvme
# Tell the host to hot-add namespace 2, then wait for the kernel to see it.
printf 'USTOR-HOTADD' > /tmp/marker
run dd if=/tmp/marker of="/dev/$dev" bs=512 seek=126976 count=1 conv=sync,fsync oflag=direct 2>/dev/null
n=300
until dev2=$(find_ns 2); do n=$((n - 1)); [ $n -gt 0 ] || die "namespace 2 never appeared"; sleep 0.1; done
wait_for "/dev/$dev2"
kv ns2_size "$(size_bytes "/dev/$dev2")"
kv ns2_md5 "$(dd if=/dev/$dev2 bs=1M count=1 iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1)"
run nvme disconnect -n "$nqn"
log "nvmf digests ok"
"#;

fn read_blocks(env: &Env, name: &'static str, lba: u64, n: u64) -> Vec<u8> {
    let desc = env.registry.open(name, false, |_| {}).unwrap();
    env.rt
        .handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            let mut b = ustor_runtime::IoBuf::alloc((n * 512) as usize).await;
            b.set_len((n * 512) as usize);
            let (r, b) = ch.read(lba, n, b).await;
            r.unwrap();
            b.to_vec()
        })
        .unwrap()
}

fn write_blocks(env: &Env, name: &'static str, lba: u64, data: Vec<u8>) {
    let desc = env.registry.open(name, true, |_| {}).unwrap();
    env.rt
        .handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            let mut b = ustor_runtime::IoBuf::alloc(data.len()).await;
            b.set_len(data.len());
            b.copy_from_slice(&data);
            let (r, _) = ch.write(lba, (data.len() / 512) as u64, b).await;
            r.unwrap();
        })
        .unwrap()
}

#[test]
fn kernel_initiator_with_digests_and_hot_add() {
    require_guest!();
    let env = env_with(BLOCKS, Default::default());
    ustor_bdev::modules::malloc::create(
        &env.registry,
        ustor_bdev::modules::RamOpts {
            name: "Malloc1".into(),
            num_blocks: 16384,
            block_size: 512,
            uuid: None,
            optimal_io_boundary: 0,
            max_transfer_blocks: 0,
        },
    )
    .unwrap();
    let ns2 = pattern(1 << 20, 42);
    write_blocks(&env, "Malloc1", 0, ns2.clone());
    let ns2_md5 = testvm::host::md5_bytes(&ns2).unwrap();
    let started = Instant::now();
    let out = std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            // Hot-add once the guest wrote the marker (or give up).
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(400) {
                if read_blocks(&env, "Malloc0", MARKER_LBA, 1).starts_with(MARKER) {
                    let nsid = env
                        .target
                        .nvmf_subsystem_add_ns(&AddNsParams {
                            nqn: NQN.into(),
                            namespace: NamespaceParams {
                                bdev_name: "Malloc1".into(),
                                nsid: 2,
                                uuid: None,
                                nguid: None,
                            },
                        })
                        .unwrap();
                    return Some(nsid);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            None
        });
        let out = GuestBuilder::new()
            .script(SCRIPT)
            .cpus(2)
            .binary("/usr/bin/fio")
            .env("NVME_PORT", env.port.to_string())
            .env("NVME_NQN", NQN)
            .timeout(Duration::from_secs(400))
            .run()
            .and_then(|o| o.success());
        if out.is_err() {
            // Unblock the watcher.
            write_blocks(&env, "Malloc0", MARKER_LBA, {
                let mut m = MARKER.to_vec();
                m.resize(512, 0);
                m
            });
        }
        let nsid = watcher.join().unwrap();
        (out, nsid)
    });
    let (out, nsid) = out;
    let out = out.unwrap_or_else(|e| panic!("guest failed: {e}"));
    eprintln!("kernel nvme-tcp vs ustor target: {:?}", started.elapsed());
    assert_eq!(nsid, Some(2));
    assert_eq!(out.value("nvme_mn"), Some("ustor test"));
    assert_eq!(out.value("nvme_sn"), Some("USTOR0001"));
    assert_eq!(
        out.value("ns_size"),
        Some((BLOCKS * 512).to_string().as_str())
    );
    assert_eq!(out.value("files"), Some("21"));
    assert_eq!(out.value("list_has_dev"), Some("1"), "nvme list");
    assert_eq!(out.value("fio_verify_errors"), Some("0"));
    // Both phases ran: the writes, and the verify pass's reads.
    assert_eq!(out.value("fio_phases"), Some("2"));
    assert_eq!(
        out.value("ns2_size"),
        Some((16384u64 * 512).to_string().as_str())
    );
    assert_eq!(out.value("ns2_md5"), Some(ns2_md5.as_str()));
    let stats = env.target.nvmf_get_stats().unwrap();
    let dq: u64 = stats.poll_groups.iter().map(|g| g.digest_qpairs).sum();
    let errs: u64 = stats.poll_groups.iter().map(|g| g.digest_errors).sum();
    assert!(dq >= 2, "digests were not negotiated: {stats:?}");
    assert_eq!(errs, 0);
    // The guest's two CPUs got two I/O queues, spread over both reactors.
    assert_eq!(stats.poll_groups.len(), 2);
    assert!(
        stats.poll_groups.iter().all(|g| g.io_qpairs > 0),
        "I/O queues not spread over the reactors: {stats:?}"
    );
    // fio's 16 MiB went through this target on top of the file system work.
    let written: u64 = stats.poll_groups.iter().map(|g| g.bytes_written).sum();
    assert!(written >= 16 << 20, "{written}");
}

/// The rig's stock nvme-tcp.sh (defaults: no digests, NQN from discovery).
#[test]
fn kernel_initiator_stock_script() {
    require_guest!();
    let env = env_with(BLOCKS, Default::default());
    let out = GuestBuilder::new()
        .script_file(guest_script("nvme-tcp.sh"))
        .env("NVME_PORT", env.port.to_string())
        .timeout(Duration::from_secs(400))
        .run()
        .and_then(|o| o.success())
        .unwrap_or_else(|e| panic!("guest failed: {e}"));
    assert_eq!(out.value("nvme_nqn"), Some(NQN));
    assert_eq!(
        out.value("ns_size"),
        Some((BLOCKS * 512).to_string().as_str())
    );
    assert_eq!(out.value("files"), Some("21"));
    // (The raw region is overwritten by mkfs afterwards; the guest checked
    // it by reading back.) The writes went through this target.
    let stats = env.target.nvmf_get_stats().unwrap();
    let written: u64 = stats.poll_groups.iter().map(|g| g.bytes_written).sum();
    assert!(written >= 8 << 20, "{stats:?}");
}

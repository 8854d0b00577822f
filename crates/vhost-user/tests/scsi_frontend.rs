//! vhost-user-scsi against a frontend without a VM (`common/frontend.rs`:
//! rust-vmm's `vhost` crate for the protocol, split rings driven in a
//! shared memfd): task management by tag on the control queue, and a bdev
//! hot-removed with commands in flight, packed rings. Commands are held at
//! the bdev by delay bdevs, so "in flight" is a state the tests wait for,
//! not a guess.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use testkit::wait_until;
use ustor_bdev::Registry;
use ustor_runtime::{PollMode, Runtime, RuntimeConfig};
use ustor_vhost::scsi::{ScsiController, ScsiControllerConfig};

#[path = "common/frontend.rs"]
mod frontend;
#[path = "common/scsi.rs"]
mod scsi;

use frontend::{Fe, DATA_BASE};
use scsi::*;

/// The coalescing test measures signal rates and takes this for writing,
/// so no other test runs beside it.
static RUN_ALONE: RwLock<()> = RwLock::new(());

struct Fixture {
    registry: Arc<Registry>,
    dir: PathBuf,
    rt: Runtime,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let rt = Runtime::start(RuntimeConfig {
            cores: vec![0, 1],
            pin: false,
            poll_mode: PollMode::Adaptive,
            ..RuntimeConfig::default()
        })
        .expect("runtime starts");
        let registry = Registry::new(Some(rt.handle()));
        let dir = std::env::temp_dir().join(format!("ustor-vhost-scsi-fe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("socket dir");
        Fixture { registry, dir, rt }
    })
}

fn malloc(name: &str) {
    let opts = ustor_bdev::modules::RamOpts {
        name: name.into(),
        num_blocks: (16 << 20) / 512,
        block_size: 512,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    };
    ustor_bdev::modules::malloc::create(&fixture().registry, opts).expect("malloc bdev");
}

/// A delay bdev `name` over a new malloc bdev, no latency yet.
fn delayed(name: &str) {
    let f = fixture();
    malloc(&format!("{name}_base"));
    let p = ustor_vbdev::delay::DelayParams {
        base_bdev_name: format!("{name}_base"),
        name: name.into(),
        avg_read_latency: 0,
        p99_read_latency: 0,
        avg_write_latency: 0,
        p99_write_latency: 0,
        uuid: None,
    };
    ustor_vbdev::delay::create(&f.registry, &Arc::downgrade(&f.registry), p).expect("delay bdev");
}

/// Sets the read or write latency of delay bdev `name` (new I/O only).
fn latency(name: &str, write: bool, us: u64) {
    let kind = if write { "write" } else { "read" };
    for t in ["avg", "p99"] {
        let p = ustor_vbdev::delay::UpdateParams {
            delay_bdev_name: name.into(),
            latency_type: format!("{t}_{kind}"),
            latency_us: us,
        };
        ustor_vbdev::delay::update_latency(&fixture().registry, p).expect("latency");
    }
}

fn controller(name: &str, request_queues: u16) -> Arc<ScsiController> {
    controller_with(name, request_queues, false)
}

fn controller_with(name: &str, request_queues: u16, packed_ring: bool) -> Arc<ScsiController> {
    let f = fixture();
    ScsiController::create(
        f.rt.handle(),
        ScsiControllerConfig {
            name: name.into(),
            socket: f.dir.join(name),
            reactors: vec![0, 1],
            request_queues,
            poll_window: Duration::from_micros(50),
            packed_ring,
        },
    )
    .expect("scsi controller")
}

/// Sends a TMF from control slot `slot` and waits for its answer.
fn tmf_now(f: &mut Fe, slot: usize, subtype: u32, target: u8, tag: u64) -> u8 {
    let head = tmf(f, slot, subtype, target, tag);
    let got = f.wait_n(CTRL, 1);
    assert_eq!(got, vec![(head, 1)], "one TMF answered, one byte");
    tmf_resp(f, slot)
}

const TAG_W: u64 = 0x5701;
const TAG_R: u64 = 0x5702;

/// ABORT TASK and QUERY TASK find the command by its tag: a read held at
/// the bdev for ten minutes is aborted at once (answered ABORTED, in the
/// used ring before the TMF's FUNCTION COMPLETE); a write of the same
/// target held for ten minutes on another queue is neither aborted nor
/// waited for, and QUERY TASK still finds it.
#[test]
fn abort_task_aborts_a_read_at_the_bdev_by_tag() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    let reg = &fixture().registry;
    delayed("tmf");
    let c = controller("tmfc", 2);
    c.add_target(reg, 0, "tmf").expect("target 0");
    let mut f = Fe::connect(&c.config.socket, 4, false);
    let (qw, qr) = (REQ0, REQ0 + 1);
    ready(&mut f, qw, 0);
    ready(&mut f, qr, 0);
    let dev = c.device().clone();

    // W: a write the bdev holds for ten minutes (it outlives the test).
    f.mem.write(DATA_BASE, &[0x5a; 4096]);
    latency("tmf", true, 600_000_000);
    let w = cmd(
        &mut f,
        qw,
        1,
        0,
        TAG_W,
        &rw10(true, 8, 8),
        &[(DATA_BASE, 4096)],
        &[],
    );
    // The latency stays: W may reach the bdev after it was taken.
    wait_until("W in flight", Duration::from_secs(10), || {
        dev.commands_in_flight(0) == 1
    });
    assert_eq!(
        tmf_now(&mut f, 0, TMF_QUERY_TASK, 0, TAG_W),
        S_FUNCTION_SUCCEEDED
    );
    assert_eq!(tmf_now(&mut f, 1, TMF_QUERY_TASK, 0, 0xdead), S_OK);
    assert_eq!(
        tmf_now(&mut f, 1, TMF_ABORT_TASK, 0, 0xdead),
        S_OK,
        "no such task"
    );

    // R: a read the bdev holds for ten minutes too, on the other queue.
    latency("tmf", false, 600_000_000);
    let rbuf = DATA_BASE + 0x10000;
    let r = cmd(
        &mut f,
        qr,
        1,
        0,
        TAG_R,
        &rw10(false, 100, 8),
        &[],
        &[(rbuf, 4096)],
    );
    wait_until("R in flight", Duration::from_secs(10), || {
        dev.commands_in_flight(0) == 2
    });
    // The TMF answers within `tmf_now`'s 10 s, not the read's 10 minutes.
    let t0 = std::time::Instant::now();
    assert_eq!(
        tmf_now(&mut f, 2, TMF_ABORT_TASK, 0, TAG_R),
        S_OK,
        "ABORT TASK R"
    );
    eprintln!("ABORT TASK of a read at the bdev: {:?}", t0.elapsed());
    // R came back before the TMF's answer: it is in the used ring now,
    // answered ABORTED (whether it had reached the bdev or not yet).
    let back = f.used(qr);
    assert_eq!(back.len(), 1, "R answered before its abort completed");
    assert_eq!(back[0].0, r);
    let rr = resp(&f, qr, 1);
    assert_eq!(rr.response, S_ABORTED, "R: {rr:?}");
    // Counted out just after the used ring: only W is left.
    wait_until("only W in flight", Duration::from_secs(10), || {
        dev.commands_in_flight(0) == 1
    });
    assert_eq!(
        tmf_now(&mut f, 3, TMF_QUERY_TASK, 0, TAG_R),
        S_OK,
        "R is gone"
    );

    // W is still running and was not waited for.
    assert!(f.used(qw).is_empty(), "W was not answered");
    assert_eq!(
        tmf_now(&mut f, 4, TMF_QUERY_TASK, 0, TAG_W),
        S_FUNCTION_SUCCEEDED
    );
    assert_eq!(
        tmf_now(&mut f, 5, TMF_QUERY_TASK_SET, 0, 0),
        S_FUNCTION_SUCCEEDED
    );
    let _ = w;
    // W holds the rings for ten minutes: neither stop the controller nor
    // disconnect (a stop would wait for W); the process ends first.
    std::mem::forget(f);
    std::mem::forget(c);
}

/// Reads held at the bdev when it is hot-removed: every one is answered
/// with an error, the driver hears TRANSPORT_RESET / REMOVED for the
/// target on the event queue, the target is gone from the controller
/// (later commands get BAD_TARGET) and the other target works on.
#[test]
fn hot_removed_bdev_takes_its_target_with_commands_in_flight() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    let reg = &fixture().registry;
    malloc("hrk");
    let c = controller("hrc", 1);
    c.add_target(reg, 1, "hrk").expect("target 1");
    let mut f = Fe::connect(&c.config.socket, 3, false);
    for k in 0..8 {
        let at = scsi::hdr(EVENTS, k);
        f.add(EVENTS, &[(at, 16, true)]);
    }
    ready(&mut f, REQ0, 1);
    let dev = c.device().clone();
    const N: usize = 8;
    // The removal must find the reads at the bdev: if a stalled machine
    // let them finish first, try again with a longer hold.
    let mut held = false;
    for (attempt, us) in [300_000u64, 2_000_000, 8_000_000].into_iter().enumerate() {
        let name = format!("hr{attempt}");
        delayed(&name);
        c.add_target(reg, 0, &name).expect("target 0");
        ready(&mut f, REQ0, 0);
        latency(&name, false, us);
        for k in 0..N {
            let buf = DATA_BASE + k as u64 * 4096;
            cmd(
                &mut f,
                REQ0,
                1 + k,
                0,
                k as u64,
                &rw10(false, 8 * k as u32, 8),
                &[],
                &[(buf, 4096)],
            );
        }
        wait_until("reads in flight", Duration::from_secs(10), || {
            dev.commands_in_flight(0) == N as u32
        });
        reg.hot_remove(&name).expect("hot remove");
        // Commands a worker had not started yet fail at once (the bdev is
        // gone); only a read that came back good shows one that finished
        // before the removal. Whatever is back now counts towards N.
        let mut back = f.used(REQ0);
        let early = back.len();
        back.extend(f.wait_n(REQ0, N - early));
        assert_eq!(back.len(), N);
        wait_until("target 0 gone", Duration::from_secs(10), || {
            c.targets().iter().all(|t| t.0 != 0)
        });
        held = (0..N).all(|k| !resp(&f, REQ0, 1 + k).good());
        if held {
            break;
        }
    }
    assert!(held, "the reads finished before every removal");
    for k in 0..N {
        let r = resp(&f, REQ0, 1 + k);
        assert!(!r.good(), "read {k} held at the removal: {r:?}");
    }
    // The event queue told the driver (its last event is the removal).
    let mut events = Vec::new();
    wait_until("removal event", Duration::from_secs(10), || {
        events.extend(f.used(EVENTS));
        events.iter().any(|&(head, len)| {
            let ev = f.mem.bytes(scsi::hdr(EVENTS, head as usize), 16);
            len == 16 && ev[0..4] == [1, 0, 0, 0] && ev[4..6] == [1, 0] && ev[12] == 2
        })
    });
    // Target 0 is gone; target 1 serves on (write, read back).
    cmd(&mut f, REQ0, 20, 0, 99, &TEST_UNIT_READY, &[], &[]);
    f.wait_n(REQ0, 1);
    assert_eq!(resp(&f, REQ0, 20).response, S_BAD_TARGET);
    let (wbuf, rbuf) = (DATA_BASE + 0x100000, DATA_BASE + 0x200000);
    let pat: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    f.mem.write(wbuf, &pat);
    cmd(
        &mut f,
        REQ0,
        21,
        1,
        100,
        &rw10(true, 64, 8),
        &[(wbuf, 4096)],
        &[],
    );
    f.wait_n(REQ0, 1);
    assert!(resp(&f, REQ0, 21).good());
    cmd(
        &mut f,
        REQ0,
        22,
        1,
        101,
        &rw10(false, 64, 8),
        &[],
        &[(rbuf, 4096)],
    );
    f.wait_n(REQ0, 1);
    assert!(resp(&f, REQ0, 22).good());
    assert_eq!(f.mem.bytes(rbuf, 4096), pat);
    assert_eq!(c.targets(), vec![(1, "hrk".to_string())]);
    drop(f);
    c.stop();
}

const QD: usize = 32;

/// Keeps QD 4 KiB writes in flight on the first request ring until `n`
/// completed (the driver sleeping on its call eventfd between batches);
/// returns the signals the device sent meanwhile.
fn stream_writes(f: &mut Fe, n: usize, seed: u8) -> u64 {
    let q = REQ0;
    let sig0 = f.rings[q].signals;
    let mut slot_of = std::collections::HashMap::new();
    let mut sent = 0usize;
    let send = |f: &mut Fe, slot: usize, sent: &mut usize| {
        let buf = DATA_BASE + slot as u64 * 4096;
        f.mem.write(buf, &[seed ^ slot as u8; 4096]);
        let c = rw10(true, 8 * slot as u32, 8);
        let head = cmd(f, q, slot, 0, *sent as u64, &c, &[(buf, 4096)], &[]);
        *sent += 1;
        head
    };
    for slot in 0..QD {
        let head = send(f, slot, &mut sent);
        slot_of.insert(head, slot);
    }
    let mut done = 0;
    while done < n {
        let got = f.wait(q, Duration::from_secs(10));
        assert!(!got.is_empty(), "writes stopped at {done}/{n}");
        for (head, _) in got {
            let slot = slot_of.remove(&head).expect("a head in flight");
            assert!(resp(f, q, slot).good(), "write {done}");
            done += 1;
            if sent < n {
                let h = send(f, slot, &mut sent);
                slot_of.insert(h, slot);
            }
        }
    }
    f.rings[q].signals - sig0
}

/// `vhost_controller_set_coalescing` reaches the scsi request queues.
/// Asserted on the device's own state, not on a signal rate (two timed
/// phases compared under load flaked: a slow driver batches by itself):
/// without settings no signal is held; with a delay above the threshold,
/// once the delay is in force (waited for: signals start being held) the
/// stream goes on to its end with signals held and fewer signals than
/// commands; every write lands.
#[test]
fn coalescing_batches_scsi_call_signals() {
    let _alone = RUN_ALONE.write().unwrap_or_else(|e| e.into_inner());
    malloc("cob");
    let c = controller("coc", 1);
    c.add_target(&fixture().registry, 0, "cob")
        .expect("target 0");
    let mut f = Fe::connect(&c.config.socket, 3, false);
    ready(&mut f, REQ0, 0);
    let dev = c.device();
    let sig0 = stream_writes(&mut f, 4000, 1);
    assert_eq!(dev.held(), 0, "no settings: every signal goes at once");
    dev.set_coalescing(100, 1000);
    // The delay applies after a rate check: write until signals are held
    // (the state the rest asserts on), 30 s at most.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while dev.held() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "coalescing never held a signal back"
        );
        stream_writes(&mut f, 500, 2);
    }
    let (held0, n) = (dev.held(), 10_000);
    let sig1 = stream_writes(&mut f, n, 3);
    let held1 = dev.held() - held0;
    eprintln!(
        "QD 32 scsi writes: {sig0} signals for 4000 without coalescing, \
         {sig1} ({held1} held back) for {n} with"
    );
    // Every command was answered (stream_writes waits for each) and
    // signals covered several completions each. Whether this stream holds
    // any back is not asserted: the delay was shown in force above, and
    // this driver's event index can ask for almost no signals at all (a
    // quiet run saw 1 signal and 0 held for 10,000 commands).
    assert!(sig1 < n as u64, "{sig1} signals for {n} commands");
    c.device().set_coalescing(0, 1000);
    // Every slot's last write is on the medium: read it back.
    for slot in 0..QD {
        let buf = DATA_BASE + 0x100000 + slot as u64 * 4096;
        cmd(
            &mut f,
            REQ0,
            slot,
            0,
            1,
            &rw10(false, 8 * slot as u32, 8),
            &[],
            &[(buf, 4096)],
        );
        f.wait_n(REQ0, 1);
        assert!(resp(&f, REQ0, slot).good());
        assert_eq!(
            f.mem.bytes(buf, 4096),
            vec![3 ^ slot as u8; 4096],
            "slot {slot}"
        );
    }
    drop(f);
    c.stop();
}

/// Packed rings end to end: every ring of a controller created with
/// `packed_ring` runs packed under the test frontend's packed driver;
/// 40 rounds of 16 writes and 16 reads (three- and four-slot chains on
/// 128-slot rings: the rings wrap some 20 times, completions come in any
/// order; half the writes' data in one piece, which goes to the bdev as
/// it is, half in two, copied) carry data that reads back, TMFs work on
/// the packed control queue, and the device reports the frontend and its
/// packed rings until it disconnects.
#[test]
fn packed_rings_carry_commands_and_task_management() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    let reg = &fixture().registry;
    malloc("pk");
    let c = controller_with("pkc", 1, true);
    c.add_target(reg, 0, "pk").expect("target 0");
    let mut f = Fe::connect_packed(&c.config.socket, 3);
    let dev = c.device().clone();
    wait_until("three packed rings", Duration::from_secs(10), || {
        dev.rings_running() == (3, 3)
    });
    assert_eq!(c.frontend_pid(), Some(std::process::id() as i32));
    ready(&mut f, REQ0, 0);
    const QD: usize = 16;
    let wbuf = |k: usize| DATA_BASE + (k * 4096) as u64;
    let rbuf = |k: usize| DATA_BASE + 0x10_0000 + (k * 4096) as u64;
    for round in 0..40u32 {
        let data = |k: usize| -> Vec<u8> {
            (0..4096u32)
                .map(|i| (round * 31 + k as u32 * 7 + i) as u8)
                .collect()
        };
        let lba = |k: usize| (round * QD as u32 + k as u32) * 8;
        for k in 0..QD {
            f.mem.write(wbuf(k), &data(k));
            // One piece (handed to the bdev as it is) or two (copied).
            let out = match k % 2 {
                0 => vec![(wbuf(k), 4096)],
                _ => vec![(wbuf(k), 2048), (wbuf(k) + 2048, 2048)],
            };
            cmd(
                &mut f,
                REQ0,
                1 + k,
                0,
                k as u64,
                &rw10(true, lba(k), 8),
                &out,
                &[],
            );
        }
        let got = f.wait_n(REQ0, QD);
        assert_eq!(got.len(), QD, "round {round}");
        for k in 0..QD {
            assert!(resp(&f, REQ0, 1 + k).good(), "write {k} of round {round}");
            f.mem.write(rbuf(k), &[0u8; 4096]);
            let inn = [(rbuf(k), 1024), (rbuf(k) + 1024, 3072)];
            cmd(
                &mut f,
                REQ0,
                1 + k,
                0,
                k as u64,
                &rw10(false, lba(k), 8),
                &[],
                &inn,
            );
        }
        let got = f.wait_n(REQ0, QD);
        assert_eq!(got.len(), QD, "round {round}");
        for k in 0..QD {
            assert!(resp(&f, REQ0, 1 + k).good(), "read {k} of round {round}");
            assert!(
                f.mem.bytes(rbuf(k), 4096) == data(k),
                "read {k} of round {round}"
            );
        }
    }
    // Task management on the packed control queue.
    assert_eq!(tmf_now(&mut f, 0, TMF_QUERY_TASK, 0, 0xdead), S_OK);
    assert_eq!(tmf_now(&mut f, 1, TMF_QUERY_TASK_SET, 0, 0), S_OK);
    assert_eq!(tmf_now(&mut f, 2, TMF_ABORT_TASK, 0, 0xdead), S_OK);
    drop(f);
    wait_until("rings stopped", Duration::from_secs(10), || {
        dev.rings_running() == (0, 0) && c.frontend_pid().is_none()
    });
    c.stop();
}

/// Hands ring `q` a new call fd and waits for the one signal every new
/// call fd gets; a second handle on the fd, to see later signals.
fn new_call_fd(f: &mut Fe, q: usize) -> vmm_sys_util::eventfd::EventFd {
    let call = vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
    let probe = call.try_clone().unwrap();
    f.set_call(q, call);
    wait_until("the new call fd signalled", Duration::from_secs(10), || {
        probe.read().is_ok()
    });
    probe
}

/// A ring started before its call fd (QEMU does this while the guest's
/// vector is masked) may complete a command with no fd to signal: the new
/// call fd is signalled when it comes, or the driver would wait forever
/// (a guest's virtio-scsi probe hung so on packed rings).
#[test]
fn a_call_fd_set_late_is_signalled() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    malloc("late");
    let c = controller("latec", 1);
    c.add_target(&fixture().registry, 0, "late")
        .expect("target 0");
    let mut f = Fe::connect(&c.config.socket, 3, false);
    ready(&mut f, REQ0, 0);
    f.restart_without_call(REQ0);
    let head = cmd(&mut f, REQ0, 0, 0, 7, &TEST_UNIT_READY, &[], &[]);
    let mut got = Vec::new();
    wait_until("the command used", Duration::from_secs(10), || {
        got.extend(f.used(REQ0));
        !got.is_empty()
    });
    assert_eq!(got, vec![(head, CMD_RESP)]);
    assert!(resp(&f, REQ0, 0).good());
    new_call_fd(&mut f, REQ0);
    drop(f);
    c.stop();
}

/// SET_VRING_CALL on a running ring swaps the fd in place: it does not
/// wait for the commands in flight (QEMU sends it when the guest masks or
/// unmasks the queue's vector, its vCPU waiting for the answer), and a
/// command answered afterwards signals the new fd.
#[test]
fn a_new_call_fd_does_not_wait_for_commands_in_flight() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    let reg = &fixture().registry;
    delayed("swapc");
    let c = controller("swapcc", 1);
    c.add_target(reg, 0, "swapc").expect("target 0");
    let mut f = Fe::connect(&c.config.socket, 3, false);
    ready(&mut f, REQ0, 0);
    let dev = c.device().clone();
    // A read the bdev holds for ten minutes (ABORT TASK ends it below).
    latency("swapc", false, 600_000_000);
    const TAG: u64 = 0x5c;
    let r = cmd(
        &mut f,
        REQ0,
        1,
        0,
        TAG,
        &rw10(false, 8, 8),
        &[],
        &[(DATA_BASE, 4096)],
    );
    wait_until("the read in flight", Duration::from_secs(10), || {
        dev.commands_in_flight(0) == 1
    });
    let probe = new_call_fd(&mut f, REQ0);
    // Answered (and signalled) with the read still held.
    assert_eq!(dev.commands_in_flight(0), 1, "the read still held");
    f.arm(REQ0);
    assert_eq!(tmf_now(&mut f, 0, TMF_ABORT_TASK, 0, TAG), S_OK);
    wait_until(
        "the read's answer signalled",
        Duration::from_secs(10),
        || probe.read().is_ok(),
    );
    assert_eq!(f.used(REQ0), vec![(r, CMD_RESP)]);
    assert_eq!(resp(&f, REQ0, 1).response, S_ABORTED);
    drop(f);
    c.stop();
}

/// Plain READs and WRITEs (the core's fast path on a malloc bdev, which
/// completes in its submit): data-out and data-in in one piece of guest
/// memory go to the bdev in place, in several pieces they are copied; what
/// the guest reads back is what it wrote, byte for byte, either way, and
/// each used length counts the response and the data-in.
#[test]
fn plain_reads_and_writes_move_the_guests_bytes_in_one_piece_or_several() {
    let _shared = RUN_ALONE.read().unwrap_or_else(|e| e.into_inner());
    malloc("plain");
    let c = controller("plainc", 1);
    c.add_target(&fixture().registry, 0, "plain")
        .expect("target 0");
    let mut f = Fe::connect(&c.config.socket, 3, false);
    ready(&mut f, REQ0, 0);
    let pattern = |len: usize, seed: u8| -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(7) ^ seed ^ (i >> 9) as u8)
            .collect()
    };
    let (a, b) = (pattern(16384, 0x31), pattern(8192, 0x5c));
    let run = |f: &mut Fe, cdb: &[u8], out: &[(u64, u32)], inn: &[(u64, u32)]| {
        let head = cmd(f, REQ0, 1, 0, 9, cdb, out, inn);
        let got = f.wait_n(REQ0, 1);
        let data_in: u32 = inn.iter().map(|p| p.1).sum();
        assert_eq!(got, vec![(head, CMD_RESP + data_in)], "{cdb:02x?}");
        let r = resp(f, REQ0, 1);
        assert!(r.good(), "{cdb:02x?}: {r:?}");
    };
    // 16 KiB in one piece at LBA 64; 8 KiB in two pieces at LBA 200.
    let one = DATA_BASE;
    f.mem.write(one, &a);
    run(&mut f, &rw10(true, 64, 32), &[(one, 16384)], &[]);
    let (p, q) = (DATA_BASE + 0x10000, DATA_BASE + 0x13000);
    f.mem.write(p, &b[..4096]);
    f.mem.write(q, &b[4096..]);
    run(&mut f, &rw10(true, 200, 16), &[(p, 4096), (q, 4096)], &[]);
    // Back through one piece, and through three uneven ones.
    let back = DATA_BASE + 0x20000;
    f.mem.write(back, &[0xee; 16384]);
    run(&mut f, &rw10(false, 64, 32), &[], &[(back, 16384)]);
    assert!(f.mem.bytes(back, 16384) == a, "one piece, in place");
    let pieces = [
        (DATA_BASE + 0x30000, 512u32),
        (DATA_BASE + 0x31000, 7680),
        (DATA_BASE + 0x34000, 8192),
    ];
    for (at, len) in pieces {
        f.mem.write(at, &vec![0xee; len as usize]);
    }
    run(&mut f, &rw10(false, 64, 32), &[], &pieces);
    let got: Vec<u8> = pieces
        .iter()
        .flat_map(|&(at, len)| f.mem.bytes(at, len as usize))
        .collect();
    assert!(got == a, "three pieces, copied");
    run(&mut f, &rw10(false, 200, 16), &[], &[(back, 8192)]);
    assert!(
        f.mem.bytes(back, 8192) == b,
        "written in two pieces, read in one"
    );
    drop(f);
    c.stop();
}

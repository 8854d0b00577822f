//! The per-connection tasks that drive the session machine: the receiver
//! (non-blocking `readv` straight into the command's buffers), the sender
//! (`writev` of headers and buffers), the keep-alive, and background
//! reinstatement after a connection failure.

use super::*;

/// Background session reinstatement after a connection failure, with
/// back-off, until it works or the host goes away.
pub(super) async fn recover(s: Rc<Shared>) {
    s.recovering.set(true);
    let mut delay = RECONNECT_MIN;
    let mut tries = 0u32;
    while !s.closed.get() && !s.connected.get() {
        match s.reinstate().await {
            Ok(()) => {
                tracing::info!("iscsi {}: session reinstated", s.cfg.portal);
                break;
            }
            Err(e) => {
                tries += 1;
                if tries == 1 || tries.is_multiple_of(10) {
                    tracing::warn!(
                        "iscsi {}: reinstatement failed ({tries} tries): {e}",
                        s.cfg.portal
                    );
                }
                ustor_runtime::sleep(delay).await;
                delay = (delay * 2).min(RECONNECT_MAX);
            }
        }
    }
    s.recovering.set(false);
}

pub(super) const EMPTY_IOV: libc::iovec = libc::iovec {
    iov_base: std::ptr::null_mut(),
    iov_len: 0,
};

/// What one receive attempt found.
enum Rx {
    /// Bytes arrived; `drained` = fewer than asked (the socket is empty).
    Got {
        drained: bool,
    },
    WouldBlock,
}

/// One non-blocking `readv` and the state change it causes, with no await
/// in between: the iovecs are valid for exactly this call.
fn rx_once(s: &Shared, fd: RawFd, iov: &mut [libc::iovec; RX_IOVS]) -> Result<Rx, String> {
    let r = {
        let mut g = s.st.borrow_mut();
        let Some(st) = g.as_mut() else {
            return Ok(Rx::WouldBlock);
        };
        let n = st.rx_iovecs(iov);
        let asked: usize = iov[..n].iter().map(|v| v.iov_len).sum();
        // SAFETY: the iovecs point into the state's own buffers or into an
        // active command's buffer, which the mid-layer keeps alive while the
        // command is ours; nothing can release it during this synchronous
        // call.
        match unsafe { readv_nb(fd, &iov[..n]) } {
            Ok(Some(k)) => match st.rx_advance(k) {
                Ok(()) => Ok(Rx::Got { drained: k < asked }),
                Err(e) => {
                    if !matches!(e, crate::session::RxError::Eof) {
                        st.stats.protocol_errors += 1;
                    }
                    Err(e.to_string())
                }
            },
            Ok(None) => Ok(Rx::WouldBlock),
            Err(e) => Err(e.to_string()),
        }
    };
    // Answers to the target (NOP echoes, R2T data) go out now.
    if s.st.borrow().as_ref().is_some_and(|st| st.tx_pending()) {
        s.flush_tx();
    }
    r
}

/// The receive poller: up to a budget of reads per reactor pass while
/// commands are outstanding (PDUs queued in the socket are taken without
/// waiting for the next pass, but no connection holds the reactor).
pub(super) fn rx_poll(
    s: &Rc<Shared>,
    gen: u64,
    fd: RawFd,
    iov: &mut [libc::iovec; RX_IOVS],
) -> ustor_runtime::PollStatus {
    use ustor_runtime::PollStatus;
    let busy = s.live(gen)
        && s.st
            .borrow()
            .as_ref()
            .is_some_and(|st| st.outstanding() > 0);
    if !busy {
        return PollStatus::Idle;
    }
    let mut status = PollStatus::Idle;
    for _ in 0..RX_PASS_BUDGET {
        match rx_once(s, fd, iov) {
            Ok(Rx::Got { drained }) => {
                status = PollStatus::Busy;
                if drained {
                    break;
                }
            }
            Ok(Rx::WouldBlock) => break,
            Err(why) => {
                s.fail_conn(gen, &why);
                return PollStatus::Busy;
            }
        }
    }
    status
}

/// Receives PDUs straight into their destination (see `State::rx_iovecs`);
/// waits in an io_uring poll when the socket is empty.
pub(super) async fn receiver(s: Rc<Shared>, fd: RawFd, gen: u64) {
    let mut iov = [EMPTY_IOV; RX_IOVS];
    let mut passes = 0u32;
    loop {
        if !s.live(gen) {
            return;
        }
        let wait = match rx_once(&s, fd, &mut iov) {
            Ok(Rx::Got { drained }) => drained,
            Ok(Rx::WouldBlock) => true,
            Err(why) => {
                s.fail_conn(gen, &why);
                return;
            }
        };
        passes += 1;
        if wait {
            passes = 0;
            if let Err(e) = wait_ready(fd, libc::POLLIN as u32).await {
                s.fail_conn(gen, &e.to_string());
                return;
            }
        } else if passes >= LOOP_BUDGET {
            passes = 0;
            ustor_runtime::yield_now().await;
        }
    }
}

/// Sends staged PDUs with `writev` (headers and the commands' buffers).
pub(super) async fn sender(s: Rc<Shared>, fd: RawFd, gen: u64) {
    let mut iov = [EMPTY_IOV; TX_IOVS];
    let mut passes = 0u32;
    loop {
        if !s.live(gen) {
            return;
        }
        let r = {
            let mut g = s.st.borrow_mut();
            let Some(st) = g.as_mut() else { return };
            let n = st.tx_iovecs(&mut iov);
            if n == 0 {
                None
            } else {
                // SAFETY: the iovecs point into staged headers, the spill
                // buffer or active commands' buffers (see `State::release_tx`
                // for commands that go away); valid for this synchronous call.
                Some(match unsafe { writev_nb(fd, &iov[..n]) } {
                    Ok(Some(k)) => {
                        st.tx_advance(k);
                        Ok(true)
                    }
                    Ok(None) => Ok(false),
                    Err(e) => Err(e.to_string()),
                })
            }
        };
        match r {
            None => {
                std::future::poll_fn(|cx| {
                    let pending = s.st.borrow().as_ref().is_some_and(|st| st.tx_pending());
                    if pending || !s.live(gen) {
                        return Poll::Ready(());
                    }
                    let mut w = s.send_waker.borrow_mut();
                    if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                        *w = Some(cx.waker().clone());
                    }
                    Poll::Pending
                })
                .await;
                passes = 0;
            }
            Some(Ok(true)) => {
                passes += 1;
                if passes >= LOOP_BUDGET {
                    passes = 0;
                    ustor_runtime::yield_now().await;
                }
            }
            Some(Ok(false)) => {
                if let Err(e) = wait_ready(fd, libc::POLLOUT as u32).await {
                    s.fail_conn(gen, &e.to_string());
                    return;
                }
            }
            Some(Err(why)) => {
                s.fail_conn(gen, &why);
                return;
            }
        }
    }
}

/// NOP-Out pings when nothing arrived for `nop_interval_ms`; an answer
/// missing after `nop_timeout_ms` fails the connection.
pub(super) async fn keepalive(s: Rc<Shared>, gen: u64) {
    let interval = ticks::from_duration(Duration::from_millis(s.cfg.nop_interval_ms));
    let timeout = ticks::from_duration(Duration::from_millis(s.cfg.nop_timeout_ms.max(1)));
    let tick = Duration::from_millis((s.cfg.nop_interval_ms.min(s.cfg.nop_timeout_ms) / 4).max(10));
    let mut last_rx = ticks::now();
    let mut ping_sent = 0u64;
    loop {
        ustor_runtime::sleep(tick).await;
        if !s.live(gen) {
            return;
        }
        let now = ticks::now();
        let seq = s.next_seq();
        let failed = {
            let mut g = s.st.borrow_mut();
            let Some(st) = g.as_mut() else { return };
            if st.rx_seen {
                st.rx_seen = false;
                last_rx = now;
            }
            if st.ping_itt.is_some() {
                if now.saturating_sub(ping_sent) > timeout {
                    st.stats.keepalive_timeouts += 1;
                    true
                } else {
                    false
                }
            } else {
                if now.saturating_sub(last_rx) >= interval {
                    st.ping(seq);
                    ping_sent = now;
                }
                false
            }
        };
        if failed {
            s.fail_conn(gen, "NOP-Out ping not answered");
            return;
        }
        s.wake_sender();
    }
}

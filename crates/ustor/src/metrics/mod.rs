//! `ustor serve --metrics ADDR`: a small HTTP listener that serves the
//! Prometheus text format on `/metrics`. Off by default. It runs on its own
//! threads and reads the counters the stats RPCs read (through the method
//! table, like a client would), so the reactors pay only what an RPC costs
//! them, when a scrape comes, and the I/O path nothing.
//!
//! The listener caps its connections (extra ones get 503), gives each
//! request a deadline (408 after it), parses with `httparse` (malformed:
//! 400), and answers one request per connection.

pub mod render;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use ustor_bdev::Registry;
use ustor_rpc::MethodTable;

/// The listener's bounds.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections served at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// How long a client has to send its whole request (then 408).
    pub request_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 16,
            request_timeout: Duration::from_secs(5),
        }
    }
}
/// Longest request head accepted.
const MAX_REQUEST: usize = 8192;

/// Where the exposition's numbers come from.
#[derive(Clone)]
pub struct Sources {
    pub table: MethodTable,
    pub registry: Arc<Registry>,
}

impl Sources {
    /// The current exposition.
    pub fn scrape(&self) -> String {
        let t = Duration::from_secs(5);
        let hists: Vec<render::BdevHists> = self
            .registry
            .list()
            .iter()
            .filter(|e| e.histograms_enabled())
            .filter_map(|e| {
                let name = e.info().name.clone();
                let st = self.registry.iostat(&name).ok()?;
                Some(render::BdevHists {
                    name,
                    read: st.read_hist?,
                    write: st.write_hist?,
                })
            })
            .collect();
        render::render(|m| self.table.call_blocking(m, Value::Null, t).ok(), &hists)
    }
}

/// The running listener; stopped by [`MetricsServer::shutdown`] or drop.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl MetricsServer {
    pub fn start(addr: SocketAddr, src: Sources, lim: Limits) -> std::io::Result<MetricsServer> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let accept = std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || accept_loop(listener, src, st, lim))?;
        Ok(MetricsServer {
            addr,
            stop,
            accept: Some(accept),
        })
    }

    /// The bound address (the port the kernel chose for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn shutdown(&mut self) {
        let Some(h) = self.accept.take() else {
            return;
        };
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        let _ = h.join();
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Releases a connection's place when its thread ends.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn accept_loop(listener: TcpListener, src: Sources, stop: Arc<AtomicBool>, lim: Limits) {
    let open = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut conn) = conn else { continue };
        if open.fetch_add(1, Ordering::SeqCst) >= lim.max_connections {
            open.fetch_sub(1, Ordering::SeqCst);
            let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = respond(
                &mut conn,
                503,
                "text/plain",
                b"too many connections\n",
                false,
            );
            continue;
        }
        let slot = Slot(open.clone());
        let src = src.clone();
        let spawned = std::thread::Builder::new()
            .name("metrics-conn".into())
            .spawn(move || {
                let _slot = slot;
                serve_one(conn, &src, lim.request_timeout);
            });
        if let Err(e) = spawned {
            tracing::warn!("metrics: cannot start a connection thread: {e}");
        }
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq)]
pub enum Request {
    /// `GET`/`HEAD` of a path; `head` sends no body.
    Get { path: String, head: bool },
    /// Another method (405).
    Method,
    /// Not HTTP/1.x (400).
    Malformed,
    /// The head is not complete yet.
    Partial,
}

/// Parses a request head (the whole buffer read so far).
pub fn parse(buf: &[u8]) -> Request {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Request::Partial,
        Err(_) => return Request::Malformed,
    }
    match (req.method, req.path) {
        (Some(m @ ("GET" | "HEAD")), Some(p)) => Request::Get {
            path: p.split('?').next().unwrap_or("").to_string(),
            head: m == "HEAD",
        },
        (Some(_), Some(_)) => Request::Method,
        _ => Request::Malformed,
    }
}

/// Reads the request head within `timeout`, answers, closes.
fn serve_one(mut conn: TcpStream, src: &Sources, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let _ = conn.set_write_timeout(Some(timeout));
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let req = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let _ = respond(&mut conn, 408, "text/plain", b"request timeout\n", false);
            return;
        }
        let _ = conn.set_read_timeout(Some(left));
        match conn.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        }
        match parse(&buf) {
            Request::Partial if buf.len() >= MAX_REQUEST => break Request::Malformed,
            Request::Partial => continue,
            r => break r,
        }
    };
    let _ = match req {
        Request::Get { path, head } if path == "/metrics" => {
            let body = src.scrape();
            respond(
                &mut conn,
                200,
                "text/plain; version=0.0.4; charset=utf-8",
                body.as_bytes(),
                head,
            )
        }
        Request::Get { path, head } if path == "/" => respond(
            &mut conn,
            200,
            "text/plain",
            b"ustor metrics: GET /metrics\n",
            head,
        ),
        Request::Get { head, .. } => respond(&mut conn, 404, "text/plain", b"not found\n", head),
        Request::Method => respond(&mut conn, 405, "text/plain", b"only GET and HEAD\n", false),
        Request::Malformed | Request::Partial => {
            respond(&mut conn, 400, "text/plain", b"bad request\n", false)
        }
    };
}

fn respond(
    conn: &mut TcpStream,
    code: u16,
    ctype: &str,
    body: &[u8],
    head: bool,
) -> std::io::Result<()> {
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        _ => "Service Unavailable",
    };
    let mut out = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if code == 405 {
        out.push_str("Allow: GET, HEAD\r\n");
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    if !head {
        bytes.extend_from_slice(body);
    }
    conn.write_all(&bytes)?;
    conn.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_heads() {
        let get = |p: &str| Request::Get {
            path: p.into(),
            head: false,
        };
        assert_eq!(
            parse(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            get("/metrics")
        );
        assert_eq!(parse(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"), get("/metrics"));
        assert_eq!(
            parse(b"HEAD / HTTP/1.1\r\n\r\n"),
            Request::Get {
                path: "/".into(),
                head: true
            }
        );
        assert_eq!(parse(b"POST /metrics HTTP/1.1\r\n\r\n"), Request::Method);
        assert_eq!(parse(b"GET /metrics HTTP/1.1\r\n"), Request::Partial);
        assert_eq!(parse(b"\x16\x03\x01\x02\x00\x01\x00"), Request::Malformed);
        assert_eq!(parse(b"GET /metrics HTTP/9.9\r\n\r\n"), Request::Malformed);
        assert_eq!(parse(b"GET\r\n\r\n"), Request::Malformed);
    }

    /// An answer's status code (the connection is closed after it).
    fn status(c: &mut TcpStream) -> u16 {
        let mut out = String::new();
        let _ = c.read_to_string(&mut out);
        out.split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0)
    }

    #[test]
    fn connection_cap_and_request_timeout() {
        let src = Sources {
            table: MethodTable::new(),
            registry: Registry::new(None),
        };
        let lim = Limits {
            max_connections: 2,
            request_timeout: Duration::from_millis(300),
        };
        let m = MetricsServer::start("127.0.0.1:0".parse().unwrap(), src, lim).unwrap();
        let addr = m.local_addr();
        // Two silent clients hold both places: a third is refused at once.
        let mut silent: Vec<TcpStream> =
            (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
        testkit::wait_until(
            "503 for a connection over the cap",
            Duration::from_secs(10),
            || status(&mut TcpStream::connect(addr).unwrap()) == 503,
        );
        // The silent ones time out with 408, which frees their places.
        for c in &mut silent {
            assert_eq!(status(c), 408);
        }
        testkit::wait_until(
            "a place freed for a real request",
            Duration::from_secs(10),
            || {
                let mut c = TcpStream::connect(addr).unwrap();
                c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
                status(&mut c) == 200
            },
        );
    }

    proptest::proptest! {
        /// Any bytes: an answer, never a panic; a complete well-formed
        /// GET keeps its path whatever follows it.
        #[test]
        fn any_bytes_get_an_answer(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let _ = parse(&bytes);
            let mut req = b"GET /metrics HTTP/1.1\r\n\r\n".to_vec();
            req.extend_from_slice(&bytes);
            proptest::prop_assert_eq!(parse(&req), Request::Get { path: "/metrics".into(), head: false });
        }
    }
}

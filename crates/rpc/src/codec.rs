//! Wire format: splitting a byte stream into JSON values and decoding
//! JSON-RPC 2.0 messages (single, batch, notification) into [`Request`]s, and
//! encoding responses. No I/O here and no panics on any input (fuzzed by
//! `fuzz/fuzz_targets/rpc_request.rs`).
//!
//! SPDK's clients send JSON texts back to back with no length prefix or
//! delimiter and read replies the same way, so the only framing is "one
//! complete JSON value". [`StreamDecoder`] finds value boundaries
//! incrementally with a small bracket scanner (strings and escapes aware) and
//! runs serde_json once per complete value, so a request arriving in many
//! small reads is not re-parsed from the start on every read.

use crate::errors::RpcError;
use serde_json::{Map, Value};

/// Default bound on one request (one top-level JSON value), in bytes.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 4 << 20;

/// Unfinished values up to this size are syntax-checked on every read.
const EARLY_CHECK_ALWAYS_BYTES: usize = 4096;
/// Decoder buffers above this capacity are shrunk once mostly consumed.
const SHRINK_ABOVE_BYTES: usize = 256 << 10;

/// Why a byte stream cannot go on. Either way the server answers with the
/// carried error (id null) and closes the connection, as SPDK does: after a
/// syntax error the stream position is lost, so nothing later can be trusted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FrameError {
    #[error("invalid JSON: {0}")]
    Syntax(String),
    #[error("request exceeds the limit of {limit} bytes")]
    TooLarge { limit: usize },
}

impl FrameError {
    /// The JSON-RPC error to send before closing.
    pub fn to_rpc_error(&self) -> RpcError {
        match self {
            FrameError::Syntax(msg) => RpcError::parse_error(msg),
            FrameError::TooLarge { limit } => RpcError::invalid_request(format!(
                "request exceeds the limit of {limit} bytes; connection closed"
            )),
        }
    }
}

/// Incremental splitter of a byte stream into complete JSON values.
#[derive(Debug)]
pub struct StreamDecoder {
    buf: Vec<u8>,
    max_value_bytes: usize,
    scan: Scan,
    /// Partial-value size at the last early syntax check.
    early_checked: usize,
}

/// Scanner state for the value being assembled at the front of `buf`.
#[derive(Debug, Default, Clone, Copy)]
struct Scan {
    /// Bytes of `buf` already examined.
    pos: usize,
    /// Nesting depth of `{`/`[` outside strings.
    depth: usize,
    in_string: bool,
    escape: bool,
}

impl StreamDecoder {
    pub fn new(max_value_bytes: usize) -> Self {
        StreamDecoder {
            buf: Vec::new(),
            max_value_bytes: max_value_bytes.max(1),
            scan: Scan::default(),
            early_checked: 0,
        }
    }

    /// Bytes received but not yet returned as values.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Whether a value has started but not completed (a half-sent request).
    pub fn has_partial(&self) -> bool {
        self.buf.iter().any(|b| !b.is_ascii_whitespace())
    }

    /// Append received bytes. Fails once the value being assembled is
    /// already over the limit, so a caller never buffers much more than
    /// `max_value_bytes` plus one read.
    pub fn push(&mut self, bytes: &[u8]) -> Result<(), FrameError> {
        self.buf.extend_from_slice(bytes);
        self.check_limit()
    }

    fn check_limit(&self) -> Result<(), FrameError> {
        // Only the unfinished value counts: complete values are taken out
        // by next_value() before the next push.
        let start = self.leading_ws();
        if self.buf.len() - start > self.max_value_bytes && self.scan_end_hint().is_none() {
            return Err(FrameError::TooLarge {
                limit: self.max_value_bytes,
            });
        }
        Ok(())
    }

    fn leading_ws(&self) -> usize {
        self.buf
            .iter()
            .position(|b| !b.is_ascii_whitespace())
            .unwrap_or(self.buf.len())
    }

    /// End offset of the first value if it completes within the limit
    /// (without advancing the persistent scanner).
    fn scan_end_hint(&self) -> Option<usize> {
        let start = self.leading_ws();
        let limit_end = (start + self.max_value_bytes).min(self.buf.len());
        let mut s = self.scan;
        scan_container(&self.buf, &mut s, start, limit_end)
    }

    /// The next complete value, `Ok(None)` when more bytes are needed.
    pub fn next_value(&mut self) -> Result<Option<Value>, FrameError> {
        let start = self.leading_ws();
        if start == self.buf.len() {
            self.buf.clear();
            self.scan = Scan::default();
            return Ok(None);
        }
        let end = match self.buf[start] {
            b'{' | b'[' => {
                let limit_end = (start + self.max_value_bytes).min(self.buf.len());
                match scan_container(&self.buf, &mut self.scan, start, limit_end) {
                    Some(end) => end,
                    None => {
                        self.check_limit()?;
                        self.early_syntax_check(start)?;
                        return Ok(None);
                    }
                }
            }
            // A scalar or garbage: let serde decide (a scalar is a valid
            // JSON text but an invalid request, answered by the caller).
            _ => return self.next_scalar(start),
        };
        let parsed = serde_json::from_slice::<Value>(&self.buf[start..end]);
        self.consume(end);
        parsed
            .map(Some)
            .map_err(|e| FrameError::Syntax(e.to_string()))
    }

    /// Report a syntax error in an unfinished value now rather than when
    /// its brackets balance (or never, for `{garbage` with no `}`): serde
    /// parses the partial text and only an error that is not "unexpected
    /// end of input" counts. Checks run at geometrically growing sizes
    /// (and always while small), so the total work stays linear however
    /// the request is split into reads.
    fn early_syntax_check(&mut self, start: usize) -> Result<(), FrameError> {
        let partial = self.buf.len() - start;
        if partial > EARLY_CHECK_ALWAYS_BYTES && partial < self.early_checked.saturating_mul(2) {
            return Ok(());
        }
        self.early_checked = partial;
        match serde_json::from_slice::<Value>(&self.buf[start..]) {
            Err(e) if !e.is_eof() => Err(FrameError::Syntax(e.to_string())),
            _ => Ok(()),
        }
    }

    fn next_scalar(&mut self, start: usize) -> Result<Option<Value>, FrameError> {
        let window_end = (start + self.max_value_bytes).min(self.buf.len());
        let mut it =
            serde_json::Deserializer::from_slice(&self.buf[start..window_end]).into_iter::<Value>();
        match it.next() {
            Some(Ok(v)) => {
                let end = start + it.byte_offset();
                self.consume(end);
                Ok(Some(v))
            }
            Some(Err(e)) if e.is_eof() => self.check_limit().map(|()| None),
            Some(Err(e)) => Err(FrameError::Syntax(e.to_string())),
            None => Ok(None),
        }
    }

    fn consume(&mut self, end: usize) {
        self.buf.drain(..end);
        self.scan = Scan::default();
        self.early_checked = 0;
        // Give back the memory of a large request once it is parsed, so an
        // idle connection does not keep megabytes.
        if self.buf.capacity() > SHRINK_ABOVE_BYTES && self.buf.len() < SHRINK_ABOVE_BYTES / 2 {
            self.buf.shrink_to(SHRINK_ABOVE_BYTES / 2);
        }
    }
}

/// Advance `s` over `buf[s.pos.max(start)..limit_end]`; return the end
/// offset (exclusive) once the container opened at `start` closes.
fn scan_container(buf: &[u8], s: &mut Scan, start: usize, limit_end: usize) -> Option<usize> {
    let mut i = s.pos.max(start);
    while i < limit_end {
        let b = buf[i];
        i += 1;
        if s.in_string {
            if s.escape {
                s.escape = false;
            } else if b == b'\\' {
                s.escape = true;
            } else if b == b'"' {
                s.in_string = false;
            }
            continue;
        }
        match b {
            b'"' => s.in_string = true,
            b'{' | b'[' => s.depth += 1,
            b'}' | b']' => {
                s.depth = s.depth.saturating_sub(1);
                if s.depth == 0 {
                    s.pos = i;
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    s.pos = i;
    None
}

/// One decoded request. `id == None` marks a notification (no reply).
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub id: Option<Value>,
    pub method: String,
    /// Always an object or an array; a missing `params` is `{}` because
    /// SPDK's client omits empty params.
    pub params: Value,
}

/// One entry of a message: a request to dispatch, or an error to answer
/// right away (with the id it carried when that id was valid, else null).
pub type Entry = Result<Request, (Value, RpcError)>;

/// A decoded top-level JSON value.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    Single(Entry),
    /// A non-empty batch; its reply is one array of the non-notification
    /// replies (none at all if every entry is a notification).
    Batch(Vec<Entry>),
}

/// Decode one top-level value. An empty batch and a non-object, non-array
/// value are a single -32600 error.
pub fn decode_message(v: Value) -> Message {
    match v {
        Value::Array(items) if items.is_empty() => {
            Message::Single(Err((Value::Null, RpcError::invalid_request("empty batch"))))
        }
        Value::Array(items) => Message::Batch(items.into_iter().map(decode_request).collect()),
        other => Message::Single(decode_request(other)),
    }
}

/// Decode one request object.
pub fn decode_request(v: Value) -> Entry {
    let Value::Object(mut obj) = v else {
        return Err((
            Value::Null,
            RpcError::invalid_request("expected a JSON object"),
        ));
    };
    // The id is taken first so that later errors can echo it.
    let id = match obj.remove("id") {
        None => None,
        Some(id @ (Value::Null | Value::String(_) | Value::Number(_))) => Some(id),
        Some(_) => {
            return Err((
                Value::Null,
                RpcError::invalid_request("`id` must be a string, a number or null"),
            ))
        }
    };
    let echo = id.clone().unwrap_or(Value::Null);
    match obj.get("jsonrpc") {
        Some(Value::String(s)) if s == "2.0" => {}
        _ => {
            return Err((
                echo,
                RpcError::invalid_request("`jsonrpc` must be exactly \"2.0\""),
            ))
        }
    }
    let method = match obj.remove("method") {
        Some(Value::String(m)) => m,
        Some(_) => return Err((echo, RpcError::invalid_request("`method` must be a string"))),
        None => return Err((echo, RpcError::invalid_request("missing `method`"))),
    };
    let params = match obj.remove("params") {
        None => Value::Object(Map::new()),
        Some(p @ (Value::Object(_) | Value::Array(_))) => p,
        Some(_) => {
            return Err((
                echo,
                RpcError::invalid_request("`params` must be an object or an array"),
            ))
        }
    };
    Ok(Request { id, method, params })
}

/// `{"jsonrpc":"2.0","id":..,"result":..}` or `{..,"error":{..}}`.
pub fn encode_response(id: Value, result: Result<Value, RpcError>) -> Value {
    let mut m = Map::new();
    m.insert("jsonrpc".into(), Value::from("2.0"));
    m.insert("id".into(), id);
    match result {
        Ok(v) => m.insert("result".into(), v),
        Err(e) => m.insert("error".into(), e.to_json()),
    };
    Value::Object(m)
}

/// A request as a client sends it; `params` is left out when it is null or
/// an empty object, like SPDK's client.
pub fn encode_request(id: Option<Value>, method: &str, params: Option<&Value>) -> Value {
    let mut m = Map::new();
    m.insert("jsonrpc".into(), Value::from("2.0"));
    m.insert("method".into(), Value::from(method));
    if let Some(p) = params {
        let empty = p.is_null() || p.as_object().is_some_and(Map::is_empty);
        if !empty {
            m.insert("params".into(), p.clone());
        }
    }
    if let Some(id) = id {
        m.insert("id".into(), id);
    }
    Value::Object(m)
}

/// Feed arbitrary bytes through the splitter and decoder, as the server
/// would; returns how many messages were decoded. Shared by the fuzz target
/// and the proptest so both exercise the same path.
pub fn fuzz_stream(data: &[u8], max_value_bytes: usize) -> usize {
    let mut dec = StreamDecoder::new(max_value_bytes);
    let mut n = 0;
    // Feed in uneven chunks to exercise partial-input handling.
    for chunk in data.chunks(7) {
        if dec.push(chunk).is_err() {
            return n;
        }
        loop {
            match dec.next_value() {
                Ok(Some(v)) => {
                    let msg = decode_message(v);
                    if let Message::Single(Err((id, e))) = &msg {
                        let _ = encode_response(id.clone(), Err(e.clone()));
                    }
                    n += 1;
                }
                Ok(None) => break,
                Err(_) => return n,
            }
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn values(input: &[&[u8]]) -> Vec<Result<Value, FrameError>> {
        let mut d = StreamDecoder::new(1024);
        let mut out = Vec::new();
        for chunk in input {
            if let Err(e) = d.push(chunk) {
                out.push(Err(e));
                return out;
            }
            loop {
                match d.next_value() {
                    Ok(Some(v)) => out.push(Ok(v)),
                    Ok(None) => break,
                    Err(e) => {
                        out.push(Err(e));
                        return out;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn splits_back_to_back_values_across_reads() {
        let out = values(&[b"{\"a\":\"}{\\\"\"}  {\"b\"", b":[1,2]}\n[1]{", b"}"]);
        assert_eq!(
            out,
            vec![
                Ok(json!({"a": "}{\""})),
                Ok(json!({"b": [1, 2]})),
                Ok(json!([1])),
                Ok(json!({}))
            ]
        );
    }

    #[test]
    fn partial_value_waits_and_syntax_error_fails() {
        let mut d = StreamDecoder::new(1024);
        d.push(b"{\"jsonrpc\": \"2.0\", ").unwrap();
        assert_eq!(d.next_value(), Ok(None));
        assert!(d.has_partial());
        assert!(matches!(
            values(&[b"{\"a\" 1}"])[0],
            Err(FrameError::Syntax(_))
        ));
        assert!(matches!(values(&[b"xyz"])[0], Err(FrameError::Syntax(_))));
        assert!(matches!(values(&[b"{]"])[0], Err(FrameError::Syntax(_))));
        // Garbage inside an unfinished object is reported without waiting
        // for a closing brace that may never come.
        assert!(matches!(
            values(&[b"{\"a\" 1"])[0],
            Err(FrameError::Syntax(_))
        ));
        assert!(matches!(values(&[b"[1, x"])[0], Err(FrameError::Syntax(_))));
        // Partial tokens are not errors.
        for partial in [
            &b"{\"a\": tr"[..],
            b"{\"a\": -",
            b"[1.5e",
            b"{\"\\u00",
            b"[\"\xc3",
        ] {
            assert_eq!(values(&[partial]), vec![], "{partial:?}");
        }
    }

    #[test]
    fn oversized_value_is_refused() {
        let mut d = StreamDecoder::new(16);
        assert_eq!(d.push(b"{\"a\":\"0123456789"), Ok(()));
        assert_eq!(d.next_value(), Ok(None));
        assert_eq!(d.push(b"abcdef\""), Err(FrameError::TooLarge { limit: 16 }));
        // Small values back to back in one read are fine.
        let mut d = StreamDecoder::new(16);
        d.push(b"{\"a\":1} {\"b\":2} {\"c\":3} {\"d\":4}").unwrap();
        let mut n = 0;
        while let Ok(Some(_)) = d.next_value() {
            n += 1;
        }
        assert_eq!(n, 4);
    }

    #[test]
    fn decodes_requests() {
        let ok = decode_request(json!({"jsonrpc":"2.0","method":"m","id":-1.5}));
        assert_eq!(
            ok,
            Ok(Request {
                id: Some(json!(-1.5)),
                method: "m".into(),
                params: json!({})
            })
        );
        let note = decode_request(json!({"jsonrpc":"2.0","method":"m","params":[1]}));
        assert_eq!(note.unwrap().id, None);
        let bad = decode_request(json!({"jsonrpc":"1.0","method":"m","id":"x"}));
        assert_eq!(bad.unwrap_err().0, json!("x"));
        let bad = decode_request(json!({"jsonrpc":"2.0","method":1,"id":1}));
        assert_eq!(bad.unwrap_err().1.code, crate::errors::INVALID_REQUEST);
        let bad = decode_request(json!({"jsonrpc":"2.0","method":"m","params":"x","id":1}));
        assert!(bad.unwrap_err().1.message.contains("params"));
        let bad = decode_request(json!({"jsonrpc":"2.0","method":"m","id":{}}));
        assert_eq!(bad.unwrap_err().0, Value::Null);
        assert!(matches!(decode_message(json!([])), Message::Single(Err(_))));
    }
}

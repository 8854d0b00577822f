//! JSON-RPC error objects: the standard JSON-RPC 2.0 codes and SPDK's domain
//! codes (negative errno with the `strerror` text), so that a script written
//! against SPDK sees the same `code`/`message` pair from ustor.

use serde_json::{json, Map, Value};

/// Invalid JSON was received (JSON-RPC 2.0).
pub const PARSE_ERROR: i32 = -32700;
/// The JSON sent is not a valid Request object.
pub const INVALID_REQUEST: i32 = -32600;
/// The method does not exist or is not available.
pub const METHOD_NOT_FOUND: i32 = -32601;
/// Invalid method parameter(s).
pub const INVALID_PARAMS: i32 = -32602;
/// Internal JSON-RPC error.
pub const INTERNAL_ERROR: i32 = -32603;
/// SPDK's `SPDK_JSONRPC_ERROR_INVALID_STATE`: method not allowed in the
/// current framework state (startup vs runtime).
pub const INVALID_STATE: i32 = -1;

/// One JSON-RPC error object: `{"code": .., "message": .., "data": ..}`.
///
/// Domain failures use SPDK's convention: `code` is the negative errno and
/// `message` its `strerror` text (or a more specific sentence), so the errno
/// survives the trip to the client.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message} (code {code})")]
pub struct RpcError {
    pub code: i32,
    pub message: String,
    /// Optional structured detail. For invalid parameters it is
    /// `{"param": "<name>"}` so that tools (and the config loader) can name
    /// the offending field without parsing the message.
    pub data: Option<Value>,
}

impl RpcError {
    /// An error with an arbitrary code and message.
    pub fn new(code: i32, message: impl Into<String>) -> Self {
        RpcError {
            code,
            message: message.into(),
            data: None,
        }
    }

    /// Attach structured `data`.
    pub fn with_data(mut self, data: Value) -> Self {
        self.data = Some(data);
        self
    }

    /// -32700 "Parse error: ..." (the reply to bytes that are not JSON).
    pub fn parse_error(detail: impl std::fmt::Display) -> Self {
        Self::new(PARSE_ERROR, format!("Parse error: {detail}"))
    }

    /// -32600 "Invalid request: ...".
    pub fn invalid_request(detail: impl std::fmt::Display) -> Self {
        Self::new(INVALID_REQUEST, format!("Invalid request: {detail}"))
    }

    /// -32601 "Method not found" (SPDK's exact text; `data` names the method).
    pub fn method_not_found(method: &str) -> Self {
        Self::new(METHOD_NOT_FOUND, "Method not found").with_data(json!({ "method": method }))
    }

    /// -32602 with a free-form message.
    pub fn invalid_params(message: impl Into<String>) -> Self {
        Self::new(INVALID_PARAMS, message)
    }

    /// -32602 naming the bad parameter: "Invalid parameter `name`: why".
    pub fn invalid_param(name: &str, why: impl std::fmt::Display) -> Self {
        Self::new(INVALID_PARAMS, format!("Invalid parameter `{name}`: {why}"))
            .with_data(json!({ "param": name }))
    }

    /// -32603 "Internal error: ...".
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        Self::new(INTERNAL_ERROR, format!("Internal error: {detail}"))
    }

    /// SPDK-style domain error: code `-errno`, message `strerror(errno)`,
    /// e.g. `RpcError::errno(libc::EEXIST)` is `{-17, "File exists"}`.
    pub fn errno(errno: i32) -> Self {
        Self::new(-errno.saturating_abs(), strerror(errno))
    }

    /// Domain error with errno code and a specific message (SPDK often says
    /// e.g. "bdev Malloc0 already exists" with code -17).
    pub fn errno_msg(errno: i32, message: impl Into<String>) -> Self {
        Self::new(-errno.saturating_abs(), message)
    }

    /// Map an I/O error to its errno form (EIO when it carries none).
    pub fn from_io(err: &std::io::Error) -> Self {
        let errno = err.raw_os_error().unwrap_or(libc::EIO);
        Self::errno_msg(errno, err.to_string())
    }

    /// The errno this error carries, if its code is in SPDK's errno range.
    pub fn as_errno(&self) -> Option<i32> {
        (self.code < 0 && self.code > -4096).then_some(-self.code)
    }

    /// The parameter this error names (see [`RpcError::invalid_param`]).
    pub fn param(&self) -> Option<&str> {
        self.data.as_ref()?.get("param")?.as_str()
    }

    /// The wire form of the error object.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("code".into(), Value::from(self.code));
        m.insert("message".into(), Value::from(self.message.clone()));
        if let Some(d) = &self.data {
            m.insert("data".into(), d.clone());
        }
        Value::Object(m)
    }

    /// Decode a wire error object; anything malformed becomes an internal
    /// error describing what was received, never a panic.
    pub fn from_json(v: &Value) -> Self {
        let code = v
            .get("code")
            .and_then(Value::as_i64)
            .and_then(|c| i32::try_from(c).ok());
        let message = v.get("message").and_then(Value::as_str);
        match (code, message) {
            (Some(code), Some(message)) => RpcError {
                code,
                message: message.to_string(),
                data: v.get("data").cloned(),
            },
            _ => Self::internal(format!("malformed error object: {v}")),
        }
    }
}

/// `strerror` text for an errno, thread-safe (XSI `strerror_r`).
pub fn strerror(errno: i32) -> String {
    let errno = errno.saturating_abs();
    let mut buf = [0 as libc::c_char; 128];
    // SAFETY: buf is valid for buf.len() bytes; strerror_r NUL-terminates on
    // success and we fall back below when it fails.
    let rc = unsafe { libc::strerror_r(errno, buf.as_mut_ptr(), buf.len()) };
    if rc != 0 {
        return format!("Unknown error {errno}");
    }
    // SAFETY: on success the buffer holds a NUL-terminated string.
    let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    s.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_texts_match_spdk() {
        assert_eq!(
            RpcError::errno(libc::EEXIST),
            RpcError::new(-17, "File exists")
        );
        assert_eq!(RpcError::errno(libc::ENODEV).message, "No such device");
        assert_eq!(RpcError::errno(libc::EINVAL).message, "Invalid argument");
        assert_eq!(RpcError::errno(libc::EBUSY).code, -16);
        assert_eq!(
            RpcError::errno(libc::EBUSY).message,
            "Device or resource busy"
        );
        assert_eq!(RpcError::errno(-libc::ENOMEM).code, -12);
    }

    #[test]
    fn json_roundtrip() {
        let e = RpcError::invalid_param("block_size", "must be a power of two");
        assert_eq!(RpcError::from_json(&e.to_json()), e);
        assert_eq!(e.param(), Some("block_size"));
        let bad = RpcError::from_json(&json!({"code": "x"}));
        assert_eq!(bad.code, INTERNAL_ERROR);
    }
}

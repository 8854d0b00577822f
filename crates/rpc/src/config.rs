//! SPDK-format JSON config files:
//! `{"subsystems":[{"subsystem":"bdev","config":[{"method":..,"params":{..}}]}]}`.
//! [`load_config`] turns a file into an ordered list of [`ConfigCall`]s with
//! errors that name the file, subsystem, entry and field; [`apply_config`]
//! runs them through a [`MethodTable`] and, on the first failure, undoes the
//! calls already applied in reverse order.

use crate::dispatch::MethodTable;
use crate::errors::RpcError;
use serde_json::{Map, Value};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Config files larger than this are refused rather than read into memory.
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;
/// How long one config call may take before loading fails.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// One method call from a config file, with where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigCall {
    pub file: PathBuf,
    pub subsystem: String,
    /// Index of the entry in the subsystem's `config` array.
    pub entry: usize,
    /// Index inside the entry when it is a batch (an array of calls).
    pub batch_index: Option<usize>,
    pub method: String,
    /// An object or array; `{}` when the file has none.
    pub params: Value,
}

impl ConfigCall {
    /// A call with no file position, e.g. the undo of another call.
    pub fn new(method: &str, params: Value) -> Self {
        ConfigCall {
            file: PathBuf::new(),
            subsystem: String::new(),
            entry: 0,
            batch_index: None,
            method: method.to_string(),
            params,
        }
    }

    /// "subsystem `bdev` entry 2" (with "[1]" for a batch member).
    pub fn location(&self) -> String {
        match self.batch_index {
            Some(b) => format!("subsystem `{}` entry {}[{b}]", self.subsystem, self.entry),
            None => format!("subsystem `{}` entry {}", self.subsystem, self.entry),
        }
    }
}

/// Why a config could not be loaded or applied.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: {source}", file.display())]
    Io {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: JSON syntax error at line {line}, column {column}: {message}", file.display())]
    Syntax {
        file: PathBuf,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{}: {location}: {message}", file.display())]
    Schema {
        file: PathBuf,
        location: String,
        message: String,
    },
    #[error("{0}")]
    Call(Box<CallFailure>),
}

/// A config call that failed while applying a config (boxed in
/// [`ConfigError::Call`] to keep the error small).
#[derive(Debug, thiserror::Error)]
#[error("{}: {location}: {method}{}: {} (code {}){}", file.display(),
    field.as_ref().map(|f| format!(": field `{f}`")).unwrap_or_default(),
    error.message, error.code, rollback_summary(rollback_failures))]
pub struct CallFailure {
    pub file: PathBuf,
    pub location: String,
    pub method: String,
    /// The parameter the method named as bad, when it did.
    pub field: Option<String>,
    pub error: RpcError,
    /// Undo calls that failed too ("method (undoing where): message").
    pub rollback_failures: Vec<String>,
}

fn rollback_summary(failures: &[String]) -> String {
    if failures.is_empty() {
        String::new()
    } else {
        format!("; rollback incomplete: {}", failures.join("; "))
    }
}

/// Read and validate a config file.
pub fn load_config(path: impl AsRef<Path>) -> Result<Vec<ConfigCall>, ConfigError> {
    let file = path.as_ref().to_path_buf();
    let io = |source| ConfigError::Io {
        file: file.clone(),
        source,
    };
    let f = std::fs::File::open(&file).map_err(io)?;
    let mut text = Vec::new();
    f.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(io)?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(schema(
            &file,
            "file",
            format!("larger than {MAX_CONFIG_BYTES} bytes"),
        ));
    }
    parse_config(&file, &text)
}

fn schema(file: &Path, location: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Schema {
        file: file.to_path_buf(),
        location: location.to_string(),
        message: message.into(),
    }
}

/// Validate config text already in memory; `file` is used in errors.
pub fn parse_config(file: &Path, text: &[u8]) -> Result<Vec<ConfigCall>, ConfigError> {
    let root: Value = serde_json::from_slice(text).map_err(|e| ConfigError::Syntax {
        file: file.to_path_buf(),
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })?;
    let Value::Object(mut root) = root else {
        return Err(schema(
            file,
            "top level",
            "expected an object with `subsystems`",
        ));
    };
    if let Some(k) = root.keys().find(|k| *k != "subsystems") {
        return Err(schema(file, "top level", format!("unknown field `{k}`")));
    }
    let subsystems = match root.remove("subsystems") {
        Some(Value::Array(a)) => a,
        Some(_) => return Err(schema(file, "field `subsystems`", "expected an array")),
        None => return Err(schema(file, "top level", "missing field `subsystems`")),
    };
    let mut calls = Vec::new();
    for (i, sub) in subsystems.into_iter().enumerate() {
        parse_subsystem(file, i, sub, &mut calls)?;
    }
    Ok(calls)
}

fn parse_subsystem(
    file: &Path,
    i: usize,
    sub: Value,
    calls: &mut Vec<ConfigCall>,
) -> Result<(), ConfigError> {
    let at = format!("subsystems[{i}]");
    let Value::Object(mut sub) = sub else {
        return Err(schema(file, &at, "expected an object"));
    };
    if let Some(k) = sub.keys().find(|k| *k != "subsystem" && *k != "config") {
        return Err(schema(file, &at, format!("unknown field `{k}`")));
    }
    let name = match sub.remove("subsystem") {
        Some(Value::String(s)) => s,
        Some(_) => return Err(schema(file, &at, "field `subsystem`: expected a string")),
        None => return Err(schema(file, &at, "missing field `subsystem`")),
    };
    let entries = match sub.remove("config") {
        // SPDK writes `null` for a subsystem with nothing to configure.
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a,
        Some(_) => {
            let at = format!("subsystem `{name}`");
            return Err(schema(
                file,
                &at,
                "field `config`: expected an array or null",
            ));
        }
    };
    for (entry, e) in entries.into_iter().enumerate() {
        let base = ConfigCall {
            file: file.to_path_buf(),
            subsystem: name.clone(),
            entry,
            batch_index: None,
            method: String::new(),
            params: Value::Null,
        };
        match e {
            // SPDK configs may group calls into batch arrays.
            Value::Array(batch) => {
                for (b, item) in batch.into_iter().enumerate() {
                    let call = ConfigCall {
                        batch_index: Some(b),
                        ..base.clone()
                    };
                    calls.push(parse_call(call, item)?);
                }
            }
            other => calls.push(parse_call(base, other)?),
        }
    }
    Ok(())
}

fn parse_call(mut call: ConfigCall, v: Value) -> Result<ConfigCall, ConfigError> {
    let err = |call: &ConfigCall, msg: String| schema(&call.file, &call.location(), msg);
    let Value::Object(mut obj) = v else {
        return Err(err(&call, "expected an object with `method`".into()));
    };
    if let Some(k) = obj.keys().find(|k| *k != "method" && *k != "params") {
        return Err(err(&call, format!("unknown field `{k}`")));
    }
    call.method = match obj.remove("method") {
        Some(Value::String(m)) => m,
        Some(_) => return Err(err(&call, "field `method`: expected a string".into())),
        None => return Err(err(&call, "missing field `method`".into())),
    };
    call.params = match obj.remove("params") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(p @ (Value::Object(_) | Value::Array(_))) => p,
        Some(_) => return Err(err(&call, "field `params`: expected an object".into())),
    };
    Ok(call)
}

/// Run `calls` in order through `table` (same dispatch, state checks and
/// handlers as over the socket). On the first failure, the calls already
/// applied are undone in reverse order with the calls `undo` returns for
/// them (`None`: nothing to undo, e.g. a setter), and the error names the
/// file, entry, method and field. Returns how many calls were applied.
///
/// Blocks the calling thread on each call: run it where handlers do not
/// need this thread to answer (not on a reactor, not on the RPC thread).
pub fn apply_config(
    table: &MethodTable,
    calls: &[ConfigCall],
    undo: impl Fn(&ConfigCall) -> Option<ConfigCall>,
) -> Result<usize, ConfigError> {
    for (n, call) in calls.iter().enumerate() {
        let r = table.call_blocking(&call.method, call.params.clone(), CALL_TIMEOUT);
        let Err(error) = r else { continue };
        let mut rollback_failures = Vec::new();
        for done in calls[..n].iter().rev() {
            let Some(u) = undo(done) else { continue };
            if let Err(e) = table.call_blocking(&u.method, u.params.clone(), CALL_TIMEOUT) {
                tracing::error!("config rollback: {} failed: {e}", u.method);
                rollback_failures.push(format!(
                    "{} (undoing {}): {}",
                    u.method,
                    done.location(),
                    e.message
                ));
            }
        }
        return Err(ConfigError::Call(Box::new(CallFailure {
            file: call.file.clone(),
            location: call.location(),
            method: call.method.clone(),
            field: error.param().map(str::to_string),
            error,
            rollback_failures,
        })));
    }
    Ok(calls.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(s: &str) -> Result<Vec<ConfigCall>, ConfigError> {
        parse_config(Path::new("t.json"), s.as_bytes())
    }

    #[test]
    fn parses_spdk_shape() {
        let calls = parse(
            r#"{"subsystems":[{"subsystem":"bdev","config":[
                {"method":"bdev_malloc_create","params":{"name":"m0"}},
                [{"method":"a"},{"method":"b","params":null}]]},
              {"subsystem":"nbd","config":null}]}"#,
        )
        .unwrap();
        assert_eq!(calls.len(), 3);
        assert_eq!(calls[0].params, json!({"name":"m0"}));
        assert_eq!(calls[2].location(), "subsystem `bdev` entry 1[1]");
        assert_eq!(calls[2].params, json!({}));
    }

    #[test]
    fn errors_name_where() {
        let e = parse("{\"subsystems\": [\n  {\"subsystem\": \"bdev\",, }]}").unwrap_err();
        assert!(matches!(e, ConfigError::Syntax { line: 2, .. }), "{e}");
        let e = parse(
            r#"{"subsystems":[{"subsystem":"bdev","config":[{"method":"m"},{"params":{}}]}]}"#,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "t.json: subsystem `bdev` entry 1: missing field `method`"
        );
        let e = parse(r#"{"subsystems":[{"subsystem":"bdev","confg":[]}]}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `confg`"), "{e}");
        let e = parse(r#"{"subsystem":[]}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `subsystem`"), "{e}");
    }
}

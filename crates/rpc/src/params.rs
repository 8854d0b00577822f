//! Typed parameter decoding for method handlers: serde structs (declare them
//! `#[serde(deny_unknown_fields)]`) with every failure turned into a -32602
//! error that names the offending field, e.g. "unknown field `foo`",
//! "missing field `name`", "invalid type for `block_size`: ...".

use crate::errors::RpcError;
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};

/// Decode `params` into `T`. A missing (null) `params` is treated as `{}`
/// because SPDK's client omits empty params.
///
/// ```
/// #[derive(Debug, serde::Deserialize)]
/// #[allow(dead_code)]
/// #[serde(deny_unknown_fields)]
/// struct Create { name: String, block_size: u32 }
/// let err = ustor_rpc::parse_params::<Create>(serde_json::json!({"name": "m0"})).unwrap_err();
/// assert_eq!(err.message, "Invalid parameters: missing field `block_size`");
/// ```
pub fn parse_params<T: DeserializeOwned>(params: Value) -> Result<T, RpcError> {
    let params = match params {
        Value::Null => Value::Object(Map::new()),
        p => p,
    };
    serde_path_to_error::deserialize::<_, T>(params).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        params_error(&path, &inner)
    })
}

/// Build the -32602 error from serde's message and the path where it
/// happened (as `serde_path_to_error` prints it). serde reports
/// unknown/missing fields by name but type errors only by position, which
/// is what the path adds. Public for layers that decode their own params
/// (a bdev module's create) and report through RPC.
pub fn params_error(path: &str, inner: &str) -> RpcError {
    let field = field_in_message(inner).map(str::to_string).or_else(|| {
        // The path ends at the struct holding an unknown/missing field, or
        // at the field itself for type errors; "." means the top level.
        (path != "." && !path.is_empty()).then(|| path.to_string())
    });
    let message = if inner.starts_with("unknown field") || inner.starts_with("missing field") {
        match path {
            "." | "" => format!("Invalid parameters: {inner}"),
            p => format!("Invalid parameters: {inner} in `{p}`"),
        }
    } else {
        match &field {
            Some(f) => format!("Invalid parameters: invalid value for `{f}`: {inner}"),
            None => format!("Invalid parameters: {inner}"),
        }
    };
    let err = RpcError::invalid_params(message);
    match field {
        Some(f) => err.with_data(json!({ "param": f })),
        None => err,
    }
}

/// The field named in serde's "unknown field `x`" / "missing field `x`".
fn field_in_message(msg: &str) -> Option<&str> {
    let rest = msg
        .strip_prefix("unknown field `")
        .or_else(|| msg.strip_prefix("missing field `"))?;
    rest.split('`').next()
}

/// Reject any parameter: for methods that take none (a non-empty object or
/// array is -32602, as SPDK answers "... requires no parameters").
pub fn no_params(method: &str, params: &Value) -> Result<(), RpcError> {
    let empty = match params {
        Value::Null => true,
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    };
    if empty {
        Ok(())
    } else {
        Err(RpcError::invalid_params(format!(
            "Invalid parameters: {method} requires no parameters"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Create {
        name: String,
        block_size: u32,
        #[serde(default)]
        uuid: Option<String>,
    }

    #[test]
    fn names_the_field() {
        let e =
            parse_params::<Create>(json!({"name": "m", "block_size": 512, "foo": 1})).unwrap_err();
        assert!(e.message.contains("unknown field `foo`"), "{}", e.message);
        assert_eq!(e.param(), Some("foo"));
        let e = parse_params::<Create>(json!({"block_size": 512})).unwrap_err();
        assert_eq!(e.message, "Invalid parameters: missing field `name`");
        let e = parse_params::<Create>(json!({"name": "m", "block_size": "x"})).unwrap_err();
        assert!(
            e.message.contains("invalid value for `block_size`"),
            "{}",
            e.message
        );
        assert!(e.message.contains("invalid type"), "{}", e.message);
        assert_eq!(e.param(), Some("block_size"));
        assert_eq!(e.code, crate::errors::INVALID_PARAMS);
    }

    #[test]
    fn null_is_empty_object() {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Opt {
            #[serde(default)]
            current: bool,
        }
        assert!(!parse_params::<Opt>(Value::Null).unwrap().current);
        assert!(no_params("m", &Value::Null).is_ok());
        assert!(no_params("m", &json!({"a": 1})).is_err());
    }
}

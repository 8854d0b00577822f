//! `ustor rpc`, `ustor save-config`, `ustor load-config`: the client side,
//! with SPDK rpc.py's behaviour (pretty JSON out, non-zero exit with the
//! server's message on error).

use serde_json::{Map, Value};
use ustor_rpc::{format_error, to_pretty, RpcClient};

pub const DEFAULT_SOCKET: &str = "/var/tmp/ustor.sock";

#[derive(clap::Args)]
pub struct SocketArg {
    /// RPC socket of the server.
    #[arg(short = 's', long = "server", default_value = DEFAULT_SOCKET)]
    pub socket: String,
}

#[derive(clap::Args)]
pub struct RpcArgs {
    #[arg(short = 's', long = "server", default_value = DEFAULT_SOCKET)]
    socket: String,
    /// Params as one JSON object (merged under any --key value pairs).
    #[arg(long)]
    json: Option<String>,
    method: String,
    /// `--key value` pairs; values that parse as JSON (numbers, true, {...})
    /// are sent as such, others as strings; `--flag` alone means true.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    rest: Vec<String>,
}

#[derive(clap::Args)]
pub struct LoadArgs {
    file: String,
    #[arg(short = 's', long = "server", default_value = DEFAULT_SOCKET)]
    socket: String,
}

/// Turns `--key value --flag --other=3` into a JSON object.
pub fn parse_kv(rest: &[String]) -> Result<Map<String, Value>, String> {
    let mut m = Map::new();
    let mut i = 0;
    while i < rest.len() {
        let Some(k) = rest[i].strip_prefix("--") else {
            return Err(format!("expected --key, got `{}`", rest[i]));
        };
        let (k, v) = match k.split_once('=') {
            Some((k, v)) => (k.to_string(), Some(v.to_string())),
            None if i + 1 < rest.len() && !rest[i + 1].starts_with("--") => {
                i += 1;
                (k.to_string(), Some(rest[i].clone()))
            }
            None => (k.to_string(), None),
        };
        let key = k.replace('-', "_");
        let val = match v {
            None => Value::Bool(true),
            Some(v) => serde_json::from_str::<Value>(&v)
                .ok()
                .filter(|j| !j.is_string())
                .unwrap_or(Value::String(v)),
        };
        m.insert(key, val);
        i += 1;
    }
    Ok(m)
}

pub fn run(a: RpcArgs) -> i32 {
    let mut params = match parse_kv(&a.rest) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("ustor rpc: {e}");
            return 2;
        }
    };
    if let Some(j) = &a.json {
        match serde_json::from_str::<Value>(j) {
            Ok(Value::Object(o)) => params.extend(o),
            Ok(_) => {
                eprintln!("ustor rpc: --json must be a JSON object");
                return 2;
            }
            Err(e) => {
                eprintln!("ustor rpc: --json: {e}");
                return 2;
            }
        }
    }
    let params = if params.is_empty() {
        Value::Null
    } else {
        Value::Object(params)
    };
    let mut c = match RpcClient::connect(&a.socket) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}", e.message);
            return 1;
        }
    };
    match c.call(&a.method, params.clone()) {
        Ok(v) => {
            println!("{}", to_pretty(&v));
            0
        }
        Err(e) => {
            eprintln!("{}", format_error(&a.method, &params, &e));
            1
        }
    }
}

pub fn save(a: SocketArg) -> i32 {
    let r = RpcClient::connect(&a.socket).and_then(|mut c| ustor_rpc::save_config(&mut c, None));
    match r {
        Ok(v) => {
            println!("{}", to_pretty(&v));
            0
        }
        Err(e) => {
            eprintln!("save_config: {}", e.message);
            1
        }
    }
}

pub fn load(a: LoadArgs) -> i32 {
    let calls = match ustor_rpc::load_config(&a.file) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return 1;
        }
    };
    let mut c = match RpcClient::connect(&a.socket) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}", e.message);
            return 1;
        }
    };
    for (n, call) in calls.iter().enumerate() {
        if let Err(e) = c.call(&call.method, call.params.clone()) {
            eprintln!(
                "{}: {}: {}",
                a.file,
                call.location(),
                format_error(&call.method, &call.params, &e)
            );
            // Nothing half-created: undo what this file created, newest first.
            for done in calls[..n].iter().rev() {
                if let Some(u) = crate::methods::undo_call(done) {
                    if let Err(e) = c.call(&u.method, u.params.clone()) {
                        eprintln!(
                            "rollback of {}: {} failed: {}",
                            done.location(),
                            u.method,
                            e.message
                        );
                    }
                }
            }
            return 1;
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn kv_pairs_become_typed_params() {
        let args: Vec<String> = [
            "--name",
            "m0",
            "--num-blocks",
            "128",
            "--read-only",
            "--uuid=abc",
            "--x",
            "{\"a\":1}",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let m = parse_kv(&args).unwrap();
        assert_eq!(
            Value::Object(m),
            json!({"name": "m0", "num_blocks": 128, "read_only": true, "uuid": "abc", "x": {"a": 1}})
        );
        assert!(parse_kv(&["oops".to_string()]).is_err());
    }
}

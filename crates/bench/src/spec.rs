//! Inline bdev specs for `ustor bench --bdev`: `KIND:ARG` where KIND is a
//! module in the registry's table that takes inline specs (`null:1G`,
//! `malloc:256M`, `uring:/dev/loop0`, `uring:/path/file`), or the name of an
//! existing bdev.

use std::sync::Arc;

use ustor_bdev::{ControlError, Registry};

/// Creates the bdev a spec names (or checks a plain name exists) and returns
/// its name.
pub fn create(reg: &Arc<Registry>, spec: &str, block_size: u32) -> Result<String, ControlError> {
    let Some((kind, arg)) = spec.split_once(':') else {
        return match reg.get(spec) {
            Some(_) => Ok(spec.to_string()),
            None => Err(ControlError::NotFound(spec.to_string())),
        };
    };
    match reg.module(kind) {
        Some(m) if m.inline_spec_syntax().is_some() => m
            .inline_spec(reg, arg, block_size)
            .map(|e| e.info().name.clone()),
        _ => {
            let kinds: Vec<&str> = reg
                .modules()
                .iter()
                .filter_map(|m| m.inline_spec_syntax())
                .collect();
            Err(ControlError::invalid(
                "bdev",
                format!("unknown bdev kind `{kind}` ({})", kinds.join(", ")),
            ))
        }
    }
}

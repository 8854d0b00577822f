//! Inline bdev specs for `ustor bench --bdev`: `null:1G`, `malloc:256M`,
//! `uring:/dev/loop0`, `uring:/path/file`, or the name of an existing bdev.

use std::sync::Arc;

use ustor_bdev::modules::{malloc, null, uring, RamOpts};
use ustor_bdev::{parse_size, ControlError, Registry};

/// Creates the bdev a spec names (or checks a plain name exists) and returns
/// its name.
pub fn create(reg: &Arc<Registry>, spec: &str, block_size: u32) -> Result<String, ControlError> {
    let Some((kind, arg)) = spec.split_once(':') else {
        return match reg.get(spec) {
            Some(_) => Ok(spec.to_string()),
            None => Err(ControlError::NotFound(spec.to_string())),
        };
    };
    let size = |what: &str| {
        parse_size(arg)
            .filter(|s| *s > 0)
            .ok_or_else(|| ControlError::invalid("bdev", format!("bad {what} size `{arg}`")))
    };
    let ram = |name: &str, bytes: u64| RamOpts {
        name: name.into(),
        num_blocks: bytes / block_size as u64,
        block_size,
        uuid: None,
        optimal_io_boundary: 0,
        max_transfer_blocks: 0,
    };
    match kind {
        "null" => null::create(reg, ram("Null0", size("null")?)).map(|e| e.info().name.clone()),
        "malloc" => {
            malloc::create(reg, ram("Malloc0", size("malloc")?)).map(|e| e.info().name.clone())
        }
        "uring" => uring::create(
            reg,
            uring::UringOpts {
                name: "Uring0".into(),
                filename: arg.to_string(),
                block_size: 0,
                uuid: None,
                direct: true,
                sqpoll: false,
                iopoll: false,
            },
        )
        .map(|e| e.info().name.clone()),
        _ => Err(ControlError::invalid(
            "bdev",
            format!("unknown bdev kind `{kind}` (null, malloc, uring)"),
        )),
    }
}

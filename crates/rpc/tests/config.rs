//! Config files: loading with precise errors, applying through the method
//! table with rollback of what was created before a failure.

mod common;
use common::*;
use serde_json::json;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use ustor_rpc::{
    apply_config, load_config, parse_params, CallFailure, ConfigCall, ConfigError, MethodTable,
    RpcError, RPC_RUNTIME,
};

fn write_tmp(tag: &str, text: &str) -> std::path::PathBuf {
    let p = sock_path(tag).with_extension("json");
    std::fs::write(&p, text).unwrap();
    p
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Create {
    name: String,
    block_size: u32,
}

/// A table with create/delete methods over a set of names.
fn table_with_objects() -> (MethodTable, Arc<Mutex<BTreeSet<String>>>) {
    let t = MethodTable::new();
    let objs = Arc::new(Mutex::new(BTreeSet::new()));
    let o = objs.clone();
    t.register_sync("obj_create", RPC_RUNTIME, move |p| {
        let c: Create = parse_params(p)?;
        if c.block_size % 512 != 0 {
            return Err(RpcError::invalid_param(
                "block_size",
                "must be a multiple of 512",
            ));
        }
        if !o.lock().unwrap().insert(c.name.clone()) {
            return Err(RpcError::errno(libc::EEXIST));
        }
        Ok(json!(c.name))
    })
    .unwrap();
    let o = objs.clone();
    t.register_sync("obj_delete", RPC_RUNTIME, move |p| {
        let name = p["name"].as_str().unwrap_or_default().to_string();
        if o.lock().unwrap().remove(&name) {
            Ok(json!(true))
        } else {
            Err(RpcError::errno(libc::ENODEV))
        }
    })
    .unwrap();
    t.register_sync("set_option", RPC_RUNTIME, |_| Ok(json!(true)))
        .unwrap();
    (t, objs)
}

fn undo(c: &ConfigCall) -> Option<ConfigCall> {
    (c.method == "obj_create")
        .then(|| ConfigCall::new("obj_delete", json!({"name": c.params["name"]})))
}

#[test]
fn applies_in_order() {
    let (t, objs) = table_with_objects();
    let f = write_tmp(
        "ok",
        r#"{"subsystems": [
            {"subsystem": "bdev", "config": [
                {"method": "set_option", "params": {"x": 1}},
                {"method": "obj_create", "params": {"name": "a", "block_size": 512}},
                {"method": "obj_create", "params": {"name": "b", "block_size": 4096}}]},
            {"subsystem": "nbd", "config": null}]}"#,
    );
    let calls = load_config(&f).unwrap();
    assert_eq!(calls.len(), 3);
    assert_eq!(apply_config(&t, &calls, undo).unwrap(), 3);
    assert_eq!(objs.lock().unwrap().len(), 2);
    std::fs::remove_file(f).unwrap();
}

#[test]
fn failure_rolls_back_and_names_file_entry_field() {
    let (t, objs) = table_with_objects();
    objs.lock().unwrap().insert("pre".into());
    let f = write_tmp(
        "rollback",
        r#"{"subsystems": [
            {"subsystem": "bdev", "config": [
                {"method": "obj_create", "params": {"name": "a", "block_size": 512}},
                {"method": "set_option", "params": {}},
                {"method": "obj_create", "params": {"name": "b", "block_size": 512}},
                {"method": "obj_create", "params": {"name": "c", "block_size": 1000}}]}]}"#,
    );
    let calls = load_config(&f).unwrap();
    let err = apply_config(&t, &calls, undo).unwrap_err();
    match &err {
        ConfigError::Call(failure) => {
            let CallFailure {
                file,
                location,
                method,
                field,
                error,
                rollback_failures,
            } = &**failure;
            assert_eq!(file, &f);
            assert_eq!(location, "subsystem `bdev` entry 3");
            assert_eq!(method, "obj_create");
            assert_eq!(field.as_deref(), Some("block_size"));
            assert_eq!(error.code, -32602);
            assert!(rollback_failures.is_empty());
        }
        other => panic!("unexpected {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains(&f.display().to_string()) && text.contains("field `block_size`"),
        "{text}"
    );
    // a and b were undone; the object that existed before is untouched.
    assert_eq!(*objs.lock().unwrap(), BTreeSet::from(["pre".to_string()]));

    // Unknown params and duplicates fail the same way (errno code kept).
    let f2 = write_tmp(
        "dup",
        r#"{"subsystems": [{"subsystem": "bdev", "config": [
            {"method": "obj_create", "params": {"name": "z", "block_size": 512}},
            {"method": "obj_create", "params": {"name": "pre", "block_size": 512}}]}]}"#,
    );
    let err = apply_config(&t, &load_config(&f2).unwrap(), undo).unwrap_err();
    assert!(err.to_string().contains("File exists (code -17)"), "{err}");
    assert_eq!(*objs.lock().unwrap(), BTreeSet::from(["pre".to_string()]));
    let f3 = write_tmp(
        "unknown",
        r#"{"subsystems": [{"subsystem": "bdev", "config": [
            {"method": "obj_create", "params": {"name": "z", "block_size": 512, "typo": 1}}]}]}"#,
    );
    let err = apply_config(&t, &load_config(&f3).unwrap(), undo).unwrap_err();
    assert!(err.to_string().contains("field `typo`"), "{err}");
    let f4 = write_tmp(
        "nomethod",
        r#"{"subsystems": [{"subsystem": "bdev", "config": [{"method": "nope"}]}]}"#,
    );
    let err = apply_config(&t, &load_config(&f4).unwrap(), undo).unwrap_err();
    assert!(err.to_string().contains("Method not found"), "{err}");
    for p in [f, f2, f3, f4] {
        std::fs::remove_file(p).unwrap();
    }
}

#[test]
fn rollback_failures_are_reported() {
    let (t, _objs) = table_with_objects();
    let calls = vec![
        ConfigCall::new("obj_create", json!({"name": "a", "block_size": 512})),
        ConfigCall::new("obj_create", json!({"name": "a", "block_size": 512})),
    ];
    // An undo that targets the wrong object fails; the error says so.
    let err = apply_config(&t, &calls, |_| {
        Some(ConfigCall::new("obj_delete", json!({"name": "ghost"})))
    })
    .unwrap_err();
    let ConfigError::Call(failure) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(failure.rollback_failures.len(), 1);
    assert!(err.to_string().contains("rollback incomplete"), "{err}");
}

#[test]
fn load_errors_name_file_and_position() {
    let missing = sock_path("missing").with_extension("json");
    let e = load_config(&missing).unwrap_err();
    assert!(matches!(e, ConfigError::Io { .. }));
    assert!(e.to_string().starts_with(&missing.display().to_string()));

    let f = write_tmp(
        "syntax",
        "{\n  \"subsystems\": [\n    {\"subsystem\": \"bdev\" \"config\": []}\n  ]\n}",
    );
    match load_config(&f).unwrap_err() {
        ConfigError::Syntax {
            line, column, file, ..
        } => {
            assert_eq!((line, file), (3, f.clone()));
            assert!(column > 20);
        }
        other => panic!("{other:?}"),
    }
    let f2 = write_tmp(
        "schema",
        r#"{"subsystems": [{"subsystem": "bdev", "config": [{"method": "a"}, {"method": 5}]}]}"#,
    );
    let e = load_config(&f2).unwrap_err().to_string();
    assert!(
        e.ends_with("subsystem `bdev` entry 1: field `method`: expected a string"),
        "{e}"
    );
    let f3 = write_tmp(
        "params",
        r#"{"subsystems": [{"subsystem": "nbd", "config": [[{"method": "a", "params": 3}]]}]}"#,
    );
    let e = load_config(&f3).unwrap_err().to_string();
    assert!(
        e.ends_with("subsystem `nbd` entry 0[0]: field `params`: expected an object"),
        "{e}"
    );
    for p in [f, f2, f3] {
        std::fs::remove_file(p).unwrap();
    }
}

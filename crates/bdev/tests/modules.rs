//! The module table: built-in modules create bdevs from their SPDK RPC
//! parameters and delete them by name, give inline specs, and a module's
//! examine hears of every bdev registered after it joined the table.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use serde_json::json;
use ustor_bdev::modules::register_builtin;
use ustor_bdev::{BdevEntry, BdevModule, ControlError, Registry};
use ustor_runtime::IoBuf;

#[test]
fn builtin_modules_create_and_delete_from_json() {
    let rt = runtime(1);
    let reg = registry(&rt);
    register_builtin(&reg).unwrap();
    let names: Vec<_> = reg.modules().iter().map(|m| m.name()).collect();
    assert_eq!(names, ["malloc", "null", "uring"]);
    let m = reg.module("malloc").unwrap();
    assert_eq!(m.create_method().as_deref(), Some("bdev_malloc_create"));
    assert_eq!(m.delete_method().as_deref(), Some("bdev_malloc_delete"));
    // SPDK's name when none is given.
    let e = m
        .create(&reg, json!({"num_blocks": 64, "block_size": 512}))
        .unwrap();
    assert_eq!(e.info().name, "Malloc0");
    assert_eq!(e.info().module, "malloc");
    // A bad parameter is a typed error naming the field.
    match m.create(
        &reg,
        json!({"num_blocks": 64, "block_size": 512, "bogus": 1}),
    ) {
        Err(ControlError::Params { msg, .. }) => assert!(msg.contains("bogus"), "{msg}"),
        r => panic!("{:?}", r.map(|e| e.info().name.clone())),
    }
    // The bdev works: data round-trips.
    let desc = reg.open("Malloc0", true, |_| {}).unwrap();
    let ok = rt
        .handle()
        .block_on(0, move || async move {
            let ch = desc.channel().unwrap();
            let mut b = IoBuf::alloc(4096).await;
            pattern(&mut b, 3, 11);
            let (r, _) = ch.write(3, 8, b).await;
            r.unwrap();
            let (r, got) = ch.read(3, 8, IoBuf::alloc(4096).await).await;
            r.unwrap();
            let mut want = vec![0u8; 4096];
            pattern(&mut want, 3, 11);
            got[..] == want[..]
        })
        .unwrap();
    assert!(ok);
    m.delete(&reg, "Malloc0").unwrap();
    assert!(reg.get("Malloc0").is_none());
    // Inline specs.
    let n = reg.module("null").unwrap();
    assert_eq!(n.inline_spec_syntax(), Some("null:SIZE"));
    let e = n.inline_spec(&reg, "1M", 4096).unwrap();
    assert_eq!((e.info().num_blocks, e.info().block_size), (256, 4096));
    assert!(n.inline_spec(&reg, "lots", 512).is_err());
    // `malloc:SIZE` (ustor bench) is populated before it is handed out, so a
    // benchmark does not time first-touch page allocation.
    let e = m.inline_spec(&reg, "4M", 4096).unwrap();
    let resident = e.bdev().driver_info()["malloc"]["resident_bytes"].as_u64();
    assert_eq!(resident, Some(4 << 20));
    // One module per name.
    assert!(matches!(
        reg.add_module(Arc::new(ustor_bdev::modules::null::module())),
        Err(ControlError::Exists(_))
    ));
}

/// Hears every registered bdev.
struct Watcher(Arc<Mutex<Vec<String>>>);

impl BdevModule for Watcher {
    fn name(&self) -> &'static str {
        "watcher"
    }
    fn create_method(&self) -> Option<String> {
        None
    }
    fn delete_method(&self) -> Option<String> {
        None
    }
    fn create(&self, _: &Registry, _: serde_json::Value) -> Result<Arc<BdevEntry>, ControlError> {
        Err(ControlError::invalid("name", "watcher makes no bdevs"))
    }
    fn examine(&self, _reg: &Registry, bdev: &Arc<BdevEntry>) {
        self.0.lock().unwrap().push(bdev.info().name.clone());
    }
}

#[test]
fn examine_hears_every_new_bdev() {
    let reg = Registry::new(None);
    register_builtin(&reg).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    reg.add_module(Arc::new(Watcher(seen.clone()))).unwrap();
    let null = reg.module("null").unwrap();
    null.create(
        &reg,
        json!({"name": "n0", "num_blocks": 8, "block_size": 512}),
    )
    .unwrap();
    null.create(&reg, json!({"num_blocks": 8, "block_size": 512}))
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), ["n0", "Null0"]);
}

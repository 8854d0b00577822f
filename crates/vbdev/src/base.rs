//! What every virtual bdev does with its bases: open them writable, claim
//! them exclusively (so they cannot be deleted or claimed under it), hear
//! their hot-remove (which hot-removes the virtual bdev in turn) and their
//! resize (followed by 1:1 vbdevs, reported by the others), and
//! derive its own limits from theirs.

use std::sync::{Arc, Mutex, Weak};

use ustor_bdev::{BdevEntry, BdevEvent, BdevInfo, ControlError, Desc, IoType, Registry};

/// What a virtual bdev does when its base is resized.
#[derive(Clone)]
pub enum OnResize {
    /// Takes the base's new size (a 1:1 mapping: passthru, delay, error).
    Follow,
    /// Keeps its size and says so in the log (its layout is fixed at
    /// creation: split, raid).
    Report,
    /// Asks: called with the base's new size in blocks, returns the
    /// virtual bdev's new size when it changes (a concat array's last
    /// member), `None` to keep it (then reported as for `Report`).
    Ask(Arc<dyn Fn(u64) -> Option<u64> + Send + Sync>),
}

/// Opens base `name` for virtual bdev `by` and claims it exclusively. When
/// the base is hot-removed, `by` is hot-removed too (its I/O would fail
/// anyway; its own openers must hear it). When the base is resized, `by`
/// follows or reports it (`on_resize`).
pub fn open(
    reg: &Registry,
    weak: &Weak<Registry>,
    name: &str,
    by: &str,
    on_resize: OnResize,
) -> Result<Desc, ControlError> {
    let (w, parent, base) = (weak.clone(), by.to_string(), name.to_string());
    let d = reg.open(name, true, move |ev| {
        let Some(r) = w.upgrade() else { return };
        match ev {
            BdevEvent::Remove => {
                // Already gone (deleted first) is fine.
                let _ = r.hot_remove(&parent);
            }
            BdevEvent::Resize => {
                let Some(b) = r.get(&base) else { return };
                let new = match &on_resize {
                    OnResize::Follow => Some(b.num_blocks()),
                    OnResize::Report => None,
                    OnResize::Ask(f) => f(b.num_blocks()),
                };
                match (new, r.get(&parent)) {
                    // Its openers hear it in turn (targets, other vbdevs).
                    (Some(n), Some(top)) => {
                        top.resize(n);
                    }
                    _ => tracing::warn!(
                        bdev = %parent, base = %base, base_blocks = b.num_blocks(),
                        "base bdev resized; this bdev keeps its size"
                    ),
                }
            }
        }
    })?;
    d.claim_exclusive(by)?;
    Ok(d)
}

/// Refuses a virtual bdev name that is empty or taken, before any base is
/// touched.
pub fn check_free(reg: &Registry, name: &str) -> Result<(), ControlError> {
    if name.is_empty() {
        return Err(ControlError::invalid("name", "must not be empty"));
    }
    if reg.get(name).is_some() {
        return Err(ControlError::Exists(name.to_string()));
    }
    Ok(())
}

/// Refuses a base list naming one bdev twice.
pub fn check_distinct(names: &[String]) -> Result<(), ControlError> {
    for (i, n) in names.iter().enumerate() {
        if names[..i].contains(n) {
            return Err(ControlError::invalid(
                "base_bdevs",
                format!("`{n}` is listed twice"),
            ));
        }
    }
    Ok(())
}

/// Refuses `base` as a new base of the existing virtual bdev `top` when
/// `base` is `top` itself or is built on it (claims it, directly or through
/// other virtual bdevs): `top`'s I/O would come back to it without end.
pub fn check_no_cycle(reg: &Registry, top: &str, base: &str) -> Result<(), ControlError> {
    let Some(b) = reg.get(base) else {
        return Ok(()); // Opening it will say it is unknown.
    };
    let mut todo = vec![top.to_string()];
    let mut seen: Vec<String> = Vec::new();
    while let Some(n) = todo.pop() {
        if seen.contains(&n) {
            continue;
        }
        let Some(e) = reg.get(&n) else { continue };
        if Arc::ptr_eq(&e, &b) {
            return Err(ControlError::invalid(
                "base_bdev",
                format!("`{base}` is `{top}` or built on it (a cycle)"),
            ));
        }
        todo.extend(e.claimers());
        seen.push(n);
    }
    Ok(())
}

/// The info of a virtual bdev over `bases`: their common block size, the
/// strictest alignment, a write cache if any has one; `num_blocks` and the
/// naming come from the caller. Refuses bases of different block sizes.
pub fn info(
    name: &str,
    uuid: Option<uuid::Uuid>,
    product: &str,
    module: &'static str,
    bases: &[Desc],
    num_blocks: u64,
) -> Result<BdevInfo, ControlError> {
    let bs = bases[0].info().block_size;
    if let Some(d) = bases.iter().find(|d| d.info().block_size != bs) {
        return Err(ControlError::invalid(
            "base_bdevs",
            format!(
                "`{}` has block size {}, `{}` has {bs}",
                d.name(),
                d.info().block_size,
                bases[0].name()
            ),
        ));
    }
    let all = |f: fn(&BdevInfo) -> bool| bases.iter().all(|d| f(d.info()));
    Ok(BdevInfo {
        name: name.into(),
        uuid: uuid.unwrap_or_else(uuid::Uuid::new_v4),
        product_name: product.into(),
        module,
        block_size: bs,
        num_blocks,
        required_alignment: bases
            .iter()
            .map(|d| d.info().required_alignment)
            .max()
            .unwrap_or(1),
        // Children are split for each base's own limits.
        max_transfer_blocks: 0,
        optimal_boundary_blocks: 0,
        write_cache: bases.iter().any(|d| d.info().write_cache),
        unmap_reads_zero: all(|i| i.unmap_reads_zero),
        memory_resident: all(|i| i.memory_resident),
    })
}

/// What a virtual bdev may claim natively: what every base does natively
/// (children get no emulation), except compare-and-write, which a virtual
/// bdev does not pass on yet (it would have to reach one base whole to
/// stay atomic; a mirror's copies could not be compared atomically).
pub fn all_support(bases: &[Desc], t: IoType) -> bool {
    t != IoType::CompareAndWrite && bases.iter().all(|d| d.io_type_supported(t))
}

/// FUA honoured by every base (otherwise the layer above flushes).
pub fn all_fua(bases: &[Desc], t: IoType) -> bool {
    bases.iter().all(|d| d.entry().bdev().fua_supported(t))
}

/// Control state of live vbdevs of one kind (error injections, delay
/// latencies) by device, for the RPC methods that change it: the registry
/// hands out `dyn Bdev`, not the type, so a module keeps its own table.
/// Entries go with their state (weak references).
pub struct Live<T>(Mutex<Vec<(usize, Weak<T>)>>);

impl<T> Default for Live<T> {
    fn default() -> Live<T> {
        Live::new()
    }
}

impl<T> Live<T> {
    pub const fn new() -> Live<T> {
        Live(Mutex::new(Vec::new()))
    }

    fn key(e: &BdevEntry) -> usize {
        Arc::as_ptr(e.bdev()) as *const () as usize
    }

    /// Remembers `state` for the bdev `e`.
    pub fn add(&self, e: &BdevEntry, state: &Arc<T>) {
        let mut l = self.0.lock().unwrap_or_else(|p| p.into_inner());
        l.retain(|(_, w)| w.strong_count() > 0);
        l.push((Self::key(e), Arc::downgrade(state)));
    }

    /// The state of bdev `name`, which must be of `module`.
    pub fn find(&self, reg: &Registry, name: &str, module: &str) -> Result<Arc<T>, ControlError> {
        let e = reg
            .get(name)
            .filter(|e| e.info().module == module)
            .ok_or_else(|| ControlError::NotFound(name.to_string()))?;
        let k = Self::key(&e);
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(a, _)| *a == k)
            .find_map(|(_, w)| w.upgrade())
            .ok_or_else(|| ControlError::NotFound(name.to_string()))
    }
}

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;
use crate::protocol::{EventHandle, PointerDescriptor};

const A: ImporterId = ImporterId(1);
const B: ImporterId = ImporterId(2);

/// A simulated pool allocation: freeing it is moving it out of the table.
#[derive(Debug, PartialEq, Eq)]
struct SimAlloc(u64);

#[test]
fn owner_alone_frees_at_owner_release() {
    let mut t = LeaseTable::new();
    t.insert(BufferId(1), SimAlloc(1)).unwrap();
    assert_eq!(t.release_owner(BufferId(1)).unwrap(), Some(SimAlloc(1)));
    assert!(t.is_empty());
    t.check_invariants();
}

#[test]
fn buffer_lives_until_every_importer_released() {
    let mut t = LeaseTable::new();
    let buf = BufferId(10);
    t.insert(buf, SimAlloc(10)).unwrap();
    t.grant(buf, A).unwrap();
    t.grant(buf, B).unwrap();
    assert_eq!(t.holders(buf).collect::<Vec<_>>(), vec![A, B]);
    assert_eq!(t.release_owner(buf).unwrap(), None);
    assert!(!t.owner_holds(buf));
    assert_eq!(t.release(buf, B).unwrap(), None);
    t.check_invariants();
    assert_eq!(t.release(buf, A).unwrap(), Some(SimAlloc(10)));
    assert!(t.is_empty());
    t.check_invariants();
}

#[test]
fn importer_releases_before_owner() {
    let mut t = LeaseTable::new();
    let buf = BufferId(3);
    t.insert(buf, SimAlloc(3)).unwrap();
    t.grant(buf, A).unwrap();
    assert_eq!(t.release(buf, A).unwrap(), None);
    assert_eq!(t.release_owner(buf).unwrap(), Some(SimAlloc(3)));
    t.check_invariants();
}

#[test]
fn disconnect_releases_everything_the_importer_held() {
    let mut t = LeaseTable::new();
    for id in 1..=4 {
        t.insert(BufferId(id), SimAlloc(id)).unwrap();
        t.grant(BufferId(id), A).unwrap();
    }
    t.grant(BufferId(2), B).unwrap();
    // The owner let go of 1 and 2: 1 is held by A only, 2 by A and B.
    assert_eq!(t.release_owner(BufferId(1)).unwrap(), None);
    assert_eq!(t.release_owner(BufferId(2)).unwrap(), None);
    let freed = t.disconnect(A);
    assert_eq!(freed, vec![(BufferId(1), SimAlloc(1))]);
    assert_eq!(t.leases_of(A).count(), 0);
    assert_eq!(t.leases_of(B).collect::<Vec<_>>(), vec![BufferId(2)]);
    assert_eq!(t.len(), 3);
    t.check_invariants();
    assert_eq!(t.disconnect(B), vec![(BufferId(2), SimAlloc(2))]);
    // An importer that held nothing, or is already gone, frees nothing.
    assert!(t.disconnect(B).is_empty());
    assert!(t.disconnect(ImporterId(99)).is_empty());
    t.check_invariants();
}

#[test]
fn double_release_is_an_error() {
    let mut t = LeaseTable::new();
    let buf = BufferId(5);
    t.insert(buf, SimAlloc(5)).unwrap();
    t.grant(buf, A).unwrap();
    assert_eq!(t.release(buf, A).unwrap(), None);
    let err = t.release(buf, A).unwrap_err();
    assert!(
        matches!(err, LeaseError::NotLeased { buffer, importer } if buffer == buf && importer == A),
        "{err}"
    );
    // Also after the buffer is gone entirely.
    assert_eq!(t.release_owner(buf).unwrap(), Some(SimAlloc(5)));
    assert!(matches!(t.release(buf, A).unwrap_err(), LeaseError::NotLeased { .. }));
    assert!(matches!(
        t.release_owner(buf).unwrap_err(),
        LeaseError::UnknownBuffer { .. }
    ));
    t.check_invariants();
}

#[test]
fn release_by_an_importer_that_never_held_it_is_an_error() {
    let mut t = LeaseTable::new();
    t.insert(BufferId(1), SimAlloc(1)).unwrap();
    t.grant(BufferId(1), A).unwrap();
    assert!(matches!(
        t.release(BufferId(1), B).unwrap_err(),
        LeaseError::NotLeased { .. }
    ));
    assert_eq!(t.holders(BufferId(1)).collect::<Vec<_>>(), vec![A]);
    t.check_invariants();
}

#[test]
fn grant_errors() {
    let mut t = LeaseTable::new();
    assert!(matches!(
        t.grant(BufferId(1), A).unwrap_err(),
        LeaseError::UnknownBuffer { .. }
    ));
    t.insert(BufferId(1), SimAlloc(1)).unwrap();
    assert!(matches!(
        t.insert(BufferId(1), SimAlloc(1)).unwrap_err(),
        LeaseError::DuplicateBuffer { .. }
    ));
    t.grant(BufferId(1), A).unwrap();
    assert!(matches!(
        t.grant(BufferId(1), A).unwrap_err(),
        LeaseError::AlreadyLeased { .. }
    ));
    assert_eq!(t.release_owner(BufferId(1)).unwrap(), None);
    assert!(matches!(
        t.grant(BufferId(1), B).unwrap_err(),
        LeaseError::BufferRetired { .. }
    ));
    assert!(matches!(
        t.release_owner(BufferId(1)).unwrap_err(),
        LeaseError::BufferRetired { .. }
    ));
    t.check_invariants();
}

#[test]
fn revoke_undoes_a_grant() {
    let mut t = LeaseTable::new();
    t.insert(BufferId(1), SimAlloc(1)).unwrap();
    t.grant(BufferId(1), A).unwrap();
    assert_eq!(t.revoke(BufferId(1), A).unwrap(), None);
    assert_eq!(t.holders(BufferId(1)).count(), 0);
    assert_eq!(t.release_owner(BufferId(1)).unwrap(), Some(SimAlloc(1)));
    t.check_invariants();
}

#[derive(Clone, Debug)]
enum Op {
    Insert(u64),
    Grant(u64, u64),
    Release(u64, u64),
    ReleaseOwner(u64),
    Disconnect(u64),
}

fn op() -> impl Strategy<Value = Op> {
    // Few ids, so that operations collide often.
    let buf = 0u64..6;
    let imp = 0u64..3;
    prop_oneof![
        buf.clone().prop_map(Op::Insert),
        (buf.clone(), imp.clone()).prop_map(|(b, i)| Op::Grant(b, i)),
        (buf.clone(), imp.clone()).prop_map(|(b, i)| Op::Release(b, i)),
        buf.prop_map(Op::ReleaseOwner),
        imp.prop_map(Op::Disconnect),
    ]
}

/// The reference model: per live buffer, whether the owner holds it and which importers do.
#[derive(Default)]
struct Model {
    live: BTreeMap<u64, (bool, BTreeSet<u64>)>,
    ever_inserted: BTreeSet<u64>,
}

proptest! {
    /// Any sequence of operations keeps the invariants, frees exactly when the model says the
    /// last holder left, and frees every buffer exactly once once everyone lets go.
    #[test]
    fn lease_table_matches_model(ops in proptest::collection::vec(op(), 0..80)) {
        let mut t = LeaseTable::new();
        let mut m = Model::default();
        let mut freed = Vec::new();
        for op in ops {
            match op {
                Op::Insert(b) => {
                    if m.ever_inserted.contains(&b) && !m.live.contains_key(&b) {
                        // An exporter never reuses an id.
                        continue;
                    }
                    let r = t.insert(BufferId(b), SimAlloc(b));
                    if m.ever_inserted.insert(b) {
                        prop_assert!(r.is_ok());
                        m.live.insert(b, (true, BTreeSet::new()));
                    } else {
                        prop_assert!(matches!(r, Err(LeaseError::DuplicateBuffer { .. })), "{:?}", r);
                    }
                }
                Op::Grant(b, i) => {
                    let r = t.grant(BufferId(b), ImporterId(i));
                    let ok = match m.live.get_mut(&b) {
                        Some((true, holders)) => holders.insert(i),
                        _ => false,
                    };
                    prop_assert_eq!(r.is_ok(), ok);
                }
                Op::Release(b, i) => {
                    let r = t.release(BufferId(b), ImporterId(i));
                    let held = m.live.get_mut(&b).is_some_and(|(_, holders)| holders.remove(&i));
                    if held {
                        let (owner, holders) = &m.live[&b];
                        let last = !*owner && holders.is_empty();
                        if last {
                            m.live.remove(&b);
                        }
                        let got = r.unwrap();
                        prop_assert_eq!(got.is_some(), last);
                        freed.extend(got.map(|a| a.0));
                    } else {
                        prop_assert!(matches!(r, Err(LeaseError::NotLeased { .. })), "{:?}", r);
                    }
                }
                Op::ReleaseOwner(b) => {
                    let r = t.release_owner(BufferId(b));
                    match m.live.get_mut(&b) {
                        Some((owner @ true, holders)) => {
                            *owner = false;
                            let last = holders.is_empty();
                            if last {
                                m.live.remove(&b);
                            }
                            let got = r.unwrap();
                            prop_assert_eq!(got.is_some(), last);
                            freed.extend(got.map(|a| a.0));
                        }
                        _ => prop_assert!(r.is_err()),
                    }
                }
                Op::Disconnect(i) => {
                    let mut expect = Vec::new();
                    for (b, (owner, holders)) in m.live.iter_mut() {
                        if holders.remove(&i) && !*owner && holders.is_empty() {
                            expect.push(*b);
                        }
                    }
                    for b in &expect {
                        m.live.remove(b);
                    }
                    let got: Vec<u64> = t.disconnect(ImporterId(i)).into_iter().map(|(_, a)| a.0).collect();
                    prop_assert_eq!(&got, &expect);
                    freed.extend(got);
                }
            }
            t.check_invariants();
            prop_assert_eq!(t.len(), m.live.len());
        }
        // Everyone lets go: every buffer ever inserted is freed exactly once.
        for i in 0..3 {
            freed.extend(t.disconnect(ImporterId(i)).into_iter().map(|(_, a)| a.0));
        }
        for b in m.live.keys() {
            if let Ok(Some(a)) = t.release_owner(BufferId(*b)) {
                freed.push(a.0);
            }
        }
        prop_assert!(t.is_empty());
        freed.sort_unstable();
        let mut unique = freed.clone();
        unique.dedup();
        prop_assert_eq!(&freed, &unique, "a buffer was freed twice");
        prop_assert_eq!(unique, m.ever_inserted.iter().copied().collect::<Vec<_>>());
    }
}

fn descriptor(buffer: u64, block: u64, offset: u64, size: u64) -> BufferDescriptor {
    BufferDescriptor {
        buffer_id: BufferId(buffer),
        block_id: BlockId(block),
        block_size: 1 << 20,
        offset,
        size,
        pointer: PointerDescriptor([block as u8; 64]),
        ready_event: Some(EventHandle([1; 64])),
        keep_import: false,
    }
}

#[test]
fn import_table_imports_each_block_once() {
    let mut t = ImportTable::new();
    let imports = std::cell::Cell::new(0);
    let import = |d: &BufferDescriptor| {
        imports.set(imports.get() + 1);
        Ok::<_, LeaseError>(format!("import of {}", d.block_id))
    };
    assert_eq!(t.add(&descriptor(1, 7, 0, 256), import).unwrap(), "import of block#7");
    t.add(&descriptor(2, 7, 256, 256), import).unwrap();
    t.add(&descriptor(3, 8, 0, 64), import).unwrap();
    assert_eq!(imports.get(), 2);
    assert_eq!((t.len(), t.block_count()), (3, 2));
    let (handle, place) = t.get(BufferId(2)).unwrap();
    assert_eq!(handle, "import of block#7");
    assert_eq!((place.block_id, place.offset, place.size), (BlockId(7), 256, 256));
    t.check_invariants();

    // The block is handed back with its last buffer, not before.
    assert_eq!(t.release(BufferId(1)).unwrap(), None);
    assert_eq!(t.release(BufferId(2)).unwrap().as_deref(), Some("import of block#7"));
    assert_eq!(t.block_count(), 1);
    t.check_invariants();

    // A later buffer in a freed block imports it again.
    t.add(&descriptor(4, 7, 0, 8), import).unwrap();
    assert_eq!(imports.get(), 3);
    let mut drained = t.drain();
    drained.sort();
    assert_eq!(drained.len(), 2);
    assert!(t.is_empty());
}

/// What an import can fail with in the tests: the table's own errors, or the import's.
#[derive(Debug)]
enum ImportError {
    Lease,
    Closed,
}

impl From<LeaseError> for ImportError {
    fn from(_: LeaseError) -> Self {
        ImportError::Lease
    }
}

#[test]
fn import_table_errors_leave_it_unchanged() {
    let mut t: ImportTable<u32> = ImportTable::new();
    t.add(&descriptor(1, 7, 0, 256), |_| Ok::<_, LeaseError>(1)).unwrap();
    assert!(matches!(
        t.add(&descriptor(1, 7, 0, 256), |_| Ok::<_, LeaseError>(2))
            .unwrap_err(),
        LeaseError::DuplicateBuffer { .. }
    ));
    let mut other_size = descriptor(2, 7, 0, 256);
    other_size.block_size = 4096;
    assert!(matches!(
        t.add(&other_size, |_| Ok::<_, LeaseError>(2)).unwrap_err(),
        LeaseError::BlockSizeChanged { .. }
    ));
    let failed = t.add(&descriptor(3, 9, 0, 1), |_| Err(ImportError::Closed));
    assert!(matches!(failed.unwrap_err(), ImportError::Closed));
    assert_eq!((t.len(), t.block_count()), (1, 1));
    assert!(matches!(
        t.release(BufferId(3)).unwrap_err(),
        LeaseError::UnknownBuffer { .. }
    ));
    assert_eq!(t.release(BufferId(1)).unwrap(), Some(1));
    assert!(matches!(
        t.release(BufferId(1)).unwrap_err(),
        LeaseError::UnknownBuffer { .. }
    ));
    t.check_invariants();
}

/// The module documentation's example (a doctest until the module became private): two importers
/// and the owner; the last holder to let go frees.
#[test]
fn last_holder_frees() -> Result<()> {
    let mut table = LeaseTable::new();
    let (buf, a, b) = (BufferId(1), ImporterId(1), ImporterId(2));
    table.insert(buf, "allocation")?;
    table.grant(buf, a)?;
    table.grant(buf, b)?;
    assert_eq!(table.release_owner(buf)?, None); // importers still hold it
    assert_eq!(table.release(buf, a)?, None);
    assert_eq!(table.disconnect(b), vec![(buf, "allocation")]); // last holder gone: free it
    Ok(())
}

#[test]
fn a_kept_block_stays_imported_after_its_last_buffer_and_is_imported_once() {
    let mut t = ImportTable::new();
    let imports = std::cell::Cell::new(0);
    let import = |d: &BufferDescriptor| {
        imports.set(imports.get() + 1);
        Ok::<_, LeaseError>(format!("import of {}", d.block_id))
    };
    let kept = |buffer, offset| BufferDescriptor {
        keep_import: true,
        ..descriptor(buffer, 3, offset, 4096)
    };
    // One buffer at a time through the same block: one import for all of them.
    for id in 0..100u64 {
        t.add(&kept(id, (id % 8) * 4096), import).unwrap();
        t.check_invariants();
        assert_eq!(t.release(BufferId(id)).unwrap(), None, "a kept block came back");
        t.check_invariants();
    }
    assert_eq!(imports.get(), 1);
    assert_eq!((t.len(), t.block_count(), t.kept_count()), (0, 1, 1));
    // A block not kept still comes back with its last buffer.
    t.add(&descriptor(500, 4, 0, 16), import).unwrap();
    assert_eq!(t.release(BufferId(500)).unwrap().as_deref(), Some("import of block#4"));
    // A block first imported without the flag becomes kept when a later buffer carries it.
    t.add(&descriptor(600, 5, 0, 16), import).unwrap();
    t.add(
        &BufferDescriptor {
            keep_import: true,
            ..descriptor(601, 5, 16, 16)
        },
        import,
    )
    .unwrap();
    assert_eq!(t.release(BufferId(600)).unwrap(), None);
    assert_eq!(t.release(BufferId(601)).unwrap(), None);
    assert_eq!(t.kept_count(), 2);
    // The kept imports come back at the end of the connection.
    let mut drained: Vec<_> = t.drain().into_iter().map(|(id, _)| id).collect();
    drained.sort_unstable();
    assert_eq!(drained, vec![BlockId(3), BlockId(5)]);
    t.check_invariants();
}

#[test]
fn block_pins_park_the_last_buffer_until_every_keeper_is_gone() {
    let mut pins: BlockPins<u64, &str> = BlockPins::default();
    // Nobody keeps block 1: its last buffer is freed at once.
    assert_eq!(pins.park(1, "a"), Some("a"));
    pins.keep(1, ImporterId(10));
    pins.keep(1, ImporterId(11));
    pins.keep(2, ImporterId(11));
    pins.check_invariants();
    assert!(pins.is_kept(1) && pins.keeps_any(ImporterId(10)) && !pins.keeps_any(ImporterId(12)));
    // Kept: parked, once per block.
    assert_eq!(pins.park(1, "b"), None);
    assert_eq!(pins.park(1, "c"), Some("c"), "a second parked buffer in one block");
    assert_eq!(pins.parked(), 1);
    // One keeper leaves: still kept by the other.
    assert_eq!(pins.importer_gone(ImporterId(10)), vec![]);
    assert_eq!(pins.importer_gone(ImporterId(10)), vec![], "gone twice");
    pins.check_invariants();
    // The last keeper leaves: the parked buffer is handed back; block 2 had none parked.
    assert_eq!(pins.importer_gone(ImporterId(11)), vec![(1, "b")]);
    pins.check_invariants();
    assert_eq!((pins.len(), pins.parked()), (0, 0));
    assert!(!pins.is_kept(2));
}

proptest! {
    /// A model of the exporter's use of `BlockPins` with a live count per block: a buffer's
    /// memory is never handed back while an importer keeps its block, every buffer is handed back
    /// exactly once when everyone is gone, and the invariants hold throughout.
    #[test]
    fn block_pins_model(ops in proptest::collection::vec((0u8..4, 0u64..4, 0u64..3), 0..200)) {
        let mut pins: BlockPins<u64, u64> = BlockPins::default();
        let mut live: std::collections::BTreeMap<u64, Vec<u64>> = Default::default();
        let mut keepers: std::collections::BTreeMap<u64, std::collections::BTreeSet<u64>> = Default::default();
        let mut parked = std::collections::BTreeSet::new();
        let mut freed = Vec::new();
        let mut next = 0u64;
        let free = |block: u64, buffer: u64, keepers: &std::collections::BTreeMap<u64, std::collections::BTreeSet<u64>>| {
            assert!(keepers.get(&block).is_none_or(|k| k.is_empty()), "block {block} freed while kept");
            buffer
        };
        for (op, block, importer) in ops {
            match op {
                0 => {
                    live.entry(block).or_default().push(next);
                    next += 1;
                }
                1 => {
                    pins.keep(block, ImporterId(importer));
                    keepers.entry(block).or_default().insert(importer);
                }
                2 => {
                    // Free one buffer of the block: the last one is parked if kept.
                    // (A parked buffer counts as live, as in the exporter's block record.)
                    let Some(buffers) = live.get_mut(&block) else { continue };
                    let Some(buffer) = buffers.pop() else { continue };
                    let last = buffers.is_empty();
                    if last {
                        live.remove(&block);
                    }
                    if last && !parked.contains(&block) {
                        match pins.park(block, buffer) {
                            Some(b) => freed.push(free(block, b, &keepers)),
                            None => {
                                prop_assert!(keepers.get(&block).is_some_and(|k| !k.is_empty()));
                                parked.insert(block);
                            }
                        }
                    } else {
                        freed.push(buffer);
                    }
                }
                _ => {
                    for set in keepers.values_mut() {
                        set.remove(&importer);
                    }
                    for (b, buffer) in pins.importer_gone(ImporterId(importer)) {
                        parked.remove(&b);
                        freed.push(free(b, buffer, &keepers));
                    }
                }
            }
            pins.check_invariants();
        }
        // Everyone leaves, every buffer is freed.
        for importer in 0..3 {
            for set in keepers.values_mut() {
                set.remove(&importer);
            }
            for (b, buffer) in pins.importer_gone(ImporterId(importer)) {
                freed.push(free(b, buffer, &keepers));
            }
        }
        for (_, buffers) in std::mem::take(&mut live) {
            freed.extend(buffers);
        }
        prop_assert_eq!(pins.len(), 0);
        freed.sort_unstable();
        prop_assert_eq!(freed, (0..next).collect::<Vec<_>>());
    }
}

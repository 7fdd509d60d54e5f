//! Who holds which shared buffer: pure bookkeeping, no GPU, no sockets.
//!
//! The driver's rule: an importer must free its import of a pointer before the exporter frees
//! the allocation. So the exporter frees a shared buffer only when its last holder lets go:
//! the exporter itself ([`LeaseTable::release_owner`]) and every importer it was shared with
//! ([`LeaseTable::release`] on a `Release` message, [`LeaseTable::disconnect`] when the
//! importer's connection closes, since a dead importer holds nothing). Whichever call drops
//! the last hold hands the buffer's handle back, and the exporter frees it.
//!
//! The importer's side, [`ImportTable`], imports each block once, maps buffers to blocks, and
//! hands a block back when its last buffer is released, so that the importer frees its import
//! before it sends `Release`, unless the exporter let it keep the block's import (the fast
//! release path of protocol version 2): such a block stays imported until the connection ends.
//!
//! The exporter's side of kept imports, [`BlockPins`], records which importers keep which block
//! imported, and holds back the free of a block's last buffer (which would let the allocation go
//! back to the driver) until every importer that keeps the block is gone; a block id is therefore
//! never reused for another allocation while an importer may still hold a stale import of it.
//!
//! Both are generic over the handle type, so tests run them against a simulated pool
//! (`lease/tests.rs`, with a model-based property test of the lease table). Their refusals are
//! [`LeaseError`]s; [`ImporterId`] and [`LeaseError`] are re-exported at the crate root.

use std::collections::{btree_map, BTreeMap, BTreeSet};
use std::fmt;

use crate::protocol::{BlockId, BufferDescriptor, BufferId};

/// What the tables of this module return: a [`LeaseError`] names the rule an operation broke.
type Result<T, E = LeaseError> = std::result::Result<T, E>;

/// An operation the lease bookkeeping refuses: the buffer or the lease is not in the state the
/// operation needs.
///
/// The crate's [`Error`](crate::Error) wraps it as `Error::Lease`, with the same message.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// A buffer id was registered twice.
    #[error("buffer {buffer} is already registered")]
    DuplicateBuffer {
        /// The buffer.
        buffer: BufferId,
    },

    /// A buffer id that is not registered (never was, or was already freed).
    #[error("unknown buffer {buffer}")]
    UnknownBuffer {
        /// The buffer.
        buffer: BufferId,
    },

    /// The buffer was already shared with this importer.
    #[error("buffer {buffer} is already leased to importer {importer}")]
    AlreadyLeased {
        /// The buffer.
        buffer: BufferId,
        /// The importer.
        importer: ImporterId,
    },

    /// Release of a buffer the importer does not hold (for example a double release).
    #[error("importer {importer} does not hold buffer {buffer}")]
    NotLeased {
        /// The buffer.
        buffer: BufferId,
        /// The importer.
        importer: ImporterId,
    },

    /// The exporter already gave the buffer up: it may not be shared or given up again.
    #[error("buffer {buffer} was already released by its owner")]
    BufferRetired {
        /// The buffer.
        buffer: BufferId,
    },

    /// The exporter announced a block the importer already knows with another size: a protocol
    /// violation by the exporter.
    #[error("protocol violation: {block} was announced with {was} bytes, now with {now}")]
    BlockSizeChanged {
        /// The block.
        block: BlockId,
        /// The size it was announced with first.
        was: u64,
        /// The size announced now.
        now: u64,
    },
}

/// The exporter's name for one importer connection; unique for the exporter's lifetime (do not
/// reuse ids: a late message of a closed connection must not count for a new one).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct ImporterId(pub u64);

impl fmt::Display for ImporterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// One shared buffer's holders.
#[derive(Debug)]
struct Entry<B> {
    handle: B,
    /// The exporter itself still holds the buffer.
    owner_holds: bool,
    holders: BTreeSet<ImporterId>,
}

/// The exporter's record of shared buffers and their holders. See the
/// [module documentation](self).
///
/// Invariants (checked by the tests after every operation):
/// - a buffer is present iff its owner or at least one importer holds it;
/// - importer `i` is among a buffer's holders iff the buffer is among `i`'s leases;
/// - no importer has an empty lease set recorded.
#[derive(Debug)]
pub(crate) struct LeaseTable<B> {
    buffers: BTreeMap<BufferId, Entry<B>>,
    leases: BTreeMap<ImporterId, BTreeSet<BufferId>>,
}

impl<B> Default for LeaseTable<B> {
    fn default() -> Self {
        LeaseTable {
            buffers: BTreeMap::new(),
            leases: BTreeMap::new(),
        }
    }
}

impl<B> LeaseTable<B> {
    /// An empty table.
    #[cfg(test)]
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Registers a buffer the exporter holds. [`LeaseError::DuplicateBuffer`] if the id is taken.
    pub(crate) fn insert(&mut self, buffer: BufferId, handle: B) -> Result<()> {
        if self.buffers.contains_key(&buffer) {
            return Err(LeaseError::DuplicateBuffer { buffer });
        }
        self.buffers.insert(
            buffer,
            Entry {
                handle,
                owner_holds: true,
                holders: BTreeSet::new(),
            },
        );
        Ok(())
    }

    /// Records that `importer` now holds `buffer`; call it before sending the `Buffer` message.
    ///
    /// Errors: [`LeaseError::UnknownBuffer`], [`LeaseError::BufferRetired`] (the owner already let go, so
    /// it may not be shared any more), [`LeaseError::AlreadyLeased`].
    pub(crate) fn grant(&mut self, buffer: BufferId, importer: ImporterId) -> Result<()> {
        let entry = self
            .buffers
            .get_mut(&buffer)
            .ok_or(LeaseError::UnknownBuffer { buffer })?;
        if !entry.owner_holds {
            return Err(LeaseError::BufferRetired { buffer });
        }
        if !entry.holders.insert(importer) {
            return Err(LeaseError::AlreadyLeased { buffer, importer });
        }
        self.leases.entry(importer).or_default().insert(buffer);
        Ok(())
    }

    /// Undoes a [`LeaseTable::grant`] whose `Buffer` message could not be sent. The importer
    /// never saw the buffer; returns the handle if that was the last hold.
    pub(crate) fn revoke(&mut self, buffer: BufferId, importer: ImporterId) -> Result<Option<B>> {
        self.release(buffer, importer)
    }

    /// `importer` released `buffer`. Returns the handle if nobody holds the buffer any more:
    /// free it now.
    ///
    /// [`LeaseError::NotLeased`] if the importer does not hold it (a double release, or an id it
    /// never received): a protocol violation by the importer.
    pub(crate) fn release(&mut self, buffer: BufferId, importer: ImporterId) -> Result<Option<B>> {
        let held = self.leases.get_mut(&importer).is_some_and(|set| set.remove(&buffer));
        if !held {
            return Err(LeaseError::NotLeased { buffer, importer });
        }
        if self.leases.get(&importer).is_some_and(BTreeSet::is_empty) {
            self.leases.remove(&importer);
        }
        Ok(self.drop_holder(buffer, importer))
    }

    /// The exporter lets go of `buffer`. Returns the handle if no importer holds it: free it
    /// now; otherwise the last importer's release returns it.
    ///
    /// Errors: [`LeaseError::UnknownBuffer`], [`LeaseError::BufferRetired`] (already let go).
    pub(crate) fn release_owner(&mut self, buffer: BufferId) -> Result<Option<B>> {
        let entry = self
            .buffers
            .get_mut(&buffer)
            .ok_or(LeaseError::UnknownBuffer { buffer })?;
        if !entry.owner_holds {
            return Err(LeaseError::BufferRetired { buffer });
        }
        entry.owner_holds = false;
        Ok(self.remove_if_unheld(buffer))
    }

    /// `importer` is gone (its connection closed, or it said `Goodbye`): every buffer it held
    /// counts as released. Returns the buffers nobody holds any more, in id order: free them.
    pub(crate) fn disconnect(&mut self, importer: ImporterId) -> Vec<(BufferId, B)> {
        let Some(held) = self.leases.remove(&importer) else {
            return Vec::new();
        };
        held.into_iter()
            .filter_map(|buffer| self.drop_holder(buffer, importer).map(|handle| (buffer, handle)))
            .collect()
    }

    /// The handle of a registered buffer.
    pub(crate) fn get(&self, buffer: BufferId) -> Option<&B> {
        self.buffers.get(&buffer).map(|e| &e.handle)
    }

    /// The handle of a registered buffer, to update it.
    pub(crate) fn get_mut(&mut self, buffer: BufferId) -> Option<&mut B> {
        self.buffers.get_mut(&buffer).map(|e| &mut e.handle)
    }

    /// The importers that hold at least one buffer, in id order.
    pub(crate) fn importers(&self) -> impl Iterator<Item = ImporterId> + '_ {
        self.leases.keys().copied()
    }

    /// Whether the exporter itself still holds `buffer`.
    #[cfg(test)]
    pub(crate) fn owner_holds(&self, buffer: BufferId) -> bool {
        self.buffers.get(&buffer).is_some_and(|e| e.owner_holds)
    }

    /// The importers holding `buffer`, in id order.
    pub(crate) fn holders(&self, buffer: BufferId) -> impl Iterator<Item = ImporterId> + '_ {
        self.buffers
            .get(&buffer)
            .into_iter()
            .flat_map(|e| e.holders.iter().copied())
    }

    /// The buffers `importer` holds, in id order.
    pub(crate) fn leases_of(&self, importer: ImporterId) -> impl Iterator<Item = BufferId> + '_ {
        self.leases
            .get(&importer)
            .into_iter()
            .flat_map(|set| set.iter().copied())
    }

    /// How many buffers are alive (held by anyone).
    pub(crate) fn len(&self) -> usize {
        self.buffers.len()
    }

    /// Whether no buffer is alive.
    pub(crate) fn is_empty(&self) -> bool {
        self.buffers.is_empty()
    }

    fn drop_holder(&mut self, buffer: BufferId, importer: ImporterId) -> Option<B> {
        let entry = self.buffers.get_mut(&buffer)?;
        entry.holders.remove(&importer);
        self.remove_if_unheld(buffer)
    }

    fn remove_if_unheld(&mut self, buffer: BufferId) -> Option<B> {
        let entry = self.buffers.get(&buffer)?;
        if entry.owner_holds || !entry.holders.is_empty() {
            return None;
        }
        self.buffers.remove(&buffer).map(|e| e.handle)
    }

    /// Checks the invariants listed on the type; panics with a description if one is broken.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        for (buffer, entry) in &self.buffers {
            assert!(
                entry.owner_holds || !entry.holders.is_empty(),
                "{buffer} is recorded but nobody holds it"
            );
            for importer in &entry.holders {
                assert!(
                    self.leases.get(importer).is_some_and(|set| set.contains(buffer)),
                    "{buffer} lists holder {importer}, whose leases lack it"
                );
            }
        }
        for (importer, set) in &self.leases {
            assert!(!set.is_empty(), "importer {importer} has an empty lease set");
            for buffer in set {
                assert!(
                    self.buffers.get(buffer).is_some_and(|e| e.holders.contains(importer)),
                    "importer {importer} leases {buffer}, which does not list it"
                );
            }
        }
    }
}

/// The exporter's record of blocks whose imports importers keep (see the
/// [module documentation](self)), over blocks named by a key `K` (the block's base address in
/// the exporter) and parked buffers `B`.
///
/// Invariants (checked by the tests): importer `i` keeps block `k` iff `k` is among `i`'s
/// blocks; a block is recorded iff some importer keeps it; a parked buffer sits only in a
/// recorded block, at most one per block.
#[derive(Debug)]
pub(crate) struct BlockPins<K, B> {
    blocks: BTreeMap<K, Pinned<B>>,
    by_importer: BTreeMap<ImporterId, BTreeSet<K>>,
}

#[derive(Debug)]
struct Pinned<B> {
    keepers: BTreeSet<ImporterId>,
    parked: Option<B>,
}

impl<K, B> Default for BlockPins<K, B> {
    fn default() -> Self {
        BlockPins {
            blocks: BTreeMap::new(),
            by_importer: BTreeMap::new(),
        }
    }
}

impl<K: Ord + Copy, B> BlockPins<K, B> {
    /// `importer` may keep `block` imported from now on (record it before the `Buffer` message
    /// that allows it goes out).
    pub(crate) fn keep(&mut self, block: K, importer: ImporterId) {
        self.blocks
            .entry(block)
            .or_insert_with(|| Pinned {
                keepers: BTreeSet::new(),
                parked: None,
            })
            .keepers
            .insert(importer);
        self.by_importer.entry(importer).or_default().insert(block);
    }

    /// Whether some importer keeps `block` imported.
    #[cfg(test)]
    pub(crate) fn is_kept(&self, block: K) -> bool {
        self.blocks.contains_key(&block)
    }

    /// Whether `importer` keeps any block imported.
    pub(crate) fn keeps_any(&self, importer: ImporterId) -> bool {
        self.by_importer.contains_key(&importer)
    }

    /// The last live buffer of `block` is to be freed: if an importer keeps the block imported,
    /// the buffer is parked here instead (its allocation keeps the block alive) and `None`
    /// returned; otherwise it comes back: free it now.
    pub(crate) fn park(&mut self, block: K, buffer: B) -> Option<B> {
        match self.blocks.get_mut(&block) {
            Some(pinned) if pinned.parked.is_none() => {
                pinned.parked = Some(buffer);
                None
            }
            _ => Some(buffer),
        }
    }

    /// `importer` keeps nothing imported any more (it said `Goodbye` after freeing its imports,
    /// or its process is gone). Returns the parked buffers of the blocks nobody keeps now, in key
    /// order: free them.
    pub(crate) fn importer_gone(&mut self, importer: ImporterId) -> Vec<(K, B)> {
        let Some(blocks) = self.by_importer.remove(&importer) else {
            return Vec::new();
        };
        let mut freed = Vec::new();
        for block in blocks {
            let Some(pinned) = self.blocks.get_mut(&block) else {
                continue;
            };
            pinned.keepers.remove(&importer);
            if pinned.keepers.is_empty() {
                if let Some(parked) = self.blocks.remove(&block).and_then(|p| p.parked) {
                    freed.push((block, parked));
                }
            }
        }
        freed
    }

    /// How many blocks are kept imported by some importer.
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// How many buffers are parked.
    pub(crate) fn parked(&self) -> usize {
        self.blocks.values().filter(|p| p.parked.is_some()).count()
    }

    /// Checks the invariants listed on the type; panics with a description if one is broken.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self)
    where
        K: fmt::Debug,
    {
        for (block, pinned) in &self.blocks {
            assert!(!pinned.keepers.is_empty(), "{block:?} is recorded but nobody keeps it");
            for importer in &pinned.keepers {
                assert!(
                    self.by_importer.get(importer).is_some_and(|s| s.contains(block)),
                    "{block:?} lists {importer}, whose blocks lack it"
                );
            }
        }
        for (importer, blocks) in &self.by_importer {
            assert!(!blocks.is_empty(), "{importer} has an empty block set");
            for block in blocks {
                assert!(
                    self.blocks.get(block).is_some_and(|p| p.keepers.contains(importer)),
                    "{importer} keeps {block:?}, which does not list it"
                );
            }
        }
    }
}

/// One imported block on the importer's side.
#[derive(Debug)]
struct ImportedBlock<H> {
    handle: H,
    size: u64,
    buffers: BTreeSet<BufferId>,
    /// The exporter allowed keeping the import after the last buffer is released.
    keep: bool,
}

/// Where a buffer lives, on the importer's side.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct BufferPlace {
    /// The block it lives in.
    pub(crate) block_id: BlockId,
    /// Its offset in the block.
    pub(crate) offset: u64,
    /// Its size.
    pub(crate) size: u64,
}

/// The importer's record of imported blocks and the buffers in them. See the
/// [module documentation](self).
///
/// Invariants: every buffer's block is present and lists it; every block lists at least one
/// buffer (a block whose last buffer is released leaves the table and is handed back), unless
/// it is kept (`keep_import`), which stays until [`ImportTable::drain`].
#[derive(Debug)]
pub(crate) struct ImportTable<H> {
    blocks: BTreeMap<BlockId, ImportedBlock<H>>,
    buffers: BTreeMap<BufferId, BufferPlace>,
}

impl<H> Default for ImportTable<H> {
    fn default() -> Self {
        ImportTable {
            blocks: BTreeMap::new(),
            buffers: BTreeMap::new(),
        }
    }
}

impl<H> ImportTable<H> {
    /// An empty table.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Records a received buffer. If its block is not imported yet, `import` imports it
    /// (`cuMemPoolImportPointer` on the block's descriptor) and its handle is kept; if
    /// `import` fails, nothing is recorded. Returns the block's handle; the buffer starts at
    /// `descriptor.offset` bytes into it.
    ///
    /// Errors: [`LeaseError::DuplicateBuffer`]; [`LeaseError::BlockSizeChanged`] if the
    /// exporter names a known block with another size; whatever `import` returns.
    pub(crate) fn add<E: From<LeaseError>>(
        &mut self,
        descriptor: &BufferDescriptor,
        import: impl FnOnce(&BufferDescriptor) -> Result<H, E>,
    ) -> Result<&H, E> {
        let buffer = descriptor.buffer_id;
        if self.buffers.contains_key(&buffer) {
            return Err(LeaseError::DuplicateBuffer { buffer }.into());
        }
        let block_id = descriptor.block_id;
        let block = match self.blocks.entry(block_id) {
            btree_map::Entry::Occupied(entry) => {
                let block = entry.into_mut();
                if block.size != descriptor.block_size {
                    return Err(LeaseError::BlockSizeChanged {
                        block: block_id,
                        was: block.size,
                        now: descriptor.block_size,
                    }
                    .into());
                }
                // Once the exporter allowed keeping it, it counts this importer as keeping it.
                block.keep |= descriptor.keep_import;
                block
            }
            btree_map::Entry::Vacant(entry) => entry.insert(ImportedBlock {
                handle: import(descriptor)?,
                size: descriptor.block_size,
                buffers: BTreeSet::new(),
                keep: descriptor.keep_import,
            }),
        };
        block.buffers.insert(buffer);
        self.buffers.insert(
            buffer,
            BufferPlace {
                block_id,
                offset: descriptor.offset,
                size: descriptor.size,
            },
        );
        Ok(&block.handle)
    }

    /// The block handle and place of a buffer.
    #[cfg(test)]
    pub(crate) fn get(&self, buffer: BufferId) -> Option<(&H, BufferPlace)> {
        let place = *self.buffers.get(&buffer)?;
        let block = self.blocks.get(&place.block_id)?;
        Some((&block.handle, place))
    }

    /// Forgets a buffer. Returns its block's handle if it was the block's last buffer and the
    /// block is not kept: free the import (and synchronize) *before* sending `Release` for this
    /// buffer. A kept block stays imported, with no buffer.
    ///
    /// [`LeaseError::UnknownBuffer`] if the buffer is not recorded (a double release).
    pub(crate) fn release(&mut self, buffer: BufferId) -> Result<Option<H>> {
        let place = self
            .buffers
            .remove(&buffer)
            .ok_or(LeaseError::UnknownBuffer { buffer })?;
        let Some(block) = self.blocks.get_mut(&place.block_id) else {
            return Ok(None);
        };
        block.buffers.remove(&buffer);
        if block.buffers.is_empty() && !block.keep {
            return Ok(self.blocks.remove(&place.block_id).map(|b| b.handle));
        }
        Ok(None)
    }

    /// Forgets everything (shutdown); returns every block handle, to be freed before the
    /// importer says `Goodbye`.
    pub(crate) fn drain(&mut self) -> Vec<(BlockId, H)> {
        self.buffers.clear();
        std::mem::take(&mut self.blocks)
            .into_iter()
            .map(|(id, block)| (id, block.handle))
            .collect()
    }

    /// How many buffers are recorded.
    pub(crate) fn len(&self) -> usize {
        self.buffers.len()
    }

    /// Whether no buffer is recorded.
    pub(crate) fn is_empty(&self) -> bool {
        self.buffers.is_empty()
    }

    /// How many blocks are imported (kept ones included).
    pub(crate) fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// How many imported blocks are kept.
    pub(crate) fn kept_count(&self) -> usize {
        self.blocks.values().filter(|b| b.keep).count()
    }

    /// Checks the invariants listed on the type; panics with a description if one is broken.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        for (buffer, place) in &self.buffers {
            let block = self
                .blocks
                .get(&place.block_id)
                .unwrap_or_else(|| panic!("{buffer} lives in missing {}", place.block_id));
            assert!(block.buffers.contains(buffer));
            assert!(place.offset + place.size <= block.size);
        }
        for (id, block) in &self.blocks {
            assert!(block.keep || !block.buffers.is_empty(), "{id} has no buffers");
            for buffer in &block.buffers {
                assert_eq!(self.buffers.get(buffer).map(|p| p.block_id), Some(*id));
            }
        }
    }
}

#[cfg(test)]
mod tests;

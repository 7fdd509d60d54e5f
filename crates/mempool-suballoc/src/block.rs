//! A block: a range of addresses carved from one upstream chunk.

/// A range of addresses `[addr, addr + size)` carved from the upstream chunk that starts at `chunk`.
///
/// The chunk is what keeps coalescing honest: two free blocks merge only when they touch *and* come
/// from the same chunk, because memory from two upstream allocations that happen to be adjacent
/// cannot be handed out (or returned upstream) as one range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Block {
    /// First address of the block.
    pub addr: u64,
    /// Length in bytes.
    pub size: u64,
    /// Identifies the upstream chunk (or superblock) the block was carved from: its start address.
    pub chunk: u64,
}

impl Block {
    /// One past the last address of the block.
    #[inline]
    pub const fn end(&self) -> u64 {
        self.addr + self.size
    }
}

//! The upstream chunks an engine holds, and the checks every engine shares.
//!
//! Every engine gets its memory the same way (an upstream allocation whose address it checks) and
//! gives it back the same way (on the stream the chunk was allocated on when releasing everything,
//! on the stream of the call in progress when trimming); [`Chunks`] does both, for the pool's and
//! the fixed-size core's chunks and the binning engine's large allocations.

use std::fmt::Debug;

use crate::addr_map::AddrMap;

use crate::error::{ensure, Error, InvariantViolation};

use crate::block::Block;

use crate::stream_order::StreamOrder;

use crate::types::{EngineStats, ALIGNMENT};

use crate::upstream::Upstream;

/// An upstream allocation held by an engine.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chunk<S> {
    pub(crate) size: u64,
    /// The stream it was allocated on, and is returned on by [`Chunks::release_all`].
    pub(crate) stream: S,
}

/// Upstream chunks by start address: a hash map, since the binning engine adds and removes one for
/// every allocation above its largest bin (a B-tree was several hundred instructions per operation
/// there); the walks in address order sort first.
#[derive(Debug)]
pub(crate) struct Chunks<S> {
    /// Invariants: disjoint, aligned, non-empty; sizes add up to `reserved`.
    map: AddrMap<Chunk<S>>,
    reserved: u64,
}

impl<S> Default for Chunks<S> {
    fn default() -> Self {
        Self {
            map: AddrMap::default(),
            reserved: 0,
        }
    }
}

impl<S: Copy + Debug> Chunks<S> {
    /// Allocates a chunk of `size` bytes (a non-zero multiple of [`ALIGNMENT`]) on `stream` and
    /// records it. Errors come back as the upstream reported them (out-of-memory with the chunk's
    /// size: the caller knows what was requested); an address that is null, misaligned or whose range
    /// would pass the end of the address space is given back and reported as [`Error::Upstream`].
    pub(crate) fn allocate<U: Upstream<S>>(&mut self, upstream: &U, size: u64, stream: S) -> Result<u64, Error> {
        let addr = upstream.allocate(size, stream)?;
        if addr == 0 || addr % ALIGNMENT != 0 || addr.checked_add(size).is_none() {
            // The broken contract is the error to report; whether the upstream takes the bad range
            // back changes nothing for the engine, which never uses it.
            let _ = upstream.deallocate(addr, size, stream);
            return Err(Error::Upstream {
                op: "allocate",
                source: format!(
                    "returned {addr:#x} for {size} bytes, not a non-null address aligned to {ALIGNMENT} bytes \
                     whose range fits in 64 bits"
                )
                .into(),
            });
        }
        self.map.insert(addr, Chunk { size, stream });
        self.reserved += size;
        Ok(addr)
    }

    /// Returns the chunk at `addr` (which the caller knows is one) to the upstream on `stream`
    /// (which the caller has ordered after every use of it) and forgets it, whether the upstream
    /// takes it back or fails. Returns its size.
    pub(crate) fn release<U: Upstream<S>>(&mut self, upstream: &U, addr: u64, stream: S) -> Result<u64, Error> {
        let Some(chunk) = self.map.remove(&addr) else {
            debug_assert!(false, "releasing {addr:#x}, which is not a chunk");
            return Ok(0);
        };
        self.reserved -= chunk.size;
        upstream.deallocate(addr, chunk.size, stream)?;
        Ok(chunk.size)
    }

    /// Blocks the host until the streams the chunks were allocated on have completed their work
    /// (each stream once, however many chunks came on it).
    pub(crate) fn synchronize<O: StreamOrder<Stream = S>>(&self, order: &O) -> Result<(), Error>
    where
        S: Eq + std::hash::Hash,
    {
        let mut seen = std::collections::HashSet::new();
        self.map
            .values()
            .filter(|c| seen.insert(c.stream))
            .try_for_each(|c| order.synchronize(c.stream))
    }

    /// Returns every chunk to the upstream on the stream it was allocated on, and forgets them all,
    /// including those the upstream fails to take back; returns the first such error. The caller
    /// has synchronized those streams.
    pub(crate) fn release_all<U: Upstream<S>>(&mut self, upstream: &U) -> Result<(), Error> {
        let mut result = Ok(());
        let chunks = self.iter().collect::<Vec<_>>();
        self.map.clear();
        for (addr, chunk) in chunks {
            result = result.and(upstream.deallocate(addr, chunk.size, chunk.stream));
        }
        self.reserved = 0;
        result
    }

    /// The chunk that starts at `addr`.
    pub(crate) fn get(&self, addr: u64) -> Option<Chunk<S>> {
        self.map.get(&addr).copied()
    }

    /// Number of chunks.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Bytes in all chunks.
    pub(crate) fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Every chunk as `(address, chunk)`, in address order (sorted on each call: for the cold paths).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, Chunk<S>)> + '_ {
        let mut all: Vec<(u64, Chunk<S>)> = self.map.iter().map(|(&a, &c)| (a, c)).collect();
        all.sort_unstable_by_key(|&(a, _)| a);
        all.into_iter()
    }

    /// Checks the invariants written next to the fields; `engine` names the engine in messages.
    pub(crate) fn check(&self, engine: &str) -> Result<(), InvariantViolation> {
        let total: u64 = self.map.values().map(|c| c.size).sum();
        ensure!(
            total == self.reserved,
            "{engine}: chunks add up to {total} bytes, `reserved` says {}",
            self.reserved
        );
        let mut blocks: Vec<(Block, &str)> = self
            .iter()
            .map(|(addr, c)| {
                let block = Block {
                    addr,
                    size: c.size,
                    chunk: addr,
                };
                (block, "upstream chunk")
            })
            .collect();
        check_disjoint(engine, &mut blocks, |_| true)
    }
}

/// Checks that `blocks` (sorted here by address; each with a word for messages, such as "free")
/// are non-empty, aligned to [`ALIGNMENT`], inside their chunk as `inside` judges, and pairwise
/// disjoint.
pub(crate) fn check_disjoint(
    engine: &str,
    blocks: &mut [(Block, &str)],
    inside: impl Fn(&Block) -> bool,
) -> Result<(), InvariantViolation> {
    blocks.sort_unstable_by_key(|(b, _)| b.addr);
    let mut prev: Option<Block> = None;
    for &(b, what) in blocks.iter() {
        ensure!(
            b.size > 0 && b.addr % ALIGNMENT == 0 && b.size % ALIGNMENT == 0,
            "{engine}: {what} block {b:?} is empty or not aligned to {ALIGNMENT}"
        );
        ensure!(inside(&b), "{engine}: {what} block {b:?} is not inside its chunk");
        if let Some(p) = prev {
            ensure!(p.end() <= b.addr, "{engine}: blocks {p:?} and {b:?} overlap");
        }
        prev = Some(b);
    }
    Ok(())
}

/// Checks the identity every engine keeps: free + used = reserved.
pub(crate) fn check_balance(engine: &str, st: &EngineStats) -> Result<(), InvariantViolation> {
    ensure!(
        st.free_bytes + st.used_bytes == st.reserved_bytes,
        "{engine}: free {} + used {} != reserved {}",
        st.free_bytes,
        st.used_bytes,
        st.reserved_bytes
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// An upstream that answers every allocation with one fixed address and records what it is given
    /// back.
    struct Fixed {
        addr: u64,
        returned: Mutex<Vec<(u64, u64)>>,
    }

    impl Upstream<()> for Fixed {
        fn allocate(&self, _bytes: u64, _stream: ()) -> Result<u64, Error> {
            Ok(self.addr)
        }
        fn deallocate(&self, addr: u64, bytes: u64, _stream: ()) -> Result<(), Error> {
            self.returned.lock().unwrap().push((addr, bytes));
            Ok(())
        }
    }

    #[test]
    fn an_upstream_breaking_its_contract_is_reported_and_given_its_range_back() {
        // Null, misaligned, and aligned but running past the end of the address space.
        for addr in [0, 100, u64::MAX - 255] {
            let up = Fixed {
                addr,
                returned: Mutex::new(Vec::new()),
            };
            let mut chunks = Chunks::default();
            let e = chunks.allocate(&up, 512, ()).unwrap_err();
            assert!(
                matches!(&e, Error::Upstream { op: "allocate", source } if source.to_string().contains(&format!("{addr:#x}"))),
                "{addr:#x}: {e:?}"
            );
            assert_eq!(*up.returned.lock().unwrap(), [(addr, 512)]);
            assert_eq!((chunks.len(), chunks.reserved()), (0, 0));
        }
        let up = Fixed {
            addr: 1 << 20,
            returned: Mutex::new(Vec::new()),
        };
        let mut chunks = Chunks::default();
        assert_eq!(chunks.allocate(&up, 512, ()).unwrap(), 1 << 20);
        assert_eq!(chunks.reserved(), 512);
    }
}

//! Export: the physical allocations behind a range of live allocations, handed out for sharing with
//! another process ([`ServiceExport`]), and the hold that keeps their tag from sleeping until dropped.

use std::sync::Arc;

use mempool_core::{DeviceAddr, PhysicalAllocation};

use crate::error::{Error, Result};
use crate::resources::service::resource::{asleep_error, ServiceResource};
use crate::resources::service::state::free_chunks;
use crate::resources::service::types::Tag;

impl ServiceResource {
    /// The physical allocations behind `addr..addr+len` (inside one tag's region, every chunk touched by a
    /// live allocation), for sharing with another process, and a hold that keeps the tag from sleeping
    /// until it is dropped. Each allocation spans one or more chunks; the first starts
    /// [`ServiceExport::offset`] bytes before `addr`.
    ///
    /// Errors: an empty range, a range outside the reservation or across two tags, a sleeping tag, a range
    /// with a chunk no live allocation touches.
    pub fn export(self: &Arc<Self>, addr: DeviceAddr, len: usize) -> Result<ServiceExport> {
        let mut st = self.state();
        let bad = |reason: String| Error::Unsupported {
            resource: self.name,
            reason,
        };
        if len == 0 {
            return Err(bad("cannot export an empty range".into()));
        }
        let ri = self
            .region_slot(addr)
            .filter(|&i| i < st.regions.len())
            .ok_or_else(|| bad(format!("{addr} is not in the resource's reservation")))?;
        let r = &st.regions[ri];
        if !r.table.contains(addr.0, len as u64) {
            return Err(bad(format!(
                "{len} bytes at {addr} run past the end of tag `{}`'s region",
                r.name
            )));
        }
        if r.asleep.is_some() {
            return Err(asleep_error(self.name, &r.name, "export from"));
        }
        let span = r.table.span(addr.0, len as u64);
        let free = free_chunks(r);
        if let Some(i) = span.clone().find(|&i| free[i] || !r.table.is_mapped(i)) {
            return Err(bad(format!(
                "{len} bytes at {addr} include the chunk at {} that no live allocation of tag `{}` touches",
                DeviceAddr(r.table.addr(i)),
                r.name
            )));
        }
        // Every chunk of the span is mapped (checked above): the mappings over it are the one holding its
        // first chunk and those starting after that chunk inside it.
        let first = r
            .mappings
            .range(..=span.start)
            .next_back()
            .map_or(span.start, |(&g, _)| g);
        let chunks: Vec<Arc<PhysicalAllocation>> = r
            .mappings
            .range(first..span.end)
            .map(|(_, m)| m.physical().clone())
            .collect();
        let first = r.table.addr(first);
        st.regions[ri].exports += 1;
        Ok(ServiceExport {
            owner: self.clone(),
            tag: Tag(ri as u32),
            chunks,
            offset: (addr.0 - first) as usize,
            len,
        })
    }

    fn end_export(&self, tag: Tag) {
        let mut st = self.state();
        if let Some(r) = st.regions.get_mut(tag.index()) {
            r.exports = r.exports.saturating_sub(1);
        }
    }
}

/// Physical chunks of a [`ServiceResource`] handed out for sharing ([`ServiceResource::export`]): while it
/// lives, the tag cannot sleep. It holds the chunks (so they outlive any unmapping here) and the resource.
pub struct ServiceExport {
    owner: Arc<ServiceResource>,
    tag: Tag,
    chunks: Vec<Arc<PhysicalAllocation>>,
    offset: usize,
    len: usize,
}

impl std::fmt::Debug for ServiceExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceExport")
            .field("tag", &self.tag)
            .field("chunks", &self.chunks.len())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl ServiceExport {
    /// The physical allocations behind the range, in address order, contiguous: each spans one or more
    /// chunks ([`PhysicalAllocation::size`] says how many bytes), the first starting [`offset`](Self::offset)
    /// bytes before the range.
    pub fn chunks(&self) -> &[Arc<PhysicalAllocation>] {
        &self.chunks
    }

    /// Where the range starts in the first chunk.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The range's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: an export has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The tag it belongs to.
    pub fn tag(&self) -> Tag {
        self.tag
    }

    /// The resource it came from.
    pub fn resource(&self) -> &Arc<ServiceResource> {
        &self.owner
    }
}

impl Drop for ServiceExport {
    fn drop(&mut self) {
        self.owner.end_export(self.tag);
    }
}

//! Ranges over several VMM physical allocations on the exporter's side: [`share_vmm_chunks`] sends the
//! chunks behind a range (a growable reservation's, such as a service resource's, each of its own size)
//! as one `VmmChunks` message with a descriptor and a size per chunk. The range lives in the same lease
//! table as every other shared buffer, with no owner's reference: the caller's hold is dropped when the
//! last importer released it, said `Goodbye`, or died and its process is gone.

use std::sync::Arc;

use mempool_core::{AllocationProps, DeviceAddr, Granularity, HandleTypes, PhysicalAllocation, StreamRef};

use super::state::{FreeFn, Freer, Inner, Shared};
use super::vmm::{check_granted, send_to_each};
use crate::error::{Error, Result};
use crate::lease::ImporterId;
use crate::protocol::{check_vmm_chunks, BufferId, Message, VmmChunksDescriptor, CAP_VMM_CHUNKS, MAX_VMM_CHUNKS};

/// [`Exporter::share_vmm_chunks`](crate::Exporter::share_vmm_chunks).
pub(super) fn share_vmm_chunks(
    inner: &Arc<Inner>,
    chunks: &[Arc<PhysicalAllocation>],
    offset: usize,
    len: usize,
    hold: Box<dyn Send + Sync>,
    stream: StreamRef<'_>,
    to: &[ImporterId],
) -> Result<BufferId> {
    let invalid = |reason: String| Error::from(mempool_core::Error::InvalidArgument(reason));
    if to.is_empty() {
        return Err(invalid("sharing VMM chunks needs at least one importer".into()));
    }
    let descriptor = describe(inner, chunks, offset, len)?;
    let reactor = inner.reactor()?;
    check_granted(&inner.lock(), to, CAP_VMM_CHUNKS)?;
    let fds = chunks
        .iter()
        .map(|c| c.export_fd())
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let event = inner.take_event()?;
    event.event.record(stream)?;
    let mut state = inner.lock();
    // Checked again: an importer may have gone meanwhile.
    if let Err(e) = check_granted(&state, to, CAP_VMM_CHUNKS) {
        state.idle_events.push(event);
        return Err(e);
    }
    let id = BufferId(state.next_buffer);
    state.next_buffer += 1;
    let handle = event.handle;
    let kept = chunks.to_vec();
    // Called once, when the last holder let go: the owner's work before the share is ordered before
    // `stream` (the owner's reference is let go on the caller's stream below), importers synchronized
    // before releasing or are gone. Only then may the owner reuse the memory (a service resource's tag
    // sleeps only once its export is dropped).
    let free: FreeFn = Box::new(move |_, _, stream| {
        let synced = stream.synchronize();
        drop(kept);
        drop(hold);
        synced.map_err(Error::from)
    });
    let shared = Shared {
        // Nothing of the exporter's address space is shared: the record only keeps the range's length.
        ptr: DeviceAddr(0),
        len,
        // No pool block lies at address 0, so the range never joins a block's record or its pins.
        block_base: 0,
        free: Some(Freer::Custom(free)),
        events: vec![event],
        last_use: None,
        release_waits: Vec::new(),
    };
    if let Err(e) = state.leases.insert(id, shared) {
        return Err(e.into());
    }
    if let Err(e) = state.grant_all(id, to) {
        drop(state);
        // Nobody holds it: this frees it (drops the hold) on `stream`.
        let _ = inner.release_owner(id, stream);
        return Err(e);
    }
    drop(state);

    let message = Message::VmmChunks(VmmChunksDescriptor {
        ready_event: Some(handle),
        buffer_id: id,
        ..descriptor
    });
    // The owner's reference still holds the range, so revoking frees nothing.
    let first_error = send_to_each(inner, reactor, &message, id, &fds, to);
    // From now on the importers hold it alone: the last to let go frees it.
    let released = inner.release_owner(id, stream);
    inner.notify_all_waiters();
    match (first_error, released) {
        (Some(e), _) | (None, Err(e)) => Err(e),
        (None, Ok(())) => Ok(id),
    }
}

/// The message's fields but the id and the event, after checking what the caller handed over.
fn describe(
    inner: &Inner,
    chunks: &[Arc<PhysicalAllocation>],
    offset: usize,
    len: usize,
) -> Result<VmmChunksDescriptor> {
    let invalid = |reason: String| Error::from(mempool_core::Error::InvalidArgument(reason));
    if chunks.is_empty() {
        return Err(invalid("sharing VMM chunks needs at least one chunk".into()));
    }
    if chunks.len() > MAX_VMM_CHUNKS {
        return Err(invalid(format!(
            "a range over {} chunks is more than one share carries ({MAX_VMM_CHUNKS}, the most file \
             descriptors one message can pass): share it in parts, or use larger chunks",
            chunks.len()
        )));
    }
    let device = inner.source.pool().device();
    let props = AllocationProps::new(device).handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR);
    let granularity = device.vmm_granularity(&props, Granularity::Minimum)?;
    for (i, c) in chunks.iter().enumerate() {
        if c.device() != device {
            return Err(invalid(format!(
                "chunk {i} lives on device {}, not on the exporter's device {}",
                c.device().ordinal(),
                device.ordinal()
            )));
        }
        if !c.props().handle_types.contains(HandleTypes::POSIX_FILE_DESCRIPTOR) {
            return Err(invalid(format!(
                "chunk {i} was not created exportable as a POSIX file descriptor"
            )));
        }
        if c.size() == 0 || !c.size().is_multiple_of(granularity) {
            return Err(invalid(format!(
                "chunk {i} has {} bytes, not a non-zero multiple of device {}'s granularity of {granularity} bytes",
                c.size(),
                device.ordinal()
            )));
        }
    }
    // Every size is a whole number of their greatest common divisor, itself a multiple of the
    // granularity.
    let unit = chunks.iter().map(|c| c.size()).fold(0, gcd);
    let mut sizes = Vec::with_capacity(chunks.len());
    for (i, c) in chunks.iter().enumerate() {
        let units = u32::try_from(c.size() / unit).map_err(|_| {
            invalid(format!(
                "chunk {i} has {} bytes, more than one share describes ({} units of {unit} bytes)",
                c.size(),
                u32::MAX
            ))
        })?;
        sizes.push(units);
    }
    let total = chunks
        .iter()
        .try_fold(0usize, |sum, c| sum.checked_add(c.size()))
        .ok_or_else(|| {
            invalid(format!(
                "{} chunks hold more bytes than this machine addresses",
                chunks.len()
            ))
        })?;
    let first = chunks[0].size();
    let last_start = total - chunks[chunks.len() - 1].size();
    // The importer's own checks, with the caller's words for the range.
    let end = offset.checked_add(len);
    if offset >= first || len == 0 || end.is_none_or(|end| end > total) {
        return Err(invalid(format!(
            "{len} bytes at offset {offset} are not a non-empty range inside {} chunks of {total} bytes in all \
             that starts in the first ({first} bytes)",
            chunks.len()
        )));
    }
    if end.is_some_and(|end| end <= last_start) {
        return Err(invalid(format!(
            "{len} bytes at offset {offset} end before the last of the {} chunks (which starts at byte \
             {last_start}): share only the chunks the range reaches",
            chunks.len()
        )));
    }
    let descriptor = VmmChunksDescriptor {
        buffer_id: BufferId(0),
        unit: unit as u64,
        granularity: granularity as u64,
        offset: offset as u64,
        len: len as u64,
        sizes,
        ready_event: None,
    };
    check_vmm_chunks(&descriptor).map_err(|e| invalid(format!("cannot share these chunks: {e}")))?;
    Ok(descriptor)
}

/// The greatest common divisor of `a` and `b` (`gcd(0, b) == b`).
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

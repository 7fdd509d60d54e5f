//! Out-of-memory errors that explain themselves: [`explain`] turns an out-of-memory error that passes
//! a resource into an [`OutOfMemoryReport`] naming the stack and what its resources hold.

use crate::error::{Error, OutOfMemoryReport};
use crate::observe::inspect::Inspection;
use crate::resource::MemoryResource;

/// The resources of the stack under `top`, `top` first.
pub fn stack_of(top: &dyn MemoryResource) -> Vec<&dyn MemoryResource> {
    let mut out = vec![top];
    while let Some(next) = out.last().copied().and_then(|r| r.upstream_resource()) {
        out.push(next);
    }
    out
}

/// Fills what `report` does not know yet from the stack under `top`: the names from `top` down, and
/// the numbers of the first resource that knows what it holds (`holder`); the device's free memory
/// from whichever resource knows it.
pub fn fill_from_stack(report: &mut OutOfMemoryReport, top: &dyn MemoryResource) {
    let layers = stack_of(top);
    report.stack = layers.iter().map(|r| r.name()).collect();
    for r in layers {
        let i = r.inspect();
        if report.holder.is_none() && i.knows_memory() {
            fill_holder(report, r.name(), &i);
        }
        if report.device_free.is_none() {
            report.device_free = i.device_free;
        }
    }
}

/// Sets the holder's numbers from its inspection: held, live, and (for a resource with chunks) the
/// free bytes, free blocks and largest free block of its memory map.
pub fn fill_holder(report: &mut OutOfMemoryReport, name: &'static str, i: &Inspection) {
    report.holder = Some(name);
    report.held = i.held_bytes;
    report.live = i.live_bytes;
    if i.has_chunks {
        let sum = mempool_suballoc::summarize(&i.chunks);
        report.free = Some(sum.free_bytes);
        report.free_blocks = Some(sum.free_ranges);
        report.largest_free = Some(sum.largest_free);
    } else if let (Some(h), Some(l)) = (i.held_bytes, i.live_bytes) {
        report.free = Some(h.saturating_sub(l));
    }
}

/// An out-of-memory error explained at `layer`, which the error passed on its way up: a report
/// built by a resource below gets `layer`'s name in front of its stack; a bare
/// [`Error::OutOfMemory`] becomes a report of the stack from `layer` down. Other errors (and
/// [`Error::LimitExceeded`], whose message already says why) pass unchanged. Runs only on the error
/// path.
pub fn explain(e: Error, layer: &dyn MemoryResource) -> Error {
    match e {
        Error::OutOfMemoryReport(mut r) => {
            if r.stack.first() != Some(&layer.name()) || r.stack.is_empty() {
                r.stack.insert(0, layer.name());
            }
            Error::OutOfMemoryReport(r)
        }
        Error::OutOfMemory { resource, requested } => {
            let mut r = OutOfMemoryReport::new(requested, resource);
            fill_from_stack(&mut r, layer);
            Error::OutOfMemoryReport(Box::new(r))
        }
        other => other,
    }
}

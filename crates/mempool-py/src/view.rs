//! What the three buffer classes (`mempool.DeviceBuffer`, `mempool.ipc.ExportedBuffer`,
//! `mempool.ipc.ImportedBuffer`) share: the [`RawView`] each describes its memory with, and
//! `crate::surface::device_view_pymethods!`, which writes their common Python surface once (`ptr`, `size`, `nbytes`,
//! `device`, `stream`, `len()`, `__cuda_array_interface__`, `__dlpack_device__`, `__dlpack__`) next to
//! each class's own methods.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use mempool_core::{Event, EventFlags, StreamRef};

use crate::errors::IntoPy;

/// A range of device memory as DLPack and the CUDA array interface describe it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawView {
    pub(crate) addr: u64,
    pub(crate) size: usize,
    pub(crate) device: usize,
    /// The raw stream its work is ordered on (0: legacy).
    pub(crate) stream: usize,
}

/// A Python buffer class: the memory it views (read by the methods [`device_view_pymethods!`] writes).
pub(crate) trait DeviceView {
    /// The class's name in Python, for error messages (`mempool.DeviceBuffer`, ...).
    const PY_NAME: &'static str;
    /// The memory, its device and its stream.
    fn raw_view(&self) -> RawView;
    /// Called when a view of the memory is handed out (`__dlpack__`, `__cuda_array_interface__`): a class
    /// that can let go of its memory before it is collected (`mempool.ipc.CreatedBuffer.discard`) stops
    /// doing so. Nothing by default.
    fn note_exported(&self) {}
}

/// Makes the stream `consumer` wait for the work queued on the stream `ours` so far (raw handles of streams
/// of `device`'s primary context, 0 or 1 for the legacy default stream): an event recorded on `ours` that
/// `consumer` waits on. Nothing when they are the same stream.
pub(crate) fn order_streams(device: usize, ours: usize, consumer: usize) -> PyResult<()> {
    let legacy = |h: usize| h == 0 || h == 1;
    if ours == consumer || (legacy(ours) && legacy(consumer)) {
        return Ok(());
    }
    let ctx = mempool_capi::device::context(device).py()?;
    let _bound = ctx.bind().py()?;
    // Pooled by context (the primary context of `device`; a context made anew after a reset is another).
    let key = std::sync::Arc::as_ptr(&ctx) as usize;
    let event = match take_order_event(key) {
        Some(event) => event,
        None => Event::new(&ctx, EventFlags::DISABLE_TIMING).py()?,
    };
    let raw = |h: usize| if legacy(h) { 0 } else { h };
    // SAFETY: both handles are streams of `device`'s primary context (or the legacy stream), live during
    // this call: `ours` is owned by the object being exported, `consumer` was passed by the caller for it.
    #[allow(unsafe_code)]
    let (o, c) = unsafe {
        (
            StreamRef::from_raw(raw(ours) as mempool_core::RawStream),
            StreamRef::from_raw(raw(consumer) as mempool_core::RawStream),
        )
    };
    event.record(o.in_context(&ctx)).py()?;
    c.wait(&event).py()?;
    // The wait took the recording of this moment (`cuStreamWaitEvent`): the event may be recorded
    // again for the next call, by any thread, without touching this wait.
    give_back_order_event(key, event);
    Ok(())
}

/// Events [`order_streams`] records and waits on, by context (its address: each event keeps its context
/// alive, so no other context can have it meanwhile), kept for the next call: one
/// `cuEventCreate` and `cuEventDestroy` less per call (a share, a DLPack export). Each is taken out while
/// it is recorded and waited on, so two threads never record one event at once.
static ORDER_EVENTS: std::sync::Mutex<Vec<(usize, Event)>> = std::sync::Mutex::new(Vec::new());
/// The most events [`ORDER_EVENTS`] keeps.
const MAX_ORDER_EVENTS: usize = 64;

fn take_order_event(key: usize) -> Option<Event> {
    let mut pool = ORDER_EVENTS.lock().unwrap_or_else(|p| p.into_inner());
    let i = pool.iter().position(|(k, _)| *k == key)?;
    Some(pool.swap_remove(i).1)
}

fn give_back_order_event(key: usize, event: Event) {
    let mut pool = ORDER_EVENTS.lock().unwrap_or_else(|p| p.into_inner());
    if pool.len() < MAX_ORDER_EVENTS {
        pool.push((key, event));
    }
}

/// Version 3 of CUDA's array interface of `view`: a 1-D `uint8` array over the memory, with its stream
/// (consumers order their work after it).
pub(crate) fn cuda_array_interface(py: Python<'_>, view: RawView) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("shape", (view.size,))?;
    d.set_item("strides", py.None())?;
    d.set_item("typestr", "|u1")?;
    d.set_item("data", (view.addr, false))?;
    d.set_item("version", 3)?;
    // CAI v3: 1 is the legacy default stream (0 is not allowed).
    d.set_item("stream", if view.stream == 0 { 1 } else { view.stream })?;
    Ok(d)
}

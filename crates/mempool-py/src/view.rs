//! What the three buffer classes (`mempool.DeviceBuffer`, `mempool.ipc.ExportedBuffer`,
//! `mempool.ipc.ImportedBuffer`) share: the [`RawView`] each describes its memory with, and
//! [`device_view_pymethods!`], which writes their common Python surface once (`ptr`, `size`, `nbytes`,
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
    let event = Event::new(&ctx, EventFlags::DISABLE_TIMING).py()?;
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
    c.wait(&event).py()
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

/// `#[pymethods]` of a buffer class that implements [`DeviceView`]: the shared surface (see the module
/// documentation), then the class's own methods given in the braces.
macro_rules! device_view_pymethods {
    ($ty:ty { $($own:tt)* }) => {
        #[pymethods]
        impl $ty {
            /// The device address (0 for 0 bytes).
            #[getter]
            fn ptr(&self) -> u64 {
                $crate::view::DeviceView::raw_view(self).addr
            }

            /// The size in bytes.
            #[getter]
            fn size(&self) -> usize {
                $crate::view::DeviceView::raw_view(self).size
            }

            /// The size in bytes (RMM's `nbytes`).
            #[getter]
            fn nbytes(&self) -> usize {
                $crate::view::DeviceView::raw_view(self).size
            }

            /// The ordinal of the device the memory is on (in this process).
            #[getter]
            fn device(&self) -> usize {
                $crate::view::DeviceView::raw_view(self).device
            }

            /// The raw handle of the stream the buffer's work is ordered on (0: the legacy default stream).
            #[getter]
            fn stream(&self) -> usize {
                $crate::view::DeviceView::raw_view(self).stream
            }

            fn __len__(&self) -> usize {
                $crate::view::DeviceView::raw_view(self).size
            }

            /// Version 3 of CUDA's array interface: a 1-D `uint8` array over the memory, with the buffer's
            /// stream (consumers order their work after it).
            #[getter]
            fn __cuda_array_interface__<'py>(
                &self,
                py: Python<'py>,
            ) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
                $crate::view::cuda_array_interface(py, $crate::view::DeviceView::raw_view(self))
            }

            /// DLPack's device: `(kDLCUDA, device)`.
            fn __dlpack_device__(&self) -> (i32, i32) {
                (
                    $crate::dlpack::KDL_CUDA,
                    $crate::view::DeviceView::raw_view(self).device as i32,
                )
            }

            /// A DLPack capsule viewing the memory as a 1-D `uint8` tensor, without a copy; the capsule (and
            /// the tensor a consumer builds from it) keeps the buffer alive. `stream` is the consumer's
            /// stream: the buffer's stream's work so far is ordered before it (an event), unless it is -1
            /// (no ordering). `max_version` >= (1, 0) gets a versioned capsule (`dltensor_versioned`), else
            /// `dltensor`.
            #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
            fn __dlpack__(
                slf: &Bound<'_, Self>,
                stream: Option<i64>,
                max_version: Option<(u32, u32)>,
                dl_device: Option<(i32, i32)>,
                copy: Option<bool>,
            ) -> PyResult<Py<PyAny>> {
                let view = $crate::view::DeviceView::raw_view(slf.get());
                $crate::dlpack::export_checked(
                    slf.py(),
                    <$ty as $crate::view::DeviceView>::PY_NAME,
                    view,
                    slf.clone().into_any().unbind(),
                    $crate::dlpack::DlpackArgs {
                        stream,
                        max_version,
                        dl_device,
                        copy,
                    },
                )
            }

            $($own)*
        }
    };
}

pub(crate) use device_view_pymethods;

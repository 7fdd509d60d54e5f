//! The `#[pymethods]` every buffer class shares, written once: the getters, the CUDA Array Interface
//! ([`crate::view`]) and DLPack ([`crate::dlpack`]), for a class that implements
//! [`DeviceView`](crate::view::DeviceView), followed by the class's own methods.

/// `#[pymethods]` of a buffer class that implements [`DeviceView`](crate::view::DeviceView): the shared surface (see the module
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
                $crate::view::DeviceView::note_exported(self);
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
                $crate::view::DeviceView::note_exported(slf.get());
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

//! `mempool.DeviceBuffer`: mempool-rmm's [`containers::DeviceBuffer`](RmmBuffer) (the owned allocation
//! and its [`BufferView`]: range checks and copies are theirs), freed on its stream when the last reference
//! (the object, or a view made through `__cuda_array_interface__` or DLPack) goes away.

use std::sync::{Arc, OnceLock};

use pyo3::exceptions::PyValueError;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};
use pyo3::PyTraverseError;

use mempool_core::{BufferView, Context, StreamRef};
use mempool_rmm::containers::DeviceBuffer as RmmBuffer;

use crate::errors::IntoPy;
use crate::mr::{calls_python, PyResource};
use crate::stream::{self, StreamArg};
use crate::surface::device_view_pymethods;
use crate::view::{DeviceView, RawView};

/// The primary context of `device`, borrowed for the life of the process (the buffers' streams carry it).
/// Retained once per device by mempool-capi; the `'static` reference is leaked once per device.
fn primary(device: usize) -> PyResult<&'static Arc<Context>> {
    static SLOTS: OnceLock<Box<[OnceLock<&'static Arc<Context>>]>> = OnceLock::new();
    let slots = match SLOTS.get() {
        Some(s) => s,
        None => {
            let n = mempool_capi::device::count().py()?;
            SLOTS.get_or_init(|| (0..n).map(|_| OnceLock::new()).collect())
        }
    };
    if let Some(ctx) = slots.get(device).and_then(OnceLock::get) {
        return Ok(ctx);
    }
    // Names the cause (no such device, no driver) when there is no slot.
    let ctx = mempool_capi::device::context(device).py()?;
    let slot = slots
        .get(device)
        .ok_or_else(|| PyValueError::new_err(format!("device {device} appeared after the device list was read")))?;
    Ok(slot.get_or_init(|| Box::leak(Box::new(ctx))))
}

/// A stream argument as a stream of `ctx`, for the life of the buffer that keeps its owner.
///
/// # Safety
/// 1. The stream (`s.handle`) is live, and stays so for as long as the returned view or anything made with
///    it is used: `s.owner` is kept alive that long, or a raw integer (or None, the legacy stream) is the
///    caller's documented promise that it does (docs/python.md, Streams).
/// 2. It is a stream of `ctx` (or a special handle).
#[allow(unsafe_code)]
unsafe fn stream_in(s: &StreamArg, ctx: &'static Arc<Context>) -> StreamRef<'static> {
    // SAFETY: points 1 and 2.
    unsafe { StreamRef::from_raw(s.handle as mempool_core::RawStream) }.in_context(ctx)
}

/// Device memory of `size` bytes (uninitialised), from `mr` or the current device's resource, ordered on
/// `stream`. The allocation and the free run with the interpreter released while a
/// `FailureCallbackResourceAdaptor` exists (they can wait on a pool's lock held by a thread whose failure
/// callback needs the interpreter); otherwise no lock of a resource is held by a thread waiting for the
/// interpreter, and they keep it (releasing and retaking it costs about as much as a pool's allocation).
#[pyclass(module = "mempool", name = "DeviceBuffer", frozen, weakref)]
pub struct DeviceBuffer {
    // Always `Some` until `drop` takes it to free it with the interpreter released.
    buf: Option<RmmBuffer<'static>>,
    device: usize,
    // Keeps a CuPy/Numba/PyTorch stream object alive while the memory may be freed on it (dropped after
    // `drop` queued the free: fields drop after `Drop::drop`).
    _stream_owner: Option<Py<PyAny>>,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            // The free can wait on the resource's lock, held by a thread that may need the interpreter
            // (a failure callback): release the interpreter for it while such a callback exists (releasing
            // and taking it back costs about as much as a pool's free). `Python::attach` is re-entrant here (the
            // object is being deallocated by the interpreter on this thread).
            if calls_python() {
                Python::attach(|py| py.detach(move || drop(buf)));
            } else {
                drop(buf);
            }
        }
    }
}

impl DeviceBuffer {
    /// `size` bytes from `mr` (or the current device's resource) on `s`, holding a copy of `init` when
    /// given (then `size == init.len()`).
    fn allocate(
        py: Python<'_>,
        size: usize,
        init: Option<&[u8]>,
        s: StreamArg,
        mr: Option<&Bound<'_, PyResource>>,
    ) -> PyResult<DeviceBuffer> {
        let (shared, device) = match mr {
            Some(mr) => {
                let r = mr.get();
                (r.inner.clone(), r.device)
            }
            None => {
                let device = mempool_capi::device::current().py()?;
                (mempool_capi::registry::current(device).py()?, device)
            }
        };
        let ctx = primary(device)?;
        // SAFETY: point 1: the buffer keeps `s.owner` until it is dropped (after the free is queued); a raw
        // integer or None is the caller's documented promise. Point 2: a stream passed for an allocation on
        // `device` is one of its primary context's (the documented contract, as RMM's).
        #[allow(unsafe_code)]
        let stream = unsafe { stream_in(&s, ctx) };
        // Released when the allocation can wait on a pool's lock held by a thread that needs the interpreter
        // (while a failure callback exists), and for the copy of `init`, which waits for the device.
        let buf = match init {
            Some(data) => py.detach(move || RmmBuffer::from_host(data, stream, shared)),
            None if calls_python() => py.detach(move || RmmBuffer::new(size, stream, shared)),
            None => RmmBuffer::new(size, stream, shared),
        }
        .py()?;
        Ok(DeviceBuffer {
            buf: Some(buf),
            device,
            _stream_owner: s.owner,
        })
    }

    fn b(&self) -> &RmmBuffer<'static> {
        self.buf
            .as_ref()
            .expect("a DeviceBuffer holds its allocation until it is dropped")
    }

    /// Runs `f` with a view of the whole buffer on `stream` when one was given for this call, else on the
    /// buffer's own stream.
    fn on_stream<R>(&self, stream: &StreamArg, f: impl FnOnce(&BufferView<'_>) -> R) -> PyResult<R> {
        let buf = self.b();
        if !stream.given {
            return Ok(f(buf));
        }
        let ctx = primary(self.device)?;
        // SAFETY: point 1: the stream was passed for this call; its object (`stream.owner`) is held by the
        // caller across it, a raw integer is the caller's promise that it is live, and the view below does
        // not outlive the call. Point 2: a stream passed for the buffer's device (the documented contract).
        #[allow(unsafe_code)]
        let s = unsafe { stream_in(stream, ctx) };
        // SAFETY: (1) the range is this buffer's allocation, which `buf` (borrowed for the view's life) keeps
        // and frees only through its own view; this one is dropped without releasing anything; (2) the caller
        // passed `s` for this copy, having ordered the work on the buffer before it (docs/python.md, Streams);
        // (3) `s` carries `ctx`; (4) a null address comes with 0 bytes.
        #[allow(unsafe_code)]
        let view = unsafe { BufferView::new(buf.ptr(), buf.len(), s, ctx.clone()) };
        Ok(f(&view))
    }
}

impl DeviceView for DeviceBuffer {
    const PY_NAME: &'static str = "mempool.DeviceBuffer";

    #[inline]
    fn raw_view(&self) -> RawView {
        let b = self.b();
        RawView {
            addr: b.ptr().as_raw(),
            size: b.len(),
            device: self.device,
            stream: b.stream().handle(),
        }
    }
}

/// The bytes of a host object: `bytes` as they are, anything else exporting a buffer copied (its bytes in
/// C order): the interpreter is released during the device copy, and only `bytes` is immutable.
pub(crate) fn host_bytes<'py>(host: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    match host.cast::<PyBytes>() {
        Ok(b) => Ok(b.clone()),
        Err(_) => {
            let view = host.py().import("builtins")?.getattr("memoryview")?.call1((host,))?;
            Ok(view.call_method0("tobytes")?.cast_into::<PyBytes>()?)
        }
    }
}

device_view_pymethods!(DeviceBuffer {
    #[new]
    #[pyo3(signature = (*, size = 0, stream = None, mr = None))]
    fn new(
        py: Python<'_>,
        size: usize,
        stream: Option<&Bound<'_, PyAny>>,
        mr: Option<&Bound<'_, PyResource>>,
    ) -> PyResult<Self> {
        DeviceBuffer::allocate(py, size, None, stream::extract(stream)?, mr)
    }

    /// The garbage collector sees the stream object the buffer keeps (fixed for the buffer's life).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self._stream_owner)
    }

    /// A new buffer holding a copy of `host` (bytes, or any object exporting a buffer: its bytes in C order).
    #[staticmethod]
    #[pyo3(signature = (host, stream = None, mr = None))]
    fn to_device(
        py: Python<'_>,
        host: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
        mr: Option<&Bound<'_, PyResource>>,
    ) -> PyResult<DeviceBuffer> {
        let bytes = host_bytes(host)?;
        let src = bytes.as_bytes();
        DeviceBuffer::allocate(py, src.len(), Some(src), stream::extract(stream)?, mr)
    }

    /// Copies `ary` (bytes, or any object exporting a buffer: its bytes in C order) to the start of the
    /// buffer, on `stream` (default: the buffer's own stream, so the copy follows the work queued there;
    /// RMM's default is the default stream), and waits for the copy. `ValueError` when `ary` holds more
    /// bytes than the buffer.
    #[pyo3(signature = (ary, stream = None))]
    fn copy_from_host(&self, py: Python<'_>, ary: &Bound<'_, PyAny>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let s = stream::extract(stream)?.given_if(stream.is_some());
        let bytes = host_bytes(ary)?;
        let src = bytes.as_bytes();
        self.on_stream(&s, |view| py.detach(|| view.copy_from_host(0, src)))?.py()
    }

    /// The contents as `bytes`, copied on `stream` (default: the buffer's own stream, so the copy follows
    /// the work queued there; RMM's default is the default stream).
    #[pyo3(signature = (stream = None))]
    fn tobytes<'py>(&self, py: Python<'py>, stream: Option<&Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyBytes>> {
        let s = stream::extract(stream)?.given_if(stream.is_some());
        let mut result = Ok(());
        let b = PyBytes::new_with(py, self.b().len(), |dst| {
            result = self
                .on_stream(&s, |view| py.detach(|| view.copy_to_host(0, dst)))
                .and_then(|r| r.py());
            Ok(())
        })?;
        result.map(|()| b)
    }

    /// Copies the contents to host memory, on `stream` (default: the buffer's own stream): into `ary` (a
    /// writable buffer of at least `size` bytes, returned) or, without it, into a new NumPy `uint8` array
    /// (as RMM returns), or a `bytearray` where NumPy is not installed.
    #[pyo3(signature = (ary = None, stream = None))]
    fn copy_to_host<'py>(
        &self,
        py: Python<'py>,
        ary: Option<Bound<'py, PyAny>>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let s = stream::extract(stream)?.given_if(stream.is_some());
        let size = self.b().len();
        let ary = match ary {
            Some(a) => Some(a),
            None => match py.import("numpy") {
                Ok(np) => Some(np.call_method1("empty", ((size,), "u1"))?),
                Err(e) if e.is_instance_of::<pyo3::exceptions::PyImportError>(py) => None,
                Err(e) => return Err(e),
            },
        };
        let out = PyByteArray::new_with(py, size, |dst| {
            self.on_stream(&s, |view| py.detach(|| view.copy_to_host(0, dst)))?.py()
        })?;
        let Some(ary) = ary else {
            return Ok(out.into_any());
        };
        let view = py
            .import("builtins")?
            .getattr("memoryview")?
            .call1((&ary,))?
            .call_method1("cast", ("B",))?;
        let n: usize = view.len()?;
        if n < size {
            return Err(PyValueError::new_err(format!(
                "copy_to_host: the destination holds {n} bytes, the buffer {size}"
            )));
        }
        let slice = py.import("builtins")?.getattr("slice")?.call1((0, size))?;
        view.set_item(slice, out)?;
        Ok(ary)
    }

    fn __repr__(&self) -> String {
        let b = self.b();
        format!(
            "<mempool.DeviceBuffer size={} ptr={:#x} device={} resource={}>",
            b.len(),
            b.ptr().as_raw(),
            self.device,
            b.resource().name()
        )
    }
});

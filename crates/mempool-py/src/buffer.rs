//! `mempool.DeviceBuffer`: untyped device memory from a resource, owned, freed on its stream when the last
//! reference (the object, or a view made through `__cuda_array_interface__` or DLPack) goes away.

use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};
use pyo3::PyTraverseError;

use mempool_capi::owned::Allocation;
use mempool_core::{DeviceAddr, Event, EventFlags, StreamRef};

use crate::errors::IntoPy;
use crate::mr::PyResource;
use crate::stream::{self, StreamArg};

/// Device memory of `size` bytes (uninitialised), from `mr` or the current device's resource, ordered on
/// `stream`. The allocation and the free run with the interpreter released (they can wait on a pool's
/// lock, or on a failure callback that needs the interpreter on another thread).
#[pyclass(module = "mempool", name = "DeviceBuffer", frozen, weakref)]
pub struct DeviceBuffer {
    // Always `Some` until `drop` takes it to free it with the interpreter released.
    alloc: Option<Allocation>,
    device: usize,
    // Keeps a CuPy/Numba/PyTorch stream object alive while the memory may be freed on it (dropped after
    // `drop` queued the free: fields drop after `Drop::drop`).
    _stream_owner: Option<Py<PyAny>>,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(alloc) = self.alloc.take() {
            // The free can wait on the resource's lock, held by a thread that may need the interpreter
            // (a failure callback): release the interpreter for it. `Python::attach` is re-entrant here (the
            // object is being deallocated by the interpreter on this thread).
            Python::attach(|py| py.detach(move || drop(alloc)));
        }
    }
}

impl DeviceBuffer {
    fn allocate(
        py: Python<'_>,
        size: usize,
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
        let handle = s.handle;
        // Released: the allocation can wait on a pool's lock held by a thread that needs the interpreter.
        let alloc = py
            .detach(move || {
                // SAFETY: point 1 of `Allocation::new`: the stream is `s.owner`'s, which this buffer keeps alive
                // until the allocation is freed on it; a raw integer (or None, the legacy stream) is the
                // caller's documented promise that it outlives the buffer. Point 2: the buffer's documented
                // contract (docs/python.md, Streams): work on other streams that uses the memory, through a
                // view, is synchronized before the last reference goes.
                #[allow(unsafe_code)]
                unsafe {
                    Allocation::new(shared, size, handle)
                }
            })
            .py()?;
        Ok(DeviceBuffer {
            alloc: Some(alloc),
            device,
            _stream_owner: s.owner,
        })
    }

    fn a(&self) -> &Allocation {
        self.alloc
            .as_ref()
            .expect("a DeviceBuffer holds its allocation until it is dropped")
    }

    fn stream_ref(&self) -> StreamRef<'static> {
        // SAFETY: the allocation's stream is live while the buffer is (see `allocate`).
        #[allow(unsafe_code)]
        unsafe {
            StreamRef::from_raw(self.a().stream() as mempool_core::RawStream)
        }
    }

    /// Copies the buffer's first `dst.len()` bytes to `dst`, ordered on `stream` (a stream argument,
    /// None: the buffer's own stream); waits for the copy.
    fn copy_out(&self, py: Python<'_>, dst: &mut [u8], stream: &StreamArg) -> PyResult<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let ctx = mempool_capi::device::context(self.device).py()?;
        let s = match stream.given {
            // SAFETY: the stream was passed for this call; its object (`stream.owner`) is held by the
            // caller across it, and a raw integer is the caller's promise that it is live.
            #[allow(unsafe_code)]
            true => unsafe { StreamRef::from_raw(stream.handle as mempool_core::RawStream) },
            false => self.stream_ref(),
        };
        let addr = DeviceAddr(self.a().addr());
        py.detach(|| {
            // SAFETY: `addr..addr+len` is this buffer's memory (dst.len() <= size, checked by the callers),
            // readable by work on `s` (the buffer's stream, or one the caller ordered after the writes);
            // the copy waits for the stream.
            #[allow(unsafe_code)]
            unsafe {
                mempool_core::memory::copy_to_host(&ctx, dst, addr, s)
            }
        })
        .py()
    }
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

/// Version 3 of CUDA's array interface for `size` bytes at `addr`, ordered on the raw stream `stream`.
pub(crate) fn cai<'py>(py: Python<'py>, addr: u64, size: usize, stream: usize) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("shape", (size,))?;
    d.set_item("strides", py.None())?;
    d.set_item("typestr", "|u1")?;
    d.set_item("data", (addr, false))?;
    d.set_item("version", 3)?;
    // CAI v3: 1 is the legacy default stream (0 is not allowed).
    d.set_item("stream", if stream == 0 { 1 } else { stream })?;
    Ok(d)
}

/// What `__dlpack__` of a 1-D `uint8` view does for every object that has one (`DeviceBuffer` and the
/// buffers of `mempool.ipc`): checks the arguments, orders the consumer's `stream` after `ours` (unless
/// it is -1), and returns a capsule whose tensor holds `owner` (the object, keeping its memory alive).
#[allow(clippy::too_many_arguments)]
pub(crate) fn dlpack(
    py: Python<'_>,
    what: &str,
    view: RawView,
    owner: Py<PyAny>,
    stream: Option<i64>,
    max_version: Option<(u32, u32)>,
    dl_device: Option<(i32, i32)>,
    copy: Option<bool>,
) -> PyResult<Py<PyAny>> {
    if copy == Some(true) {
        return Err(PyBufferError::new_err(format!(
            "{what} exports its memory without a copy; copy=True is not supported"
        )));
    }
    if let Some(d) = dl_device {
        if d != (KDL_CUDA, view.device as i32) {
            return Err(PyBufferError::new_err(format!(
                "the buffer is on (kDLCUDA, {}); it cannot be exported to device {d:?} without a copy",
                view.device
            )));
        }
    }
    match stream {
        Some(-1) => {}
        Some(0) => {
            return Err(PyValueError::new_err(
                "__dlpack__: stream 0 is ambiguous for CUDA (use 1 for the legacy default stream)",
            ))
        }
        Some(s) if s < -1 => return Err(PyValueError::new_err(format!("__dlpack__: invalid stream {s}"))),
        Some(s) => order_streams(view.device, view.stream, s as usize)?,
        None => order_streams(view.device, view.stream, 1)?,
    }
    let versioned = max_version.is_some_and(|(major, _)| major >= 1);
    export(py, view, owner, versioned)
}

/// A range of device memory as DLPack and the CUDA array interface describe it.
#[derive(Clone, Copy)]
pub(crate) struct RawView {
    pub(crate) addr: u64,
    pub(crate) size: usize,
    pub(crate) device: usize,
    /// The raw stream its work is ordered on (0: legacy).
    pub(crate) stream: usize,
}

impl DeviceBuffer {
    fn raw_view(&self) -> RawView {
        RawView {
            addr: self.a().addr(),
            size: self.a().size(),
            device: self.device,
            stream: self.a().stream(),
        }
    }
}

#[pymethods]
impl DeviceBuffer {
    #[new]
    #[pyo3(signature = (*, size = 0, stream = None, mr = None))]
    fn new(
        py: Python<'_>,
        size: usize,
        stream: Option<&Bound<'_, PyAny>>,
        mr: Option<&Bound<'_, PyResource>>,
    ) -> PyResult<Self> {
        DeviceBuffer::allocate(py, size, stream::extract(stream)?, mr)
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
        let bytes: Bound<'_, PyBytes> = match host.cast::<PyBytes>() {
            Ok(b) => b.clone(),
            Err(_) => {
                let view = py.import("builtins")?.getattr("memoryview")?.call1((host,))?;
                view.call_method0("tobytes")?.cast_into::<PyBytes>()?
            }
        };
        let src = bytes.as_bytes();
        let buf = DeviceBuffer::allocate(py, src.len(), stream::extract(stream)?, mr)?;
        if !src.is_empty() {
            let ctx = mempool_capi::device::context(buf.device).py()?;
            let (addr, s) = (DeviceAddr(buf.a().addr()), buf.stream_ref());
            py.detach(|| {
                // SAFETY: `addr` is the new buffer's memory of `src.len()` bytes, writable on its stream; the
                // copy waits for the stream, and `bytes` (immutable) lives across it.
                #[allow(unsafe_code)]
                unsafe {
                    mempool_core::memory::copy_to_device(&ctx, addr, src, s)
                }
            })
            .py()?;
        }
        Ok(buf)
    }

    /// The size in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.a().size()
    }

    /// The size in bytes (RMM's `nbytes`).
    #[getter]
    fn nbytes(&self) -> usize {
        self.a().size()
    }

    /// The device address (0 for 0 bytes).
    #[getter]
    fn ptr(&self) -> u64 {
        self.a().addr()
    }

    /// The ordinal of the device the memory is on.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    /// The raw handle of the stream the memory was allocated on and will be freed on (0: legacy default).
    #[getter]
    fn stream(&self) -> usize {
        self.a().stream()
    }

    /// The contents as `bytes`, copied on `stream` (default: the buffer's own stream, so the copy follows
    /// the work queued there; RMM's default is the default stream).
    #[pyo3(signature = (stream = None))]
    fn tobytes<'py>(&self, py: Python<'py>, stream: Option<&Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyBytes>> {
        let s = stream::extract(stream)?.given_if(stream.is_some());
        let mut result = Ok(());
        let b = PyBytes::new_with(py, self.a().size(), |dst| {
            result = self.copy_out(py, dst, &s);
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
        let size = self.a().size();
        let ary = match ary {
            Some(a) => Some(a),
            None => match py.import("numpy") {
                Ok(np) => Some(np.call_method1("empty", ((size,), "u1"))?),
                Err(e) if e.is_instance_of::<pyo3::exceptions::PyImportError>(py) => None,
                Err(e) => return Err(e),
            },
        };
        let out = PyByteArray::new_with(py, size, |dst| self.copy_out(py, dst, &s))?;
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

    fn __len__(&self) -> usize {
        self.a().size()
    }

    fn __repr__(&self) -> String {
        format!(
            "<mempool.DeviceBuffer size={} ptr={:#x} device={} resource={}>",
            self.a().size(),
            self.a().addr(),
            self.device,
            self.a().resource().name()
        )
    }

    /// Version 3 of CUDA's array interface: a 1-D `uint8` array over the memory, with the buffer's stream
    /// (consumers order their work after it).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        cai(py, self.a().addr(), self.a().size(), self.a().stream())
    }

    /// DLPack's device: `(kDLCUDA, device)`.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (KDL_CUDA, self.device as i32)
    }

    /// A DLPack capsule viewing the memory as a 1-D `uint8` tensor, without a copy; the capsule (and the
    /// tensor a consumer builds from it) keeps the buffer alive. `stream` is the consumer's stream: the
    /// buffer's stream's work so far is ordered before it (an event), unless it is -1 (no ordering).
    /// `max_version` >= (1, 0) gets a versioned capsule (`dltensor_versioned`), else `dltensor`.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        slf: &Bound<'_, Self>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let view = slf.get().raw_view();
        let owner = slf.clone().into_any().unbind();
        dlpack(
            slf.py(),
            "mempool.DeviceBuffer",
            view,
            owner,
            stream,
            max_version,
            dl_device,
            copy,
        )
    }
}

const KDL_CUDA: i32 = 2;

#[repr(C)]
#[derive(Copy, Clone)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Copy, Clone)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// One allocation holds the managed tensor (first, so a pointer to it is a pointer to the whole), its
/// shape and strides, and the reference that keeps the buffer alive.
#[repr(C)]
struct Export<T> {
    managed: T,
    shape: [i64; 1],
    strides: [i64; 1],
    owner: Option<Py<PyAny>>,
}

const LEGACY_NAME: &CStr = c"dltensor";
const VERSIONED_NAME: &CStr = c"dltensor_versioned";

fn tensor(view: &RawView) -> DLTensor {
    DLTensor {
        data: view.addr as *mut c_void,
        device: DLDevice {
            device_type: KDL_CUDA,
            device_id: view.device as i32,
        },
        ndim: 1,
        dtype: DLDataType {
            code: 1,
            bits: 8,
            lanes: 1,
        }, // kDLUInt, 8 bits
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// Frees an [`Export`]: drops its reference to the buffer (taking the GIL, since a consumer may call the
/// deleter from any thread). Never unwinds.
///
/// # Safety
/// 1. `p` came from `Box::into_raw` of an `Export<T>` in [`export`] and is freed once.
#[allow(unsafe_code)]
unsafe fn free_export<T>(p: *mut Export<T>) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: point 1.
        let b = unsafe { Box::from_raw(p) };
        Python::attach(move |_py| drop(b));
    }));
}

/// DLPack's deleter of a legacy (`dltensor`) managed tensor made by [`export`]. Never unwinds.
///
/// # Safety
/// 1. `p` is null, or the `managed` field of an `Export<DLManagedTensor>` made by [`export`] (the deleter
///    is set on no other tensor), passed once (DLPack's rule: the owner calls the deleter once).
#[allow(unsafe_code)]
unsafe extern "C" fn delete_legacy(p: *mut DLManagedTensor) {
    if !p.is_null() {
        // SAFETY: the deleter is only set on the `managed` field (at offset 0, repr(C)) of an `Export` made
        // by `export`; DLPack calls it once.
        unsafe { free_export(p as *mut Export<DLManagedTensor>) }
    }
}

/// DLPack's deleter of a versioned (`dltensor_versioned`) managed tensor made by [`export`]. Never unwinds.
///
/// # Safety
/// 1. As point 1 of [`delete_legacy`], for an `Export<DLManagedTensorVersioned>`.
#[allow(unsafe_code)]
unsafe extern "C" fn delete_versioned(p: *mut DLManagedTensorVersioned) {
    if !p.is_null() {
        // SAFETY: as in `delete_legacy`.
        unsafe { free_export(p as *mut Export<DLManagedTensorVersioned>) }
    }
}

/// The capsule's destructor: a capsule still named `dltensor[_versioned]` was never consumed, so it still
/// owns its tensor and calls the tensor's deleter (the DLPack specification's rule); a consumed capsule
/// (renamed `used_dltensor[_versioned]`) owns nothing.
///
/// # Safety
/// 1. Called by Python (as a capsule's destructor) with the GIL held, on a live capsule made by
///    [`export`], once.
#[allow(unsafe_code)]
unsafe extern "C" fn capsule_destructor(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with the GIL held, on a live capsule.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, LEGACY_NAME.as_ptr()) == 1 {
            let p = pyo3::ffi::PyCapsule_GetPointer(capsule, LEGACY_NAME.as_ptr()) as *mut DLManagedTensor;
            if let Some(d) = p.as_ref().and_then(|m| m.deleter) {
                d(p);
            }
        } else if pyo3::ffi::PyCapsule_IsValid(capsule, VERSIONED_NAME.as_ptr()) == 1 {
            let p = pyo3::ffi::PyCapsule_GetPointer(capsule, VERSIONED_NAME.as_ptr()) as *mut DLManagedTensorVersioned;
            if let Some(d) = p.as_ref().and_then(|m| m.deleter) {
                d(p);
            }
        }
    }
}

fn export(py: Python<'_>, view: RawView, owner: Py<PyAny>, versioned: bool) -> PyResult<Py<PyAny>> {
    let size = view.size as i64;
    let (ptr, name): (*mut c_void, &CStr) = if versioned {
        let b = Box::new(Export {
            managed: DLManagedTensorVersioned {
                version: DLPackVersion { major: 1, minor: 0 },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_versioned),
                flags: 0,
                dl_tensor: tensor(&view),
            },
            shape: [size],
            strides: [1],
            owner: Some(owner),
        });
        let p = Box::into_raw(b);
        // SAFETY: `p` is the live allocation just made; the shape and strides it points into live in it.
        #[allow(unsafe_code)]
        unsafe {
            (*p).managed.manager_ctx = p as *mut c_void;
            (*p).managed.dl_tensor.shape = (*p).shape.as_mut_ptr();
            (*p).managed.dl_tensor.strides = (*p).strides.as_mut_ptr();
        }
        (p as *mut c_void, VERSIONED_NAME)
    } else {
        let b = Box::new(Export {
            managed: DLManagedTensor {
                dl_tensor: tensor(&view),
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_legacy),
            },
            shape: [size],
            strides: [1],
            owner: Some(owner),
        });
        let p = Box::into_raw(b);
        // SAFETY: as above.
        #[allow(unsafe_code)]
        unsafe {
            (*p).managed.manager_ctx = p as *mut c_void;
            (*p).managed.dl_tensor.shape = (*p).shape.as_mut_ptr();
            (*p).managed.dl_tensor.strides = (*p).strides.as_mut_ptr();
        }
        (p as *mut c_void, LEGACY_NAME)
    };
    // SAFETY: `ptr` is a live managed tensor whose ownership passes to the capsule (freed by
    // `capsule_destructor` unless a consumer takes it); `name` is a static C string; the GIL is held.
    #[allow(unsafe_code)]
    let capsule = unsafe { pyo3::ffi::PyCapsule_New(ptr, name.as_ptr(), Some(capsule_destructor)) };
    if capsule.is_null() {
        // The capsule was not made: the tensor is still ours to free.
        // SAFETY: `ptr` came from `Box::into_raw` above and nothing else holds it.
        #[allow(unsafe_code)]
        unsafe {
            if versioned {
                free_export(ptr as *mut Export<DLManagedTensorVersioned>)
            } else {
                free_export(ptr as *mut Export<DLManagedTensor>)
            }
        }
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `capsule` is a new, owned reference.
    #[allow(unsafe_code)]
    Ok(unsafe { Bound::from_owned_ptr(py, capsule) }.unbind())
}

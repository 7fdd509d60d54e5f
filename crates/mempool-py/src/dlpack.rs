//! DLPack export of a 1-D `uint8` view of device memory, shared by every buffer class
//! ([`crate::surface::device_view_pymethods`]): the argument checks of `__dlpack__`, the managed tensors
//! (legacy `dltensor` and versioned `dltensor_versioned`), their deleters and the capsule's destructor.

use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::prelude::*;

use crate::view::{order_streams, RawView};

/// The keyword arguments of `__dlpack__` (the DLPack protocol's).
pub(crate) struct DlpackArgs {
    /// The consumer's stream: -1 asks for no ordering, None means the legacy default stream.
    pub(crate) stream: Option<i64>,
    pub(crate) max_version: Option<(u32, u32)>,
    pub(crate) dl_device: Option<(i32, i32)>,
    pub(crate) copy: Option<bool>,
}

/// What `__dlpack__` does for every buffer class (`what` names it): checks the arguments, orders the
/// consumer's stream after the buffer's (unless it is -1), and returns a capsule whose tensor holds
/// `owner` (the buffer object, keeping its memory alive).
pub(crate) fn export_checked(
    py: Python<'_>,
    what: &str,
    view: RawView,
    owner: Py<PyAny>,
    args: DlpackArgs,
) -> PyResult<Py<PyAny>> {
    if args.copy == Some(true) {
        return Err(PyBufferError::new_err(format!(
            "{what} exports its memory without a copy; copy=True is not supported"
        )));
    }
    if let Some(d) = args.dl_device {
        if d != (KDL_CUDA, view.device as i32) {
            return Err(PyBufferError::new_err(format!(
                "the buffer is on (kDLCUDA, {}); it cannot be exported to device {d:?} without a copy",
                view.device
            )));
        }
    }
    match args.stream {
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
    let versioned = args.max_version.is_some_and(|(major, _)| major >= 1);
    export(py, view, owner, versioned)
}

/// DLPack's device type of CUDA memory.
pub(crate) const KDL_CUDA: i32 = 2;

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

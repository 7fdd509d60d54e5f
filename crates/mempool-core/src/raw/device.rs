//! Device queries: `cuDeviceGet*`, `cuDeviceCanAccessPeer`.
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__DEVICE.html>

use std::ffi::CStr;

use super::{call, sys, Result};

/// The number of visible devices. The driver must be initialised ([`super::init`]).
pub(crate) fn count() -> Result<usize> {
    let mut n = 0;
    // SAFETY: the driver is initialised (callers go through `init`); one int is written.
    unsafe { call!(cuDeviceGetCount(&mut n)) }?;
    Ok(n.max(0) as usize)
}

/// The device handle of `ordinal`, which the caller has checked against [`count`].
pub(crate) fn get(ordinal: usize) -> Result<sys::CUdevice> {
    let mut dev = 0;
    // SAFETY: the driver is initialised; one int is written; an out-of-range ordinal is an error code.
    unsafe { call!(cuDeviceGet(&mut dev, ordinal as i32)) }?;
    Ok(dev)
}

pub(crate) fn name(dev: sys::CUdevice) -> Result<String> {
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: `buf` holds 256 bytes and we pass that length; the driver NUL-terminates within it.
    unsafe { call!(cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev)) }?;
    // SAFETY: the buffer is NUL-terminated (the driver writes at most len - 1 characters and a NUL), and
    // the last byte was zero-initialised and never written past.
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

pub(crate) fn uuid(dev: sys::CUdevice) -> Result<[u8; 16]> {
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: `uuid` is a valid CUuuid to write into.
    unsafe { call!(cuDeviceGetUuid_v2(&mut uuid, dev)) }?;
    Ok(uuid.bytes.map(|b| b as u8))
}

pub(crate) fn total_memory(dev: sys::CUdevice) -> Result<usize> {
    let mut bytes = 0;
    // SAFETY: one usize is written.
    unsafe { call!(cuDeviceTotalMem_v2(&mut bytes, dev)) }?;
    Ok(bytes)
}

pub(crate) fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    // SAFETY: one int is written; `attr` is a valid enumerator of the binding.
    unsafe { call!(cuDeviceGetAttribute(&mut v, attr, dev)) }?;
    Ok(v)
}

/// Whether `dev` can map memory that lives on `peer`.
pub(crate) fn can_access_peer(dev: sys::CUdevice, peer: sys::CUdevice) -> Result<bool> {
    let mut v = 0;
    // SAFETY: one int is written; both handles came from `get`.
    unsafe { call!(cuDeviceCanAccessPeer(&mut v, dev, peer)) }?;
    Ok(v != 0)
}

//! [`DeviceVec`] and [`DeviceScalar`]: typed device memory for plain-old-data element types.

use std::marker::PhantomData;

use bytemuck::Pod;
use mempool_core::{DeviceAddr, StreamRef};

use super::buffer::DeviceBuffer;
use crate::error::{Error, Result};
use crate::resource::SharedResource;

/// A vector of `T` in device memory from a resource, RMM's `device_uvector`. `T` is plain old data
/// (`bytemuck::Pod`), so the bytes moved between host and device are always valid values.
#[derive(Debug)]
pub struct DeviceVec<'s, T: Pod> {
    buf: DeviceBuffer<'s>,
    _t: PhantomData<T>,
}

impl<'s, T: Pod> DeviceVec<'s, T> {
    /// `len` uninitialised elements (initialise them before reading; reading gives unspecified, valid
    /// values).
    pub fn new(len: usize, stream: impl Into<StreamRef<'s>>, mr: SharedResource) -> Result<Self> {
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| too_large::<T>(len))?;
        Ok(DeviceVec {
            buf: DeviceBuffer::new(bytes, stream, mr)?,
            _t: PhantomData,
        })
    }

    /// A copy of `data`.
    pub fn from_slice(data: &[T], stream: impl Into<StreamRef<'s>>, mr: SharedResource) -> Result<Self> {
        let buf = DeviceBuffer::from_host(bytemuck::cast_slice(data), stream, mr)?;
        Ok(DeviceVec { buf, _t: PhantomData })
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.buf.len() / size_of::<T>()
    }
    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device address of element 0.
    pub fn ptr(&self) -> DeviceAddr {
        self.buf.ptr()
    }
    /// The untyped buffer underneath.
    pub fn as_buffer(&self) -> &DeviceBuffer<'s> {
        &self.buf
    }

    /// Copies the elements to a `Vec` (waits).
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); self.len()];
        self.buf.copy_to_host(0, bytemuck::cast_slice_mut(&mut v))?;
        Ok(v)
    }

    /// Copies `data` to elements `start..start+data.len()` (waits).
    pub fn copy_from_slice(&self, start: usize, data: &[T]) -> Result<()> {
        let offset = start.checked_mul(size_of::<T>()).ok_or_else(|| too_large::<T>(start))?;
        Ok(self.buf.copy_from_host(offset, bytemuck::cast_slice(data))?)
    }

    /// Element `i` (waits).
    pub fn get(&self, i: usize) -> Result<T> {
        let mut v = [T::zeroed()];
        self.buf
            .copy_to_host(i * size_of::<T>(), bytemuck::cast_slice_mut(&mut v))?;
        Ok(v[0])
    }

    /// Sets element `i` (waits).
    pub fn set(&self, i: usize, value: T) -> Result<()> {
        self.copy_from_slice(i, &[value])
    }

    /// Resizes to `len` elements (new ones uninitialised), in stream order.
    pub fn resize(&mut self, len: usize) -> Result<()> {
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| too_large::<T>(len))?;
        self.buf.resize(bytes)
    }
}

fn too_large<T>(len: usize) -> Error {
    Error::Unsupported {
        resource: "DeviceVec",
        reason: format!("{len} elements of {} bytes overflow", size_of::<T>()),
    }
}

/// One `T` in device memory, RMM's `device_scalar`: a place for a kernel's single result.
#[derive(Debug)]
pub struct DeviceScalar<'s, T: Pod> {
    vec: DeviceVec<'s, T>,
}

impl<'s, T: Pod> DeviceScalar<'s, T> {
    /// A scalar holding `value`.
    pub fn new(value: T, stream: impl Into<StreamRef<'s>>, mr: SharedResource) -> Result<Self> {
        Ok(DeviceScalar {
            vec: DeviceVec::from_slice(&[value], stream, mr)?,
        })
    }
    /// The value (waits for the stream's work so far).
    pub fn value(&self) -> Result<T> {
        self.vec.get(0)
    }
    /// Sets the value (waits).
    pub fn set_value(&self, value: T) -> Result<()> {
        self.vec.set(0, value)
    }
    /// The device address.
    pub fn ptr(&self) -> DeviceAddr {
        self.vec.ptr()
    }
}

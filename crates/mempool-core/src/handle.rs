//! A raw driver handle that may cross threads.

/// A raw pointer-typed CUDA handle (`CUstream`, `CUevent`, `CUmemoryPool`, `CUcontext`, ...).
///
/// The driver API is thread-safe: any thread may pass a handle to the driver, and the handle's owner
/// (the RAII type holding it) decides when it is destroyed. So the owners may be `Send` and `Sync`,
/// which raw pointers are not; this wrapper says so in one place.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct Handle<T>(*mut T);

impl<T> Handle<T> {
    pub(crate) fn new(raw: *mut T) -> Self {
        Handle(raw)
    }
    pub(crate) fn get(&self) -> *mut T {
        self.0
    }
}

// SAFETY: the pointer is an opaque driver handle, never dereferenced by Rust code; the CUDA driver
// API accepts handles from any thread (see "Thread safety" in the driver API's introduction).
#[allow(unsafe_code)]
unsafe impl<T> Send for Handle<T> {}
// SAFETY: as above; shared references only pass the handle value to the driver.
#[allow(unsafe_code)]
unsafe impl<T> Sync for Handle<T> {}

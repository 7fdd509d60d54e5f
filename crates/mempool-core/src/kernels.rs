//! Built-in check kernels (hand-written PTX, JIT-compiled by the driver): fill, copy and add over
//! 32-bit elements, and a late fill that spins first. Tests and examples use them to do real device work on pool memory without nvcc at
//! build time. Behind the `testing` feature.

use std::ffi::c_void;
use std::sync::Arc;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::module::{LaunchConfig, Module};
use crate::stream::StreamRef;
use crate::types::DeviceAddr;

/// The PTX source of the kernels.
pub const PTX: &str = include_str!("kernels.ptx");

const BLOCK: u32 = 256;

/// The check kernels, loaded in one context.
///
/// ```no_run
/// # fn main() -> mempool_core::Result<()> {
/// use mempool_core::{kernels::CheckKernels, Device, MemPool, PoolProps, Stream};
/// let dev = Device::get(0)?;
/// let ctx = dev.context()?;
/// let kernels = CheckKernels::load(&ctx)?;
/// let pool = MemPool::new(&dev, &PoolProps::new())?;
/// let stream = Stream::new(&ctx)?;
/// let buf = pool.alloc(1024 * 4, stream.as_ref())?;
/// // SAFETY: `buf` holds 1024 u32s and lives until the stream is synchronized.
/// unsafe { kernels.iota(buf.ptr(), 1024, 7, stream.as_ref())? };
/// let mut host = vec![0u8; 4096];
/// buf.copy_to_host(0, &mut host)?;
/// assert_eq!(u32::from_ne_bytes(host[4..8].try_into().unwrap()), 8);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct CheckKernels {
    module: Module,
}

impl CheckKernels {
    /// Loads the kernels into `ctx`.
    pub fn load(ctx: &Arc<Context>) -> Result<CheckKernels> {
        Ok(CheckKernels {
            module: Module::from_ptx(ctx, PTX)?,
        })
    }

    /// Launches kernel `name` over `n` elements with `params`.
    ///
    /// # Safety
    /// 1. `params` holds one pointer per parameter of `name`'s signature in kernels.ptx, in order, each to
    ///    a live value of the parameter's width.
    /// 2. The addresses among them are what the public wrapper's `# Safety` asks of its caller: device
    ///    memory that work on `stream` may access for `n` 4-byte aligned `u32`s until the kernel completes.
    #[allow(unsafe_code)]
    unsafe fn launch(&self, name: &str, n: usize, stream: StreamRef<'_>, params: &mut [*mut c_void]) -> Result<()> {
        if n >= (u32::MAX as usize) {
            return Err(Error::InvalidArgument(format!(
                "{n} elements is more than the check kernels index"
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.module.function(name)?;
        // SAFETY: points 1 and 2 are the caller's; the grid covers `n` elements, the kernels check the bound.
        unsafe { f.launch(LaunchConfig::for_elements(n, BLOCK), stream, params) }
    }

    /// `dst[i] = base + i` for `i < n` (wrapping), ordered on `stream`.
    ///
    /// # Safety
    /// 1. `dst` is device memory writable by work on `stream`, 4-byte aligned, holding `n` `u32`s, until
    ///    the kernel completes.
    #[allow(unsafe_code)]
    pub unsafe fn iota(&self, dst: DeviceAddr, n: usize, base: u32, stream: StreamRef<'_>) -> Result<()> {
        let (mut d, mut b, mut len) = (dst.0, base, n as u64);
        // SAFETY: 1. `mempool_iota_u32(u64 dst, u32 base, u64 n)`: three pointers to values of those widths.
        // 2. point 1 of this function.
        unsafe {
            self.launch(
                "mempool_iota_u32",
                n,
                stream,
                &mut [
                    &mut d as *mut u64 as *mut c_void,
                    &mut b as *mut u32 as *mut c_void,
                    &mut len as *mut u64 as *mut c_void,
                ],
            )
        }
    }

    /// `dst[i] = src[i]` for `i < n`, each element loaded by a thread (so a peer's memory is read through
    /// its mapping), ordered on `stream`.
    ///
    /// # Safety
    /// 1. Both ranges hold `n` 4-byte aligned `u32`s that work on `stream` may access (the source readable
    ///    from the stream's device), until the kernel completes.
    #[allow(unsafe_code)]
    pub unsafe fn copy(&self, dst: DeviceAddr, src: DeviceAddr, n: usize, stream: StreamRef<'_>) -> Result<()> {
        let (mut d, mut s, mut len) = (dst.0, src.0, n as u64);
        // SAFETY: 1. `mempool_copy_u32(u64 dst, u64 src, u64 n)`: three pointers to values of those widths.
        // 2. point 1 of this function.
        unsafe {
            self.launch(
                "mempool_copy_u32",
                n,
                stream,
                &mut [
                    &mut d as *mut u64 as *mut c_void,
                    &mut s as *mut u64 as *mut c_void,
                    &mut len as *mut u64 as *mut c_void,
                ],
            )
        }
    }

    /// `buf[i] += value` for `i < n` (wrapping), ordered on `stream`.
    ///
    /// # Safety
    /// 1. As for [`CheckKernels::iota`].
    #[allow(unsafe_code)]
    pub unsafe fn add(&self, buf: DeviceAddr, n: usize, value: u32, stream: StreamRef<'_>) -> Result<()> {
        let (mut p, mut v, mut len) = (buf.0, value, n as u64);
        // SAFETY: 1. `mempool_add_u32(u64 buf, u32 value, u64 n)`: three pointers to values of those widths.
        // 2. point 1 of this function.
        unsafe {
            self.launch(
                "mempool_add_u32",
                n,
                stream,
                &mut [
                    &mut p as *mut u64 as *mut c_void,
                    &mut v as *mut u32 as *mut c_void,
                    &mut len as *mut u64 as *mut c_void,
                ],
            )
        }
    }

    /// `buf[i] = value` for `i < n`, each element written only after its thread has spun for `ns`
    /// nanoseconds of the GPU's global timer, ordered on `stream`: work that keeps the range in use (and
    /// writes it last) long after the host queued it, to test that nothing else gets the memory meanwhile.
    /// Each block spins once: keep `n` within one wave of 256-thread blocks (a few hundred thousand
    /// elements on current GPUs), or the blocks that wait for a free multiprocessor spin after the first.
    ///
    /// # Safety
    /// 1. As for [`CheckKernels::iota`].
    #[allow(unsafe_code)]
    pub unsafe fn late_fill(
        &self,
        buf: DeviceAddr,
        n: usize,
        value: u32,
        ns: u64,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        let (mut p, mut v, mut len, mut t) = (buf.0, value, n as u64, ns);
        // SAFETY: 1. `mempool_late_fill_u32(u64 dst, u32 value, u64 n, u64 ns)`: four pointers to values of
        // those widths. 2. point 1 of this function.
        unsafe {
            self.launch(
                "mempool_late_fill_u32",
                n,
                stream,
                &mut [
                    &mut p as *mut u64 as *mut c_void,
                    &mut v as *mut u32 as *mut c_void,
                    &mut len as *mut u64 as *mut c_void,
                    &mut t as *mut u64 as *mut c_void,
                ],
            )
        }
    }
}

/// Reads native-endian `u32`s from bytes (a helper for checking kernel results on the host).
pub fn u32s(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

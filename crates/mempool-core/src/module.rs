//! Loading PTX and launching kernels: what tests, examples and the bench harness need to run real
//! device code without nvcc at build time.
//! <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MODULE.html>

use std::ffi::{c_void, CString};
use std::sync::Arc;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::handle::Handle;
use crate::raw::{self, sys};
use crate::stream::StreamRef;

/// A loaded module (PTX, JIT-compiled by the driver for the device), unloaded on drop.
#[derive(Debug)]
pub struct Module {
    ctx: Arc<Context>,
    raw: Handle<sys::CUmod_st>,
}

/// A kernel of a [`Module`].
#[derive(Debug)]
pub struct Function<'m> {
    module: &'m Module,
    raw: Handle<sys::CUfunc_st>,
}

/// A launch shape.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks per grid.
    pub grid: (u32, u32, u32),
    /// Threads per block.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory in bytes.
    pub shared_mem: u32,
}

impl LaunchConfig {
    /// A 1-D launch covering `n` threads with `block` threads per block (at least one block).
    pub fn for_elements(n: usize, block: u32) -> LaunchConfig {
        let blocks = n.div_ceil(block as usize).max(1) as u32;
        LaunchConfig {
            grid: (blocks, 1, 1),
            block: (block, 1, 1),
            shared_mem: 0,
        }
    }
}

impl Module {
    /// Loads PTX text into `ctx` (`cuModuleLoadData`).
    pub fn from_ptx(ctx: &Arc<Context>, ptx: &str) -> Result<Module> {
        let image = CString::new(ptx).map_err(|_| Error::InvalidArgument("PTX text contains a NUL byte".into()))?;
        let _g = ctx.bind()?;
        let raw = raw::module::load_data(&image)?;
        Ok(Module {
            ctx: ctx.clone(),
            raw: Handle::new(raw),
        })
    }

    /// The kernel named `name` (its `.entry` name).
    pub fn function(&self, name: &str) -> Result<Function<'_>> {
        let cname = CString::new(name).map_err(|_| Error::InvalidArgument("kernel name contains a NUL byte".into()))?;
        // SAFETY: the module is owned by `self`, which the function borrows.
        #[allow(unsafe_code)]
        let raw = unsafe { raw::module::get_function(self.raw.get(), &cname) }?;
        Ok(Function {
            module: self,
            raw: Handle::new(raw),
        })
    }

    /// The context the module is loaded in.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // Launches borrow the module only for the call; queued kernels keep running after an unload is
        // requested only if the driver allows it, so wait for the context's work first.
        let r = self.ctx.bind().and_then(|_g| {
            raw::context::synchronize()?;
            // SAFETY: owned by `self`, unloaded once; no function handle outlives `self` (they borrow it),
            // and queued work finished above.
            #[allow(unsafe_code)]
            let r = unsafe { raw::module::unload(self.raw.get()) };
            Ok(r?)
        });
        if let Err(e) = r {
            crate::drop_errors::record(e);
        }
    }
}

impl Function<'_> {
    /// Launches the kernel on `stream` (`cuLaunchKernel`).
    ///
    /// # Safety
    /// 1. `params` holds one pointer per kernel parameter, each to a value of exactly that parameter's
    ///    type (e.g. `&mut u64` for a `.u64` pointer parameter).
    /// 2. Every address the kernel dereferences is valid for what it does with it, in `stream`'s order.
    /// 3. `stream` belongs to the module's context (or is a special handle).
    #[allow(unsafe_code)]
    pub unsafe fn launch(&self, cfg: LaunchConfig, stream: StreamRef<'_>, params: &mut [*mut c_void]) -> Result<()> {
        let _g = self.module.ctx.bind()?;
        // SAFETY: points 1 to 3 are the caller's; the function belongs to a live module.
        let r = unsafe {
            raw::module::launch(
                self.raw.get(),
                cfg.grid,
                cfg.block,
                cfg.shared_mem,
                stream.as_raw(),
                params,
            )
        };
        Ok(r?)
    }
}

//! The harness's device code: CUDA C under `kernels/`, compiled to PTX by `kernels/build-ptx.sh` and
//! committed; loaded here through the driver (`cuModuleLoadData`), so building needs no nvcc.
//!
//! The host twins of the device hash functions ([`mix32`], [`hash2`]) let workloads check kernel
//! results on the host.

use std::ffi::c_void;
use std::sync::Arc;

use mempool_core::{Context, DeviceAddr, Function, LaunchConfig, Module, StreamRef};

use crate::error::{Error, Result};

/// `kernels/work.ptx`: the multi-stream and peer workloads' kernels.
pub(crate) const WORK_PTX: &str = include_str!("../kernels/work.ptx");
/// `kernels/query.ptx`: the query workload's columnar operators.
pub(crate) const QUERY_PTX: &str = include_str!("../kernels/query.ptx");

/// Threads per block of every launch.
pub(crate) const BLOCK: u32 = 256;
/// Elements per block of the scan and radix-sort kernels (`SCAN_TILE`, `SORT_TILE` in query.cu).
pub(crate) const TILE: usize = 1024;
/// Digits of a radix-sort pass (`RADIX_DIGITS` in query.cu).
pub(crate) const RADIX_DIGITS: usize = 256;
/// The empty slot of the device hash tables (`EMPTY_KEY` in query.cu); no key may take it.
pub(crate) const EMPTY_KEY: u32 = u32::MAX;

/// The environment variable naming a directory to load `work.ptx` and `query.ptx` from at run time
/// instead of the copies built into the binary: for running freshly compiled kernels without a rebuild
/// (`build-ptx.sh` on the GPU machine, then the packed binary, in one go).
pub(crate) const PTX_DIR_VAR: &str = "MEMPOOL_BENCH_PTX_DIR";

/// Loads `kernels/{file}` (`work.ptx` or `query.ptx`) into `ctx`: the copy built into the binary, or
/// the file in the directory that `MEMPOOL_BENCH_PTX_DIR` names when that is set.
pub fn load(ctx: &Arc<Context>, file: &'static str) -> Result<Module> {
    if let Some(dir) = std::env::var_os(PTX_DIR_VAR) {
        let path = std::path::Path::new(&dir).join(file);
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        return load_module(ctx, file, &text);
    }
    let text = match file {
        "work.ptx" => WORK_PTX,
        "query.ptx" => QUERY_PTX,
        other => return Err(Error::Usage(format!("no kernel file `{other}` (work.ptx, query.ptx)"))),
    };
    load_module(ctx, file, text)
}

/// Loads PTX `text` (from `kernels/{file}`) into `ctx`; an empty file (the placeholder committed before
/// nvcc has run) is a clear error rather than a driver one.
pub(crate) fn load_module(ctx: &Arc<Context>, file: &'static str, text: &str) -> Result<Module> {
    check_ptx(file, text)?;
    Ok(Module::from_ptx(ctx, text)?)
}

/// Whether PTX text is usable: not empty and not only comments.
pub fn check_ptx(file: &'static str, text: &str) -> Result<()> {
    let has_code = text
        .lines()
        .map(str::trim)
        .any(|l| !l.is_empty() && !l.starts_with("//"));
    if has_code {
        Ok(())
    } else {
        Err(Error::EmptyPtx { file })
    }
}

/// Chris Wellons' lowbias32, as `mix32` in kernels/common.cuh.
pub fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x
}

/// The pseudo-random value of row `i` of a column seeded with `seed`, as `hash2` in common.cuh.
pub fn hash2(seed: u32, i: u64) -> u32 {
    mix32((i as u32) ^ mix32(seed ^ mix32((i >> 32) as u32)))
}

/// `bench_work_u32` on one element: `rounds` dependent mixes.
pub(crate) fn work(mut x: u32, rounds: u32) -> u32 {
    for r in 0..rounds {
        x = mix32(x.wrapping_add(r));
    }
    x
}

/// A kernel argument, passed by value.
#[derive(Copy, Clone, Debug)]
pub(crate) enum Arg {
    /// A 32-bit integer parameter.
    U32(u32),
    /// A 64-bit integer or pointer parameter.
    U64(u64),
}

impl From<DeviceAddr> for Arg {
    fn from(p: DeviceAddr) -> Arg {
        Arg::U64(p.0)
    }
}

/// One element per thread over `n` elements.
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig::for_elements(n, BLOCK)
}

/// Grid-stride kernels (reductions, copies): at most 2048 blocks.
pub(crate) fn strided(n: usize) -> LaunchConfig {
    LaunchConfig::for_elements(n.min(2048 * BLOCK as usize), BLOCK)
}

/// One block of [`BLOCK`] threads per tile of [`TILE`] elements.
pub(crate) fn tiled(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid: (n.div_ceil(TILE).max(1) as u32, 1, 1),
        block: (BLOCK, 1, 1),
        shared_mem: 0,
    }
}

/// Launches `f` with `args`.
///
/// # Safety
/// 1. `args` match the kernel's parameters in number, order and width (pointers and 64-bit integers
///    as [`Arg::U64`], 32-bit integers as [`Arg::U32`]).
/// 2. Every address the kernel reads or writes for this launch shape is valid device memory for that
///    use, ordered on `stream`, until the kernel completes.
/// 3. `stream` belongs to the function's context.
#[allow(unsafe_code)]
pub(crate) unsafe fn launch(f: &Function<'_>, cfg: LaunchConfig, stream: StreamRef<'_>, args: &[Arg]) -> Result<()> {
    let mut values: Vec<Arg> = args.to_vec();
    let mut params: Vec<*mut c_void> = values
        .iter_mut()
        .map(|a| match a {
            Arg::U32(v) => v as *mut u32 as *mut c_void,
            Arg::U64(v) => v as *mut u64 as *mut c_void,
        })
        .collect();
    // SAFETY: points 1 to 3 are the caller's; `params` points into `values`, which outlives the call
    // (the driver copies parameter values at launch).
    unsafe { f.launch(cfg, stream, &mut params) }?;
    Ok(())
}

/// Declares a struct of kernels, one field per kernel with the symbol it is looked up by, and its `new`
/// (looks every kernel up in a module, in field order).
macro_rules! kernels {
    (
        $(#[$doc:meta])*
        $vis:vis struct $name:ident from $ptx:ident {
            $($(#[$field_doc:meta])* $field:ident: $symbol:literal,)*
        }
    ) => {
        $(#[$doc])*
        #[derive(Debug)]
        $vis struct $name<'m> {
            /// The module the kernels were looked up in.
            module: &'m Module,
            $($(#[$field_doc])* pub(crate) $field: Function<'m>,)*
        }

        impl<'m> $name<'m> {
            #[doc = concat!("Looks the kernels up in `module` (loaded from `", stringify!($ptx), "`, see [`load`]).")]
            $vis fn new(module: &'m Module) -> Result<$name<'m>> {
                Ok($name {
                    module,
                    $($field: module.function($symbol)?,)*
                })
            }

            /// The context the kernels were loaded into: launches go to streams of this context.
            $vis fn context(&self) -> &'m Arc<Context> {
                self.module.context()
            }
        }
    };
}

kernels! {
    /// The kernels of `work.cu`.
    pub(crate) struct WorkKernels from WORK_PTX {
        /// `bench_fill_hash_u32(out, n, seed)`.
        fill_hash: "bench_fill_hash_u32",
        /// `bench_work_u32(buf, n, rounds)`.
        work: "bench_work_u32",
        /// `bench_sum_u32(buf, n, out)`.
        sum: "bench_sum_u32",
        /// `bench_copy_u128(dst, src, n16)`.
        copy: "bench_copy_u128",
    }
}

kernels! {
    /// The kernels of `query.cu`.
    pub struct QueryKernels from QUERY_PTX {
        /// `q_gen_u32(out, n, seed, lo, span)`.
        gen: "q_gen_u32",
        /// `q_iota_u32(out, n, base)`.
        iota: "q_iota_u32",
        /// `q_flags_range(col, n, lo, hi, flags)`.
        flags_range: "q_flags_range",
        /// `q_flags_and(flags, other, n)`.
        flags_and: "q_flags_and",
        /// `q_flags_head(sorted, n, flags)`.
        flags_head: "q_flags_head",
        /// `q_flags_occupied(table_keys, n, flags)`.
        flags_occupied: "q_flags_occupied",
        /// `q_mul_u32(a, b, n, out)`.
        mul: "q_mul_u32",
        /// `q_combine_u32(a, b, n, mul, out)`.
        combine: "q_combine_u32",
        /// `q_scan_block(in, out, n, block_sums)`.
        scan_block: "q_scan_block",
        /// `q_scan_add(data, n, tile_offsets)`.
        scan_add: "q_scan_add",
        /// `q_scan_total(flags, offsets, n, total)`.
        scan_total: "q_scan_total",
        /// `q_compact_u32(in, flags, offsets, n, out)`.
        compact_u32: "q_compact_u32",
        /// `q_compact_u64(in, flags, offsets, n, out)`.
        compact_u64: "q_compact_u64",
        /// `q_compact_index(flags, offsets, n, out)`.
        compact_index: "q_compact_index",
        /// `q_gather_u32(col, idx, m, out)`.
        gather: "q_gather_u32",
        /// `q_hash_build(keys, n, table_keys, table_rows, mask)`.
        hash_build: "q_hash_build",
        /// `q_hash_probe(keys, n, table_keys, table_rows, mask, build_rows, flags)`.
        hash_probe: "q_hash_probe",
        /// `q_groupby_sum(keys, vals, n, table_keys, table_sums, table_counts, mask)`.
        groupby_sum: "q_groupby_sum",
        /// `q_radix_hist(keys, n, shift, hist, nblocks)`.
        radix_hist: "q_radix_hist",
        /// `q_radix_scatter(keys, vals, n, shift, offsets, keys_out, vals_out, nblocks)`.
        radix_scatter: "q_radix_scatter",
        /// `q_sum_u32(vals, n, out)`.
        sum_u32: "q_sum_u32",
        /// `q_sum_u64(vals, n, out)`.
        sum_u64: "q_sum_u64",
        /// `q_count_unsorted(keys, n, out)`.
        count_unsorted: "q_count_unsorted",
    }
}

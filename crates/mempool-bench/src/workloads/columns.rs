//! Device columns and the columnar operators the query workload strings together. Every column and
//! every intermediate is allocated through the resource under test and freed (in stream order) when it
//! drops, as cuDF's columns are: a pipeline allocates and frees many buffers of many sizes.
//!
//! The safe operators cannot reach memory outside their columns: the pairing of stream and kernels is
//! checked by [`Exec::new`], flags are a type of their own ([`Flags`], every value 0 or 1, made only by
//! the flag operators) and a [`Selection`] borrows the flags it was computed from, so a compaction
//! always writes within the column it allocates for it. The one operator whose bounds depend on the
//! values of a column, `Exec::gather`, is `unsafe`.

#![allow(unsafe_code)]

use std::cell::RefCell;
use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::Arc;

use mempool_core::{memory, Context, DeviceAddr, StreamRef};
use mempool_rmm::MemoryResource;

use crate::error::{Error, Result};
use crate::kernels::{elementwise, launch, strided, tiled, Arg, QueryKernels, EMPTY_KEY, RADIX_DIGITS, TILE};

/// Element types of columns.
pub trait Element: Copy + Default + 'static {
    /// Bytes per element.
    const SIZE: usize;
    /// Reads one element from native-endian bytes.
    fn read(bytes: &[u8]) -> Self;
}

impl Element for u32 {
    const SIZE: usize = 4;
    fn read(b: &[u8]) -> u32 {
        u32::from_ne_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl Element for u64 {
    const SIZE: usize = 8;
    fn read(b: &[u8]) -> u64 {
        u64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
    }
}

/// Where the operators run: a resource, a stream, the loaded kernels.
///
/// Invariant: `stream` belongs to `ctx`, the context `k` was loaded into (checked by [`Exec::new`]).
pub struct Exec<'a> {
    /// The resource every buffer comes from.
    pub(crate) mr: &'a dyn MemoryResource,
    /// The stream all work and all frees are ordered on.
    pub(crate) stream: StreamRef<'a>,
    /// The context of the stream and kernels.
    pub(crate) ctx: &'a Arc<Context>,
    /// The kernels.
    pub(crate) k: &'a QueryKernels<'a>,
    /// The first error a column's drop met (drops cannot return one).
    drop_error: RefCell<Option<Error>>,
    /// Buffers allocated so far.
    allocations: std::cell::Cell<u64>,
}

/// A device column of `len` elements of `T`, freed through the resource on the stream when dropped.
///
/// Invariant: `ptr` is a live allocation of `exec.mr` of `len * T::SIZE` bytes (null when `len` is 0),
/// usable by work on `exec.stream`.
pub struct Col<'e, T: Element> {
    exec: &'e Exec<'e>,
    ptr: DeviceAddr,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Element> Col<'_, T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address.
    pub fn ptr(&self) -> DeviceAddr {
        self.ptr
    }

    fn arg(&self) -> Arg {
        Arg::U64(self.ptr.0)
    }

    /// Copies the column to the host (waits for the stream).
    pub fn download(&self) -> Result<Vec<T>> {
        let mut bytes = vec![0u8; self.len * T::SIZE];
        if self.len > 0 {
            // SAFETY: the column's invariant: `len * SIZE` bytes of device memory readable on the stream.
            unsafe { memory::copy_to_host(self.exec.ctx, &mut bytes, self.ptr, self.exec.stream) }?;
        }
        Ok(bytes.chunks_exact(T::SIZE).map(T::read).collect())
    }
}

impl<T: Element> Drop for Col<'_, T> {
    fn drop(&mut self) {
        // SAFETY: the column owns `ptr`, a live allocation of `exec.mr` of `len * T::SIZE` bytes (the struct
        // invariant), freed once here; every kernel and copy that used it was queued on `exec.stream`.
        #[allow(unsafe_code)]
        let r = unsafe { self.exec.mr.deallocate(self.ptr, self.len * T::SIZE, self.exec.stream) };
        if let Err(e) = r {
            self.exec.drop_error.borrow_mut().get_or_insert(e.into());
        }
    }
}

/// A column of flags, one per row, each 0 or 1: made only by the flag operators ([`Exec::flags_range`],
/// `Exec::flags_head`, [`Exec::probe`]) and changed only by [`Exec::flags_and`], which keeps every
/// value 0 or 1. Reads as a `Col<u32>`.
///
/// Invariant: every element of the column is 0 or 1 once the work queued on the stream before any use
/// has run.
pub struct Flags<'e>(Col<'e, u32>);

impl<'e> Deref for Flags<'e> {
    type Target = Col<'e, u32>;

    fn deref(&self) -> &Col<'e, u32> {
        &self.0
    }
}

/// The rows a filter keeps: the exclusive scan of its flags and their count. It borrows the flags it
/// was computed from, so they cannot change (or be swapped for others) while it is used.
///
/// Invariant: `offsets` is the exclusive scan of `flags` (queued on the stream) and `count` is the
/// number of flags set, so `offsets[i] < count` for every row `i` whose flag is set.
///
/// Flags are combined before they are selected on:
///
/// ```
/// use mempool_bench::workloads::columns::{Col, Exec};
///
/// fn kept<'a>(x: &'a Exec<'a>, col: &Col<'a, u32>) -> mempool_bench::Result<Col<'a, u32>> {
///     let mut flags = x.flags_range(col, 0, 100)?;
///     let other = x.flags_range(col, 50, 200)?;
///     x.flags_and(&mut flags, &other)?;
///     let sel = x.select(&flags)?;
///     x.compact(col, &sel)
/// }
/// ```
///
/// Changing the flags under a selection (which would leave its offsets and count stale, and the
/// compaction writing past its output) does not compile:
///
/// ```compile_fail,E0502
/// use mempool_bench::workloads::columns::{Col, Exec};
///
/// fn kept<'a>(x: &'a Exec<'a>, col: &Col<'a, u32>) -> mempool_bench::Result<Col<'a, u32>> {
///     let mut flags = x.flags_range(col, 0, 100)?;
///     let other = x.flags_range(col, 50, 200)?;
///     let sel = x.select(&flags)?;
///     x.flags_and(&mut flags, &other)?;
///     x.compact(col, &sel)
/// }
/// ```
pub struct Selection<'s, 'e> {
    /// The flags the selection was computed from.
    flags: &'s Flags<'e>,
    /// `offsets[i]`: where row `i` goes if kept.
    pub(crate) offsets: Col<'e, u32>,
    /// Rows kept.
    pub count: usize,
}

impl<'e> Selection<'_, 'e> {
    /// The flags the selection was computed from.
    pub fn flags(&self) -> &Flags<'e> {
        self.flags
    }
}

/// A hash table built on the device (open addressing).
pub struct HashTable<'e> {
    keys: Col<'e, u32>,
    rows: Col<'e, u32>,
    mask: u32,
}

/// The result of a group-by: one row per distinct key, in no particular order.
pub struct Groups<'e> {
    /// The keys.
    pub keys: Col<'e, u32>,
    /// Sums of the values per key.
    pub sums: Col<'e, u64>,
    /// Rows per key.
    pub counts: Col<'e, u32>,
}

fn capacity_for(n: usize) -> usize {
    (2 * n).max(64).next_power_of_two()
}

impl<'a> Exec<'a> {
    /// Operators over `mr` on `stream`, with the kernels `k`. The stream must be a stream of the
    /// context the kernels were loaded into (an [`Error::Usage`] otherwise, naming both contexts), and
    /// `mr` a resource of that context's device.
    pub fn new(mr: &'a dyn MemoryResource, stream: StreamRef<'a>, k: &'a QueryKernels<'a>) -> Result<Self> {
        let ctx = k.context();
        match stream.context() {
            Some(c) if c.as_raw() == ctx.as_raw() => {}
            Some(c) => {
                return Err(Error::Usage(format!(
                    "the stream belongs to context {:p} (device {}), the kernels were loaded into context {:p} \
                     (device {}): the operators launch them on the stream, so both must be of one context",
                    c.as_raw(),
                    c.device().ordinal(),
                    ctx.as_raw(),
                    ctx.device().ordinal()
                )))
            }
            None => {
                return Err(Error::Usage(
                    "the stream knows no context (a special or raw handle): give the operators a stream of the \
                     kernels' context (`Stream::as_ref`, or `StreamRef::in_context`)"
                        .into(),
                ))
            }
        }
        Ok(Exec {
            mr,
            stream,
            ctx,
            k,
            drop_error: RefCell::new(None),
            allocations: std::cell::Cell::new(0),
        })
    }

    /// Buffers allocated so far.
    pub(crate) fn allocations(&self) -> u64 {
        self.allocations.get()
    }

    /// The first error a column met when it was freed, if any (taken).
    pub fn take_drop_error(&self) -> Option<Error> {
        self.drop_error.borrow_mut().take()
    }

    /// An uninitialized column of `len` elements.
    pub(crate) fn alloc<T: Element>(&'a self, len: usize) -> Result<Col<'a, T>> {
        let ptr = self.mr.allocate(len * T::SIZE, self.stream)?;
        self.allocations.set(self.allocations.get() + 1);
        Ok(Col {
            exec: self,
            ptr,
            len,
            _t: PhantomData,
        })
    }

    /// Launches `f` (one of `self.k`'s kernels) with `args` on the Exec's stream.
    ///
    /// # Safety
    /// 1. `args` are `f`'s parameters in number, order and width (as query.cu declares them).
    /// 2. Every element the kernel reads or writes for this launch shape and these arguments lies within a
    ///    live column of this Exec (or a scalar of [`Exec::scalar_u64`]) that stays alive, in the stream's
    ///    order, until the kernel has run: the columns' drops free in stream order, so a column alive at
    ///    the launch is enough.
    unsafe fn run(&self, f: &mempool_core::Function<'_>, cfg: mempool_core::LaunchConfig, args: &[Arg]) -> Result<()> {
        // SAFETY: points 1 and 2 of `launch` are this function's points 1 and 2; point 3: `self.stream`
        // belongs to `self.ctx`, the context of the kernels (the Exec's invariant, checked by `new`).
        unsafe { launch(f, cfg, self.stream, args) }
    }

    /// A new column of `len` elements written by `f`, launched one thread per element of `n`
    /// ([`elementwise`]) with `args(out)` (`out`: the new column's argument); no launch when `len` is 0.
    ///
    /// # Safety
    /// 1. `args(out)` are `f`'s parameters in number, order and width, `out` among them.
    /// 2. Launched one thread per element of `n`, `f` reads and writes only within live columns of this
    ///    Exec, writing at most `len` elements of `T` through `out`.
    unsafe fn output<T: Element, const N: usize>(
        &'a self,
        len: usize,
        f: &mempool_core::Function<'_>,
        n: usize,
        args: impl FnOnce(Arg) -> [Arg; N],
    ) -> Result<Col<'a, T>> {
        let out = self.alloc::<T>(len)?;
        if len > 0 {
            // SAFETY: 1: the caller's point 1; 2: the caller's point 2, with `out` a live column of `len`
            // elements of `T` (it is returned, so it outlives the launch in stream order).
            unsafe { self.run(f, elementwise(n), &args(out.arg())) }?;
        }
        Ok(out)
    }

    /// The rows of `col` that `sel` keeps, by `f`.
    ///
    /// # Safety
    /// 1. `f` is `q_compact_u32` when `T` is `u32`, `q_compact_u64` when `T` is `u64` (parameters
    ///    `in, flags, offsets, n, out`; writes `out[offsets[i]] = in[i]` where `flags[i]` is set).
    unsafe fn compact_with<T: Element>(
        &'a self,
        f: &mempool_core::Function<'_>,
        what: &str,
        col: &Col<'a, T>,
        sel: &Selection<'_, 'a>,
    ) -> Result<Col<'a, T>> {
        let flags = sel.flags;
        assert_eq!(
            col.len, flags.len,
            "{what}: the column and the selection's flags differ in length"
        );
        // SAFETY: 1: point 1, the arguments in that order; 2: the kernel reads `col`, `flags` and
        // `offsets` (each `col.len` elements: the assert above and the Selection's invariant) and writes
        // `out[offsets[i]]` only where `flags[i]` is set, which is below `sel.count` (the Selection's
        // invariant), the length of `out`.
        unsafe {
            self.output(sel.count, f, col.len, |out| {
                [col.arg(), flags.arg(), sel.offsets.arg(), Arg::U64(col.len as u64), out]
            })
        }
    }

    /// A grid-stride reduction of `col` by `f` into one u64 (read back), launched only when the column
    /// has at least `min_len` elements (0 otherwise).
    ///
    /// # Safety
    /// 1. `f` is a reduction of query.cu over elements of `T` (parameters `vals, n, out`; reads
    ///    `vals[0..n)`, adds into the one `u64` at `out`): `q_sum_u32` or `q_count_unsorted` for `u32`,
    ///    `q_sum_u64` for `u64`.
    unsafe fn reduce<T: Element>(
        &'a self,
        f: &mempool_core::Function<'_>,
        col: &Col<'a, T>,
        min_len: usize,
    ) -> Result<u64> {
        let out = self.scalar_u64()?;
        if col.len >= min_len {
            // SAFETY: 1: point 1, the arguments in that order; 2: the kernel reads the `col.len` elements of
            // `col` and writes the one `u64` of `out`, both alive until the download below.
            unsafe { self.run(f, strided(col.len), &[col.arg(), Arg::U64(col.len as u64), out.arg()]) }?;
        }
        Ok(out.download()?[0])
    }

    /// A `u64` column of one element, zeroed (in stream order).
    fn scalar_u64(&'a self) -> Result<Col<'a, u64>> {
        let c = self.alloc::<u64>(1)?;
        // SAFETY: point 1 of `fill_async`: the 8 bytes of the column just allocated, alive (owned by `c`)
        // and used only on the Exec's stream, which orders the fill.
        unsafe { memory::fill_async(self.ctx, c.ptr, 0, 8, self.stream) }?;
        Ok(c)
    }

    /// `lo + hash2(seed, i) % span` for `i < n` (`span` 0: the raw hash).
    pub fn gen(&'a self, n: usize, seed: u32, lo: u32, span: u32) -> Result<Col<'a, u32>> {
        // SAFETY: 1: `q_gen_u32(out, n, seed, lo, span)`; 2: it writes `out[0..n)`, the new column's `n`
        // elements, and reads nothing.
        unsafe {
            self.output(n, &self.k.gen, n, |out| {
                [out, Arg::U64(n as u64), Arg::U32(seed), Arg::U32(lo), Arg::U32(span)]
            })
        }
    }

    /// `base + i` for `i < n`.
    pub fn iota(&'a self, n: usize, base: u32) -> Result<Col<'a, u32>> {
        // SAFETY: 1: `q_iota_u32(out, n, base)`; 2: it writes `out[0..n)` and reads nothing.
        unsafe { self.output(n, &self.k.iota, n, |out| [out, Arg::U64(n as u64), Arg::U32(base)]) }
    }

    /// Flags `lo <= col[i] < hi`.
    pub fn flags_range(&'a self, col: &Col<'a, u32>, lo: u32, hi: u32) -> Result<Flags<'a>> {
        let n = col.len;
        // SAFETY: 1: `q_flags_range(col, n, lo, hi, flags)`; 2: it reads `col[0..n)` and writes
        // `out[0..n)`, both columns of `n` elements.
        let out = unsafe {
            self.output(n, &self.k.flags_range, n, |out| {
                [col.arg(), Arg::U64(n as u64), Arg::U32(lo), Arg::U32(hi), out]
            })
        }?;
        // The kernel writes 1 or 0 to every element.
        Ok(Flags(out))
    }

    /// `flags[i] &= other[i]` (both 0 or 1, so the result is too).
    pub fn flags_and(&'a self, flags: &mut Flags<'a>, other: &Flags<'a>) -> Result<()> {
        assert_eq!(flags.len, other.len, "flags_and: lengths differ");
        if flags.len > 0 {
            // SAFETY: 1: `q_flags_and(flags, other, n)`; 2: it reads and writes `flags[0..n)` and reads
            // `other[0..n)`, both columns of `n` elements (the assert above).
            unsafe {
                self.run(
                    &self.k.flags_and,
                    elementwise(flags.len),
                    &[flags.arg(), other.arg(), Arg::U64(flags.len as u64)],
                )
            }?;
        }
        Ok(())
    }

    /// Flags the first row of each run of equal keys.
    pub(crate) fn flags_head(&'a self, sorted: &Col<'a, u32>) -> Result<Flags<'a>> {
        let n = sorted.len;
        // SAFETY: 1: `q_flags_head(sorted, n, flags)`; 2: it reads `sorted[0..n)` and writes `out[0..n)`.
        let out = unsafe { self.output(n, &self.k.flags_head, n, |out| [sorted.arg(), Arg::U64(n as u64), out]) }?;
        // The kernel writes 1 or 0 to every element.
        Ok(Flags(out))
    }

    /// `a[i] * b[i]`.
    pub fn mul(&'a self, a: &Col<'a, u32>, b: &Col<'a, u32>) -> Result<Col<'a, u32>> {
        assert_eq!(a.len, b.len, "mul: lengths differ");
        let n = a.len;
        // SAFETY: 1: `q_mul_u32(a, b, n, out)`; 2: it reads `a[0..n)`, `b[0..n)` (the assert above) and
        // writes `out[0..n)`.
        unsafe { self.output(n, &self.k.mul, n, |out| [a.arg(), b.arg(), Arg::U64(n as u64), out]) }
    }

    /// `a[i] * mul + b[i]`.
    pub(crate) fn combine(&'a self, a: &Col<'a, u32>, b: &Col<'a, u32>, mul: u32) -> Result<Col<'a, u32>> {
        assert_eq!(a.len, b.len, "combine: lengths differ");
        let n = a.len;
        // SAFETY: 1: `q_combine_u32(a, b, n, mul, out)`; 2: it reads `a[0..n)`, `b[0..n)` (the assert
        // above) and writes `out[0..n)`.
        unsafe {
            self.output(n, &self.k.combine, n, |out| {
                [a.arg(), b.arg(), Arg::U64(n as u64), Arg::U32(mul), out]
            })
        }
    }

    /// The exclusive prefix sum (tile scans, then the tile sums scanned recursively and added back).
    pub fn scan(&'a self, input: &Col<'a, u32>) -> Result<Col<'a, u32>> {
        let n = input.len;
        let out = self.alloc::<u32>(n)?;
        if n == 0 {
            return Ok(out);
        }
        let tiles = n.div_ceil(TILE);
        // One tile: no tile sums (a null pointer) and nothing to add back.
        let sums = if tiles > 1 {
            Some(self.alloc::<u32>(tiles)?)
        } else {
            None
        };
        // SAFETY: 1: `q_scan_block(in, out, n, block_sums)`; 2: launched one block per tile of TILE
        // elements (`tiled`), it reads `input[0..n)`, writes `out[0..n)` and, when not null, one tile sum
        // per block into `sums` (`tiles` elements).
        unsafe {
            self.run(
                &self.k.scan_block,
                tiled(n),
                &[
                    input.arg(),
                    out.arg(),
                    Arg::U64(n as u64),
                    sums.as_ref().map_or(Arg::U64(0), Col::arg),
                ],
            )
        }?;
        let Some(sums) = sums else {
            return Ok(out);
        };
        let offsets = self.scan(&sums)?;
        drop(sums);
        // SAFETY: 1: `q_scan_add(data, n, tile_offsets)`; 2: it reads and writes `out[0..n)` and reads
        // `offsets[i / TILE]` for `i < n`, below `tiles`, the length of `offsets`.
        unsafe {
            self.run(
                &self.k.scan_add,
                elementwise(n),
                &[out.arg(), Arg::U64(n as u64), offsets.arg()],
            )
        }?;
        Ok(out)
    }

    /// The rows `flags` keeps (reads the count back: a stream synchronize, as cuDF's compaction does).
    /// The selection borrows `flags`. More than `u32::MAX` rows are refused: offsets are 32-bit.
    pub fn select<'s>(&'a self, flags: &'s Flags<'a>) -> Result<Selection<'s, 'a>> {
        let n = flags.len;
        if u32::try_from(n).is_err() {
            return Err(Error::Usage(format!(
                "a selection of {n} rows: the offsets are 32-bit, so at most {} rows",
                u32::MAX
            )));
        }
        let offsets = self.scan(flags)?;
        if n == 0 {
            return Ok(Selection {
                flags,
                offsets,
                count: 0,
            });
        }
        // SAFETY: 1: `q_scan_total(flags, offsets, n, total)`; 2: one thread reads `flags[n - 1]` and
        // `offsets[n - 1]` (both `n` elements, `n > 0`) and writes `total[0]`, a column of one element.
        let total: Col<'_, u32> = unsafe {
            self.output(1, &self.k.scan_total, 1, |total| {
                [flags.arg(), offsets.arg(), Arg::U64(n as u64), total]
            })
        }?;
        let count = total.download()?[0] as usize;
        // `offsets` is the exclusive scan of flags that are each 0 or 1 (Flags' invariant) and at most
        // u32::MAX rows (checked above, so no sum wraps): `count` is the number of flags set and
        // `offsets[i] < count` wherever `flags[i]` is set.
        Ok(Selection { flags, offsets, count })
    }

    /// The rows of `col` that `sel` keeps (`col` as long as the selection's flags).
    pub fn compact(&'a self, col: &Col<'a, u32>, sel: &Selection<'_, 'a>) -> Result<Col<'a, u32>> {
        // SAFETY: point 1: `q_compact_u32` for a `u32` column.
        unsafe { self.compact_with(&self.k.compact_u32, "compact", col, sel) }
    }

    /// The rows of a 64-bit `col` that `sel` keeps (`col` as long as the selection's flags).
    pub(crate) fn compact_u64(&'a self, col: &Col<'a, u64>, sel: &Selection<'_, 'a>) -> Result<Col<'a, u64>> {
        // SAFETY: point 1: `q_compact_u64` for a `u64` column.
        unsafe { self.compact_with(&self.k.compact_u64, "compact_u64", col, sel) }
    }

    /// The indices of the rows `sel` keeps.
    pub fn compact_index(&'a self, sel: &Selection<'_, 'a>) -> Result<Col<'a, u32>> {
        let flags = sel.flags;
        // SAFETY: 1: `q_compact_index(flags, offsets, n, out)`; 2: it reads `flags[0..n)` and
        // `offsets[0..n)` (the Selection's invariant: `offsets` has one element per flag) and writes
        // `out[offsets[i]]` only where `flags[i]` is set, below `sel.count` (the Selection's invariant),
        // the length of `out`.
        unsafe {
            self.output(sel.count, &self.k.compact_index, flags.len, |out| {
                [flags.arg(), sel.offsets.arg(), Arg::U64(flags.len as u64), out]
            })
        }
    }

    /// `col[idx[j]]` for every `j`.
    ///
    /// # Safety
    /// 1. Every index in `idx` (as the work queued on the stream before this call leaves it) is below
    ///    `col.len()`: the kernel reads `col` at each index without a bounds check.
    pub(crate) unsafe fn gather(&'a self, col: &Col<'a, u32>, idx: &Col<'a, u32>) -> Result<Col<'a, u32>> {
        let m = idx.len;
        // SAFETY: 1: `q_gather_u32(col, idx, m, out)`; 2: it reads `idx[0..m)`, `col` at those indices
        // (below `col.len`: point 1) and writes `out[0..m)`.
        unsafe {
            self.output(m, &self.k.gather, m, |out| {
                [col.arg(), idx.arg(), Arg::U64(m as u64), out]
            })
        }
    }

    /// A hash table of `keys` to their row numbers. Keys should be unique and never `u32::MAX` (the
    /// empty slot): a repeated key keeps one of its rows, a `u32::MAX` key is not found again.
    pub fn hash_build(&'a self, keys: &Col<'a, u32>) -> Result<HashTable<'a>> {
        // At least twice the keys: the table never fills, so every insert and probe ends.
        let cap = capacity_for(keys.len);
        let tkeys = self.alloc::<u32>(cap)?;
        let rows = self.alloc::<u32>(cap)?;
        // SAFETY: point 1 of `fill_u32_async`: the `cap` u32s of the column just allocated (4-byte
        // aligned, as every allocation of a resource), on the Exec's stream.
        unsafe { memory::fill_u32_async(self.ctx, tkeys.ptr, EMPTY_KEY, cap, self.stream) }?;
        let mask = (cap - 1) as u32;
        if !keys.is_empty() {
            // SAFETY: 1: `q_hash_build(keys, n, table_keys, table_rows, mask)`; 2: it reads `keys[0..n)`
            // and reads and writes `tkeys` and `rows` at `slot & mask`, below `cap` (a power of two, the
            // length of both).
            unsafe {
                self.run(
                    &self.k.hash_build,
                    elementwise(keys.len),
                    &[
                        keys.arg(),
                        Arg::U64(keys.len as u64),
                        tkeys.arg(),
                        rows.arg(),
                        Arg::U32(mask),
                    ],
                )
            }?;
        }
        Ok(HashTable {
            keys: tkeys,
            rows,
            mask,
        })
    }

    /// For each probe key: whether it is in `table` (flags) and its build row.
    pub fn probe(&'a self, table: &HashTable<'a>, keys: &Col<'a, u32>) -> Result<(Col<'a, u32>, Flags<'a>)> {
        let n = keys.len;
        let rows = self.alloc::<u32>(n)?;
        let flags = self.alloc::<u32>(n)?;
        if n > 0 {
            // SAFETY: 1: `q_hash_probe(keys, n, table_keys, table_rows, mask, build_rows, flags)`; 2: it
            // reads `keys[0..n)`, the table's columns at `slot & mask` (below their length, `mask + 1`)
            // and writes `rows[0..n)` and `flags[0..n)`.
            unsafe {
                self.run(
                    &self.k.hash_probe,
                    elementwise(n),
                    &[
                        keys.arg(),
                        Arg::U64(n as u64),
                        table.keys.arg(),
                        table.rows.arg(),
                        Arg::U32(table.mask),
                        rows.arg(),
                        flags.arg(),
                    ],
                )
            }?;
        }
        // The kernel writes 1 or 0 to every flag.
        Ok((rows, Flags(flags)))
    }

    /// Sums and counts of `vals` per key. `distinct` must be at least the number of distinct keys: the
    /// table holds twice that (at least 64); a smaller bound can fill it, and the kernel then never ends.
    pub fn groupby(&'a self, keys: &Col<'a, u32>, vals: &Col<'a, u32>, distinct: usize) -> Result<Groups<'a>> {
        assert_eq!(keys.len, vals.len, "groupby: lengths differ");
        let n = keys.len;
        let cap = capacity_for(distinct.min(n));
        let tkeys = self.alloc::<u32>(cap)?;
        let sums = self.alloc::<u64>(cap)?;
        let counts = self.alloc::<u32>(cap)?;
        // SAFETY: point 1 of `fill_u32_async` and `fill_async`: each fill covers the column it names
        // exactly (`cap` elements, just allocated, 4-byte aligned), on the Exec's stream.
        unsafe {
            memory::fill_u32_async(self.ctx, tkeys.ptr, EMPTY_KEY, cap, self.stream)?;
            memory::fill_async(self.ctx, sums.ptr, 0, cap * 8, self.stream)?;
            memory::fill_async(self.ctx, counts.ptr, 0, cap * 4, self.stream)?;
        }
        if n > 0 {
            // SAFETY: 1: `q_groupby_sum(keys, vals, n, table_keys, table_sums, table_counts, mask)`; 2: it
            // reads `keys[0..n)` and `vals[0..n)` (the assert above) and reads and writes the three table
            // columns at `slot & mask`, below `cap`, their length.
            unsafe {
                self.run(
                    &self.k.groupby_sum,
                    elementwise(n),
                    &[
                        keys.arg(),
                        vals.arg(),
                        Arg::U64(n as u64),
                        tkeys.arg(),
                        sums.arg(),
                        counts.arg(),
                        Arg::U32((cap - 1) as u32),
                    ],
                )
            }?;
        }
        // `cap` is at least 64, so this always launches.
        // SAFETY: 1: `q_flags_occupied(table_keys, n, flags)`; 2: it reads `tkeys[0..cap)` and writes
        // `out[0..cap)`.
        let occupied = unsafe {
            self.output(cap, &self.k.flags_occupied, cap, |out| {
                [tkeys.arg(), Arg::U64(cap as u64), out]
            })
        }?;
        // The kernel writes 1 or 0 to every element.
        let occupied = Flags(occupied);
        let sel = self.select(&occupied)?;
        Ok(Groups {
            keys: self.compact(&tkeys, &sel)?,
            sums: self.compact_u64(&sums, &sel)?,
            counts: self.compact(&counts, &sel)?,
        })
    }

    /// Sorts `keys` (all below `key_bound`), carrying `vals` along, stably: LSD radix sort, 8 bits per
    /// pass, a histogram, a scan and new output columns per pass. Keys at or above the bound come out
    /// ordered by their low bits only.
    pub fn sort_pairs(
        &'a self,
        keys: Col<'a, u32>,
        vals: Option<Col<'a, u32>>,
        key_bound: u64,
    ) -> Result<(Col<'a, u32>, Option<Col<'a, u32>>)> {
        let n = keys.len;
        if let Some(v) = &vals {
            assert_eq!(v.len, n, "sort_pairs: lengths differ");
        }
        if n <= 1 {
            return Ok((keys, vals));
        }
        let bits = 64 - key_bound.saturating_sub(1).leading_zeros();
        let passes = bits.div_ceil(8).clamp(1, 4);
        let nblocks = n.div_ceil(TILE);
        let (mut keys, mut vals) = (keys, vals);
        for pass in 0..passes {
            let shift = pass * 8;
            let hist = self.alloc::<u32>(RADIX_DIGITS * nblocks)?;
            // SAFETY: 1: `q_radix_hist(keys, n, shift, hist, nblocks)`; 2: launched one block per tile
            // (`tiled`: `nblocks` blocks), it reads `keys[0..n)` and writes `hist[d * nblocks + block]`
            // for every digit `d < RADIX_DIGITS`, within its `RADIX_DIGITS * nblocks` elements.
            unsafe {
                self.run(
                    &self.k.radix_hist,
                    tiled(n),
                    &[
                        keys.arg(),
                        Arg::U64(n as u64),
                        Arg::U32(shift),
                        hist.arg(),
                        Arg::U32(nblocks as u32),
                    ],
                )
            }?;
            let offsets = self.scan(&hist)?;
            drop(hist);
            let keys_out = self.alloc::<u32>(n)?;
            let vals_out = match &vals {
                Some(_) => Some(self.alloc::<u32>(n)?),
                None => None,
            };
            // SAFETY: 1: `q_radix_scatter(keys, vals, n, shift, offsets, keys_out, vals_out, nblocks)`
            // (`vals` and `vals_out` both null or both columns of `n`); 2: same grid as the histogram, it
            // reads `keys[0..n)`, `vals[0..n)` and `offsets` (`RADIX_DIGITS * nblocks` elements) and writes
            // each row to `offsets[digit * nblocks + block]` plus its rank among the rows of that digit in
            // its tile: the exclusive scan of this pass's histogram of these same keys, so every row gets
            // a distinct position below `n` in `keys_out` and `vals_out`.
            unsafe {
                self.run(
                    &self.k.radix_scatter,
                    tiled(n),
                    &[
                        keys.arg(),
                        vals.as_ref().map_or(Arg::U64(0), Col::arg),
                        Arg::U64(n as u64),
                        Arg::U32(shift),
                        offsets.arg(),
                        keys_out.arg(),
                        vals_out.as_ref().map_or(Arg::U64(0), Col::arg),
                        Arg::U32(nblocks as u32),
                    ],
                )
            }?;
            keys = keys_out;
            vals = vals_out;
        }
        Ok((keys, vals))
    }

    /// The sum of a column (as 64-bit integers).
    pub(crate) fn sum_u32(&'a self, col: &Col<'a, u32>) -> Result<u64> {
        // SAFETY: point 1: `q_sum_u32` over a `u32` column.
        unsafe { self.reduce(&self.k.sum_u32, col, 1) }
    }

    /// The sum of a 64-bit column (wrapping).
    pub fn sum_u64(&'a self, col: &Col<'a, u64>) -> Result<u64> {
        // SAFETY: point 1: `q_sum_u64` over a `u64` column.
        unsafe { self.reduce(&self.k.sum_u64, col, 1) }
    }

    /// How many adjacent pairs are out of order (0 for a sorted column).
    pub(crate) fn count_unsorted(&'a self, col: &Col<'a, u32>) -> Result<u64> {
        // SAFETY: point 1: `q_count_unsorted` over a `u32` column.
        unsafe { self.reduce(&self.k.count_unsorted, col, 2) }
    }
}

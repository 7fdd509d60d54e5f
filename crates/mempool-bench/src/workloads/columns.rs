//! Device columns and the columnar operators the query workload strings together. Every column and
//! every intermediate is allocated through the resource under test and freed (in stream order) when it
//! drops, as cuDF's columns are: a pipeline allocates and frees many buffers of many sizes.

#![allow(unsafe_code)]

use std::cell::RefCell;
use std::marker::PhantomData;
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

/// The rows a filter keeps: the exclusive scan of its flags and their count.
pub struct Selection<'e> {
    /// `offsets[i]`: where row `i` goes if kept.
    pub(crate) offsets: Col<'e, u32>,
    /// Rows kept.
    pub count: usize,
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
    /// Operators over `mr` on `stream`.
    pub fn new(
        mr: &'a dyn MemoryResource,
        stream: StreamRef<'a>,
        ctx: &'a Arc<Context>,
        k: &'a QueryKernels<'a>,
    ) -> Self {
        Exec {
            mr,
            stream,
            ctx,
            k,
            drop_error: RefCell::new(None),
            allocations: std::cell::Cell::new(0),
        }
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

    fn run(&self, f: &mempool_core::Function<'_>, cfg: mempool_core::LaunchConfig, args: &[Arg]) -> Result<()> {
        // SAFETY: every caller below passes the kernel's parameters in order and width (query.cu), with
        // column pointers whose invariant covers the elements the launch shape touches; the stream
        // belongs to the kernels' context (the Exec's contract).
        unsafe { launch(f, cfg, self.stream, args) }
    }

    /// A new column of `len` elements written by `f`, launched one thread per element of `n`
    /// ([`elementwise`]) with `args(out)` (`out`: the new column's argument); no launch when `len` is 0.
    fn output<T: Element, const N: usize>(
        &'a self,
        len: usize,
        f: &mempool_core::Function<'_>,
        n: usize,
        args: impl FnOnce(Arg) -> [Arg; N],
    ) -> Result<Col<'a, T>> {
        let out = self.alloc::<T>(len)?;
        if len > 0 {
            self.run(f, elementwise(n), &args(out.arg()))?;
        }
        Ok(out)
    }

    /// The rows of `col` that `flags` keeps, by `f` (`q_compact_u32` or `q_compact_u64`).
    fn compact_with<T: Element>(
        &'a self,
        f: &mempool_core::Function<'_>,
        what: &str,
        col: &Col<'a, T>,
        flags: &Col<'a, u32>,
        sel: &Selection<'a>,
    ) -> Result<Col<'a, T>> {
        assert_eq!(col.len, flags.len, "{what}: lengths differ");
        self.output(sel.count, f, col.len, |out| {
            [col.arg(), flags.arg(), sel.offsets.arg(), Arg::U64(col.len as u64), out]
        })
    }

    /// A grid-stride reduction of `col` by `f` into one u64 (read back), launched only when the column
    /// has at least `min_len` elements (0 otherwise).
    fn reduce<T: Element>(&'a self, f: &mempool_core::Function<'_>, col: &Col<'a, T>, min_len: usize) -> Result<u64> {
        let out = self.scalar_u64()?;
        if col.len >= min_len {
            self.run(f, strided(col.len), &[col.arg(), Arg::U64(col.len as u64), out.arg()])?;
        }
        Ok(out.download()?[0])
    }

    fn scalar_u64(&'a self) -> Result<Col<'a, u64>> {
        let c = self.alloc::<u64>(1)?;
        // SAFETY: 8 bytes of the column, on its stream.
        unsafe { memory::fill_async(self.ctx, c.ptr, 0, 8, self.stream) }?;
        Ok(c)
    }

    /// `lo + hash2(seed, i) % span` for `i < n` (`span` 0: the raw hash).
    pub fn gen(&'a self, n: usize, seed: u32, lo: u32, span: u32) -> Result<Col<'a, u32>> {
        self.output(n, &self.k.gen, n, |out| {
            [out, Arg::U64(n as u64), Arg::U32(seed), Arg::U32(lo), Arg::U32(span)]
        })
    }

    /// `base + i` for `i < n`.
    pub fn iota(&'a self, n: usize, base: u32) -> Result<Col<'a, u32>> {
        self.output(n, &self.k.iota, n, |out| [out, Arg::U64(n as u64), Arg::U32(base)])
    }

    /// Flags `lo <= col[i] < hi`.
    pub fn flags_range(&'a self, col: &Col<'a, u32>, lo: u32, hi: u32) -> Result<Col<'a, u32>> {
        let n = col.len;
        self.output(n, &self.k.flags_range, n, |out| {
            [col.arg(), Arg::U64(n as u64), Arg::U32(lo), Arg::U32(hi), out]
        })
    }

    /// `flags[i] &= other[i]`.
    pub fn flags_and(&'a self, flags: &mut Col<'a, u32>, other: &Col<'a, u32>) -> Result<()> {
        assert_eq!(flags.len, other.len, "flags_and: lengths differ");
        if flags.len > 0 {
            self.run(
                &self.k.flags_and,
                elementwise(flags.len),
                &[flags.arg(), other.arg(), Arg::U64(flags.len as u64)],
            )?;
        }
        Ok(())
    }

    /// Flags the first row of each run of equal keys.
    pub(crate) fn flags_head(&'a self, sorted: &Col<'a, u32>) -> Result<Col<'a, u32>> {
        let n = sorted.len;
        self.output(n, &self.k.flags_head, n, |out| [sorted.arg(), Arg::U64(n as u64), out])
    }

    /// `a[i] * b[i]`.
    pub fn mul(&'a self, a: &Col<'a, u32>, b: &Col<'a, u32>) -> Result<Col<'a, u32>> {
        assert_eq!(a.len, b.len, "mul: lengths differ");
        let n = a.len;
        self.output(n, &self.k.mul, n, |out| [a.arg(), b.arg(), Arg::U64(n as u64), out])
    }

    /// `a[i] * mul + b[i]`.
    pub(crate) fn combine(&'a self, a: &Col<'a, u32>, b: &Col<'a, u32>, mul: u32) -> Result<Col<'a, u32>> {
        assert_eq!(a.len, b.len, "combine: lengths differ");
        let n = a.len;
        self.output(n, &self.k.combine, n, |out| {
            [a.arg(), b.arg(), Arg::U64(n as u64), Arg::U32(mul), out]
        })
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
        self.run(
            &self.k.scan_block,
            tiled(n),
            &[
                input.arg(),
                out.arg(),
                Arg::U64(n as u64),
                sums.as_ref().map_or(Arg::U64(0), Col::arg),
            ],
        )?;
        let Some(sums) = sums else {
            return Ok(out);
        };
        let offsets = self.scan(&sums)?;
        drop(sums);
        self.run(
            &self.k.scan_add,
            elementwise(n),
            &[out.arg(), Arg::U64(n as u64), offsets.arg()],
        )?;
        Ok(out)
    }

    /// The rows `flags` keeps (reads the count back: a stream synchronize, as cuDF's compaction does).
    pub fn select(&'a self, flags: &Col<'a, u32>) -> Result<Selection<'a>> {
        let n = flags.len;
        let offsets = self.scan(flags)?;
        if n == 0 {
            return Ok(Selection { offsets, count: 0 });
        }
        let total: Col<'_, u32> = self.output(1, &self.k.scan_total, 1, |total| {
            [flags.arg(), offsets.arg(), Arg::U64(n as u64), total]
        })?;
        let count = total.download()?[0] as usize;
        Ok(Selection { offsets, count })
    }

    /// The rows of `col` that `flags` keeps.
    pub fn compact(&'a self, col: &Col<'a, u32>, flags: &Col<'a, u32>, sel: &Selection<'a>) -> Result<Col<'a, u32>> {
        self.compact_with(&self.k.compact_u32, "compact", col, flags, sel)
    }

    /// The rows of a 64-bit `col` that `flags` keeps.
    pub(crate) fn compact_u64(
        &'a self,
        col: &Col<'a, u64>,
        flags: &Col<'a, u32>,
        sel: &Selection<'a>,
    ) -> Result<Col<'a, u64>> {
        self.compact_with(&self.k.compact_u64, "compact_u64", col, flags, sel)
    }

    /// The indices of the rows `flags` keeps.
    pub fn compact_index(&'a self, flags: &Col<'a, u32>, sel: &Selection<'a>) -> Result<Col<'a, u32>> {
        self.output(sel.count, &self.k.compact_index, flags.len, |out| {
            [flags.arg(), sel.offsets.arg(), Arg::U64(flags.len as u64), out]
        })
    }

    /// `col[idx[j]]` for every `j`. Every index must be below `col.len()`.
    pub(crate) fn gather(&'a self, col: &Col<'a, u32>, idx: &Col<'a, u32>) -> Result<Col<'a, u32>> {
        let m = idx.len;
        self.output(m, &self.k.gather, m, |out| {
            [col.arg(), idx.arg(), Arg::U64(m as u64), out]
        })
    }

    /// A hash table of `keys` (unique, never `u32::MAX`) to their row numbers.
    pub fn hash_build(&'a self, keys: &Col<'a, u32>) -> Result<HashTable<'a>> {
        let cap = capacity_for(keys.len);
        let tkeys = self.alloc::<u32>(cap)?;
        let rows = self.alloc::<u32>(cap)?;
        // SAFETY: `cap` u32s of the column, on its stream.
        unsafe { memory::fill_u32_async(self.ctx, tkeys.ptr, EMPTY_KEY, cap, self.stream) }?;
        let mask = (cap - 1) as u32;
        if !keys.is_empty() {
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
            )?;
        }
        Ok(HashTable {
            keys: tkeys,
            rows,
            mask,
        })
    }

    /// For each probe key: whether it is in `table` (flags) and its build row.
    pub fn probe(&'a self, table: &HashTable<'a>, keys: &Col<'a, u32>) -> Result<(Col<'a, u32>, Col<'a, u32>)> {
        let n = keys.len;
        let rows = self.alloc::<u32>(n)?;
        let flags = self.alloc::<u32>(n)?;
        if n > 0 {
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
            )?;
        }
        Ok((rows, flags))
    }

    /// Sums and counts of `vals` per key; `distinct` bounds the number of distinct keys.
    pub fn groupby(&'a self, keys: &Col<'a, u32>, vals: &Col<'a, u32>, distinct: usize) -> Result<Groups<'a>> {
        assert_eq!(keys.len, vals.len, "groupby: lengths differ");
        let n = keys.len;
        let cap = capacity_for(distinct.min(n));
        let tkeys = self.alloc::<u32>(cap)?;
        let sums = self.alloc::<u64>(cap)?;
        let counts = self.alloc::<u32>(cap)?;
        // SAFETY: each fill covers its column exactly, on the column's stream.
        unsafe {
            memory::fill_u32_async(self.ctx, tkeys.ptr, EMPTY_KEY, cap, self.stream)?;
            memory::fill_async(self.ctx, sums.ptr, 0, cap * 8, self.stream)?;
            memory::fill_async(self.ctx, counts.ptr, 0, cap * 4, self.stream)?;
        }
        if n > 0 {
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
            )?;
        }
        // `cap` is at least 64, so this always launches.
        let occupied = self.output(cap, &self.k.flags_occupied, cap, |out| {
            [tkeys.arg(), Arg::U64(cap as u64), out]
        })?;
        let sel = self.select(&occupied)?;
        Ok(Groups {
            keys: self.compact(&tkeys, &occupied, &sel)?,
            sums: self.compact_u64(&sums, &occupied, &sel)?,
            counts: self.compact(&counts, &occupied, &sel)?,
        })
    }

    /// Sorts `keys` (all below `key_bound`), carrying `vals` along, stably: LSD radix sort, 8 bits per
    /// pass, a histogram, a scan and new output columns per pass.
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
            )?;
            let offsets = self.scan(&hist)?;
            drop(hist);
            let keys_out = self.alloc::<u32>(n)?;
            let vals_out = match &vals {
                Some(_) => Some(self.alloc::<u32>(n)?),
                None => None,
            };
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
            )?;
            keys = keys_out;
            vals = vals_out;
        }
        Ok((keys, vals))
    }

    /// The sum of a column (as 64-bit integers).
    pub(crate) fn sum_u32(&'a self, col: &Col<'a, u32>) -> Result<u64> {
        self.reduce(&self.k.sum_u32, col, 1)
    }

    /// The sum of a 64-bit column (wrapping).
    pub fn sum_u64(&'a self, col: &Col<'a, u64>) -> Result<u64> {
        self.reduce(&self.k.sum_u64, col, 1)
    }

    /// How many adjacent pairs are out of order (0 for a sorted column).
    pub(crate) fn count_unsorted(&'a self, col: &Col<'a, u32>) -> Result<u64> {
        self.reduce(&self.k.count_unsorted, col, 2)
    }
}

//! GPU tests of [`ServiceResource`] (issue 23): tags and their regions, growth that never moves, the
//! watermark against the fragmentation pattern, trimming, sleep and wake (offload and discard), the
//! refusals (sleeping tags, pending work, exports), chunk observers, out of memory, dropping with live
//! allocations, two resources on one device.
//! `cargo test -p mempool-rmm --features gpu --test service` (packed: `mempool-rmm-service`).
//!
//! The tests take one lock: several read the device's free memory (`cuMemGetInfo`) and one fills the
//! device on purpose, so none may run beside another.
#![cfg(feature = "gpu")]

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use mempool_core::kernels::CheckKernels;
use mempool_core::{memory, take_drop_errors, Context, Device, DeviceAddr, LaunchConfig, Module, Stream};
use mempool_rmm::{
    ChunkObserver, ChunkRange, Error, MemoryResource, Reclaim, ServiceOptions, ServiceResource, SleepMode, Tag,
    TagStats,
};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

static GPU: Mutex<()> = Mutex::new(());

/// One test's device, context, stream and check kernels, holding the lock that keeps the tests apart.
struct Gpu {
    dev: Device,
    ctx: Arc<Context>,
    kernels: CheckKernels,
    stream: Stream,
    // Dropped last: the fields above wait for the device as they go.
    _lock: MutexGuard<'static, ()>,
}

fn gpu() -> Gpu {
    let lock = GPU.lock().unwrap_or_else(PoisonError::into_inner);
    // A test that failed before taking its drop errors must not fail the next one.
    let _ = take_drop_errors();
    let dev = Device::get(0).expect("GPU tests need a CUDA device");
    let ctx = dev.context().unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    Gpu {
        dev,
        ctx,
        kernels,
        stream,
        _lock: lock,
    }
}

impl Gpu {
    /// Writes `base + i` into the `i`th `u32` of `p..p+bytes`, on the test's stream.
    ///
    /// # Safety
    /// 1. `p..p+bytes` is device memory the test owns (a live allocation), awake, 4-byte aligned.
    #[allow(unsafe_code)]
    unsafe fn fill(&self, p: DeviceAddr, bytes: usize, base: u32) {
        // SAFETY: point 1; the kernel is ordered on the stream that later checks and frees use.
        unsafe { self.kernels.iota(p, bytes / 4, base, self.stream.as_ref()) }.unwrap();
    }

    /// Asserts that `p..p+bytes` holds what [`fill`](Self::fill) wrote with `base`.
    ///
    /// # Safety
    /// 1. As for [`fill`](Self::fill): `p..p+bytes` is a live, awake allocation of the test.
    #[allow(unsafe_code)]
    unsafe fn check(&self, p: DeviceAddr, bytes: usize, base: u32, what: &str) {
        let mut host = vec![0u8; bytes];
        // SAFETY: point 1; the copy waits for the stream, after the fills queued on it.
        unsafe { memory::copy_to_host(&self.ctx, &mut host, p, self.stream.as_ref()) }.unwrap();
        let bad = host
            .chunks_exact(4)
            .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .enumerate()
            .find(|&(i, v)| v != base.wrapping_add(i as u32));
        assert!(
            bad.is_none(),
            "{what}: first wrong element at {p}: {bad:?} (expected base {base})"
        );
    }

    /// The device's free memory once all its work is done.
    fn free_memory(&self) -> usize {
        self.ctx.synchronize().unwrap();
        self.ctx.memory_info().unwrap().free
    }
}

fn no_drop_errors() {
    let errors = take_drop_errors();
    assert!(errors.is_empty(), "destructors met errors: {errors:?}");
}

fn options(region: usize, max_tags: usize) -> ServiceOptions {
    ServiceOptions {
        region_size: Some(region),
        max_tags,
        chunk_size: Some(2 * MIB),
        ..Default::default()
    }
}

fn tag_stats(mr: &ServiceResource, tag: Tag) -> TagStats {
    mr.stats().tags[tag.index()].clone()
}

/// The address range of `tag`'s region.
fn region(mr: &ServiceResource, tag: Tag) -> std::ops::Range<u64> {
    let start = mr.base().0 + (tag.index() * mr.region_size()) as u64;
    start..start + mr.region_size() as u64
}

/// The bytes of the chunks that `blocks` (address, size) touch.
fn touched_bytes(chunk: usize, blocks: &[(DeviceAddr, usize)]) -> u64 {
    let chunk = chunk as u64;
    let mut set = BTreeSet::new();
    for &(p, n) in blocks {
        let n = (n as u64).div_ceil(256) * 256;
        for c in p.0 / chunk..=(p.0 + n - 1) / chunk {
            set.insert(c);
        }
    }
    set.len() as u64 * chunk
}

/// An observer that keeps the set of chunks it was told are mapped, and every inconsistency (a chunk
/// mapped twice, one unmapping that was not mapped) as text: observers run under the resource's lock,
/// so it never panics there.
struct Recorder {
    chunk: u64,
    mapped: Mutex<BTreeMap<u64, Tag>>,
    events: Mutex<Vec<(bool, ChunkRange)>>,
    errors: Mutex<Vec<String>>,
}

impl Recorder {
    fn new(chunk: usize) -> Arc<Recorder> {
        Arc::new(Recorder {
            chunk: chunk as u64,
            mapped: Mutex::new(BTreeMap::new()),
            events: Mutex::new(Vec::new()),
            errors: Mutex::new(Vec::new()),
        })
    }

    fn error(&self, e: String) {
        self.errors.lock().unwrap().push(e);
    }

    /// Bytes it believes mapped under `tag`.
    fn mapped_bytes(&self, tag: Tag) -> u64 {
        self.mapped.lock().unwrap().values().filter(|&&t| t == tag).count() as u64 * self.chunk
    }

    fn total(&self) -> u64 {
        self.mapped.lock().unwrap().len() as u64 * self.chunk
    }

    fn events(&self) -> Vec<(bool, ChunkRange)> {
        self.events.lock().unwrap().clone()
    }

    fn assert_agrees(&self, mr: &ServiceResource, when: &str) {
        let errors = self.errors.lock().unwrap().clone();
        assert!(errors.is_empty(), "{when}: the observer saw: {errors:?}");
        let stats = mr.stats();
        for t in &stats.tags {
            assert_eq!(
                self.mapped_bytes(t.tag),
                t.mapped_bytes,
                "{when}: tag `{}`: {stats:?}",
                t.name
            );
        }
        assert_eq!(self.total(), stats.mapped_bytes, "{when}");
    }
}

impl ChunkObserver for Recorder {
    fn mapped(&self, range: ChunkRange) {
        self.events.lock().unwrap().push((true, range));
        if !range.addr.0.is_multiple_of(self.chunk) || !(range.len as u64).is_multiple_of(self.chunk) || range.len == 0
        {
            self.error(format!("mapped: a range that is not whole chunks: {range:?}"));
        }
        let mut m = self.mapped.lock().unwrap();
        for a in (range.addr.0..range.end()).step_by(self.chunk as usize) {
            if m.insert(a, range.tag).is_some() {
                self.error(format!("mapped: the chunk at {a:#x} was mapped already ({range:?})"));
            }
        }
    }

    fn unmapping(&self, range: ChunkRange) {
        self.events.lock().unwrap().push((false, range));
        let mut m = self.mapped.lock().unwrap();
        for a in (range.addr.0..range.end()).step_by(self.chunk as usize) {
            match m.remove(&a) {
                Some(t) if t == range.tag => {}
                Some(t) => self.error(format!(
                    "unmapping: the chunk at {a:#x} was mapped under {t:?} ({range:?})"
                )),
                None => self.error(format!("unmapping: the chunk at {a:#x} was not mapped ({range:?})")),
            }
        }
    }
}

#[test]
#[allow(unsafe_code)]
fn service_allocations_land_in_their_tags_region_and_never_move() {
    let g = gpu();
    let s = g.stream.as_ref();
    let mr = ServiceResource::new(&g.dev, options(GIB, 4)).unwrap();
    assert_eq!(mr.chunk_size(), 2 * MIB);
    assert_eq!(mr.region_size(), GIB);
    assert_eq!(mr.stats().reservation_bytes, 4 * GIB as u64);
    assert_eq!(
        mr.stats().mapped_bytes,
        0,
        "nothing is mapped before the first allocation"
    );
    let w = mr.tag("weights").unwrap();
    let weights = mr.tagged(w);
    assert_eq!(weights.tag(), w);

    // One allocation first, its data written, then growth by many allocations of uneven sizes.
    let first_len = 3 * MIB + 512;
    let first = weights.allocate(first_len, s).unwrap();
    // SAFETY: `first` is a live allocation of `first_len` bytes.
    unsafe { g.fill(first, first_len, 7) };
    let mapped_after_first = tag_stats(&mr, w).mapped_bytes;
    assert_eq!(
        mapped_after_first,
        touched_bytes(mr.chunk_size(), &[(first, first_len)])
    );

    let mut blocks: Vec<(DeviceAddr, usize, u32)> = Vec::new();
    for i in 0..200usize {
        let len = (i % 7 + 1) * 256 * 1024 + 1024 * (i % 3);
        let p = weights.allocate(len, s).unwrap();
        // SAFETY: `p` is a live allocation of `len` bytes.
        unsafe { g.fill(p, len, (i as u32) << 20) };
        blocks.push((p, len, (i as u32) << 20));
    }
    let stats = tag_stats(&mr, w);
    assert!(
        stats.mapped_bytes > mapped_after_first,
        "200 allocations grew the tag's memory: {stats:?}"
    );
    let mut all: Vec<(DeviceAddr, usize)> = blocks.iter().map(|&(p, n, _)| (p, n)).collect();
    all.push((first, first_len));
    assert_eq!(stats.mapped_bytes, touched_bytes(mr.chunk_size(), &all), "{stats:?}");
    // SAFETY: `first` is still live; the growth left it where it was.
    unsafe { g.check(first, first_len, 7, "the first allocation after growth") };

    // Every block lies in the tag's region, overlaps no other, and belongs to the tag.
    let r = region(&mr, w);
    let mut sorted = all.clone();
    sorted.sort();
    for pair in sorted.windows(2) {
        assert!(pair[0].0 .0 + pair[0].1 as u64 <= pair[1].0 .0, "overlap: {pair:?}");
    }
    for &(p, n) in &all {
        assert!(r.contains(&p.0) && p.0 + n as u64 <= r.end, "{p} (+{n}) outside {r:x?}");
        assert_eq!(mr.tag_of(p), Some(w));
        assert_eq!(mr.tag_of(p.offset(n - 1)), Some(w));
    }

    // Free every other block, then grow again: the survivors keep their bytes at their addresses.
    let (gone, kept): (Vec<_>, Vec<_>) = blocks.iter().enumerate().partition(|(i, _)| i % 2 == 0);
    for (_, &(p, n, _)) in &gone {
        // SAFETY: `p` came from `weights` with this size and is freed once; its kernel ran on `s`.
        unsafe { weights.deallocate(p, n, s) }.unwrap();
    }
    let mut more = Vec::new();
    for i in 0..20u32 {
        let p = weights.allocate(5 * MIB, s).unwrap();
        // SAFETY: `p` is a live allocation of 5 MiB.
        unsafe { g.fill(p, 5 * MIB, 0xdead_0000 + i) };
        more.push((p, 0xdead_0000 + i));
    }
    for (_, &(p, n, base)) in &kept {
        // SAFETY: `p` is a live allocation of `n` bytes (kept).
        unsafe { g.check(p, n, base, "a block kept across frees and growth") };
    }
    // SAFETY: as above.
    unsafe { g.check(first, first_len, 7, "the first allocation at the end") };

    // The default tag has its own region (the first), through the resource's own `allocate`.
    let d = mr.allocate(MIB, s).unwrap();
    assert!(region(&mr, Tag::DEFAULT).contains(&d.0), "{d}");
    assert_eq!(mr.tag_of(d), Some(Tag::DEFAULT));
    // `tag_of` outside: before the reservation, in the region of a tag not made, past the end.
    assert_eq!(mr.tag_of(DeviceAddr(mr.base().0 - 1)), None);
    assert_eq!(mr.tag_of(mr.base().offset(2 * GIB)), None, "tag 2 is not made");
    assert_eq!(mr.tag_of(mr.base().offset(4 * GIB)), None);
    assert_eq!(mr.allocate(0, s).unwrap(), DeviceAddr::NULL);

    // SAFETY: every allocation below came from `mr` with its size, is freed once, after its kernels (on `s`).
    unsafe {
        mr.deallocate(d, MIB, s).unwrap();
        weights.deallocate(first, first_len, s).unwrap();
        for (_, &(p, n, _)) in &kept {
            weights.deallocate(p, n, s).unwrap();
        }
        for &(p, _) in &more {
            weights.deallocate(p, 5 * MIB, s).unwrap();
        }
    }
    let stats = mr.stats();
    assert_eq!(
        (stats.used_bytes, stats.tags[w.index()].live_allocations),
        (0, 0),
        "{stats:?}"
    );
    assert_eq!(stats.tags[w.index()].allocations, 221);
    assert_eq!(stats.tags[w.index()].frees, 221);
    assert_eq!(mr.trim().unwrap(), stats.mapped_bytes, "everything was idle");
    assert_eq!(mr.stats().mapped_bytes, 0);
    drop(weights);
    drop(mr);
    no_drop_errors();
}

#[test]
#[allow(unsafe_code)]
fn service_tags_are_idempotent_bounded_checked_and_counted() {
    let g = gpu();
    let s = g.stream.as_ref();
    let mr = ServiceResource::new(&g.dev, options(256 * MIB, 3)).unwrap();
    let w = mr.tag("weights").unwrap();
    assert_ne!(w, Tag::DEFAULT);
    assert_eq!(mr.tag("weights").unwrap(), w, "tag() is idempotent");
    assert_eq!(mr.tag("default").unwrap(), Tag::DEFAULT);
    assert_eq!(mr.find_tag("weights"), Some(w));
    assert_eq!(mr.find_tag("default"), Some(Tag::DEFAULT));
    assert_eq!(mr.find_tag("kv-cache"), None);
    assert_eq!(mr.tag_name(w).as_deref(), Some("weights"));
    let kv = mr.tag("kv-cache").unwrap();
    assert_eq!(mr.tag_name(kv).as_deref(), Some("kv-cache"));

    // A fourth tag does not fit: the error names the tag, the room and the option.
    let e = mr.tag("activations").unwrap_err();
    let msg = e.to_string();
    for part in ["activations", "room for 3 tags", "max_tags", "kv-cache"] {
        assert!(msg.contains(part), "`{part}` missing from: {msg}");
    }
    assert_eq!(
        mr.tag("weights").unwrap(),
        w,
        "an existing tag is still found when full"
    );
    // Bad names, refused before anything else.
    for (name, part) in [
        ("", "1 to 64"),
        ("kv cache", "' '"),
        ("é", "'é'"),
        (&"x".repeat(65) as &str, "has 65"),
    ] {
        let msg = mr.tag(name).unwrap_err().to_string();
        assert!(
            msg.contains(part),
            "`{part}` missing from the error for {name:?}: {msg}"
        );
    }
    assert_eq!(mr.stats().tags.len(), 3);

    // A tag of another resource with more tags is not this one's.
    let other = ServiceResource::new(&g.dev, options(64 * MIB, 4)).unwrap();
    for name in ["a", "b", "c"] {
        other.tag(name).unwrap();
    }
    let foreign = other.find_tag("c").unwrap();
    let msg = mr.allocate_tagged(MIB, foreign, s).unwrap_err().to_string();
    assert!(msg.contains("tag 3 is not one of this resource's"), "{msg}");
    drop(other);

    // Statistics per tag.
    let weights = mr.tagged(w);
    let kvr = mr.tagged(kv);
    let x = weights.allocate(4 * MIB, s).unwrap();
    let y = weights.allocate(4 * MIB, s).unwrap();
    let z = weights.allocate(4 * MIB, s).unwrap();
    let u = kvr.allocate(2 * MIB, s).unwrap();
    let v = kvr.allocate(2 * MIB, s).unwrap();
    // SAFETY: y came from `weights` with this size; freed once; nothing used it.
    unsafe { weights.deallocate(y, 4 * MIB, s) }.unwrap();
    let stats = mr.stats();
    let m = MIB as u64;
    let ws = &stats.tags[w.index()];
    assert_eq!(ws.name, "weights");
    assert_eq!(ws.asleep, None);
    assert_eq!(
        (
            ws.used_bytes,
            ws.peak_used_bytes,
            ws.live_allocations,
            ws.allocations,
            ws.frees
        ),
        (8 * m, 12 * m, 2, 3, 1),
        "{ws:?}"
    );
    assert_eq!(ws.mapped_bytes, 12 * m, "y's chunks stay mapped until a trim: {ws:?}");
    assert_eq!(
        ws.largest_free_mapped,
        4 * m,
        "y's hole is the one mapped free block: {ws:?}"
    );
    assert_eq!((ws.offloaded_bytes, ws.exports), (0, 0));
    let ks = &stats.tags[kv.index()];
    assert_eq!(
        (
            ks.used_bytes,
            ks.peak_used_bytes,
            ks.live_allocations,
            ks.allocations,
            ks.frees,
            ks.mapped_bytes
        ),
        (4 * m, 4 * m, 2, 2, 0, 4 * m),
        "{ks:?}"
    );
    let ds = &stats.tags[Tag::DEFAULT.index()];
    assert_eq!((ds.used_bytes, ds.allocations, ds.mapped_bytes), (0, 0, 0), "{ds:?}");
    assert_eq!((stats.used_bytes, stats.peak_used_bytes), (12 * m, 16 * m), "{stats:?}");
    assert_eq!(
        (stats.mapped_bytes, stats.peak_mapped_bytes),
        (16 * m, 16 * m),
        "{stats:?}"
    );
    for (p, t) in [(x, w), (z, w), (u, kv), (v, kv)] {
        assert_eq!(mr.tag_of(p), Some(t));
    }

    // trim returns the idle bytes (y's), and counts them.
    assert_eq!(mr.trim().unwrap(), 4 * m);
    let stats = mr.stats();
    assert_eq!(stats.tags[w.index()].mapped_bytes, 8 * m);
    assert_eq!(stats.reclaimed_bytes, 4 * m);
    assert_eq!(mr.trim().unwrap(), 0, "nothing idle is left");

    // reset_peaks brings the peaks down to now.
    mr.reset_peaks();
    let stats = mr.stats();
    assert_eq!(
        (stats.peak_used_bytes, stats.peak_mapped_bytes),
        (12 * m, 12 * m),
        "{stats:?}"
    );
    assert_eq!(stats.tags[w.index()].peak_used_bytes, 8 * m);

    // SAFETY: each came from its tag's resource with this size and is freed once (frees find the tag by
    // address, so either view frees either).
    unsafe {
        weights.deallocate(x, 4 * MIB, s).unwrap();
        kvr.deallocate(z, 4 * MIB, s).unwrap();
        mr.deallocate(u, 2 * MIB, s).unwrap();
        weights.deallocate(v, 2 * MIB, s).unwrap();
    }
    let stats = mr.stats();
    assert_eq!(stats.used_bytes, 0, "{stats:?}");
    assert_eq!((stats.tags[w.index()].frees, stats.tags[kv.index()].frees), (3, 2));
    drop((weights, kvr, mr));
    no_drop_errors();
}

#[test]
#[allow(unsafe_code)]
fn service_watermark_bounds_the_fragmentation_pattern() {
    // mempool-bench's fragmentation pattern: 1024 blocks of 1 MiB with a 64 MiB block after every 128,
    // the small ones freed, then 512 MiB (larger than any hole of 128 MiB, smaller than their total).
    let g = gpu();
    let s = g.stream.as_ref();
    let run = |reclaim: Option<Reclaim>| -> (f64, mempool_rmm::ServiceStats) {
        let mut opts = ServiceOptions::default();
        if let Some(r) = reclaim {
            opts.reclaim = r;
        }
        let mr = ServiceResource::new(&g.dev, opts).unwrap();
        let (mut smalls, mut larges) = (Vec::new(), Vec::new());
        for i in 0..1024 {
            smalls.push(mr.allocate(MIB, s).unwrap());
            if (i + 1) % 128 == 0 {
                let p = mr.allocate(64 * MIB, s).unwrap();
                // SAFETY: `p` is a live allocation of 64 MiB.
                unsafe { g.fill(p, 64 * MIB, larges.len() as u32 * 1000) };
                larges.push(p);
            }
        }
        for p in smalls {
            // SAFETY: `p` came from `mr` with this size; freed once; nothing used it.
            unsafe { mr.deallocate(p, MIB, s) }.unwrap();
        }
        g.stream.synchronize().unwrap();
        let big = mr.allocate(512 * MIB, s).unwrap();
        // SAFETY: `big` is a live allocation of 512 MiB.
        unsafe { g.fill(big, 512 * MIB, 99) };
        for (k, &p) in larges.iter().enumerate() {
            // SAFETY: the large blocks are live: whatever was unmapped, they were not.
            unsafe { g.check(p, 64 * MIB, k as u32 * 1000, "a large block after the request") };
        }
        // SAFETY: as above.
        unsafe { g.check(big, 512 * MIB, 99, "the request") };
        let stats = mr.stats();
        // SAFETY: each came from `mr` with this size and is freed once, after its kernels (on `s`).
        unsafe {
            mr.deallocate(big, 512 * MIB, s).unwrap();
            for p in larges {
                mr.deallocate(p, 64 * MIB, s).unwrap();
            }
        }
        (stats.peak_mapped_bytes as f64 / stats.peak_used_bytes as f64, stats)
    };
    let (ratio, stats) = run(None);
    println!("default (watermark 15%): peak mapped / peak live = {ratio:.3}: {stats:?}");
    assert_eq!(stats.peak_used_bytes, 1536 * MIB as u64, "{stats:?}");
    assert!(
        ratio <= 1.10,
        "the default keeps peak mapped / peak live <= 1.10, got {ratio:.3}: {stats:?}"
    );
    assert!(
        stats.reclaims >= 1,
        "the request passed the watermark and reclaimed: {stats:?}"
    );
    assert!(stats.reclaimed_bytes >= 512 * MIB as u64, "{stats:?}");

    let (ratio, stats) = run(Some(Reclaim::OnOutOfMemory));
    println!("OnOutOfMemory: peak mapped / peak live = {ratio:.3}: {stats:?}");
    assert!(
        (1.30..=1.34).contains(&ratio),
        "OnOutOfMemory keeps the holes mapped: 2 GiB for 1.5 GiB live (1.333), got {ratio:.3}: {stats:?}"
    );
    assert_eq!(stats.reclaims, 0, "{stats:?}");
    no_drop_errors();
}

#[test]
#[allow(unsafe_code)]
fn service_sleep_offload_restores_the_bytes_at_the_same_addresses() {
    let g = gpu();
    let s = g.stream.as_ref();
    let mr = ServiceResource::new(&g.dev, options(GIB, 3)).unwrap();
    let w = mr.tag("weights").unwrap();
    let kv = mr.tag("kv").unwrap();
    let weights = mr.tagged(w);
    let kvr = mr.tagged(kv);
    // Uneven sizes (blocks share chunks), and a freed block in the middle (idle chunks).
    let sizes = [8 * MIB, 3 * MIB + 256, 4 * MIB, 64 * MIB + 4096, MIB, 5 * MIB];
    let mut blocks = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let p = weights.allocate(n, s).unwrap();
        // SAFETY: `p` is a live allocation of `n` bytes.
        unsafe { g.fill(p, n, 1 + (i as u32) * 0x0100_0000) };
        blocks.push((p, n, 1 + (i as u32) * 0x0100_0000));
    }
    let (hole, hole_len, _) = blocks.remove(2);
    // SAFETY: `hole` came from `weights` with this size; freed once; its kernel ran on `s`.
    unsafe { weights.deallocate(hole, hole_len, s) }.unwrap();
    let e = kvr.allocate(16 * MIB, s).unwrap();
    // SAFETY: `e` is a live allocation of 16 MiB.
    unsafe { g.fill(e, 16 * MIB, 5) };
    g.stream.synchronize().unwrap();

    let before = tag_stats(&mr, w);
    let live: Vec<(DeviceAddr, usize)> = blocks.iter().map(|&(p, n, _)| (p, n)).collect();
    let touched = touched_bytes(mr.chunk_size(), &live);
    assert!(
        before.mapped_bytes > touched,
        "the freed block left idle chunks: {before:?}"
    );
    let kv_mapped = tag_stats(&mr, kv).mapped_bytes;

    let report = mr.sleep(&[w], SleepMode::Offload, s).unwrap();
    assert_eq!(report.released_bytes, before.mapped_bytes, "{report:?}");
    assert_eq!(
        report.offloaded_bytes, touched,
        "the chunks live blocks touch are saved: {report:?}"
    );
    let asleep = tag_stats(&mr, w);
    assert_eq!(asleep.asleep, Some(SleepMode::Offload));
    assert_eq!(
        (asleep.mapped_bytes, asleep.offloaded_bytes),
        (0, touched),
        "{asleep:?}"
    );
    assert_eq!(
        (asleep.used_bytes, asleep.live_allocations),
        (before.used_bytes, before.live_allocations)
    );
    assert_eq!(tag_stats(&mr, kv).mapped_bytes, kv_mapped, "the other tag is untouched");

    // A sleeping tag refuses allocations, a second sleep and exports, naming the tag (a free is taken:
    // `service_a_free_while_asleep_is_taken_and_wake_maps_back_only_what_is_live`).
    let msg = weights.allocate(MIB, s).unwrap_err().to_string();
    assert!(
        msg.contains("cannot allocate from tag `weights`: it is asleep"),
        "{msg}"
    );
    let (p0, n0, _) = blocks[0];
    for mode in [SleepMode::Offload, SleepMode::Discard] {
        let msg = mr.sleep(&[w], mode, s).unwrap_err().to_string();
        assert!(msg.contains("tag `weights` is already asleep"), "{msg}");
    }
    let msg = mr.export(p0, n0).unwrap_err().to_string();
    assert!(msg.contains("asleep"), "{msg}");
    assert_eq!(
        tag_stats(&mr, w).live_allocations,
        before.live_allocations,
        "nothing changed"
    );
    // The other tag works meanwhile.
    let f = kvr.allocate(8 * MIB, s).unwrap();
    // SAFETY: `f` is a live allocation of 8 MiB; `e` is live and awake.
    unsafe {
        g.fill(f, 8 * MIB, 77);
        g.check(e, 16 * MIB, 5, "the awake tag's block during the sleep");
    }
    // Waking an awake tag does nothing.
    assert_eq!(mr.wake(&[kv], s).unwrap(), Default::default());

    let report = mr.wake(&[w], s).unwrap();
    assert_eq!(
        (report.mapped_bytes, report.restored_bytes),
        (touched, touched),
        "{report:?}"
    );
    let awake = tag_stats(&mr, w);
    assert_eq!(awake.asleep, None);
    assert_eq!(
        (awake.mapped_bytes, awake.offloaded_bytes),
        (touched, 0),
        "idle chunks stay unmapped"
    );
    for &(p, n, base) in &blocks {
        // SAFETY: `p` is a live allocation of `n` bytes, awake again.
        unsafe { g.check(p, n, base, "a block after offload and wake") };
    }
    // Awake memory is usable: write over a restored block and into a new one.
    let (p1, n1, _) = blocks[1];
    let q = weights.allocate(2 * MIB, s).unwrap();
    // SAFETY: `p1` (`n1` bytes) and `q` (2 MiB) are live, awake allocations.
    unsafe {
        g.fill(p1, n1, 1234);
        g.fill(q, 2 * MIB, 4321);
        g.check(p1, n1, 1234, "a restored block rewritten");
        g.check(q, 2 * MIB, 4321, "a new block after wake");
    }

    // SAFETY: each came from `mr`'s views with its size and is freed once, after its kernels (on `s`).
    unsafe {
        for &(p, n, _) in &blocks {
            weights.deallocate(p, n, s).unwrap();
        }
        weights.deallocate(q, 2 * MIB, s).unwrap();
        kvr.deallocate(e, 16 * MIB, s).unwrap();
        kvr.deallocate(f, 8 * MIB, s).unwrap();
    }
    assert_eq!(mr.stats().used_bytes, 0);
    drop((weights, kvr, mr));
    no_drop_errors();
}

#[test]
#[allow(unsafe_code)]
fn service_sleep_discard_releases_device_memory_and_wake_maps_it_back() {
    let g = gpu();
    let s = g.stream.as_ref();
    let mr = ServiceResource::new(&g.dev, options(4 * GIB, 2)).unwrap();
    let kv = mr.tag("kv-cache").unwrap();
    let kvr = mr.tagged(kv);
    let a = kvr.allocate(GIB, s).unwrap();
    let b = kvr.allocate(200 * MIB + 768, s).unwrap();
    let d = mr.allocate(32 * MIB, s).unwrap();
    // SAFETY: a, b and d are live allocations of these sizes.
    unsafe {
        g.fill(a, GIB, 3);
        g.fill(b, 200 * MIB + 768, 4);
        g.fill(d, 32 * MIB, 5);
    }
    let mapped = tag_stats(&mr, kv).mapped_bytes;
    assert_eq!(
        mapped,
        touched_bytes(mr.chunk_size(), &[(a, GIB), (b, 200 * MIB + 768)])
    );

    let free_before = g.free_memory();
    let report = mr.sleep(&[kv], SleepMode::Discard, s).unwrap();
    let free_asleep = g.free_memory();
    assert_eq!(
        (report.released_bytes, report.offloaded_bytes),
        (mapped, 0),
        "{report:?}"
    );
    let grown = free_asleep.saturating_sub(free_before) as u64;
    assert!(
        grown as f64 >= 0.99 * mapped as f64,
        "sleep released {mapped} bytes but the device's free memory grew by {grown} ({free_before} -> {free_asleep})"
    );
    let st = tag_stats(&mr, kv);
    assert_eq!(
        (st.asleep, st.mapped_bytes, st.offloaded_bytes),
        (Some(SleepMode::Discard), 0, 0)
    );
    assert_eq!(mr.stats().mapped_bytes, tag_stats(&mr, Tag::DEFAULT).mapped_bytes);
    // SAFETY: `d` is in the default tag, awake.
    unsafe { g.check(d, 32 * MIB, 5, "the default tag's block while kv sleeps") };

    let report = mr.wake(&[kv], s).unwrap();
    let free_awake = g.free_memory();
    assert_eq!((report.mapped_bytes, report.restored_bytes), (mapped, 0), "{report:?}");
    let taken = free_asleep.saturating_sub(free_awake) as u64;
    assert!(
        taken as f64 >= 0.99 * mapped as f64,
        "wake mapped {mapped} bytes but the device's free memory fell by {taken}"
    );
    assert_eq!(tag_stats(&mr, kv).mapped_bytes, mapped);
    // Fresh memory at the same addresses: usable.
    // SAFETY: a and b are live allocations, awake again.
    unsafe {
        g.fill(a, GIB, 30);
        g.fill(b, 200 * MIB + 768, 40);
        g.check(a, GIB, 30, "a after discard and wake");
        g.check(b, 200 * MIB + 768, 40, "b after discard and wake");
    }
    // SAFETY: each came from `mr`'s views with its size and is freed once, after its kernels (on `s`).
    unsafe {
        kvr.deallocate(a, GIB, s).unwrap();
        kvr.deallocate(b, 200 * MIB + 768, s).unwrap();
        mr.deallocate(d, 32 * MIB, s).unwrap();
    }
    drop((kvr, mr));
    no_drop_errors();
}

/// A kernel that spins until the `u32` at `flag` (pinned host memory) is not zero, or `limit`
/// nanoseconds passed (so that a test that fails never leaves it running).
const SPIN_PTX: &str = r#"
.version 6.0
.target sm_50
.address_size 64

.visible .entry mempool_test_spin_until_flag(
    .param .u64 flag,
    .param .u64 limit
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<2>;
    .reg .b64 %rd<7>;
    ld.param.u64 %rd1, [flag];
    ld.param.u64 %rd2, [limit];
    cvta.to.global.u64 %rd3, %rd1;
    mov.u64 %rd4, %globaltimer;
SPIN:
    ld.volatile.global.u32 %r1, [%rd3];
    setp.ne.u32 %p1, %r1, 0;
    @%p1 bra DONE;
    mov.u64 %rd5, %globaltimer;
    sub.u64 %rd6, %rd5, %rd4;
    setp.lt.u64 %p2, %rd6, %rd2;
    @%p2 bra SPIN;
DONE:
    ret;
}

// As `mempool_test_spin_until_flag`, then `dst[i] = base + i` for `i < n` (one thread per element: every
// thread spins, then writes its element).
.visible .entry mempool_test_spin_then_fill(
    .param .u64 flag,
    .param .u64 limit,
    .param .u64 dst,
    .param .u32 base,
    .param .u64 n
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<14>;
    ld.param.u64 %rd1, [flag];
    ld.param.u64 %rd2, [limit];
    ld.param.u64 %rd7, [dst];
    ld.param.u32 %r2, [base];
    ld.param.u64 %rd8, [n];
    cvta.to.global.u64 %rd3, %rd1;
    mov.u64 %rd4, %globaltimer;
SPIN:
    ld.volatile.global.u32 %r1, [%rd3];
    setp.ne.u32 %p1, %r1, 0;
    @%p1 bra FILL;
    mov.u64 %rd5, %globaltimer;
    sub.u64 %rd6, %rd5, %rd4;
    setp.lt.u64 %p2, %rd6, %rd2;
    @%p2 bra SPIN;
FILL:
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.u32 %r6, %r3, %r4, %r5;
    cvt.u64.u32 %rd9, %r6;
    setp.ge.u64 %p3, %rd9, %rd8;
    @%p3 bra DONE;
    cvta.to.global.u64 %rd10, %rd7;
    shl.b64 %rd11, %rd9, 2;
    add.s64 %rd12, %rd10, %rd11;
    add.u32 %r7, %r2, %r6;
    st.global.u32 [%rd12], %r7;
DONE:
    ret;
}
"#;

/// Kernels of [`SPIN_PTX`] and their flag (a word of pinned host memory): work that stays on the device
/// until the test lets it go, so that the resource can be called while it runs.
struct Spinner {
    ctx: Arc<Context>,
    module: Module,
    flag: *mut u8,
}

/// Twenty seconds: how long a spinning kernel waits for its flag at most, so that a failing test does not
/// leave it spinning.
const SPIN_LIMIT_NS: u64 = 20_000_000_000;

impl Spinner {
    fn new(ctx: &Arc<Context>) -> Spinner {
        let module = Module::from_ptx(ctx, SPIN_PTX).unwrap();
        let flag = memory::pinned_host_alloc(ctx, 4096).unwrap();
        let sp = Spinner {
            ctx: ctx.clone(),
            module,
            flag,
        };
        sp.set(0);
        sp
    }

    fn set(&self, v: u32) {
        // SAFETY: `flag` is 4096 bytes of pinned host memory, aligned, that only this value and its
        // kernels (volatile loads) use.
        #[allow(unsafe_code)]
        unsafe {
            std::ptr::write_volatile(self.flag as *mut u32, v)
        };
    }

    /// Lets every kernel spinning on the flag go on.
    fn release(&self) {
        self.set(1);
    }

    /// Clears the flag for the next kernels (after the last ones finished).
    fn reset(&self) {
        self.set(0);
    }

    /// Lets the kernels go on after `delay`, from another thread.
    fn release_after(&self, delay: Duration) -> std::thread::JoinHandle<()> {
        let flag = self.flag as usize;
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            // SAFETY: as in `set`: the flag outlives the thread (the test joins it before the spinner
            // drops).
            #[allow(unsafe_code)]
            unsafe {
                std::ptr::write_volatile(flag as *mut u32, 1)
            };
        })
    }

    /// Queues on `stream` one thread that spins until the flag is set, touching nothing else.
    fn spin(&self, stream: &Stream) {
        let f = self.module.function("mempool_test_spin_until_flag").unwrap();
        let (mut flag, mut limit) = (self.flag as u64, SPIN_LIMIT_NS);
        // SAFETY: 1. the kernel takes (u64 flag, u64 limit): two pointers to u64s. 2. it reads the u32 at
        // `flag`, pinned host memory reachable at its host address (unified addressing) that lives until
        // the spinner drops, after the test synchronized the stream. 3. `stream` is of the module's context.
        #[allow(unsafe_code)]
        unsafe {
            f.launch(
                LaunchConfig {
                    grid: (1, 1, 1),
                    block: (1, 1, 1),
                    shared_mem: 0,
                },
                stream.as_ref(),
                &mut [
                    &mut flag as *mut u64 as *mut c_void,
                    &mut limit as *mut u64 as *mut c_void,
                ],
            )
        }
        .unwrap();
    }

    /// Queues on `stream` a kernel that spins until the flag is set, then writes `base + i` into the `i`th
    /// of the `n` `u32`s at `dst`.
    ///
    /// # Safety
    /// 1. `dst..dst + 4 * n` is device memory that work on `stream` may write until the kernel completes.
    #[allow(unsafe_code)]
    unsafe fn spin_then_fill(&self, stream: &Stream, dst: DeviceAddr, n: usize, base: u32) {
        let f = self.module.function("mempool_test_spin_then_fill").unwrap();
        let (mut flag, mut limit, mut d, mut b, mut len) = (self.flag as u64, SPIN_LIMIT_NS, dst.0, base, n as u64);
        // SAFETY: 1. (u64 flag, u64 limit, u64 dst, u32 base, u64 n): five pointers to values of those
        // widths. 2. the flag as in `spin`; `dst` is point 1. 3. `stream` is of the module's context.
        unsafe {
            f.launch(
                LaunchConfig::for_elements(n, 256),
                stream.as_ref(),
                &mut [
                    &mut flag as *mut u64 as *mut c_void,
                    &mut limit as *mut u64 as *mut c_void,
                    &mut d as *mut u64 as *mut c_void,
                    &mut b as *mut u32 as *mut c_void,
                    &mut len as *mut u64 as *mut c_void,
                ],
            )
        }
        .unwrap();
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        self.release();
        // The kernels read the flag until they end: wait for them before it is freed.
        let _ = self.ctx.synchronize();
        // SAFETY: `flag` came from `pinned_host_alloc`, is freed once, and no kernel reads it any more.
        #[allow(unsafe_code)]
        let _ = unsafe { memory::pinned_host_free(&self.ctx, self.flag) };
    }
}

#[test]
#[allow(unsafe_code)]
fn service_sleep_is_refused_while_the_stream_has_pending_work() {
    let g = gpu();
    let s = g.stream.as_ref();
    let mr = ServiceResource::new(&g.dev, options(256 * MIB, 2)).unwrap();
    let kv = mr.tag("kv").unwrap();
    let kvr = mr.tagged(kv);
    let a = kvr.allocate(8 * MIB, s).unwrap();
    // SAFETY: `a` is a live allocation of 8 MiB.
    unsafe { g.fill(a, 8 * MIB, 8) };
    g.stream.synchronize().unwrap();

    let module = Module::from_ptx(&g.ctx, SPIN_PTX).unwrap();
    let spin = module.function("mempool_test_spin_until_flag").unwrap();
    let flag = memory::pinned_host_alloc(&g.ctx, 4096).unwrap();
    // SAFETY: `flag` is 4096 bytes of pinned host memory, aligned, that only this test uses.
    unsafe { std::ptr::write_volatile(flag as *mut u32, 0) };
    let (mut flag_addr, mut limit) = (flag as u64, 20_000_000_000u64);
    // SAFETY: 1. the kernel takes (u64 flag, u64 limit): two pointers to u64s. 2. it reads the u32 at
    // `flag`, pinned host memory reachable at its host address (unified addressing) that lives until
    // the stream is synchronized below. 3. `s` is a stream of the module's context.
    unsafe {
        spin.launch(
            LaunchConfig {
                grid: (1, 1, 1),
                block: (1, 1, 1),
                shared_mem: 0,
            },
            s,
            &mut [
                &mut flag_addr as *mut u64 as *mut c_void,
                &mut limit as *mut u64 as *mut c_void,
            ],
        )
    }
    .unwrap();
    let refused = mr.sleep(&[kv], SleepMode::Discard, s);
    // Release the kernel before asserting anything, so that a failure does not leave it spinning.
    // SAFETY: as above; the kernel reads the word with volatile loads.
    unsafe { std::ptr::write_volatile(flag as *mut u32, 1) };
    g.stream.synchronize().unwrap();
    // SAFETY: `flag` came from `pinned_host_alloc`, is freed once, and the kernel reading it finished.
    unsafe { memory::pinned_host_free(&g.ctx, flag) }.unwrap();

    let msg = refused.unwrap_err().to_string();
    assert!(
        msg.contains("cannot sleep while the stream given has work still queued"),
        "{msg}"
    );
    let st = tag_stats(&mr, kv);
    assert_eq!(
        (st.asleep, st.mapped_bytes),
        (None, 8 * MIB as u64),
        "nothing changed: {st:?}"
    );
    // SAFETY: `a` is live and awake.
    unsafe { g.check(a, 8 * MIB, 8, "the block after the refused sleep") };

    // Once the stream is idle, the same call succeeds.
    let report = mr.sleep(&[kv], SleepMode::Offload, s).unwrap();
    assert_eq!(report.offloaded_bytes, 8 * MIB as u64);
    mr.wake(&[kv], s).unwrap();
    // SAFETY: `a` is live and awake again.
    unsafe { g.check(a, 8 * MIB, 8, "the block after sleep and wake") };
    // SAFETY: `a` came from `kvr` with this size; freed once.
    unsafe { kvr.deallocate(a, 8 * MIB, s) }.unwrap();
    drop(module);
    drop((kvr, mr));
    no_drop_errors();
}

#[test]
#[allow(unsafe_code)]
fn service_sleep_is_refused_while_an_export_lives() {
    let g = gpu();
    let s = g.stream.as_ref();
    let mr = ServiceResource::new(&g.dev, options(256 * MIB, 2)).unwrap();
    let w = mr.tag("weights").unwrap();
    let weights = mr.tagged(w);
    let p = weights.allocate(8 * MIB, s).unwrap();
    // SAFETY: `p` is a live allocation of 8 MiB.
    unsafe { g.fill(p, 8 * MIB, 9) };
    g.stream.synchronize().unwrap();

    let msg = mr.export(p, 0).unwrap_err().to_string();
    assert!(msg.contains("empty range"), "{msg}");
    let msg = mr
        .export(DeviceAddr(p.0 - 2 * MIB as u64), 2 * MIB)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("no live allocation of tag `weights` touches"), "{msg}");

    let ex = mr.export(p, 8 * MIB).unwrap();
    // The allocation's four chunks were mapped as one run: one physical allocation of 8 MiB.
    assert_eq!((ex.len(), ex.offset(), ex.chunks().len(), ex.tag()), (8 * MIB, 0, 1, w));
    assert_eq!(ex.chunks()[0].size(), 8 * MIB);
    assert_eq!(tag_stats(&mr, w).exports, 1);
    let msg = mr.sleep(&[w], SleepMode::Offload, s).unwrap_err().to_string();
    assert!(
        msg.contains("tag `weights` cannot sleep: 1 of its ranges are shared with another process"),
        "{msg}"
    );
    // A list naming a sleepable tag and the exported one changes nothing.
    let msg = mr
        .sleep(&[Tag::DEFAULT, w], SleepMode::Discard, s)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("shared with another process"), "{msg}");
    assert_eq!(tag_stats(&mr, Tag::DEFAULT).asleep, None);
    assert_eq!(tag_stats(&mr, w).asleep, None);

    drop(ex);
    assert_eq!(tag_stats(&mr, w).exports, 0);
    let report = mr.sleep(&[w], SleepMode::Offload, s).unwrap();
    assert_eq!(report.offloaded_bytes, 8 * MIB as u64);
    mr.wake(&[w], s).unwrap();
    // SAFETY: `p` is live and awake again.
    unsafe {
        g.check(
            p,
            8 * MIB,
            9,
            "the exported block after the export dropped, sleep and wake",
        )
    };
    // SAFETY: `p` came from `weights` with this size; freed once.
    unsafe { weights.deallocate(p, 8 * MIB, s) }.unwrap();
    drop((weights, mr));
    no_drop_errors();
}

#[test]
#[allow(unsafe_code)]
fn service_observers_see_every_map_and_unmap() {
    let g = gpu();
    let s = g.stream.as_ref();
    let mr = ServiceResource::new(&g.dev, options(GIB, 3)).unwrap();
    let w = mr.tag("weights").unwrap();
    let kv = mr.tag("kv").unwrap();
    let (weights, kvr) = (mr.tagged(w), mr.tagged(kv));
    let a = weights.allocate(8 * MIB, s).unwrap();

    // Attaching reports what is mapped already.
    let rec = Recorder::new(mr.chunk_size());
    let id = mr.attach(rec.clone());
    assert_eq!(
        rec.events(),
        vec![(
            true,
            ChunkRange {
                tag: w,
                addr: a,
                len: 8 * MIB
            }
        )],
        "a is the region's first block, at its chunk-aligned end"
    );
    rec.assert_agrees(&mr, "after attach");

    // Growth.
    let b = kvr.allocate(16 * MIB, s).unwrap();
    let c = weights.allocate(4 * MIB + 256, s).unwrap();
    rec.assert_agrees(&mr, "after growth");
    assert!(rec.events().iter().skip(1).all(|(mapped, _)| *mapped));
    assert_eq!(rec.mapped_bytes(kv), 16 * MIB as u64);

    // Trim: c's idle chunks are reported before they go.
    let n = rec.events().len();
    // SAFETY: `c` came from `weights` with this size; freed once; nothing used it.
    unsafe { weights.deallocate(c, 4 * MIB + 256, s) }.unwrap();
    let trimmed = mr.trim().unwrap();
    assert!(trimmed >= 4 * MIB as u64, "{trimmed}");
    let new: Vec<_> = rec.events()[n..].to_vec();
    assert!(
        !new.is_empty() && new.iter().all(|(mapped, r)| !mapped && r.tag == w),
        "{new:?}"
    );
    rec.assert_agrees(&mr, "after trim");

    // Sleep (unmapping) and wake (mapped).
    g.stream.synchronize().unwrap();
    mr.sleep(&[kv], SleepMode::Discard, s).unwrap();
    assert_eq!(rec.mapped_bytes(kv), 0);
    rec.assert_agrees(&mr, "after sleep");
    mr.wake(&[kv], s).unwrap();
    assert_eq!(rec.mapped_bytes(kv), 16 * MIB as u64);
    rec.assert_agrees(&mr, "after wake");

    // A second observer, attached now, sees the same; it is told of the unmapping when the resource drops.
    let rec2 = Recorder::new(mr.chunk_size());
    mr.attach(rec2.clone());
    rec2.assert_agrees(&mr, "second observer after attach");

    // Detach: the observer is told that everything mapped is unmapping, then nothing more.
    assert!(mr.detach(id));
    let errors = rec.errors.lock().unwrap().clone();
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(rec.total(), 0, "detach reports every mapped run as unmapping");
    let n = rec.events().len();
    let d = weights.allocate(32 * MIB, s).unwrap();
    assert_eq!(rec.events().len(), n, "a detached observer is not called");
    assert!(!mr.detach(id), "detached once");
    rec2.assert_agrees(&mr, "second observer after more growth");

    // SAFETY: each came from `mr`'s views with its size and is freed once; nothing used them.
    unsafe {
        weights.deallocate(a, 8 * MIB, s).unwrap();
        kvr.deallocate(b, 16 * MIB, s).unwrap();
    }
    // Dropping with a live allocation (d) unmaps everything, and says so.
    assert_eq!(mr.tag_of(d), Some(w));
    drop((weights, kvr, mr));
    let errors = rec2.errors.lock().unwrap().clone();
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(rec2.total(), 0, "dropping the resource reports every run as unmapping");
    no_drop_errors();
}

#[test]
#[allow(unsafe_code)]
fn service_out_of_memory_names_the_size_and_leaves_everything_as_it_was() {
    let g = gpu();
    let s = g.stream.as_ref();
    let total = g.dev.total_memory().unwrap();
    // Chunks of 510 MiB keep the attempt (map until the device is full, unmap, once more) to a few
    // hundred driver calls; not a power of two, so the reservation keeps the driver's own alignment. The
    // region holds the request, so the engine finds room and mapping is what fails.
    let chunk = 255 * 2 * MIB;
    let mr = ServiceResource::new(
        &g.dev,
        ServiceOptions {
            region_size: Some(4 * total),
            max_tags: 1,
            chunk_size: Some(chunk),
            ..Default::default()
        },
    )
    .unwrap();
    let a = mr.allocate(64 * MIB, s).unwrap();
    // SAFETY: `a` is a live allocation of 64 MiB.
    unsafe { g.fill(a, 64 * MIB, 21) };
    let before = mr.stats();
    assert_eq!(before.mapped_bytes, chunk as u64);
    let free_before = g.free_memory();

    let ask = 2 * total;
    let e = mr.allocate(ask, s).unwrap_err();
    let msg = e.to_string();
    println!("{msg}");
    assert!(e.is_out_of_memory(), "{e:?}");
    assert!(
        e.report().is_some_and(|r| r.requested == ask
            && r.tag.as_deref() == Some("default")
            && r.held == Some(chunk as u64)
            && r.live == Some(64 * MIB as u64)
            && r.largest_free.is_some()
            && r.device_free.is_some()),
        "{e:?}"
    );
    assert!(msg.contains(&format!("could not allocate {ask} bytes")), "{msg}");
    let after = mr.stats();
    assert_eq!(
        after.mapped_bytes, before.mapped_bytes,
        "nothing mapped stays: {after:?}"
    );
    assert_eq!(after.used_bytes, before.used_bytes);
    assert_eq!(after.tags[0].allocations, before.tags[0].allocations);
    assert_eq!(after.tags[0].live_allocations, 1);
    let free_after = g.free_memory();
    assert!(
        free_after + 64 * MIB >= free_before,
        "the failed request returned what it mapped: free {free_before} -> {free_after}"
    );

    // Still usable, nothing moved.
    // SAFETY: `a` is live.
    unsafe { g.check(a, 64 * MIB, 21, "a block after the out-of-memory") };
    let b = mr.allocate(GIB, s).unwrap();
    // SAFETY: `b` is a live allocation of 1 GiB.
    unsafe {
        g.fill(b, GIB, 22);
        g.check(b, GIB, 22, "a block allocated after the out-of-memory");
    }

    // A request larger than the region: the same error, naming the size.
    let small = ServiceResource::new(&g.dev, options(64 * MIB, 1)).unwrap();
    let e = small.allocate(128 * MIB, s).unwrap_err();
    assert!(e.report().is_some_and(|r| r.requested == 128 * MIB), "{e:?}");
    assert!(e.to_string().contains(&(128 * MIB).to_string()), "{e}");
    assert_eq!(small.stats().mapped_bytes, 0);
    let c = small.allocate(64 * MIB, s).unwrap();

    // SAFETY: each came from its resource with this size and is freed once, after its kernels (on `s`).
    unsafe {
        mr.deallocate(a, 64 * MIB, s).unwrap();
        mr.deallocate(b, GIB, s).unwrap();
        small.deallocate(c, 64 * MIB, s).unwrap();
    }
    drop((mr, small));
    no_drop_errors();
}

#[test]
#[allow(unsafe_code)]
fn service_drop_with_live_allocations_returns_everything() {
    let g = gpu();
    let s = g.stream.as_ref();
    // The scenario: three tags with live allocations, one of them asleep (offloaded to pinned host
    // memory), an observer attached, then the resource dropped. It runs twice: the first time sets up
    // what the driver makes lazily (events of the engines' streams, their pools), so that the second
    // measures the resource alone.
    let scenario = |baseline: Option<usize>| {
        let mr = ServiceResource::new(&g.dev, options(2 * GIB, 3)).unwrap();
        let kv = mr.tag("kv").unwrap();
        let w = mr.tag("weights").unwrap();
        let a = mr.allocate(256 * MIB, s).unwrap();
        let b = mr.tagged(kv).allocate(67 * MIB, s).unwrap();
        let c = mr.tagged(w).allocate(32 * MIB, s).unwrap();
        // SAFETY: a, b and c are live allocations of these sizes.
        unsafe {
            g.fill(a, 256 * MIB, 1);
            g.fill(b, 67 * MIB, 2);
            g.fill(c, 32 * MIB, 3);
        }
        g.stream.synchronize().unwrap();
        mr.sleep(&[w], SleepMode::Offload, s).unwrap();
        let rec = Recorder::new(mr.chunk_size());
        mr.attach(rec.clone());
        let mapped = mr.stats().mapped_bytes;
        assert_eq!(mapped, (256 + 68) * MIB as u64, "{:?}", mr.stats());
        if let Some(baseline) = baseline {
            let held = baseline.saturating_sub(g.free_memory());
            assert!(
                held as u64 >= mapped,
                "the device shows what is mapped: {held} < {mapped}"
            );
        }
        drop(mr); // a, b and c are still live
        let errors = rec.errors.lock().unwrap().clone();
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(rec.total(), 0, "the drop reported every mapped run as unmapping");
        no_drop_errors();
    };
    scenario(None);
    let baseline = g.free_memory();
    scenario(Some(baseline));
    let after = g.free_memory();
    println!("device free memory: baseline {baseline}, after the resource's drop {after}");
    assert!(
        after + 2 * MIB >= baseline,
        "dropping the resource returned everything but {} bytes (baseline {baseline}, after {after})",
        baseline - after
    );
}

#[test]
#[allow(unsafe_code)]
fn service_two_resources_on_one_device_stay_apart() {
    let g = gpu();
    let s = g.stream.as_ref();
    let one = ServiceResource::new(&g.dev, options(256 * MIB, 2)).unwrap();
    let two = ServiceResource::new(&g.dev, options(256 * MIB, 2)).unwrap();
    let r1 = one.base().0..one.base().0 + one.stats().reservation_bytes;
    let r2 = two.base().0..two.base().0 + two.stats().reservation_bytes;
    assert!(r1.end <= r2.start || r2.end <= r1.start, "{r1:x?} and {r2:x?} overlap");

    let p1 = one.allocate(16 * MIB, s).unwrap();
    let p2 = two.allocate(16 * MIB, s).unwrap();
    // SAFETY: p1 and p2 are live allocations of 16 MiB.
    unsafe {
        g.fill(p1, 16 * MIB, 100);
        g.fill(p2, 16 * MIB, 200);
    }
    assert_eq!(one.tag_of(p2), None);
    assert_eq!(two.tag_of(p1), None);

    // Frees that do not match are refused, naming why, and change nothing.
    // SAFETY: every call in this block is refused (checked below), so no allocation is freed.
    let refusals = unsafe {
        [
            (one.deallocate(p2, 16 * MIB, s), "not in the resource's reservation"),
            (one.deallocate(p1, 8 * MIB, s), "not a live allocation"),
            (
                one.deallocate(p1, 32 * MIB, s),
                "runs past the end of tag `default`'s region",
            ),
            (
                one.deallocate(p1.offset(256), 16 * MIB - 256, s),
                "not a live allocation",
            ),
            (
                one.deallocate(one.base().offset(256 * MIB), MIB, s),
                "lies in the region of tag 1, which the resource has not made (it has 1 tags)",
            ),
            (
                one.deallocate(one.base().offset(512 * MIB), MIB, s),
                "not in the resource's reservation",
            ),
        ]
    };
    for (r, why) in refusals {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::InvalidDeallocation { .. }), "{e:?}");
        assert!(e.to_string().contains(why), "`{why}` missing from: {e}");
    }
    assert_eq!(one.stats().tags[0].live_allocations, 1);

    // One sleeps and wakes while the other works.
    g.stream.synchronize().unwrap();
    one.sleep(&[Tag::DEFAULT], SleepMode::Offload, s).unwrap();
    let q2 = two.allocate(8 * MIB, s).unwrap();
    // SAFETY: q2 is a live allocation of 8 MiB; p2 is live and awake.
    unsafe {
        g.fill(q2, 8 * MIB, 300);
        g.check(p2, 16 * MIB, 200, "the second resource while the first sleeps");
    }
    one.wake(&[Tag::DEFAULT], s).unwrap();
    // SAFETY: p1 is live and awake again.
    unsafe { g.check(p1, 16 * MIB, 100, "the first resource after wake") };

    // Dropping one leaves the other whole.
    // SAFETY: p1 came from `one` with this size; freed once, after its kernels.
    unsafe { one.deallocate(p1, 16 * MIB, s) }.unwrap();
    drop(one);
    // SAFETY: p2 and q2 are live allocations of `two`.
    unsafe {
        g.check(p2, 16 * MIB, 200, "the second resource after the first dropped");
        g.check(q2, 8 * MIB, 300, "the second resource after the first dropped");
    }
    let r = two.allocate(4 * MIB, s).unwrap();
    // SAFETY: each came from `two` with its size and is freed once, after its kernels (on `s`).
    unsafe {
        two.deallocate(p2, 16 * MIB, s).unwrap();
        two.deallocate(q2, 8 * MIB, s).unwrap();
        two.deallocate(r, 4 * MIB, s).unwrap();
    }
    drop(two);
    no_drop_errors();
}

/// Issue 33, finding 1: a block freed on one stream while a kernel queued there before the free still
/// writes it. `sleep` given another (idle) stream, and `trim`, must not unmap it under that kernel: they
/// return only once it is done, and it ends without a fault. The kernel spins until a thread sets its flag,
/// 300 ms after the call began, then writes the block. Were the block unmapped under it, the write would
/// fault (`CUDA_ERROR_ILLEGAL_ADDRESS` from the stream's synchronize, which also poisons the context for
/// the tests after this one).
#[test]
#[allow(unsafe_code)]
fn service_sleep_and_trim_wait_for_a_free_in_flight_on_another_stream() {
    let g = gpu();
    let s = g.stream.as_ref();
    let s1 = Stream::new(&g.ctx).unwrap();
    let spinner = Spinner::new(&g.ctx);
    let mr = ServiceResource::new(&g.dev, options(256 * MIB, 2)).unwrap();
    let kv = mr.tag("kv").unwrap();
    let kvr = mr.tagged(kv);
    // A block that stays live through the sleep, on chunks of its own (4 MiB at the region's start).
    let keep = kvr.allocate(4 * MIB, s).unwrap();
    // SAFETY: `keep` is a live allocation of 4 MiB.
    unsafe { g.fill(keep, 4 * MIB, 11) };
    g.stream.synchronize().unwrap();

    for round in ["sleep", "trim"] {
        let x = kvr.allocate(8 * MIB, s1.as_ref()).unwrap();
        // SAFETY: `x` is a live allocation of 8 MiB, allocated on `s1`; the kernel is queued on `s1` before
        // the free below, which the stream contract allows.
        unsafe { spinner.spin_then_fill(&s1, x, 1 << 16, 7) };
        // SAFETY: `x` came from `kvr` with this size and is freed once; its one use (the kernel) is queued on
        // `s1` before the free, and nothing uses it after.
        unsafe { kvr.deallocate(x, 8 * MIB, s1.as_ref()) }.unwrap();
        assert!(!s1.as_ref().is_idle().unwrap(), "{round}: the kernel spins");
        let release = spinner.release_after(Duration::from_millis(300));
        // `s`, the stream the calls are given, is idle; `s1` is not.
        let released = match round {
            "sleep" => mr.sleep(&[kv], SleepMode::Discard, s).unwrap().released_bytes,
            _ => mr.trim().unwrap(),
        };
        let waited = s1.as_ref().is_idle().unwrap();
        release.join().unwrap();
        let finished = s1.synchronize();
        assert!(
            finished.is_ok(),
            "{round}: the kernel that writes the freed block failed: {finished:?} (it was unmapped under it)"
        );
        assert!(
            waited,
            "{round} returned before the work queued on another stream ahead of a free was done"
        );
        assert!(
            released >= 8 * MIB as u64,
            "{round}: the freed block's chunks went: {released}"
        );
        spinner.reset();
        if round == "sleep" {
            mr.wake(&[kv], s).unwrap();
            // SAFETY: `keep` is live and awake again; its contents were discarded: write, then read.
            unsafe {
                g.fill(keep, 4 * MIB, 12);
                g.check(keep, 4 * MIB, 12, "the live block after discard and wake");
            }
        }
    }
    // SAFETY: `keep` came from `kvr` with this size; freed once, after its kernels (on `s`).
    unsafe { kvr.deallocate(keep, 4 * MIB, s) }.unwrap();
    drop((kvr, mr));
    drop(spinner);
    no_drop_errors();
}

/// Issue 33: unmapping waits for what used the memory, not for the whole device. A kernel of someone
/// else (on a stream of its own, touching none of the resource's memory) spins; `trim`, `sleep` and `wake`
/// of a tag with nothing live, and the drop (with nothing live) must all return while it still runs. A
/// tag with a live allocation does wait for the device when it sleeps (its users' streams are unknown), so
/// that part runs with nothing spinning.
/// Before the change `trim` and `sleep` began with `cuCtxSynchronize` (and the drop waited so too), which
/// waits for that kernel: `trim` returned only when its 20 s limit ran out, and it was no longer running.
#[test]
#[allow(unsafe_code)]
fn service_unmaps_without_waiting_for_unrelated_work() {
    let g = gpu();
    let s = g.stream.as_ref();
    let other = Stream::new(&g.ctx).unwrap();
    let spinner = Spinner::new(&g.ctx);
    // Three tags: "default", "kv" and "idle".
    let mr = ServiceResource::new(&g.dev, options(256 * MIB, 3)).unwrap();
    let kv = mr.tag("kv").unwrap();
    let kvr = mr.tagged(kv);
    let idle = mr.tag("idle").unwrap();
    let idler = mr.tagged(idle);
    let a = kvr.allocate(8 * MIB, s).unwrap();
    let b = kvr.allocate(4 * MIB, s).unwrap();
    let c = idler.allocate(2 * MIB, s).unwrap();
    // SAFETY: a, b and c are live allocations of these sizes.
    unsafe {
        g.fill(a, 8 * MIB, 1);
        g.fill(b, 4 * MIB, 2);
        g.fill(c, 2 * MIB, 4);
    }
    g.stream.synchronize().unwrap();
    // SAFETY: `a` and `c` came from `kvr` and `idler` with these sizes; freed once, after their kernels (on
    // `s`, synchronized).
    unsafe {
        kvr.deallocate(a, 8 * MIB, s).unwrap();
        idler.deallocate(c, 2 * MIB, s).unwrap();
    }

    spinner.spin(&other);
    let busy = || !other.as_ref().is_idle().unwrap();
    assert!(busy(), "the unrelated kernel spins");
    let trimmed = mr.trim().unwrap();
    let after_trim = busy();
    // A tag with nothing live: sleep and wake wait for its frees alone, not for the device.
    mr.sleep(&[idle], SleepMode::Discard, s).unwrap();
    let after_sleep = busy();
    mr.wake(&[idle], s).unwrap();
    let after_wake = busy();
    spinner.release();
    other.synchronize().unwrap();
    spinner.reset();
    // A tag with a live allocation: its users' streams are unknown, so sleep waits for the device (nothing
    // spins now), and the live block is mapped back by wake.
    let slept = mr.sleep(&[kv], SleepMode::Discard, s).unwrap();
    let woken = mr.wake(&[kv], s).unwrap();
    // SAFETY: `b` is live and awake (its contents were discarded: write, then read).
    unsafe {
        g.fill(b, 4 * MIB, 3);
        g.check(b, 4 * MIB, 3, "the live block after discard and wake");
    }
    // SAFETY: `b` came from `kvr` with this size; freed once, after its kernels (on `s`, synchronized by
    // the check).
    unsafe { kvr.deallocate(b, 4 * MIB, s) }.unwrap();
    spinner.spin(&other);
    assert!(busy(), "the unrelated kernel spins again");
    drop((kvr, idler, mr)); // nothing live: the drop waits for the frees alone
    let after_drop = busy();
    spinner.release();
    other.synchronize().unwrap();
    println!("trimmed {trimmed}, slept {slept:?}, woken {woken:?}");
    assert!(
        trimmed >= 8 * MIB as u64,
        "trim released the freed block's chunks: {trimmed}"
    );
    assert!(slept.released_bytes >= 4 * MIB as u64 && woken.mapped_bytes >= 4 * MIB as u64);
    assert!(
        after_trim,
        "trim waited for work that touches none of the resource's memory"
    );
    assert!(
        after_sleep,
        "sleep of a tag with nothing live waited for work that touches none of the resource's memory"
    );
    assert!(
        after_wake,
        "wake waited for work that touches none of the resource's memory"
    );
    assert!(
        after_drop,
        "the drop waited for work that touches none of the resource's memory"
    );
    drop(spinner);
    no_drop_errors();
}

/// Issue 33, finding 4: a free into a sleeping tag is taken, as bookkeeping. PyTorch's and CuPy's entry
/// points (mempool-capi) drop their table entry before they free, so a refused free lost the allocation
/// for good. The block goes back to the tag's free list as address space; `wake` maps back only the chunks
/// live allocations still touch, an offloaded tag's bytes restored from where they were saved.
#[test]
#[allow(unsafe_code)]
fn service_a_free_while_asleep_is_taken_and_wake_maps_back_only_what_is_live() {
    let g = gpu();
    let s = g.stream.as_ref();
    let mr = ServiceResource::new(&g.dev, options(256 * MIB, 2)).unwrap();
    let w = mr.tag("w").unwrap();
    let wr = mr.tagged(w);
    let chunk = mr.chunk_size();
    // a and b share a chunk; c has chunks of its own.
    let (na, nb, nc) = (3 * MIB, 3 * MIB, 4 * MIB);
    let a = wr.allocate(na, s).unwrap();
    let b = wr.allocate(nb, s).unwrap();
    let c = wr.allocate(nc, s).unwrap();
    // SAFETY: a, b and c are live allocations of these sizes.
    unsafe {
        g.fill(a, na, 0x100);
        g.fill(b, nb, 0x2000_0000);
        g.fill(c, nc, 0x3000_0000);
    }
    g.stream.synchronize().unwrap();
    let saved = touched_bytes(chunk, &[(a, na), (b, nb), (c, nc)]);
    let only_b = touched_bytes(chunk, &[(b, nb)]);
    assert!(only_b < saved, "b leaves chunks of a and c that only they touch");

    // Offloaded: a and c are freed while the tag sleeps.
    let report = mr.sleep(&[w], SleepMode::Offload, s).unwrap();
    assert_eq!(report.offloaded_bytes, saved, "{report:?}");
    // SAFETY: a and c came from `wr` with these sizes, are freed once, and nothing used them since the
    // synchronize above.
    unsafe {
        wr.deallocate(a, na, s).unwrap();
        wr.deallocate(c, nc, s).unwrap();
    }
    let st = tag_stats(&mr, w);
    assert_eq!(
        (st.asleep, st.live_allocations, st.frees, st.used_bytes),
        (Some(SleepMode::Offload), 1, 2, nb as u64),
        "the frees were taken while asleep: {st:?}"
    );
    assert_eq!(
        (st.mapped_bytes, st.offloaded_bytes),
        (0, saved),
        "still asleep: {st:?}"
    );
    let woken = mr.wake(&[w], s).unwrap();
    assert_eq!(
        (woken.mapped_bytes, woken.restored_bytes),
        (only_b, only_b),
        "only the chunks b touches come back: {woken:?}"
    );
    assert_eq!(tag_stats(&mr, w).mapped_bytes, only_b);
    // SAFETY: `b` is live and awake again: its bytes come from where the offload saved them.
    unsafe { g.check(b, nb, 0x2000_0000, "b after its neighbours were freed while asleep") };
    // The freed blocks' address space is allocated again (mapped anew).
    let a2 = wr.allocate(na, s).unwrap();
    let c2 = wr.allocate(nc, s).unwrap();
    // SAFETY: a2 and c2 are live allocations of these sizes; b is live and awake.
    unsafe {
        g.fill(a2, na, 0x4000_0000);
        g.fill(c2, nc, 0x5000_0000);
        g.check(a2, na, 0x4000_0000, "a block allocated again after the wake");
        g.check(c2, nc, 0x5000_0000, "another block allocated again after the wake");
        g.check(b, nb, 0x2000_0000, "b beside them");
    }

    // Discarded: b is freed while the tag sleeps.
    let both = touched_bytes(chunk, &[(a2, na), (c2, nc)]);
    mr.sleep(&[w], SleepMode::Discard, s).unwrap();
    // SAFETY: `b` came from `wr` with this size, freed once; its last use (the check) was waited for.
    unsafe { wr.deallocate(b, nb, s) }.unwrap();
    assert_eq!(tag_stats(&mr, w).live_allocations, 2);
    let woken = mr.wake(&[w], s).unwrap();
    assert_eq!((woken.mapped_bytes, woken.restored_bytes), (both, 0), "{woken:?}");
    // SAFETY: a2 and c2 are live and awake (contents discarded: write, then read).
    unsafe {
        g.fill(a2, na, 6);
        g.fill(c2, nc, 7);
        g.check(a2, na, 6, "a2 after discard and wake");
        g.check(c2, nc, 7, "c2 after discard and wake");
    }
    // SAFETY: each came from `wr` with its size, freed once, after its kernels (on `s`).
    unsafe {
        wr.deallocate(a2, na, s).unwrap();
        wr.deallocate(c2, nc, s).unwrap();
    }
    let st = tag_stats(&mr, w);
    assert_eq!((st.live_allocations, st.used_bytes, st.frees), (0, 0, 5), "{st:?}");
    drop((wr, mr));
    no_drop_errors();
}

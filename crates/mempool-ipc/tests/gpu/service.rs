//! GPU tests of sharing a service resource's memory across processes (`ServiceResource::export`,
//! `Exporter::share_vmm_chunks`, `Importer::recv_any` / `SharedVmmRange`), in two processes over the
//! re-exec harness: the owner allocates under a tag so that the range lies across physical allocations of
//! different sizes (growth maps the chunks an allocation needs as one physical allocation, so a range
//! that also covers a chunk mapped earlier spans two), fills the range
//! and shares them; the importer maps them, each of its own size, back to back at an address of its own
//! and works on them on its GPU; while it holds them the tag cannot
//! sleep; once it released them, or died, the owner is back at its baseline and the tag sleeps. Run:
//! `cargo test -p mempool-ipc --features gpu --test gpu service::`.

use crate::harness::*;
use mempool_core::kernels::u32s;
use mempool_ipc::{Received, SharedVmmRange};
use mempool_rmm::{ServiceOptions, ServiceResource, SleepMode, Tag, TagStats};

/// A resource of four tags of 4 GiB of addresses each, with exportable chunks.
fn service(dev: &Device) -> Arc<ServiceResource> {
    let options = ServiceOptions {
        region_size: Some(4 << 30),
        max_tags: 4,
        shareable: Some(true),
        ..ServiceOptions::default()
    };
    ServiceResource::new(dev, options).expect("a service resource with exportable chunks")
}

fn tag_stats(mr: &ServiceResource, tag: Tag) -> TagStats {
    mr.stats().tags[tag.index()].clone()
}

fn connect_chunks() -> (Importer, Stream, CheckKernels) {
    let options = ImporterOptions {
        accept_vmm: true,
        ..ImporterOptions::default()
    };
    let importer = Importer::connect(child_socket(), options).expect("connect to the exporter");
    assert!(
        importer.accepts_vmm_chunks(),
        "the exporter offers ranges of VMM chunks"
    );
    let ctx = importer.device().context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    (importer, stream, kernels)
}

fn recv_range(importer: &Importer, stream: &Stream) -> SharedVmmRange {
    match importer
        .recv_any_timeout(stream.as_ref(), WAIT)
        .expect("a range of VMM chunks")
    {
        Received::VmmRange(r) => r,
        Received::Buffer(b) => panic!("a pool buffer instead of a range of VMM chunks: {b:?}"),
        Received::Vmm(v) => panic!("one VMM allocation instead of a range of VMM chunks: {v:?}"),
    }
}

/// What the parent tells the importer to expect, in its role: the size of every physical allocation
/// behind the range, and where the range starts in the first.
fn importer_role(sizes: &[usize], offset: usize) -> String {
    let sizes: Vec<String> = sizes.iter().map(usize::to_string).collect();
    format!("importer {} {offset}", sizes.join(","))
}

/// The sizes and offset `importer_role` wrote into this child's role.
fn expected_shape() -> (Vec<usize>, usize) {
    let role = role().expect("a child");
    let mut words = role.split(' ').skip(1);
    let sizes = words
        .next()
        .expect("the allocations' sizes")
        .split(',')
        .map(|s| s.parse().unwrap())
        .collect();
    let offset = words.next().expect("the offset").parse().unwrap();
    (sizes, offset)
}

/// What the importer checks of every range it receives: its shape (the owner's allocations, of
/// different sizes, mapped back to back), and (on its GPU, through its own mapping) that `add` sees the
/// owner's `iota(base)` across every allocation: after adding 5, it reads `base + 5 + i`.
fn check_range_on_gpu(r: &SharedVmmRange, stream: &Stream, kernels: &CheckKernels, base: u32) {
    let (sizes, offset) = expected_shape();
    assert_eq!(r.chunk_sizes(), &sizes[..], "the owner's allocations: {r:?}");
    assert_eq!(r.chunks(), sizes.len(), "{r:?}");
    assert_eq!(r.offset(), offset, "{r:?}");
    assert!(
        sizes.iter().any(|&s| s != sizes[0]),
        "allocations of different sizes: {r:?}"
    );
    let total: usize = sizes.iter().sum();
    let last_start = total - sizes[sizes.len() - 1];
    assert!(r.offset() < sizes[0], "{r:?}");
    assert!(
        r.offset() + r.len() > last_start && r.offset() + r.len() <= total,
        "{r:?}"
    );
    assert_eq!(r.reservation().size(), total, "{r:?}");
    assert!(r.reservation().is_mapped(0, total), "every allocation is mapped: {r:?}");
    assert_eq!(r.len() % 4, 0, "{r:?}");
    assert_eq!(r.ptr().as_raw() % 256, 0, "{r:?}");
    let n = r.len() / 4;
    // SAFETY: the range holds n u32s (checked above), mapped read-write for this device, ordered on
    // `stream` after the owner's event.
    unsafe { kernels.add(r.ptr(), n, 5, stream.as_ref()) }.unwrap();
    let mut host = vec![0u8; r.len()];
    r.view(stream.as_ref()).unwrap().copy_to_host(0, &mut host).unwrap();
    assert_iota(&u32s(&host), base + 5, "the importer's GPU sees the owner's data");
    // The bytes on both sides of every boundary between two allocations, read on their own.
    let mut at = 0;
    for size in &sizes[..sizes.len() - 1] {
        at += size;
        let i = (at - r.offset()) / 4;
        let mut pair = [0u8; 8];
        r.view(stream.as_ref())
            .unwrap()
            .copy_to_host(4 * (i - 1), &mut pair)
            .unwrap();
        assert_eq!(
            u32s(&pair),
            vec![base + 5 + i as u32 - 1, base + 5 + i as u32],
            "at byte {at}"
        );
    }
}

/// The owner's side: the resource, its tag and allocations, and the exporter.
struct Owner {
    mr: Arc<ServiceResource>,
    tag: Tag,
    stream: Stream,
    ctx: Arc<Context>,
    small: DeviceAddr,
    big: DeviceAddr,
    len: usize,
    exporter: Exporter,
}

/// The owner's side, up to the share: a small allocation first (its chunk mapped alone, next to the
/// shared one, which ends or starts inside it), then `len` bytes over 40 chunks and more filled with
/// `iota(base)` (their growth maps the chunks it needs as one allocation, beside the one it shares with
/// `small`), exported as allocations of different
/// sizes and shared with the one importer (a child running `test`, told the sizes to expect), after
/// checking what the exporter refuses.
fn share_with_child(test: &str, sock_tag: &str, base: u32) -> (Owner, ChildProc) {
    let (dev, ctx) = gpu();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let mr = service(&dev);
    let tag = mr.tag("kv-cache").unwrap();
    let chunk = mr.chunk_size();
    let small = mr.allocate_tagged(MIB, tag, stream.as_ref()).unwrap();
    let len = 40 * chunk + MIB;
    let big = mr.allocate_tagged(len, tag, stream.as_ref()).unwrap();
    // SAFETY: `big` holds len / 4 u32s, allocated on `stream`.
    unsafe { kernels.iota(big, len / 4, base, stream.as_ref()) }.unwrap();

    let export = mr.export(big, len).unwrap();
    let chunks = export.chunks().to_vec();
    let offset = export.offset();
    let sizes: Vec<usize> = chunks.iter().map(|c| c.size()).collect();
    let total: usize = sizes.iter().sum();
    assert!(chunks.len() >= 2, "{export:?} {sizes:?}");
    assert!(sizes.iter().all(|s| s % chunk == 0), "{sizes:?}");
    assert!(
        sizes.iter().any(|&s| s != sizes[0]),
        "the range lies across allocations of different sizes: {sizes:?}"
    );
    assert!(offset < sizes[0] && offset + len <= total, "{export:?} {sizes:?}");
    assert!(offset + len > total - sizes[sizes.len() - 1], "{export:?} {sizes:?}");
    assert_eq!(tag_stats(&mr, tag).exports, 1);

    let sock = socket_path(sock_tag);
    let exporter = Exporter::new(&sock, exportable_pool(&dev), ExporterOptions::default()).unwrap();
    let child = ChildProc::spawn(test, &importer_role(&sizes, offset), &sock);
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;

    // What the exporter refuses before sending anything (each hold dropped at once).
    let refused = |chunks: &[Arc<mempool_core::PhysicalAllocation>], offset: usize, len: usize, why: &str| {
        let err = exporter
            .share_vmm_chunks(chunks, offset, len, Box::new(()), stream.as_ref(), &[id])
            .expect_err(why);
        assert!(err.to_string().contains(why), "{err}");
    };
    refused(&[], 0, 1, "at least one chunk");
    refused(&chunks, sizes[0], 1, "starts in the first");
    refused(&chunks, offset, total - offset + 1, "starts in the first");
    refused(&chunks, offset, 0, "non-empty");
    refused(&chunks, 0, 1, "before the last");
    // Chunks of one range in another order: the range ends before the last one.
    let mut reversed = chunks.clone();
    reversed.reverse();
    refused(&reversed, 0, sizes[sizes.len() - 1], "before the last");
    assert_eq!(exporter.stats().live_buffers, 0);

    exporter
        .share_vmm_chunks(&chunks, offset, len, Box::new(export), stream.as_ref(), &[id])
        .unwrap();
    drop((chunks, reversed));
    // The owner keeps no reference: the importer's lease alone keeps the range (and the tag awake).
    let stats = exporter.stats();
    assert_eq!((stats.live_buffers, stats.deferred_buffers), (1, 1), "{stats:?}");
    assert_eq!(tag_stats(&mr, tag).exports, 1);
    let owner = Owner {
        mr,
        tag,
        stream,
        ctx,
        small,
        big,
        len,
        exporter,
    };
    (owner, child)
}

/// Sleeping the tag is refused while the importer holds the range, naming why.
fn sleep_is_refused(o: &Owner) {
    o.stream.synchronize().unwrap();
    let err =
        o.mr.sleep(&[o.tag], SleepMode::Discard, o.stream.as_ref())
            .expect_err("a tag whose range another process holds cannot sleep");
    assert!(err.to_string().contains("shared with another process"), "{err}");
    assert_eq!(tag_stats(&o.mr, o.tag).asleep, None);
}

/// After the importer let go (or died): the hold is dropped, the tag sleeps and wakes, and once the
/// allocations are freed and trimmed the resource holds nothing.
fn back_to_baseline(o: Owner) {
    o.exporter
        .wait_idle(WAIT)
        .expect("the range is freed once the importer let go");
    assert_eq!(tag_stats(&o.mr, o.tag).exports, 0, "the hold was dropped");
    o.stream.synchronize().unwrap();
    let slept = o.mr.sleep(&[o.tag], SleepMode::Discard, o.stream.as_ref()).unwrap();
    assert!(slept.released_bytes >= (41 * o.mr.chunk_size()) as u64, "{slept:?}");
    assert_eq!(tag_stats(&o.mr, o.tag).mapped_bytes, 0);
    o.mr.wake(&[o.tag], o.stream.as_ref()).unwrap();
    // SAFETY: both came from `allocate_tagged` on this resource with these sizes, are freed once, and
    // nothing uses them any more (the stream is synchronized, the importer is done or gone).
    unsafe {
        o.mr.deallocate(o.small, MIB, o.stream.as_ref()).unwrap();
        o.mr.deallocate(o.big, o.len, o.stream.as_ref()).unwrap();
    }
    o.stream.synchronize().unwrap();
    o.mr.trim().unwrap();
    let stats = o.mr.stats();
    assert_eq!((stats.used_bytes, stats.mapped_bytes), (0, 0), "{stats:?}");
    assert!(stats.tags.iter().all(|t| t.exports == 0), "{stats:?}");
    let errors = o.exporter.shutdown();
    assert!(errors.is_empty(), "{errors:?}");
    drop(o.mr);
    drop(o.ctx);
    no_drop_errors("owner");
}

#[test]
fn service_range_is_mapped_and_checked_by_another_process_and_keeps_its_tag_awake_until_released() {
    let test = this_test!();
    if role().is_some() {
        let (importer, stream, kernels) = connect_chunks();
        let r = recv_range(&importer, &stream);
        check_range_on_gpu(&r, &stream, &kernels, 7);
        assert_eq!(importer.held(), 1);
        tell_parent("HOLDING");
        hear_parent("RELEASE");
        drop(r); // waits for the device, unmaps every chunk, sends Release
        assert_eq!(importer.held(), 0);
        tell_parent("RELEASED");
        drop(importer);
        no_drop_errors("importer");
        return;
    }
    let _serial = serial();
    let (o, mut child) = share_with_child(test, "service-release", 7);
    child.expect("HOLDING");
    sleep_is_refused(&o);
    child.say("RELEASE");
    child.expect("RELEASED");
    o.exporter.wait_idle(WAIT).unwrap();
    let stats = o.exporter.stats();
    assert_eq!(
        (stats.freed_buffers, stats.reclaimed_buffers, stats.abandoned_buffers),
        (1, 0, 0),
        "{stats:?}"
    );
    // The importer's writes through its mapping are the owner's bytes.
    assert_iota(
        // SAFETY: `big` is live (allocated here) and holds len / 4 u32s; the importer synchronized before
        // it released, and the owner's stream is idle.
        &unsafe { read_u32s(&o.ctx, o.big, o.len / 4, o.stream.as_ref()) },
        12,
        "the owner sees the importer's writes",
    );
    child.succeeds();
    back_to_baseline(o);
}

#[test]
fn service_range_held_by_a_killed_importer_is_reclaimed_and_its_tag_sleeps_again() {
    let test = this_test!();
    if role().is_some() {
        let (importer, stream, kernels) = connect_chunks();
        let r = recv_range(&importer, &stream);
        check_range_on_gpu(&r, &stream, &kernels, 100);
        let mut told = false;
        // Keep the GPU busy on the shared memory until the parent kills this process.
        loop {
            // SAFETY: the range holds len / 4 u32s, mapped read-write for this device, ordered on `stream`.
            unsafe { kernels.add(r.ptr(), r.len() / 4, 1, stream.as_ref()) }.unwrap();
            if !told {
                tell_parent("HOLDING");
                told = true;
            }
            stream.synchronize().unwrap();
        }
    }
    let _serial = serial();
    let (o, mut child) = share_with_child(test, "service-kill", 100);
    child.expect("HOLDING");
    sleep_is_refused(&o);
    child.kill();
    o.exporter
        .wait_idle(WAIT)
        .expect("the dead importer's range is reclaimed");
    let stats = o.exporter.stats();
    assert_eq!(
        (
            stats.importers,
            stats.reclaimed_buffers,
            stats.freed_buffers,
            stats.abandoned_buffers
        ),
        (0, 1, 1, 0),
        "{stats:?}"
    );
    back_to_baseline(o);
}

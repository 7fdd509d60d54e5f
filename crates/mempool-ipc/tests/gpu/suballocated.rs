//! Suballocated buffers: one exported block, buffers as block + offset (and the version-1 path).

use crate::harness::*;

const SUB_COUNT: usize = 16;
const SUB_LEN: usize = 64 << 10;

fn suballocated_child() {
    // The "importer-v1" role speaks protocol version 1: the path without kept imports.
    let v1 = role().as_deref() == Some("importer-v1");
    let options = ImporterOptions {
        fast_release: !v1,
        ..ImporterOptions::default()
    };
    let importer = Importer::connect(child_socket(), options).expect("connect to the exporter");
    assert_eq!(
        importer.fast_release(),
        !v1,
        "the fast release path is negotiated as asked"
    );
    let ctx = importer.device().context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let n = SUB_LEN / 4;
    let mut bufs = Vec::new();
    for k in 0..SUB_COUNT {
        let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
        assert_eq!(buf.len(), SUB_LEN);
        assert_iota(&shared_u32s(&buf), (k * 100_000) as u32, "suballocated buffer data");
        bufs.push(buf);
    }
    let first_block = bufs[0].block();
    assert!(
        bufs.iter().all(|b| b.block() == first_block),
        "all buffers come from one block"
    );
    assert_eq!(importer.imported_blocks(), 1, "the block is imported once");
    let mut addresses: Vec<u64> = bufs.iter().map(|b| b.ptr().as_raw()).collect();
    addresses.sort_unstable();
    addresses.dedup();
    assert_eq!(addresses.len(), SUB_COUNT, "distinct offsets in the block");
    for buf in &bufs {
        // SAFETY: each buffer holds n u32s, ordered on `stream`.
        unsafe { kernels.add(buf.ptr(), n, 7, stream.as_ref()) }.unwrap();
    }
    drop(bufs);
    // Version 2 keeps the block imported (the exporter let it); version 1 frees it with its last buffer.
    let kept = usize::from(!v1);
    assert_eq!(
        (importer.imported_blocks(), importer.kept_blocks()),
        (kept, kept),
        "imports after the last buffer was released"
    );
    drop(importer);
    no_drop_errors("importer");
}

/// `make` builds the suballocating resource over the exporter's pool; `release` returns its unused
/// chunks to that pool, reporting any error, before the resource is dropped.
fn suballocated_parent<R: MemoryResource + 'static>(
    test: &str,
    child_role: &str,
    make: impl FnOnce(Arc<AsyncResource>, &Device) -> R,
    release: impl FnOnce(&R) -> mempool_rmm::Result<()>,
) {
    let _serial = serial();
    let (dev, ctx) = gpu();
    let upstream = Arc::new(
        AsyncResource::new(
            &dev,
            AsyncOptions {
                handle_types: HandleTypes::POSIX_FILE_DESCRIPTOR,
                release_threshold: ReleaseThreshold::KeepAll,
                ..AsyncOptions::default()
            },
        )
        .unwrap(),
    );
    let sub = Arc::new(make(upstream.clone(), &dev));
    let sock = socket_path(test);
    let exporter =
        Exporter::with_pool_in(&sock, upstream.clone(), AsyncResource::pool, ExporterOptions::default()).unwrap();
    let child = ChildProc::spawn(test, child_role, &sock);
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;

    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let n = SUB_LEN / 4;
    let mut bufs = Vec::new();
    for k in 0..SUB_COUNT {
        let ptr = sub.allocate(SUB_LEN, stream.as_ref()).unwrap();
        let mr = sub.clone();
        let free = move |p: DeviceAddr, len: usize, s: StreamRef<'_>| {
            // SAFETY: the exporter calls this once, after the last holder released the buffer, with the
            // address and size adopted below (an allocation of `sub` on `stream`).
            unsafe { mr.deallocate(p, len, s) }
        };
        // SAFETY: `ptr` is this test's fresh SUB_LEN allocation of `sub` on `stream`, handed over here and
        // used only through the returned buffer; `free` gives exactly it back to `sub`.
        let buf = unsafe { exporter.adopt(ptr, SUB_LEN, stream.as_ref(), free) }.unwrap();
        // SAFETY: the buffer holds n u32s on `stream`.
        unsafe { kernels.iota(buf.ptr(), n, (k * 100_000) as u32, stream.as_ref()) }.unwrap();
        bufs.push(buf);
    }
    assert_eq!(exporter.stats().blocks, 1, "one upstream block holds all the buffers");
    for buf in &bufs {
        exporter.share(buf, &[id]).unwrap();
    }
    for (k, buf) in bufs.iter().enumerate() {
        buf.wait_released(WAIT).unwrap();
        assert_iota(
            // SAFETY: the buffer is live (held here) and holds that many u32s; its writers are done (released
            // or synchronized) or ordered before the copy on its stream.
            &unsafe { read_u32s(&ctx, buf.ptr(), n, stream.as_ref()) },
            (k * 100_000 + 7) as u32,
            "the exporter sees the importer's writes to a suballocated buffer",
        );
    }
    child.succeeds();
    // The exporter counts the importer gone (and no longer keeping the block) once it has read its
    // Goodbye: wait for that, or the last buffer would be parked rather than freed.
    wait_no_importers(&exporter);
    drop(bufs);
    exporter.wait_idle(WAIT).unwrap();
    let stats = exporter.stats();
    assert_eq!((stats.freed_buffers, stats.blocks), (SUB_COUNT as u64, 0), "{stats:?}");
    assert!(exporter.shutdown().is_empty());
    stream.synchronize().unwrap();
    release(&sub).expect("every chunk goes back to the pool without error");
    drop(sub);
    wait_used(upstream.pool(), &ctx, 0);
    no_drop_errors("exporter");
}

#[test]
fn suballocated_buffers_from_a_pool_resource_share_one_block() {
    if role().is_some() {
        return suballocated_child();
    }
    suballocated_parent(
        this_test!(),
        "importer",
        |upstream, dev| {
            let options = PoolOptions {
                initial_size: 8 * MIB as u64,
                ..PoolOptions::default()
            };
            PoolResource::new(upstream, dev, options).unwrap()
        },
        PoolResource::release_unused,
    );
}

#[test]
fn suballocated_buffers_from_a_binning_resource_share_one_block() {
    if role().is_some() {
        return suballocated_child();
    }
    suballocated_parent(
        this_test!(),
        "importer",
        |upstream, dev| BinningResource::new(upstream, dev, BinningOptions::default()).unwrap(),
        BinningResource::release_unused,
    );
}

#[test]
fn a_version_1_importer_gets_the_version_1_path_from_a_version_2_exporter() {
    if role().is_some() {
        return suballocated_child();
    }
    suballocated_parent(
        this_test!(),
        "importer-v1",
        |upstream, dev| {
            let options = PoolOptions {
                initial_size: 8 * MIB as u64,
                ..PoolOptions::default()
            };
            PoolResource::new(upstream, dev, options).unwrap()
        },
        PoolResource::release_unused,
    );
}

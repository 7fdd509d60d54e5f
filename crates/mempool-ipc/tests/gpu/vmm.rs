//! GPU tests of VMM sharing (`Exporter::alloc_vmm` / `share_vmm`, `Importer::recv_any` /
//! `SharedVmm`), in two processes over the re-exec harness (a child re-executes this binary,
//! filtered to the same test, with `MEMPOOL_IPC_TEST_ROLE` set). Run:
//! `cargo test -p mempool-ipc --features gpu --test gpu vmm::`.

use crate::harness::*;
use mempool_core::kernels::u32s;
use mempool_ipc::{Received, SharedVmm};

const VMM_N: usize = 1 << 20;

fn connect_vmm() -> (Importer, Stream, CheckKernels) {
    let options = ImporterOptions {
        accept_vmm: true,
        ..ImporterOptions::default()
    };
    let importer = Importer::connect(child_socket(), options).expect("connect to the exporter");
    assert!(importer.accepts_vmm(), "the exporter offers VMM sharing");
    let ctx = importer.device().context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    (importer, stream, kernels)
}

fn recv_vmm(importer: &Importer, stream: &Stream) -> SharedVmm {
    match importer.recv_any_timeout(stream.as_ref(), WAIT).expect("a VMM buffer") {
        Received::Vmm(v) => v,
        Received::Buffer(b) => panic!("a pool buffer instead of a VMM allocation: {b:?}"),
        Received::VmmRange(r) => panic!("a range of VMM chunks instead of one VMM allocation: {r:?}"),
    }
}

fn vmm_u32s(v: &SharedVmm, stream: &Stream, n: usize) -> Vec<u32> {
    let mut host = vec![0u8; n * 4];
    v.view(stream.as_ref()).unwrap().copy_to_host(0, &mut host).unwrap();
    u32s(&host)
}

/// Free device memory (`cuMemGetInfo`), after the context's work is done.
fn free_memory(ctx: &Context) -> u64 {
    ctx.synchronize().unwrap();
    ctx.memory_info().unwrap().free as u64
}

#[test]
fn vmm_ipc_data_written_by_each_side_is_read_by_the_other_and_released_on_drop() {
    let test = this_test!();
    if role().is_some() {
        let (importer, stream, kernels) = connect_vmm();
        let v = recv_vmm(&importer, &stream);
        assert!(v.len() >= VMM_N * 4, "{} bytes", v.len());
        assert_eq!(v.len() % v.mapping().reservation().granularity(), 0);
        assert_eq!(importer.held(), 1);
        assert_iota(
            &vmm_u32s(&v, &stream, VMM_N),
            1000,
            "the importer sees the exporter's data",
        );
        // SAFETY: the mapping holds at least VMM_N u32s, ordered on `stream` after the exporter's event.
        unsafe { kernels.add(v.ptr(), VMM_N, 5, stream.as_ref()) }.unwrap();
        drop(v); // waits for the device, unmaps, releases the handle, sends Release
        assert_eq!(importer.held(), 0);
        tell_parent("DROPPED");
        drop(importer);
        no_drop_errors("importer");
        return;
    }
    let _serial = serial();
    let (dev, ctx) = gpu();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let sock = socket_path("vmm-basic");
    let exporter = Exporter::new(&sock, exportable_pool(&dev), ExporterOptions::default()).unwrap();
    let mut child = ChildProc::spawn(test, "importer", &sock);
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;

    let vmm = exporter.alloc_vmm(VMM_N * 4, stream.as_ref()).unwrap();
    assert_eq!(vmm.len() % vmm.granularity(), 0);
    assert_eq!(vmm.len(), vmm.physical().size());
    // SAFETY: the mapping holds at least VMM_N u32s, ordered on `stream`.
    unsafe { kernels.iota(vmm.ptr(), VMM_N, 1000, stream.as_ref()) }.unwrap();
    exporter.share_vmm(&vmm, &[id]).unwrap();
    assert_eq!(vmm.holders(), vec![id]);
    assert_eq!(exporter.stats().live_buffers, 1);
    child.expect("DROPPED");
    vmm.wait_released(WAIT).expect("the importer's drop releases the lease");
    assert_iota(
        // SAFETY: the buffer is live (held here) and holds that many u32s; its writers are done (released
        // or synchronized) or ordered before the copy on its stream.
        &unsafe { read_u32s(&ctx, vmm.ptr(), VMM_N, stream.as_ref()) },
        1005,
        "the exporter sees the importer's writes",
    );
    child.succeeds();
    vmm.release().unwrap();
    exporter.wait_idle(WAIT).unwrap();
    let stats = exporter.stats();
    assert_eq!(
        (stats.live_buffers, stats.freed_buffers, stats.reclaimed_buffers),
        (0, 1, 0),
        "{stats:?}"
    );
    assert!(exporter.shutdown().is_empty());
    no_drop_errors("exporter");
}

const VMM_KILL_COUNT: usize = 4;
const VMM_KILL_LEN: usize = 256 * MIB;
/// What other processes' contexts may move the device's free memory by meanwhile.
const VMM_SLACK: u64 = 64 * MIB as u64;

#[test]
fn vmm_ipc_importer_killed_mid_use_is_reclaimed_and_its_memory_freed() {
    let test = this_test!();
    if role().is_some() {
        let (importer, stream, kernels) = connect_vmm();
        let bufs: Vec<SharedVmm> = (0..VMM_KILL_COUNT).map(|_| recv_vmm(&importer, &stream)).collect();
        let n = VMM_KILL_LEN / 4;
        let mut told = false;
        // Keep the GPU busy on the shared memory until the parent kills this process.
        loop {
            for v in &bufs {
                // SAFETY: each mapping holds at least n u32s, ordered on `stream`.
                unsafe { kernels.add(v.ptr(), n, 1, stream.as_ref()) }.unwrap();
            }
            if !told {
                tell_parent("HOLDING");
                told = true;
            }
        }
    }
    let _serial = serial();
    let (dev, ctx) = gpu();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let sock = socket_path("vmm-kill");
    let exporter = Exporter::new(&sock, exportable_pool(&dev), ExporterOptions::default()).unwrap();
    let baseline = free_memory(&ctx);
    let mut child = ChildProc::spawn(test, "importer", &sock);
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    for k in 0..VMM_KILL_COUNT {
        let vmm = exporter.alloc_vmm(VMM_KILL_LEN, stream.as_ref()).unwrap();
        // SAFETY: the mapping holds VMM_KILL_LEN / 4 u32s, ordered on `stream`.
        unsafe { kernels.iota(vmm.ptr(), VMM_KILL_LEN / 4, k as u32, stream.as_ref()) }.unwrap();
        exporter.share_vmm(&vmm, &[id]).unwrap();
        // The exporter lets go at once: only the importer holds it now.
    }
    child.expect("HOLDING");
    let stats = exporter.stats();
    assert_eq!(
        (stats.live_buffers, stats.deferred_buffers),
        (VMM_KILL_COUNT, VMM_KILL_COUNT),
        "{stats:?}"
    );
    let held = free_memory(&ctx);
    let shared = (VMM_KILL_COUNT * VMM_KILL_LEN) as u64;
    assert!(
        held + shared <= baseline + VMM_SLACK,
        "free memory {held} while {shared} bytes are shared, baseline {baseline}"
    );

    child.kill();
    exporter
        .wait_idle(WAIT)
        .expect("the dead importer's VMM buffers are freed");
    let stats = exporter.stats();
    assert_eq!(
        (
            stats.importers,
            stats.reclaimed_buffers,
            stats.freed_buffers,
            stats.abandoned_buffers
        ),
        (0, VMM_KILL_COUNT as u64, VMM_KILL_COUNT as u64, 0),
        "{stats:?}"
    );
    // The physical memory goes back to the driver once both processes' handles are gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let free = free_memory(&ctx);
        if free + VMM_SLACK >= baseline {
            println!("{MARK} free memory: baseline {baseline}, holding {held}, after reclaim {free}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "free memory stays at {free} bytes after the reclaim, baseline {baseline} (holding: {held}): \
             the {shared} shared bytes were not freed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(exporter.shutdown().is_empty());
    no_drop_errors("exporter");
}

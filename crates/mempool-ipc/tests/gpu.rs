//! GPU tests of mempool-ipc: an exporter and importers in separate processes. They need a GPU and
//! fail without one (never skip). Run: `cargo test -p mempool-ipc --features gpu --test gpu`.
//!
//! Each test that needs a second process re-executes this test binary, filtered to the same
//! test, with `MEMPOOL_IPC_TEST_ROLE` naming the child's part (CUDA does not survive `fork`).
//! Children print marker lines on stdout; the parent waits for them and may write lines to the
//! child's stdin.
#![cfg(feature = "gpu")]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mempool_core::kernels::{u32s, CheckKernels};
use mempool_core::{memory, Context, Device, DeviceAddr, HandleTypes, MemPool, PoolProps, Stream, StreamRef};
use mempool_ipc::{Error, Exporter, ExporterOptions, Importer, ImporterOptions, SharedBuffer};
use mempool_rmm::suballoc::{BinningConfig, PoolConfig};
use mempool_rmm::{AsyncOptions, AsyncResource, BinningResource, MemoryResource, PoolResource, ReleaseThreshold};

const ROLE: &str = "MEMPOOL_IPC_TEST_ROLE";
const SOCK: &str = "MEMPOOL_IPC_TEST_SOCK";
const MARK: &str = "MEMPOOL-IPC-TEST";
const WAIT: Duration = Duration::from_secs(30);
const MIB: usize = 1 << 20;

/// The tests assert on process-wide things (drop errors, the GPU's memory): one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

// VMM sharing, with the helpers below.
#[path = "vmm_ipc/mod.rs"]
mod vmm_ipc;

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn gpu() -> (Device, Arc<Context>) {
    let dev = Device::get(0).expect("GPU tests need a CUDA device: run them on a GPU machine");
    let ctx = dev.context().expect("primary context");
    (dev, ctx)
}

fn exportable_pool(dev: &Device) -> MemPool {
    MemPool::new(dev, &PoolProps::new().handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR)).expect("exportable pool")
}

/// A socket path unique to this process and `tag` (the test's name), short enough for `sun_path`
/// (108 bytes) whatever the tag's length: the tag's first 24 characters and a hash of all of it.
fn socket_path(tag: &str) -> PathBuf {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    tag.hash(&mut hasher);
    let short: String = tag.chars().take(24).collect();
    std::env::temp_dir().join(format!(
        "mempool-ipc-gpu-{}-{short}-{:016x}.sock",
        std::process::id(),
        hasher.finish()
    ))
}

fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

fn child_socket() -> PathBuf {
    PathBuf::from(std::env::var(SOCK).expect("the parent passes the socket path"))
}

fn read_u32s(ctx: &Context, ptr: DeviceAddr, n: usize, stream: StreamRef<'_>) -> Vec<u32> {
    let mut host = vec![0u8; n * 4];
    // SAFETY: callers pass live device memory of at least n u32s, ordered on `stream`.
    unsafe { memory::copy_to_host(ctx, &mut host, ptr, stream) }.unwrap();
    u32s(&host)
}

fn shared_u32s(buf: &SharedBuffer<'_>) -> Vec<u32> {
    let mut host = vec![0u8; buf.len()];
    buf.copy_to_host(0, &mut host).unwrap();
    u32s(&host)
}

fn assert_iota(got: &[u32], base: u32, what: &str) {
    if let Some((i, &v)) = got.iter().enumerate().find(|&(i, &v)| v != base.wrapping_add(i as u32)) {
        panic!("{what}: element {i} is {v}, expected {}", base.wrapping_add(i as u32));
    }
}

fn no_drop_errors(what: &str) {
    let ipc = mempool_ipc::take_drop_errors();
    let core = mempool_core::take_drop_errors();
    assert!(
        ipc.is_empty() && core.is_empty(),
        "{what}: errors in drops: {ipc:?} {core:?}"
    );
}

/// A child process running `test` in role `role`, killed if the test fails first.
struct ChildProc {
    child: Child,
    stdout: BufReader<ChildStdout>,
    stdin: Option<ChildStdin>,
    name: String,
}

impl ChildProc {
    fn spawn(test: &str, role: &str, sock: &Path) -> ChildProc {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .env(SOCK, sock)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the child process");
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let stdin = child.stdin.take();
        ChildProc {
            child,
            stdout,
            stdin,
            name: format!("{test}/{role}"),
        }
    }

    /// Waits for the child to print `MARK word`.
    fn expect(&mut self, word: &str) {
        let want = format!("{MARK} {word}");
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "{} exited before printing {want:?}", self.name);
            // libtest run with --nocapture prints "test NAME ... " without a newline before the test's
            // own output, so the first mark shares its line.
            if line.trim_end().ends_with(&want) {
                return;
            }
        }
    }

    fn say(&mut self, word: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{word}").unwrap();
        stdin.flush().unwrap();
    }

    fn kill(&mut self) {
        self.child.kill().unwrap(); // SIGKILL
        let status = self.child.wait().unwrap();
        assert!(!status.success());
    }

    fn succeeds(mut self) {
        let status = self.child.wait().unwrap();
        assert!(status.success(), "child {} failed: {status}", self.name);
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// In a child: prints a marker line for the parent.
fn tell_parent(word: &str) {
    println!("{MARK} {word}");
}

/// In a child: waits for a line from the parent.
fn hear_parent(word: &str) {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    assert_eq!(line.trim_end(), word);
}

fn connect() -> (Importer, Stream, CheckKernels) {
    let importer = Importer::connect(child_socket(), ImporterOptions::default()).expect("connect to the exporter");
    let ctx = importer.device().context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    (importer, stream, kernels)
}

/// Waits (bounded) until the pool's used memory is back to `baseline`: frees queued on other
/// streams complete asynchronously.
fn wait_used(pool: &MemPool, ctx: &Context, baseline: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        ctx.synchronize().unwrap();
        let used = pool.usage().unwrap().used_current;
        if used == baseline {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the pool's used memory stays at {used} bytes, baseline {baseline}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---- Pool and pointer sharing, data checked on both sides ----

const BASIC_N: usize = 1 << 20;

#[test]
fn pool_and_pointer_shared_with_data_checked_on_both_sides() {
    if role().is_some() {
        let (importer, stream, kernels) = connect();
        let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
        assert_eq!(buf.len(), BASIC_N * 4);
        assert_iota(&shared_u32s(&buf), 1000, "the importer sees the exporter's data");
        // SAFETY: the buffer holds BASIC_N u32s, ordered on `stream` after the exporter's event.
        unsafe { kernels.add(buf.ptr(), BASIC_N, 5, stream.as_ref()) }.unwrap();
        assert_eq!(importer.held(), 1);
        buf.release().expect("release the buffer");
        assert_eq!(importer.held(), 0);
        assert_eq!(importer.imported_blocks(), 0);
        drop(importer);
        no_drop_errors("importer");
        return;
    }
    let _serial = serial();
    let (dev, ctx) = gpu();
    let sock = socket_path("basic");
    let exporter = Exporter::new(&sock, exportable_pool(&dev), ExporterOptions::default()).unwrap();
    let child = ChildProc::spawn(
        "pool_and_pointer_shared_with_data_checked_on_both_sides",
        "importer",
        &sock,
    );
    let importers = exporter.wait_for_importers(1, WAIT).unwrap();
    assert_eq!(importers[0].credentials.pid, child.child.id() as i32);

    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let buf = exporter.alloc(BASIC_N * 4, stream.as_ref()).unwrap();
    // SAFETY: the buffer holds BASIC_N u32s on `stream`.
    unsafe { kernels.iota(buf.ptr(), BASIC_N, 1000, stream.as_ref()) }.unwrap();
    exporter.share(&buf, &[importers[0].id]).unwrap();
    assert_eq!(buf.holders(), vec![importers[0].id]);
    buf.wait_released(WAIT).unwrap();
    assert_iota(
        &read_u32s(&ctx, buf.ptr(), BASIC_N, stream.as_ref()),
        1005,
        "the exporter sees the importer's writes",
    );
    child.succeeds();
    buf.release().unwrap();
    exporter.wait_idle(WAIT).unwrap();
    wait_used(exporter.pool(), &ctx, 0);
    let stats = exporter.stats();
    assert_eq!(
        (stats.freed_buffers, stats.reclaimed_buffers, stats.blocks),
        (1, 0, 0),
        "{stats:?}"
    );
    assert!(exporter.shutdown().is_empty());
    assert!(!sock.exists(), "the socket file is removed at shutdown");
    no_drop_errors("exporter");
}

// ---- Suballocated buffers: one exported block, buffers as block + offset ----

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
    make: impl FnOnce(Arc<AsyncResource>, &Arc<Context>) -> R,
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
    let sub = Arc::new(make(upstream.clone(), &ctx));
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
            &read_u32s(&ctx, buf.ptr(), n, stream.as_ref()),
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
        "suballocated_buffers_from_a_pool_resource_share_one_block",
        "importer",
        |upstream, ctx| {
            let config = PoolConfig {
                initial_size: 8 * MIB as u64,
                ..PoolConfig::default()
            };
            PoolResource::new(upstream, ctx, config).unwrap()
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
        "suballocated_buffers_from_a_binning_resource_share_one_block",
        "importer",
        |upstream, ctx| BinningResource::new(upstream, ctx, BinningConfig::default()).unwrap(),
        BinningResource::release_unused,
    );
}

#[test]
fn a_version_1_importer_gets_the_version_1_path_from_a_version_2_exporter() {
    if role().is_some() {
        return suballocated_child();
    }
    suballocated_parent(
        "a_version_1_importer_gets_the_version_1_path_from_a_version_2_exporter",
        "importer-v1",
        |upstream, ctx| {
            let config = PoolConfig {
                initial_size: 8 * MIB as u64,
                ..PoolConfig::default()
            };
            PoolResource::new(upstream, ctx, config).unwrap()
        },
        PoolResource::release_unused,
    );
}

// ---- The fast release path: reuse ordered by the importer's event, kept imports ----

/// An exportable upstream and a `PoolResource` over it with one 64 MiB chunk, and an exporter of it.
fn suballocating_exporter(tag: &str) -> (Arc<AsyncResource>, Arc<PoolResource<Arc<AsyncResource>>>, Exporter) {
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
    let config = PoolConfig {
        initial_size: 64 * MIB as u64,
        ..PoolConfig::default()
    };
    let sub = Arc::new(PoolResource::new(upstream.clone(), &ctx, config).unwrap());
    let exporter = Exporter::with_pool_in(
        socket_path(tag),
        upstream.clone(),
        AsyncResource::pool,
        ExporterOptions::default(),
    )
    .unwrap();
    (upstream, sub, exporter)
}

/// Waits (bounded) until the exporter has no importer connected.
fn wait_no_importers(exporter: &Exporter) {
    let deadline = Instant::now() + WAIT;
    while exporter.stats().importers > 0 {
        assert!(
            Instant::now() < deadline,
            "an importer stays connected: {:?}",
            exporter.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Allocates `len` bytes from `sub` on `stream` and hands them to the exporter.
fn adopt_from<'s>(
    exporter: &Exporter,
    sub: &Arc<PoolResource<Arc<AsyncResource>>>,
    len: usize,
    stream: StreamRef<'s>,
) -> mempool_ipc::ExportedBuffer<'s> {
    let ptr = sub.allocate(len, stream).unwrap();
    let mr = sub.clone();
    // SAFETY: the exporter calls this once, after the last holder let go, with the range adopted below.
    let free = move |p: DeviceAddr, n: usize, s: StreamRef<'_>| unsafe { mr.deallocate(p, n, s) };
    // SAFETY: `ptr` is a fresh `len`-byte allocation of `sub` on `stream`, used only through the returned
    // buffer; `free` gives exactly it back.
    unsafe { exporter.adopt(ptr, len, stream, free) }.unwrap()
}

const ORDER_LEN: usize = 16 * MIB;
const ORDER_ADDS: u32 = 400;

#[test]
fn fast_release_orders_the_exporters_reads_and_reuse_after_the_importers_last_kernel() {
    let test = "fast_release_orders_the_exporters_reads_and_reuse_after_the_importers_last_kernel";
    if role().is_some() {
        let (importer, stream, kernels) = connect();
        assert!(importer.fast_release());
        for round in ["RELEASED", "RELEASED-AGAIN"] {
            let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
            // Hundreds of kernels still queued when the buffer is released: the release must not
            // wait for them, and the exporter must not touch the memory before they are done.
            for _ in 0..ORDER_ADDS {
                // SAFETY: the buffer holds ORDER_LEN / 4 u32s, ordered on `stream`.
                unsafe { kernels.add(buf.ptr(), ORDER_LEN / 4, 1, stream.as_ref()) }.unwrap();
            }
            let t0 = Instant::now();
            drop(buf);
            println!(
                "FINDING: dropping the buffer with {ORDER_ADDS} kernels queued took {:?}",
                t0.elapsed()
            );
            importer.flush_releases().unwrap();
            tell_parent(round);
        }
        hear_parent("DONE");
        drop(importer);
        no_drop_errors("importer");
        return;
    }
    let _serial = serial();
    let (_dev, ctx) = gpu();
    let (upstream, sub, exporter) = suballocating_exporter("order");
    let mut child = ChildProc::spawn(test, "importer", exporter.path());
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let n = ORDER_LEN / 4;
    // An anchor keeps the block live, so the buffer below is freed (not parked) when let go.
    let anchor = adopt_from(&exporter, &sub, 4096, stream.as_ref());
    let buf = adopt_from(&exporter, &sub, ORDER_LEN, stream.as_ref());
    // SAFETY: the buffer holds n u32s on `stream`.
    unsafe { kernels.iota(buf.ptr(), n, 0, stream.as_ref()) }.unwrap();
    exporter.share(&buf, &[id]).unwrap();
    child.expect("RELEASED");
    buf.wait_released(WAIT).unwrap();
    assert_iota(
        &read_u32s(&ctx, buf.ptr(), n, stream.as_ref()),
        ORDER_ADDS,
        "after wait_released, work on the buffer's stream sees every kernel the importer queued before its release",
    );

    drop(buf);

    // Reuse: the exporter lets go at once, the importer releases while its kernels still run, the
    // exporter frees the buffer (ordered after the importer's event) and the memory is allocated
    // again on the exporter's stream and overwritten at once. Had the free not waited for the
    // importer's kernels, they would add to what the exporter writes.
    let buf = adopt_from(&exporter, &sub, ORDER_LEN, stream.as_ref());
    // SAFETY: the buffer holds n u32s on `stream`.
    unsafe { kernels.iota(buf.ptr(), n, 0, stream.as_ref()) }.unwrap();
    exporter.share(&buf, &[id]).unwrap();
    let second = buf.ptr();
    drop(buf);
    child.expect("RELEASED-AGAIN");
    let deadline = Instant::now() + WAIT;
    while exporter.stats().freed_buffers < 2 {
        assert!(
            Instant::now() < deadline,
            "the second buffer was never freed: {:?}",
            exporter.stats()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let again = sub.allocate(ORDER_LEN, stream.as_ref()).unwrap();
    println!(
        "FINDING: the freed buffer's memory was handed out again at the same address: {}",
        again == second
    );
    // SAFETY: `again` is this test's ORDER_LEN allocation of `sub`, on `stream`.
    unsafe { kernels.iota(again, n, 5, stream.as_ref()) }.unwrap();
    assert_iota(
        &read_u32s(&ctx, again, n, stream.as_ref()),
        5,
        "memory reused after the importer's release",
    );
    // SAFETY: allocated above on `stream`, freed once.
    unsafe { sub.deallocate(again, ORDER_LEN, stream.as_ref()) }.unwrap();
    child.say("DONE");
    child.succeeds();
    wait_no_importers(&exporter);
    drop(anchor);
    exporter.wait_idle(WAIT).unwrap();
    let stats = exporter.stats();
    assert_eq!(
        (stats.kept_blocks, stats.parked_buffers, stats.freed_buffers),
        (0, 0, 3),
        "{stats:?}"
    );
    assert!(exporter.shutdown().is_empty());
    stream.synchronize().unwrap();
    sub.release_unused().unwrap();
    drop(sub);
    wait_used(upstream.pool(), &ctx, 0);
    no_drop_errors("exporter");
}

/// The importer's side of the ready-event tests: receives one buffer whose exporter still has
/// ORDER_ADDS kernels queued on it, and checks it sees the last one. With `on_host` the exporter's
/// work is done when `recv` returns, so the buffer is read on a stream of its own that nothing
/// orders; otherwise on the receiving stream, which waits on the exporter's event.
fn ready_child(on_host: bool) {
    let options = ImporterOptions {
        wait_ready_on_host: on_host,
        ..ImporterOptions::default()
    };
    let importer = Importer::connect(child_socket(), options).expect("connect to the exporter");
    let ctx = importer.device().context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    hear_parent("QUEUED");
    let t0 = Instant::now();
    let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
    println!(
        "FINDING: recv with the exporter's {ORDER_ADDS} kernels queued took {:?} (a pending ready event waited for \
         on the {})",
        t0.elapsed(),
        if on_host { "host" } else { "GPU" }
    );
    let n = buf.len() / 4;
    let got = if on_host {
        let unordered = Stream::new(&ctx).unwrap();
        read_u32s(&ctx, buf.ptr(), n, unordered.as_ref())
    } else {
        shared_u32s(&buf)
    };
    assert_iota(
        &got,
        ORDER_ADDS,
        "the importer sees every kernel the exporter queued before the share",
    );
    drop(buf);
    importer.flush_releases().unwrap();
    drop(importer);
    no_drop_errors("importer");
}

fn ready_parent(test: &str, child_role: &str) {
    let _serial = serial();
    let (_dev, ctx) = gpu();
    let (upstream, sub, exporter) = suballocating_exporter(&format!("ready-{child_role}"));
    let mut child = ChildProc::spawn(test, child_role, exporter.path());
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let n = ORDER_LEN / 4;
    let anchor = adopt_from(&exporter, &sub, 4096, stream.as_ref());
    let buf = adopt_from(&exporter, &sub, ORDER_LEN, stream.as_ref());
    // SAFETY: the buffer holds n u32s on `stream`.
    unsafe { kernels.iota(buf.ptr(), n, 0, stream.as_ref()) }.unwrap();
    for _ in 0..ORDER_ADDS {
        // SAFETY: as above.
        unsafe { kernels.add(buf.ptr(), n, 1, stream.as_ref()) }.unwrap();
    }
    exporter.share(&buf, &[id]).unwrap();
    child.say("QUEUED");
    buf.wait_released(WAIT).unwrap();
    drop(buf);
    child.succeeds();
    wait_no_importers(&exporter);
    drop(anchor);
    exporter.wait_idle(WAIT).unwrap();
    assert!(exporter.shutdown().is_empty());
    stream.synchronize().unwrap();
    sub.release_unused().unwrap();
    drop(sub);
    wait_used(upstream.pool(), &ctx, 0);
    no_drop_errors("exporter");
}

#[test]
fn a_pending_ready_event_orders_the_importers_stream_after_the_exporters_kernels() {
    let test = "a_pending_ready_event_orders_the_importers_stream_after_the_exporters_kernels";
    if role().is_some() {
        return ready_child(false);
    }
    ready_parent(test, "importer");
}

#[test]
fn wait_ready_on_host_returns_from_recv_after_the_exporters_kernels() {
    let test = "wait_ready_on_host_returns_from_recv_after_the_exporters_kernels";
    if role().is_some() {
        return ready_child(true);
    }
    ready_parent(test, "importer-host-ready");
}

/// `ImporterOptions::release_on_host`: the importer queues ORDER_ADDS kernels on a buffer and drops it;
/// when the exporter hears the release, those kernels are done, so the exporter reads the buffer on a
/// stream nothing orders and sees every one of them.
#[test]
fn release_on_host_finishes_the_importers_kernels_before_the_exporter_hears_the_release() {
    let test = "release_on_host_finishes_the_importers_kernels_before_the_exporter_hears_the_release";
    if role().is_some() {
        let options = ImporterOptions {
            release_on_host: true,
            ..ImporterOptions::default()
        };
        let importer = Importer::connect(child_socket(), options).expect("connect to the exporter");
        assert!(importer.fast_release());
        let ctx = importer.device().context().unwrap();
        let stream = Stream::new(&ctx).unwrap();
        let kernels = CheckKernels::load(&ctx).unwrap();
        let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
        let n = buf.len() / 4;
        for _ in 0..ORDER_ADDS {
            // SAFETY: the buffer holds n u32s, ordered on `stream` (recv's stream).
            unsafe { kernels.add(buf.ptr(), n, 1, stream.as_ref()) }.unwrap();
        }
        let t0 = Instant::now();
        drop(buf);
        println!(
            "FINDING: dropping a buffer with {ORDER_ADDS} kernels queued on it took {:?} with release_on_host",
            t0.elapsed()
        );
        importer.flush_releases().unwrap();
        drop(importer);
        no_drop_errors("importer");
        return;
    }
    let _serial = serial();
    let (_dev, ctx) = gpu();
    let (upstream, sub, exporter) = suballocating_exporter("rel-host");
    let child = ChildProc::spawn(test, "importer", exporter.path());
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let n = ORDER_LEN / 4;
    let anchor = adopt_from(&exporter, &sub, 4096, stream.as_ref());
    let buf = adopt_from(&exporter, &sub, ORDER_LEN, stream.as_ref());
    // SAFETY: the buffer holds n u32s on `stream`.
    unsafe { kernels.iota(buf.ptr(), n, 0, stream.as_ref()) }.unwrap();
    stream.synchronize().unwrap();
    exporter.share(&buf, &[id]).unwrap();
    buf.wait_released(WAIT).unwrap();
    let unordered = Stream::new(&ctx).unwrap();
    let got = read_u32s(&ctx, buf.ptr(), n, unordered.as_ref());
    assert_iota(
        &got,
        ORDER_ADDS,
        "after the release, the exporter sees every kernel the importer queued before dropping the buffer",
    );
    drop(buf);
    child.succeeds();
    wait_no_importers(&exporter);
    drop(anchor);
    exporter.wait_idle(WAIT).unwrap();
    assert!(exporter.shutdown().is_empty());
    stream.synchronize().unwrap();
    sub.release_unused().unwrap();
    drop(sub);
    wait_used(upstream.pool(), &ctx, 0);
    no_drop_errors("exporter");
}

const KEPT_COUNT: usize = 8;

#[test]
fn a_consumer_killed_with_kept_imports_keeps_the_block_allocated_until_its_process_is_gone() {
    let test = "a_consumer_killed_with_kept_imports_keeps_the_block_allocated_until_its_process_is_gone";
    if role().is_some() {
        let (importer, stream, kernels) = connect();
        assert!(importer.fast_release());
        for _ in 0..KEPT_COUNT {
            let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
            // SAFETY: the buffer holds 1024 u32s, ordered on `stream`.
            unsafe { kernels.add(buf.ptr(), 1024, 1, stream.as_ref()) }.unwrap();
        }
        importer.flush_releases().unwrap();
        assert_eq!(
            importer.kept_blocks(),
            1,
            "the block stays imported with no buffer held"
        );
        tell_parent("KEEPING");
        // Wait to be killed, with the block still imported.
        hear_parent("NEVER");
        unreachable!("the parent kills this process");
    }
    let _serial = serial();
    let (_dev, ctx) = gpu();
    let (upstream, sub, exporter) = suballocating_exporter("kept-kill");
    let mut child = ChildProc::spawn(test, "importer", exporter.path());
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let stream = Stream::new(&ctx).unwrap();
    for _ in 0..KEPT_COUNT {
        let buf = adopt_from(&exporter, &sub, 4096, stream.as_ref());
        buf.fill(0).unwrap();
        exporter.share(&buf, &[id]).unwrap();
        // Only the importer holds it now.
    }
    child.expect("KEEPING");
    let deadline = Instant::now() + WAIT;
    while exporter.stats().live_buffers > 0 {
        assert!(Instant::now() < deadline, "releases never came: {:?}", exporter.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    let stats = exporter.stats();
    // Every buffer was released, but the block's last one is parked: the importer keeps the block
    // imported, so its allocation must not go back to the driver.
    assert_eq!(
        (
            stats.kept_blocks,
            stats.parked_buffers,
            stats.freed_buffers,
            stats.blocks
        ),
        (1, 1, KEPT_COUNT as u64 - 1, 1),
        "{stats:?}"
    );
    child.kill();
    let deadline = Instant::now() + WAIT;
    while exporter.stats().parked_buffers > 0 {
        assert!(
            Instant::now() < deadline,
            "the parked buffer was never freed: {:?}",
            exporter.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    exporter.wait_idle(WAIT).unwrap();
    let stats = exporter.stats();
    assert_eq!(
        (
            stats.kept_blocks,
            stats.parked_buffers,
            stats.freed_buffers,
            stats.blocks,
            stats.importers
        ),
        (0, 0, KEPT_COUNT as u64, 0, 0),
        "{stats:?}"
    );
    assert!(exporter.shutdown().is_empty());
    stream.synchronize().unwrap();
    sub.release_unused().unwrap();
    drop(sub);
    wait_used(upstream.pool(), &ctx, 0);
    no_drop_errors("exporter");
}

// ---- Many buffers in flight, two importers, frees deferred until both released ----

const MANY: usize = 64;
const MANY_LEN: usize = 256 << 10;

#[test]
fn many_buffers_in_flight_with_two_importers_are_freed_only_after_both_release() {
    let test = "many_buffers_in_flight_with_two_importers_are_freed_only_after_both_release";
    if role().is_some() {
        let (importer, stream, _kernels) = connect();
        let mut bufs = Vec::new();
        for k in 0..MANY {
            let buf = importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer");
            assert_iota(&shared_u32s(&buf), (k * 1_000_000) as u32, "buffer data");
            bufs.push(buf);
        }
        assert_eq!(importer.held(), MANY);
        tell_parent("HOLDING");
        hear_parent("go");
        drop(bufs);
        assert_eq!(importer.held(), 0);
        drop(importer);
        no_drop_errors("importer");
        return;
    }
    let _serial = serial();
    let (dev, ctx) = gpu();
    let sock = socket_path("many");
    let exporter = Exporter::new(&sock, exportable_pool(&dev), ExporterOptions::default()).unwrap();
    let mut children = [
        ChildProc::spawn(test, "importer", &sock),
        ChildProc::spawn(test, "importer", &sock),
    ];
    let importers: Vec<_> = exporter
        .wait_for_importers(2, WAIT)
        .unwrap()
        .iter()
        .map(|i| i.id)
        .collect();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let mut bufs = Vec::new();
    for k in 0..MANY {
        let buf = exporter.alloc(MANY_LEN, stream.as_ref()).unwrap();
        // SAFETY: the buffer holds MANY_LEN / 4 u32s on `stream`.
        unsafe { kernels.iota(buf.ptr(), MANY_LEN / 4, (k * 1_000_000) as u32, stream.as_ref()) }.unwrap();
        exporter.share(&buf, &importers).unwrap();
        bufs.push(buf);
    }
    for child in &mut children {
        child.expect("HOLDING");
    }
    // The exporter lets go first: nothing may be freed while the importers hold the buffers.
    drop(bufs);
    ctx.synchronize().unwrap();
    let stats = exporter.stats();
    assert_eq!(
        (stats.live_buffers, stats.deferred_buffers, stats.freed_buffers),
        (MANY, MANY, 0),
        "{stats:?}"
    );
    assert!(exporter.pool().usage().unwrap().used_current >= (MANY * MANY_LEN) as u64);

    children[0].say("go");
    // One importer released everything; the other still holds it all.
    let deadline = Instant::now() + WAIT;
    while exporter.stats().importers > 1 {
        assert!(Instant::now() < deadline, "the first importer did not leave");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        exporter.stats().live_buffers,
        MANY,
        "freed before the second importer released"
    );
    children[1].say("go");
    exporter.wait_idle(WAIT).unwrap();
    wait_used(exporter.pool(), &ctx, 0);
    let [a, b] = children;
    a.succeeds();
    b.succeeds();
    let stats = exporter.stats();
    assert_eq!(
        (stats.freed_buffers, stats.reclaimed_buffers),
        (MANY as u64, 0),
        "{stats:?}"
    );
    assert!(exporter.shutdown().is_empty());
    no_drop_errors("exporter");
}

// ---- An importer killed with SIGKILL mid-use ----

const KILL_COUNT: usize = 8;
const KILL_LEN: usize = 16 * MIB;

#[test]
fn an_importer_killed_mid_use_loses_its_leases_and_memory_returns_to_baseline() {
    let test = "an_importer_killed_mid_use_loses_its_leases_and_memory_returns_to_baseline";
    if role().is_some() {
        let (importer, stream, kernels) = connect();
        let bufs: Vec<_> = (0..KILL_COUNT)
            .map(|_| importer.recv_timeout(stream.as_ref(), WAIT).expect("a buffer"))
            .collect();
        let n = KILL_LEN / 4;
        let mut told = false;
        // Keep the GPU busy on the shared memory until the parent kills this process.
        loop {
            for buf in &bufs {
                // SAFETY: each buffer holds n u32s, ordered on `stream`.
                unsafe { kernels.add(buf.ptr(), n, 1, stream.as_ref()) }.unwrap();
            }
            if !told {
                tell_parent("HOLDING");
                told = true;
            }
        }
    }
    let _serial = serial();
    let (dev, ctx) = gpu();
    let pool = Arc::new(exportable_pool(&dev));
    let baseline = pool.usage().unwrap().used_current;
    let sock = socket_path("kill");
    let exporter = Exporter::with_shared_pool(&sock, pool.clone(), ExporterOptions::default()).unwrap();
    let mut child = ChildProc::spawn(test, "importer", &sock);
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let kernels = CheckKernels::load(&ctx).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    for k in 0..KILL_COUNT {
        let buf = exporter.alloc(KILL_LEN, stream.as_ref()).unwrap();
        // SAFETY: the buffer holds KILL_LEN / 4 u32s on `stream`.
        unsafe { kernels.iota(buf.ptr(), KILL_LEN / 4, k as u32, stream.as_ref()) }.unwrap();
        exporter.share(&buf, &[id]).unwrap();
        // The exporter lets go at once: only the importer holds the buffer now.
    }
    child.expect("HOLDING");
    assert_eq!(exporter.stats().live_buffers, KILL_COUNT);
    assert!(pool.usage().unwrap().used_current >= baseline + (KILL_COUNT * KILL_LEN) as u64);

    child.kill();
    exporter.wait_idle(WAIT).expect("the dead importer's buffers are freed");
    let stats = exporter.stats();
    assert_eq!(
        (
            stats.importers,
            stats.reclaimed_buffers,
            stats.freed_buffers,
            stats.abandoned_buffers
        ),
        (0, KILL_COUNT as u64, KILL_COUNT as u64, 0),
        "{stats:?}"
    );
    wait_used(&pool, &ctx, baseline);

    // The exporter keeps serving: a new importer would be accepted, and its own memory works.
    let buf = exporter.alloc(MIB, stream.as_ref()).unwrap();
    buf.release().unwrap();
    wait_used(&pool, &ctx, baseline);
    assert!(exporter.shutdown().is_empty());
    no_drop_errors("exporter");
}

// ---- The exporter dies ----

const DEATH_N: usize = 1 << 20;

#[test]
fn exporter_death_leaves_received_buffers_usable_until_dropped() {
    let test = "exporter_death_leaves_received_buffers_usable_until_dropped";
    if role().is_some() {
        // The exporter, in the child: share one buffer, then wait to be killed.
        let (dev, ctx) = gpu();
        let exporter = Exporter::new(child_socket(), exportable_pool(&dev), ExporterOptions::default()).unwrap();
        tell_parent("LISTENING");
        let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
        let kernels = CheckKernels::load(&ctx).unwrap();
        let stream = Stream::new(&ctx).unwrap();
        let buf = exporter.alloc(DEATH_N * 4, stream.as_ref()).unwrap();
        // SAFETY: the buffer holds DEATH_N u32s on `stream`.
        unsafe { kernels.iota(buf.ptr(), DEATH_N, 7000, stream.as_ref()) }.unwrap();
        exporter.share(&buf, &[id]).unwrap();
        stream.synchronize().unwrap();
        tell_parent("SHARED");
        std::thread::sleep(Duration::from_secs(120));
        panic!("the parent should have killed this exporter");
    }
    let _serial = serial();
    let (_dev, ctx) = gpu();
    let sock = socket_path("death");
    let mut child = ChildProc::spawn(test, "exporter", &sock);
    child.expect("LISTENING");
    let importer = Importer::connect(&sock, ImporterOptions::default()).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let buf = importer.recv_timeout(stream.as_ref(), WAIT).unwrap();
    child.expect("SHARED");
    assert_iota(&shared_u32s(&buf), 7000, "data before the exporter dies");

    child.kill();
    // The socket reports the exporter's death clearly.
    let err = importer.recv_timeout(stream.as_ref(), WAIT).unwrap_err();
    println!("FINDING: recv after the exporter died: {err}");
    assert!(matches!(err, Error::ExporterGone { .. }), "{err:?}");

    // What the driver does with memory imported from a dead process: it stays readable and writable.
    let after = shared_u32s(&buf);
    println!(
        "FINDING: after the exporter died, the imported buffer reads {:?}...",
        &after[..4]
    );
    assert_iota(&after, 7000, "data after the exporter died");
    // SAFETY: the buffer holds DEATH_N u32s, ordered on `stream`.
    unsafe { kernels.add(buf.ptr(), DEATH_N, 1, stream.as_ref()) }.unwrap();
    let sync = stream.synchronize();
    println!("FINDING: a kernel writing the imported buffer after the exporter died: {sync:?}");
    sync.unwrap();
    assert_iota(&shared_u32s(&buf), 7001, "writes after the exporter died");

    let released = buf.release();
    println!("FINDING: freeing the import after the exporter died: {released:?}");
    released.unwrap();
    let reconnect = Importer::connect(&sock, ImporterOptions::default());
    println!(
        "FINDING: connecting to the dead exporter's socket: {:?}",
        reconnect.as_ref().err()
    );
    assert!(reconnect.is_err());
    drop(importer);
    let errors = (mempool_ipc::take_drop_errors(), mempool_core::take_drop_errors());
    println!("FINDING: errors in drops after the exporter died: {errors:?}");
    assert!(errors.0.is_empty() && errors.1.is_empty(), "{errors:?}");
    let _ = std::fs::remove_file(&sock);
}

// ---- Floods and stalls: the exporter stays available ----
//
// These run the exporter in a child process of its own (`run_role`), so that its descriptor and
// thread counts are its own and not those of the test harness's other threads. Other processes
// play the peers: silent connections and idle importers that speak the protocol by hand
// (`FakeImporter`: the handshake in raw frames, and the pool's descriptor discarded by reading
// it without room for it), and a real `Importer` for the timed handshake.

const FLOOD_SILENT: usize = 1000;
const FLOOD_IDLE: usize = 1000;

/// Runs `test` again in a child process in role `role`, output shown, and asserts it passed.
fn run_role(test: &str, role: &str) {
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .status()
        .expect("spawn the child process");
    assert!(status.success(), "{test}/{role} failed: {status} (its output is above)");
}

/// Raises this process's soft limit of open descriptors to `want` (or the hard limit, if lower).
fn raise_nofile(want: u64) -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    let hard = limit.maximum.unwrap_or(u64::MAX);
    let soft = want.min(hard);
    if limit.current.is_some_and(|c| c >= soft) {
        return limit.current.unwrap_or(soft);
    }
    limit.current = Some(soft);
    setrlimit(Resource::Nofile, limit).expect("raise RLIMIT_NOFILE");
    soft
}

fn count_dir(path: &str) -> usize {
    std::fs::read_dir(path).unwrap().count()
}

/// The process's open descriptors and threads.
fn fds_and_threads() -> (usize, usize) {
    (count_dir("/proc/self/fd"), count_dir("/proc/self/task"))
}

fn frame(ty: u16, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(12 + body.len());
    f.extend_from_slice(b"MPIP");
    f.extend_from_slice(&1u16.to_le_bytes());
    f.extend_from_slice(&ty.to_le_bytes());
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(body);
    f
}

/// An importer that speaks the protocol by hand, with no GPU: what an idle importer (or one that
/// stops reading) looks like to the exporter.
struct FakeImporter {
    stream: std::os::unix::net::UnixStream,
}

impl FakeImporter {
    /// Connects and completes the handshake (Hello, Welcome, Ready, PoolDescriptor).
    fn connect(path: &Path) -> std::io::Result<FakeImporter> {
        use std::io::Read;
        let mut stream = std::os::unix::net::UnixStream::connect(path)?;
        stream.set_read_timeout(Some(WAIT))?;
        stream.write_all(&frame(1, &[]))?;
        let mut welcome = [0u8; 12 + 32];
        stream.read_exact(&mut welcome)?;
        assert_eq!(
            u16::from_le_bytes([welcome[6], welcome[7]]),
            2,
            "expected Welcome: {welcome:?}"
        );
        stream.write_all(&frame(3, &welcome[12..28]))?;
        // A plain read has no room for the descriptor: the kernel closes it.
        let mut pool = [0u8; 12 + 24];
        stream.read_exact(&mut pool)?;
        assert_eq!(
            u16::from_le_bytes([pool[6], pool[7]]),
            4,
            "expected PoolDescriptor: {pool:?}"
        );
        Ok(FakeImporter { stream })
    }

    /// The next message: `Some(buffer id)` for a `Buffer`, `None` for `Goodbye` or the end.
    fn next_buffer(&mut self) -> Option<u64> {
        use std::io::Read;
        let mut header = [0u8; 12];
        self.stream.read_exact(&mut header).ok()?;
        let ty = u16::from_le_bytes([header[6], header[7]]);
        let len = u32::from_le_bytes(header[8..12].try_into().unwrap()) as usize;
        let mut body = vec![0u8; len];
        self.stream.read_exact(&mut body).ok()?;
        (ty == 5).then(|| u64::from_le_bytes(body[..8].try_into().unwrap()))
    }

    fn release(&mut self, buffer: u64) {
        self.stream.write_all(&frame(6, &buffer.to_le_bytes())).unwrap();
    }

    fn goodbye(mut self) {
        let _ = self.stream.write_all(&frame(7, &[]));
    }
}

/// Runs one exporter through a share and a shutdown, so that what the driver and the exporter
/// set up once per process (event and export machinery, descriptors the driver keeps open) is
/// in place before a baseline is taken.
fn warm_up(pool: &Arc<MemPool>, ctx: &Arc<Context>) {
    let sock = socket_path("warm");
    let exporter = Exporter::with_shared_pool(&sock, pool.clone(), ExporterOptions::default()).unwrap();
    let mut fake = FakeImporter::connect(&sock).unwrap();
    let id = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    let stream = Stream::new(ctx).unwrap();
    let buf = exporter.alloc(MIB, stream.as_ref()).unwrap();
    exporter.share(&buf, &[id]).unwrap();
    let got = fake.next_buffer().expect("a buffer");
    fake.release(got);
    buf.wait_released(WAIT).unwrap();
    drop(buf);
    fake.goodbye();
    exporter.wait_idle(WAIT).unwrap();
    assert!(exporter.shutdown().is_empty());
    stream.synchronize().unwrap();
}

/// Checks that the exporter's process is back to its baseline: descriptors, threads, pool.
fn assert_back_to_baseline(what: &str, baseline: (usize, usize), pool: &MemPool, ctx: &Context, used: u64) {
    wait_used(pool, ctx, used);
    // The serving thread was joined by the shutdown; a moment for the kernel's bookkeeping.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = fds_and_threads();
        if now == baseline {
            println!(
                "{what}: back to baseline: {} descriptors, {} threads, {used} bytes used",
                now.0, now.1
            );
            return;
        }
        if Instant::now() > deadline {
            let fds: Vec<String> = std::fs::read_dir("/proc/self/fd")
                .unwrap()
                .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .map(|p| p.display().to_string())
                .collect();
            panic!("{what}: (descriptors, threads) = {now:?}, baseline {baseline:?}; open descriptors: {fds:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn flood_of_silent_connections_and_idle_importers_leaves_the_handshake_under_a_second() {
    let test = "flood_of_silent_connections_and_idle_importers_leaves_the_handshake_under_a_second";
    match role().as_deref() {
        None => {
            let _serial = serial();
            return run_role(test, "exporter");
        }
        Some("exporter") => {}
        Some("clients") => return flood_clients(),
        Some("importer") => return flood_importer(),
        Some(other) => panic!("unknown role {other}"),
    }
    let limit = raise_nofile(16384);
    let (dev, ctx) = gpu();
    let pool = Arc::new(exportable_pool(&dev));
    warm_up(&pool, &ctx);
    let baseline = fds_and_threads();
    let used = pool.usage().unwrap().used_current;
    println!("exporter: RLIMIT_NOFILE soft limit {limit}; baseline {baseline:?} (descriptors, threads)");

    let sock = socket_path("flood");
    let options = ExporterOptions {
        max_importers: FLOOD_IDLE + 100,
        ..ExporterOptions::default()
    };
    let max_handshakes = options.max_handshakes;
    let exporter = Exporter::with_shared_pool(&sock, pool.clone(), options).unwrap();
    let mut clients = ChildProc::spawn(test, "clients", &sock);
    clients.expect("HELD");
    let idle = exporter
        .wait_for_importers(FLOOD_IDLE, WAIT)
        .unwrap_or_else(|e| panic!("{e}: {:?}", exporter.stats()));
    let stats = exporter.stats();
    let (fds, threads) = fds_and_threads();
    println!("exporter: holding {FLOOD_IDLE} idle importers under a flood of silent connections: {stats:?}");
    println!("exporter: {fds} descriptors, {threads} threads");
    assert!(stats.handshakes <= max_handshakes, "{stats:?}");
    assert!(
        stats.evicted_handshakes as usize >= FLOOD_SILENT - max_handshakes,
        "{stats:?}"
    );
    // One serving thread, whatever the number of importers (a few more allowed for the driver).
    assert!(
        threads <= baseline.1 + 4,
        "{threads} threads while serving {FLOOD_IDLE} importers, {} before",
        baseline.1
    );

    // A real importer connects during the flood (the clients keep replacing silent connections).
    let mut importer = ChildProc::spawn(test, "importer", &sock);
    importer.expect("READY");
    importer.say("GO");
    let all = exporter.wait_for_importers(FLOOD_IDLE + 1, WAIT).unwrap();
    let new = all.iter().find(|i| !idle.contains(i)).expect("the new importer").id;
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let buf = exporter.alloc(MIB, stream.as_ref()).unwrap();
    // SAFETY: the buffer holds MIB / 4 u32s, ordered on `stream`.
    unsafe { kernels.iota(buf.ptr(), MIB / 4, 4242, stream.as_ref()) }.unwrap();
    exporter.share(&buf, &[new]).unwrap();
    drop(buf);
    importer.expect("DONE");
    importer.succeeds();

    clients.say("STOP");
    clients.succeeds();
    exporter.wait_idle(WAIT).unwrap();
    let deadline = Instant::now() + WAIT;
    while exporter.stats().importers + exporter.stats().handshakes > 0 {
        assert!(Instant::now() < deadline, "connections stay: {:?}", exporter.stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    let stats = exporter.stats();
    println!("exporter: after the flood: {stats:?}");
    assert_eq!(
        stats.accept_pauses, 0,
        "ran out of descriptors at a soft limit of {limit}"
    );
    let errors = exporter.shutdown();
    assert!(errors.is_empty(), "{errors:?}");
    assert!(!sock.exists(), "the socket file stays after the shutdown");
    drop((kernels, stream));
    assert_back_to_baseline("exporter", baseline, &pool, &ctx, used);
    no_drop_errors("exporter");
}

/// Holds FLOOD_SILENT connections that never say a word and FLOOD_IDLE importers that complete
/// the handshake and then say nothing, and keeps flooding (a new silent connection every
/// millisecond, the oldest one closed) until the parent says STOP.
fn flood_clients() {
    raise_nofile(16384);
    let sock = child_socket();
    let mut silent: std::collections::VecDeque<_> = (0..FLOOD_SILENT)
        .map(|_| std::os::unix::net::UnixStream::connect(&sock).expect("a silent connection"))
        .collect();
    let idle: Vec<FakeImporter> = (0..FLOOD_IDLE)
        .map(|i| FakeImporter::connect(&sock).unwrap_or_else(|e| panic!("idle importer {i}: {e}")))
        .collect();
    tell_parent("HELD");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopper = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            hear_parent("STOP");
            stop.store(true, std::sync::atomic::Ordering::Release);
        })
    };
    let mut made = 0usize;
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        if let Ok(s) = std::os::unix::net::UnixStream::connect(&sock) {
            silent.pop_front();
            silent.push_back(s);
            made += 1;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    stopper.join().unwrap();
    println!("clients: {made} more silent connections during the test");
    drop(idle);
    drop(silent);
}

/// Times `Importer::connect` (CUDA is initialized first), checks it took under a second, and
/// checks the buffer it is sent.
fn flood_importer() {
    let (_dev, _ctx) = gpu();
    // What `connect` does besides the handshake, done once before the clock starts.
    let _ = Device::all().unwrap();
    tell_parent("READY");
    hear_parent("GO");
    let start = Instant::now();
    let importer = Importer::connect(child_socket(), ImporterOptions::default()).expect("connect during the flood");
    let took = start.elapsed();
    println!("importer: handshake and pool import during the flood took {took:?}");
    assert!(
        took < Duration::from_secs(1),
        "the handshake took {took:?} during the flood"
    );
    let stream = Stream::new(&importer.device().context().unwrap()).unwrap();
    let buf = importer.recv_timeout(stream.as_ref(), WAIT).unwrap();
    stream.synchronize().unwrap();
    assert_iota(&shared_u32s(&buf), 4242, "the buffer shared during the flood");
    drop(buf);
    drop(importer);
    tell_parent("DONE");
}

const STALL_BUFFERS: usize = 4000;
const STALL_QUEUE: usize = 64;
const STALL_BOUND: Duration = Duration::from_millis(10);

#[test]
fn stalled_importer_does_not_delay_shares_to_another_by_more_than_10ms() {
    let test = "stalled_importer_does_not_delay_shares_to_another_by_more_than_10ms";
    match role().as_deref() {
        None => {
            let _serial = serial();
            return run_role(test, "exporter");
        }
        Some("exporter") => {}
        Some("stalled") => {
            // Completes the handshake, then never reads again.
            let _fake = FakeImporter::connect(&child_socket()).unwrap();
            tell_parent("CONNECTED");
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        Some(other) => panic!("unknown role {other}"),
    }
    let (dev, ctx) = gpu();
    let pool = Arc::new(exportable_pool(&dev));
    warm_up(&pool, &ctx);
    let baseline = fds_and_threads();
    let used = pool.usage().unwrap().used_current;

    let sock = socket_path("stall");
    let mut options = ExporterOptions {
        send_queue_len: STALL_QUEUE,
        ..ExporterOptions::default()
    };
    // Long enough that the stalled importer is cut off by its full queue, not by the clock.
    options.listener.connection.io_timeout = Duration::from_secs(60);
    let exporter = Exporter::with_shared_pool(&sock, pool.clone(), options).unwrap();
    let mut stalled = ChildProc::spawn(test, "stalled", &sock);
    stalled.expect("CONNECTED");
    let s = exporter.wait_for_importers(1, WAIT).unwrap()[0].id;
    // The reader: receives every buffer, notes when, and releases it at once.
    let (tx, rx) = std::sync::mpsc::channel::<(u64, Instant)>();
    let reader = {
        let sock = sock.clone();
        std::thread::spawn(move || {
            let mut fake = FakeImporter::connect(&sock).unwrap();
            while let Some(id) = fake.next_buffer() {
                let at = Instant::now();
                fake.release(id);
                if tx.send((id, at)).is_err() {
                    break;
                }
            }
            fake.goodbye();
        })
    };
    let b = exporter
        .wait_for_importers(2, WAIT)
        .unwrap()
        .into_iter()
        .find(|i| i.id != s)
        .unwrap()
        .id;

    let stream = Stream::new(&ctx).unwrap();
    let mut delays = Vec::with_capacity(STALL_BUFFERS);
    let mut stalled_at = None;
    for k in 0..STALL_BUFFERS {
        let buf = exporter.alloc(4096, stream.as_ref()).unwrap();
        let to: &[_] = if stalled_at.is_none() { &[s, b] } else { &[b] };
        let start = Instant::now();
        match exporter.share(&buf, to) {
            Ok(()) => {}
            Err(Error::Share { importer, source, .. }) if importer == s => {
                assert!(
                    matches!(
                        *source,
                        Error::Stalled { .. } | Error::Refused { .. } | Error::UnknownImporter { .. }
                    ),
                    "{source}"
                );
                stalled_at.get_or_insert(k);
            }
            Err(Error::UnknownImporter { importer }) if importer == s => {
                stalled_at.get_or_insert(k);
                exporter.share(&buf, &[b]).unwrap();
            }
            Err(e) => panic!("share {k}: {e}"),
        }
        let (id, at) = rx.recv_timeout(WAIT).expect("the reader receives every buffer");
        assert_eq!(id, buf.id().0);
        delays.push(at - start);
        drop(buf);
    }
    let stalled_at = stalled_at.expect("the stalled importer's queue never filled");
    let mut sorted = delays.clone();
    sorted.sort();
    let pct = |p: usize| sorted[(sorted.len() - 1) * p / 100];
    println!(
        "share -> the reader receives it, over {STALL_BUFFERS} shares (the other importer stopped reading, \
         cut off at share {stalled_at}): median {:?}, p99 {:?}, max {:?}",
        pct(50),
        pct(99),
        pct(100)
    );
    let worst: Vec<(usize, Duration)> = {
        let mut d: Vec<_> = delays.iter().copied().enumerate().collect();
        d.sort_by_key(|x| std::cmp::Reverse(x.1));
        d.into_iter().take(5).collect()
    };
    println!("the five longest (share index, delay): {worst:?}");
    assert!(pct(100) < STALL_BOUND, "a share reached the reader {:?} late", pct(100));
    let stats = exporter.stats();
    println!("exporter: {stats:?}");
    assert_eq!(stats.stalled_importers, 1, "{stats:?}");
    // The stalled importer holds what reached its socket: reclaimed once its process is gone.
    assert_eq!(stats.awaiting_exit, 1, "{stats:?}");
    stalled.kill();
    exporter
        .wait_idle(WAIT)
        .unwrap_or_else(|e| panic!("{e}: {:?}", exporter.stats()));
    let stats = exporter.stats();
    assert!(stats.reclaimed_buffers > 0 && stats.abandoned_buffers == 0, "{stats:?}");
    let errors = exporter.shutdown();
    assert!(
        errors
            .iter()
            .all(|e| matches!(e, Error::Stalled { importer, .. } if *importer == s)),
        "{errors:?}"
    );
    reader.join().unwrap();
    // The stalled child's stdin and stdout pipes are the test's, not the exporter's: closed before the count.
    drop((rx, stream, stalled));
    assert_back_to_baseline("exporter", baseline, &pool, &ctx, used);
    no_drop_errors("exporter");
}

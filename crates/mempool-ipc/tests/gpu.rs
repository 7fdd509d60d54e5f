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

fn socket_path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("mempool-ipc-gpu-{}-{tag}.sock", std::process::id()))
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
    let (importer, stream, kernels) = connect();
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
    assert_eq!(importer.imported_blocks(), 0);
    drop(importer);
    no_drop_errors("importer");
}

/// `make` builds the suballocating resource over the exporter's pool; `release` returns its unused
/// chunks to that pool, reporting any error, before the resource is dropped.
fn suballocated_parent<R: MemoryResource + 'static>(
    test: &str,
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
    let child = ChildProc::spawn(test, "importer", &sock);
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
        |upstream, ctx| BinningResource::new(upstream, ctx, BinningConfig::default()).unwrap(),
        BinningResource::release_unused,
    );
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

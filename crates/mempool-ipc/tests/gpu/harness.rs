//! The re-exec harness every scenario uses, and the helpers they share.
//!
//! A test that needs a second process re-executes this test binary, filtered to the same test
//! (`--exact`, the name [`this_test!`] gives), with `MEMPOOL_IPC_TEST_ROLE` naming the child's
//! part (CUDA does not survive `fork`). Children print marker lines on stdout; the parent waits
//! for them and may write lines to the child's stdin. Before it spawns a child, the harness checks
//! that the binary lists a test of that name, so a misnamed test fails instead of running nothing.

pub(crate) use std::io::{BufRead, BufReader, Write};
pub(crate) use std::path::{Path, PathBuf};
pub(crate) use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};
pub(crate) use std::time::{Duration, Instant};

pub(crate) use mempool_core::kernels::{u32s, CheckKernels};
pub(crate) use mempool_core::{
    memory, Context, Device, DeviceAddr, HandleTypes, MemPool, PoolProps, Stream, StreamRef,
};
pub(crate) use mempool_ipc::{Error, Exporter, ExporterOptions, Importer, ImporterOptions, SharedBuffer};
pub(crate) use mempool_rmm::suballoc::{BinningOptions, PoolOptions};
pub(crate) use mempool_rmm::{
    AsyncOptions, AsyncResource, BinningResource, MemoryResource, PoolResource, ReleaseThreshold,
};

pub(crate) const ROLE: &str = "MEMPOOL_IPC_TEST_ROLE";
pub(crate) const SOCK: &str = "MEMPOOL_IPC_TEST_SOCK";
pub(crate) const MARK: &str = "MEMPOOL-IPC-TEST";
pub(crate) const WAIT: Duration = Duration::from_secs(30);
pub(crate) const MIB: usize = 1 << 20;

/// The tests assert on process-wide things (drop errors, the GPU's memory): one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// The libtest name of the test function this is written in (`module::test_fn`), for
/// [`ChildProc::spawn`] and `run_role`: derived from the function, so it cannot go stale.
macro_rules! this_test {
    () => {{
        fn here() {}
        let name = std::any::type_name_of_val(&here);
        let name = name.strip_suffix("::here").expect("a function's path");
        // Drop the crate's name: libtest names tests by their path inside the crate.
        name.split_once("::").map_or(name, |(_, path)| path)
    }};
}

/// Checks that this binary has a test named exactly `test`, so that a child filtered to it runs
/// it (a child filtered to a name that matches nothing would run no test and exit 0).
pub(crate) fn assert_test_exists(test: &str) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--list", "--exact", test])
        .env_remove(ROLE)
        .output()
        .expect("list this binary's tests");
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(
        listed.lines().any(|l| l == format!("{test}: test")),
        "this test binary has no test named {test:?}: {listed}"
    );
}

pub(crate) fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn gpu() -> (Device, Arc<Context>) {
    let dev = Device::get(0).expect("GPU tests need a CUDA device: run them on a GPU machine");
    let ctx = dev.context().expect("primary context");
    (dev, ctx)
}

pub(crate) fn exportable_pool(dev: &Device) -> MemPool {
    MemPool::new(dev, &PoolProps::new().handle_types(HandleTypes::POSIX_FILE_DESCRIPTOR)).expect("exportable pool")
}

/// A socket path unique to this process and `tag` (the test's name), short enough for `sun_path`
/// (108 bytes) whatever the tag's length: the tag's first 24 characters and a hash of all of it.
pub(crate) fn socket_path(tag: &str) -> PathBuf {
    pub(crate) use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    tag.hash(&mut hasher);
    let short: String = tag.chars().take(24).collect();
    std::env::temp_dir().join(format!(
        "mempool-ipc-gpu-{}-{short}-{:016x}.sock",
        std::process::id(),
        hasher.finish()
    ))
}

pub(crate) fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

pub(crate) fn child_socket() -> PathBuf {
    PathBuf::from(std::env::var(SOCK).expect("the parent passes the socket path"))
}

/// Copies `n` u32s at `ptr` to the host, ordered on `stream`.
///
/// # Safety
/// 1. `ptr..ptr + 4 * n` is live device memory reachable from `ctx` that stays allocated until
///    the copy is done (it is done when this returns).
/// 2. Nothing writes it during the copy: its writers' work is done or ordered before the copy on
///    `stream`.
pub(crate) unsafe fn read_u32s(ctx: &Context, ptr: DeviceAddr, n: usize, stream: StreamRef<'_>) -> Vec<u32> {
    let mut host = vec![0u8; n * 4];
    // SAFETY: the caller keeps points 1 and 2; `host` holds exactly n u32s.
    unsafe { memory::copy_to_host(ctx, &mut host, ptr, stream) }.unwrap();
    u32s(&host)
}

pub(crate) fn shared_u32s(buf: &SharedBuffer<'_>) -> Vec<u32> {
    let mut host = vec![0u8; buf.len()];
    buf.copy_to_host(0, &mut host).unwrap();
    u32s(&host)
}

pub(crate) fn assert_iota(got: &[u32], base: u32, what: &str) {
    if let Some((i, &v)) = got.iter().enumerate().find(|&(i, &v)| v != base.wrapping_add(i as u32)) {
        panic!("{what}: element {i} is {v}, expected {}", base.wrapping_add(i as u32));
    }
}

pub(crate) fn no_drop_errors(what: &str) {
    let ipc = mempool_ipc::take_drop_errors();
    let core = mempool_core::take_drop_errors();
    assert!(
        ipc.is_empty() && core.is_empty(),
        "{what}: errors in drops: {ipc:?} {core:?}"
    );
}

/// A child process running `test` in role `role`, killed if the test fails first.
pub(crate) struct ChildProc {
    child: Child,
    stdout: BufReader<ChildStdout>,
    stdin: Option<ChildStdin>,
    name: String,
}

impl ChildProc {
    pub(crate) fn spawn(test: &str, role: &str, sock: &Path) -> ChildProc {
        assert_test_exists(test);
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

    /// The child's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the child to print `MARK word`.
    pub(crate) fn expect(&mut self, word: &str) {
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

    pub(crate) fn say(&mut self, word: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{word}").unwrap();
        stdin.flush().unwrap();
    }

    pub(crate) fn kill(&mut self) {
        self.child.kill().unwrap(); // SIGKILL
        let status = self.child.wait().unwrap();
        assert!(!status.success());
    }

    pub(crate) fn succeeds(mut self) {
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
pub(crate) fn tell_parent(word: &str) {
    println!("{MARK} {word}");
}

/// In a child: waits for a line from the parent.
pub(crate) fn hear_parent(word: &str) {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    assert_eq!(line.trim_end(), word);
}

pub(crate) fn connect() -> (Importer, Stream, CheckKernels) {
    let importer = Importer::connect(child_socket(), ImporterOptions::default()).expect("connect to the exporter");
    let ctx = importer.device().context().unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    (importer, stream, kernels)
}

/// Waits (bounded) until the pool's used memory is back to `baseline`: frees queued on other
/// streams complete asynchronously.
pub(crate) fn wait_used(pool: &MemPool, ctx: &Context, baseline: u64) {
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

/// Waits (bounded) until the exporter has no importer connected.
pub(crate) fn wait_no_importers(exporter: &Exporter) {
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

/// A version-1 frame of message type `ty`, for tests that speak the protocol by hand
/// (docs/ipc-protocol.md).
pub(crate) fn frame(ty: u16, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(12 + body.len());
    f.extend_from_slice(b"MPIP");
    f.extend_from_slice(&1u16.to_le_bytes());
    f.extend_from_slice(&ty.to_le_bytes());
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(body);
    f
}

/// The harness's own check (no GPU needed): the name `this_test!` gives is the one libtest lists.
#[test]
fn this_test_names_the_test_function_as_libtest_lists_it() {
    assert_eq!(
        this_test!(),
        "harness::this_test_names_the_test_function_as_libtest_lists_it"
    );
    assert_test_exists(this_test!());
}

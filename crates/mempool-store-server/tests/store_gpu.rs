//! GPU tests of the memory store (`mempool_store`): a server and clients in separate
//! processes. They need a GPU and fail without one (never skip). Run:
//! `cargo test -p mempool-store-server --features gpu --test store_gpu -- --test-threads=1`.
//!
//! Each test that needs more processes re-executes this binary, filtered to the same test
//! (`--exact`), with `STORE_TEST_ROLE` naming the child's part (CUDA does not survive `fork`).
//! Children print marker lines; the parent waits for them and writes lines to their stdin. The
//! server runs in the test's own process unless the test kills it or counts its descriptors and
//! memory (then it is a `mempool-store-server` process); clients always run in children
//! (an interprocess event is opened in another process than the one that made it). No test
//! asserts how long something took: deadlines are only a safety net against hangs.
#![cfg(feature = "gpu")]

/// Hostile clients over raw sockets, shared with the host test of the same shape.
#[path = "../../mempool-store/tests/store_attack/mod.rs"]
mod store_attack;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mempool_core::kernels::{u32s, CheckKernels};
use mempool_core::{memory, Context, Device, Stream};
use mempool_store::{
    Attached, BufferState, Client, ClientOptions, CreateOptions, Error, Quotas, Server, ServerConfig, ServerStats,
};

const ROLE: &str = "STORE_TEST_ROLE";
const SOCK: &str = "STORE_TEST_SOCK";
const MARK: &str = "MEMSVC-TEST";
const WAIT: Duration = Duration::from_secs(60);
const MIB: usize = 1 << 20;
/// Every test buffer: large enough that a leak shows in `cuMemGetInfo` beyond its noise.
const SIZE: usize = 256 * MIB;
/// What `cuMemGetInfo` may differ by without a leak (driver bookkeeping).
const SLACK: usize = 48 * MIB;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The libtest name of the test function this is written in.
macro_rules! this_test {
    () => {{
        fn here() {}
        let name = std::any::type_name_of_val(&here);
        let name = name.strip_suffix("::here").expect("a function's path");
        name.split_once("::").map_or(name, |(_, path)| path)
    }};
}

fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

fn child_socket() -> PathBuf {
    PathBuf::from(std::env::var(SOCK).expect("the parent passes the socket path"))
}

fn socket_path(tag: &str) -> PathBuf {
    let short: String = tag.chars().rev().take(24).collect::<String>().chars().rev().collect();
    std::env::temp_dir().join(format!(
        "store-gpu-{}-{}.sock",
        std::process::id(),
        short.replace("::", "-")
    ))
}

fn gpu() -> (Device, Arc<Context>) {
    let dev = Device::get(0).expect("GPU tests need a CUDA device: run them on a GPU machine");
    let ctx = dev.context().expect("primary context");
    (dev, ctx)
}

fn free_memory(ctx: &Context) -> usize {
    ctx.memory_info().unwrap().free
}

/// Waits (bounded) until free device memory is back within [`SLACK`] of `baseline` (a dead
/// process's context is torn down asynchronously).
fn wait_free(ctx: &Context, baseline: usize, what: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let free = free_memory(ctx);
        if free + SLACK >= baseline {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: free device memory stays at {free} bytes, {} MiB below the baseline {baseline}",
            (baseline - free) / MIB
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn wait_stats(server: &Server, what: &str, f: impl Fn(&ServerStats) -> bool) {
    let deadline = Instant::now() + WAIT;
    loop {
        let stats = server.stats();
        if f(&stats) {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting until {what}: {stats:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn no_drop_errors(what: &str) {
    let ipc = mempool_store::take_drop_errors();
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
        ChildProc::spawn_as(test, role, sock, None)
    }

    /// [`ChildProc::spawn`], running as `uid` (and its gid, without supplementary groups) when
    /// given: this process must be root.
    fn spawn_as(test: &str, role: &str, sock: &Path, uid: Option<u32>) -> ChildProc {
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--list", "--exact", test])
            .env_remove(ROLE)
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .any(|l| l == format!("{test}: test")),
            "this test binary has no test named {test:?}"
        );
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .env(SOCK, sock)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(uid) = uid {
            use std::os::unix::process::CommandExt;
            // Another uid cannot write root's home (CUDA's JIT cache).
            command
                .uid(uid)
                .gid(uid)
                .env("HOME", std::env::temp_dir())
                .env("CUDA_CACHE_DISABLE", "1");
        }
        let mut child = command.spawn().unwrap_or_else(|e| {
            panic!(
                "spawn the child process {role:?}{}: {e}",
                uid.map(|u| format!(
                    " as uid {u} (the test binary and every directory above it must be readable and \
                     executable by that uid)"
                ))
                .unwrap_or_default()
            )
        });
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let stdin = child.stdin.take();
        ChildProc {
            child,
            stdout,
            stdin,
            name: format!("{test}/{role}"),
        }
    }

    /// Waits for the child to print `MARK word`; returns the rest of that line.
    fn expect(&mut self, word: &str) -> String {
        let want = format!("{MARK} {word}");
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "{} exited before printing {want:?}", self.name);
            if let Some(at) = line.find(&want) {
                return line[at + want.len()..].trim().to_owned();
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

fn tell_parent(word: &str) {
    println!("{MARK} {word}");
    std::io::stdout().flush().unwrap();
}

fn hear_parent(word: &str) {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    assert_eq!(line.trim_end(), word);
}

/// A client child's GPU: device 0, a stream, the check kernels.
fn client_gpu() -> (Device, Arc<Context>, Stream, CheckKernels) {
    let (dev, ctx) = gpu();
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    (dev, ctx, stream, kernels)
}

/// Creates `name` (SIZE bytes), fills it with `base + i` by a kernel and publishes it on `stream`.
fn create_iota(
    client: &Client,
    dev: Device,
    name: &str,
    base: u32,
    stream: &Stream,
    kernels: &CheckKernels,
) -> Attached {
    let created = client
        .create(name, SIZE, dev, &CreateOptions::new().tag("gpu-test"))
        .unwrap();
    assert_eq!(created.len(), SIZE);
    // SAFETY: 1. `created` maps SIZE bytes (SIZE / 4 u32s, aligned) read-write for `dev`, and stays
    // mapped until it is dropped, which synchronizes the context first.
    unsafe { kernels.iota(created.ptr(), SIZE / 4, base, stream.as_ref()) }.unwrap();
    created.publish(stream.as_ref()).unwrap()
}

/// Checks on the GPU that `buf` holds `base + i` (copied to the host on `stream`, ordered after
/// the attach's wait on the creator's event: no host synchronization before it).
fn check_iota(ctx: &Context, buf: &Attached, base: u32, stream: &Stream) {
    let n = buf.len() / 4;
    let mut host = vec![0u8; buf.len()];
    // SAFETY: 1. `buf` maps `len` bytes readable by `stream`'s device until it is dropped, after this.
    unsafe { memory::copy_to_host(ctx, &mut host, buf.ptr(), stream.as_ref()) }.unwrap();
    let got = u32s(&host);
    assert_eq!(got.len(), n);
    if let Some((i, &v)) = got.iter().enumerate().find(|&(i, &v)| v != base.wrapping_add(i as u32)) {
        panic!(
            "{}: element {i} is {v}, expected {}",
            buf.name(),
            base.wrapping_add(i as u32)
        );
    }
}

fn serve(path: &Path) -> Server {
    Server::serve(ServerConfig::new(path).devices([0])).expect("start the memory server on GPU 0")
}

#[test]
fn create_write_publish_attach_across_processes_and_after_a_restart() {
    match role().as_deref() {
        Some("creator") => {
            let (dev, _ctx, stream, kernels) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let mine = create_iota(&client, dev, "e2e/w", 7, &stream, &kernels);
            tell_parent("PUBLISHED");
            hear_parent("END");
            mine.release().unwrap();
            no_drop_errors("creator");
            return;
        }
        Some("attacher") => {
            let (_dev, ctx, stream, _) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let buf = client.attach("e2e/w", stream.as_ref()).unwrap();
            assert_eq!(buf.len(), SIZE);
            check_iota(&ctx, &buf, 7, &stream);
            let info = client.list().unwrap();
            assert_eq!(info.len(), 1);
            assert_eq!((info[0].name.as_str(), info[0].tag.as_str()), ("e2e/w", "gpu-test"));
            drop(buf);
            no_drop_errors("attacher");
            tell_parent("OK");
            return;
        }
        Some(other) => panic!("unknown role {other}"),
        None => {}
    }
    let _s = serial();
    let (_dev, ctx) = gpu();
    let baseline = free_memory(&ctx);
    let path = socket_path(this_test!());
    let server = serve(&path);
    let mut creator = ChildProc::spawn(this_test!(), "creator", &path);
    creator.expect("PUBLISHED");
    // Attached while its creator lives, in another process.
    let mut attacher = ChildProc::spawn(this_test!(), "attacher", &path);
    attacher.expect("OK");
    attacher.succeeds();
    creator.say("END");
    creator.succeeds();
    wait_stats(&server, "the children's attachments end", |s| s.attachments == 0);
    assert_eq!(server.stats().buffers, 1, "a published buffer outlives its creator");
    // A restarted client attaches by name and finds the same bytes, its creator gone.
    let mut again = ChildProc::spawn(this_test!(), "attacher", &path);
    again.expect("OK");
    again.succeeds();
    let admin = Client::connect(&path).unwrap();
    admin.delete("e2e/w").unwrap();
    wait_stats(&server, "the deleted buffer is freed", |s| {
        s.buffers == 0 && s.bytes == 0
    });
    drop(admin);
    server.shutdown();
    wait_free(&ctx, baseline, "after delete and shutdown");
    no_drop_errors("server");
}

#[test]
fn a_client_killed_mid_write_leaves_nothing() {
    if let Some(role) = role() {
        assert_eq!(role, "writer");
        let (dev, _ctx, stream, kernels) = client_gpu();
        let client = Client::connect(child_socket()).unwrap();
        let created = client.create("kill/w", SIZE, dev, &CreateOptions::new()).unwrap();
        for i in 0..1000u32 {
            // SAFETY: 1. `created` maps SIZE bytes read-write for `dev` until this process dies.
            unsafe { kernels.iota(created.ptr(), SIZE / 4, i, stream.as_ref()) }.unwrap();
        }
        tell_parent("WRITING");
        std::thread::sleep(Duration::from_secs(600));
        drop(created);
        return;
    }
    let _s = serial();
    let (_dev, ctx) = gpu();
    let baseline = free_memory(&ctx);
    let path = socket_path(this_test!());
    let server = serve(&path);
    let mut writer = ChildProc::spawn(this_test!(), "writer", &path);
    writer.expect("WRITING");
    assert_eq!(server.stats().buffers, 1);
    writer.kill();
    wait_stats(&server, "the dead writer's buffer is freed", |s| {
        s.buffers == 0 && s.attachments == 0 && s.connections == 0
    });
    let admin = Client::connect(&path).unwrap();
    assert!(
        admin.list().unwrap().is_empty(),
        "an unpublished buffer dies with its creator"
    );
    drop(admin);
    wait_free(&ctx, baseline, "after the writer died (server still up)");
    server.shutdown();
    no_drop_errors("server");
}

#[test]
fn clients_killed_mid_attach_and_holding_an_attachment_are_reclaimed() {
    match role().as_deref() {
        Some("creator") => {
            let (dev, _ctx, stream, kernels) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let mine = create_iota(&client, dev, "kill/a", 3, &stream, &kernels);
            mine.release().unwrap();
            tell_parent("PUBLISHED");
            return;
        }
        Some("looper") => {
            // Attaches and lets go in a loop until killed: the kill lands somewhere in an attach.
            let (_dev, _ctx, stream, _) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let first = client.attach("kill/a", stream.as_ref()).unwrap();
            drop(first);
            tell_parent("LOOPING");
            loop {
                let buf = client.attach("kill/a", stream.as_ref()).unwrap();
                drop(buf);
            }
        }
        Some("holder") => {
            let (_dev, ctx, stream, _) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let buf = client.attach("kill/a", stream.as_ref()).unwrap();
            check_iota(&ctx, &buf, 3, &stream);
            tell_parent("HOLDING");
            std::thread::sleep(Duration::from_secs(600));
            drop(buf);
            return;
        }
        Some("checker") => {
            let (_dev, ctx, stream, _) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let buf = client.attach("kill/a", stream.as_ref()).unwrap();
            check_iota(&ctx, &buf, 3, &stream);
            drop(buf);
            no_drop_errors("checker");
            tell_parent("OK");
            return;
        }
        Some(other) => panic!("unknown role {other}"),
        None => {}
    }
    let _s = serial();
    let (_dev, ctx) = gpu();
    let baseline = free_memory(&ctx);
    let path = socket_path(this_test!());
    let server = serve(&path);
    let mut creator = ChildProc::spawn(this_test!(), "creator", &path);
    creator.expect("PUBLISHED");
    creator.succeeds();
    wait_stats(&server, "the creator let go", |s| s.attachments == 0);

    let mut looper = ChildProc::spawn(this_test!(), "looper", &path);
    looper.expect("LOOPING");
    std::thread::sleep(Duration::from_millis(200));
    looper.kill();
    let mut holder = ChildProc::spawn(this_test!(), "holder", &path);
    holder.expect("HOLDING");
    assert!(server.stats().attachments >= 1);
    holder.kill();
    wait_stats(&server, "the killed clients' attachments are reclaimed", |s| {
        s.attachments == 0 && s.connections == 0
    });
    // The buffer is intact for the next client.
    let mut checker = ChildProc::spawn(this_test!(), "checker", &path);
    checker.expect("OK");
    checker.succeeds();
    let admin = Client::connect(&path).unwrap();
    admin.delete("kill/a").unwrap();
    drop(admin);
    wait_stats(&server, "the buffer is freed", |s| s.buffers == 0 && s.attachments == 0);
    wait_free(&ctx, baseline, "after the killed clients and the delete");
    server.shutdown();
    no_drop_errors("server");
}

#[test]
fn racing_creators_exactly_one_wins() {
    if let Some(role) = role() {
        assert_eq!(role, "racer");
        let (dev, _ctx) = gpu();
        let client = Client::connect(child_socket()).unwrap();
        tell_parent("READY");
        hear_parent("GO");
        match client.create("race/x", SIZE, dev, &CreateOptions::new()) {
            Ok(created) => {
                tell_parent("RESULT WON");
                hear_parent("END");
                created.discard().unwrap();
            }
            Err(Error::NameTaken { name }) => {
                assert_eq!(name, "race/x");
                tell_parent("RESULT LOST");
                hear_parent("END");
            }
            Err(e) => panic!("{e}"),
        }
        no_drop_errors("racer");
        return;
    }
    let _s = serial();
    let (_dev, ctx) = gpu();
    let baseline = free_memory(&ctx);
    let path = socket_path(this_test!());
    let server = serve(&path);
    let test = this_test!();
    let mut racers: Vec<ChildProc> = (0..4).map(|_| ChildProc::spawn(test, "racer", &path)).collect();
    for r in &mut racers {
        r.expect("READY");
    }
    for r in &mut racers {
        r.say("GO");
    }
    let results: Vec<String> = racers.iter_mut().map(|r| r.expect("RESULT")).collect();
    assert_eq!(results.iter().filter(|r| *r == "WON").count(), 1, "{results:?}");
    assert_eq!(results.iter().filter(|r| *r == "LOST").count(), 3, "{results:?}");
    assert_eq!(server.stats().buffers, 1);
    for mut r in racers {
        r.say("END");
        r.succeeds();
    }
    wait_stats(&server, "the winner's discarded buffer is freed", |s| s.buffers == 0);
    wait_free(&ctx, baseline, "after the race");
    server.shutdown();
    no_drop_errors("server");
}

#[test]
fn attaching_a_name_being_deleted_fails_while_holders_keep_their_bytes() {
    match role().as_deref() {
        Some("creator") => {
            let (dev, _ctx, stream, kernels) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            create_iota(&client, dev, "del/x", 11, &stream, &kernels)
                .release()
                .unwrap();
            tell_parent("PUBLISHED");
            return;
        }
        Some("holder") => {
            let (_dev, ctx, stream, _) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let buf = client.attach("del/x", stream.as_ref()).unwrap();
            tell_parent("HOLDING");
            hear_parent("CHECK");
            // Deleted meanwhile: the name is gone, the memory is not.
            check_iota(&ctx, &buf, 11, &stream);
            assert!(matches!(
                client.attach("del/x", stream.as_ref()),
                Err(Error::UnknownName { .. })
            ));
            drop(buf);
            no_drop_errors("holder");
            tell_parent("OK");
            return;
        }
        Some("late") => {
            let (_dev, _ctx, stream, _) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            match client.attach("del/x", stream.as_ref()) {
                Err(Error::UnknownName { name }) => assert_eq!(name, "del/x"),
                other => panic!("attaching a deleted name: {other:?}"),
            }
            tell_parent("OK");
            return;
        }
        Some(other) => panic!("unknown role {other}"),
        None => {}
    }
    let _s = serial();
    let (_dev, ctx) = gpu();
    let baseline = free_memory(&ctx);
    let path = socket_path(this_test!());
    let server = serve(&path);
    let mut creator = ChildProc::spawn(this_test!(), "creator", &path);
    creator.expect("PUBLISHED");
    creator.succeeds();
    let mut holder = ChildProc::spawn(this_test!(), "holder", &path);
    holder.expect("HOLDING");
    let admin = Client::connect(&path).unwrap();
    admin.delete("del/x").unwrap();
    assert!(admin.list().unwrap().is_empty());
    assert_eq!(server.stats().buffers, 1, "the holder keeps it alive");
    let mut late = ChildProc::spawn(this_test!(), "late", &path);
    late.expect("OK");
    late.succeeds();
    holder.say("CHECK");
    holder.expect("OK");
    holder.succeeds();
    wait_stats(&server, "the last holder let go", |s| s.buffers == 0);
    drop(admin);
    wait_free(&ctx, baseline, "after the delete");
    server.shutdown();
    no_drop_errors("server");
}

#[test]
fn a_killed_server_gives_peer_gone_mappings_stay_valid_and_a_restart_serves_the_path() {
    match role().as_deref() {
        Some("server") => {
            let server = serve(&child_socket());
            tell_parent("LISTENING");
            std::thread::sleep(Duration::from_secs(600));
            drop(server);
            return;
        }
        Some(other) => panic!("unknown role {other}"),
        None => {}
    }
    let _s = serial();
    let (dev, ctx) = gpu();
    let stream = Stream::new(&ctx).unwrap();
    let kernels = CheckKernels::load(&ctx).unwrap();
    let path = socket_path(this_test!());
    let mut server = ChildProc::spawn(this_test!(), "server", &path);
    server.expect("LISTENING");
    let client = Client::connect(&path).unwrap();
    let mine = create_iota(&client, dev, "srv/x", 5, &stream, &kernels);
    stream.synchronize().unwrap();
    server.kill();
    // The next call says the server is gone, and so does every later one.
    assert!(
        matches!(client.list(), Err(Error::PeerGone { .. })),
        "after the server died"
    );
    assert!(matches!(client.stats(), Err(Error::PeerGone { .. })));
    assert!(matches!(Client::connect(&path), Err(Error::PeerGone { .. })));
    // This process holds its own imported handle: its mapping stays valid until it drops it.
    check_iota(&ctx, &mine, 5, &stream);
    // SAFETY: 1. `mine` maps SIZE bytes read-write for `dev` until it is dropped below.
    unsafe { kernels.add(mine.ptr(), SIZE / 4, 1, stream.as_ref()) }.unwrap();
    check_iota(&ctx, &mine, 6, &stream);
    // Letting go after the server died reports nothing (there is nobody to tell).
    mine.release().unwrap();
    no_drop_errors("client after the server died");
    // The dead server's socket file is stale: a new server replaces it and starts empty.
    let mut restarted = ChildProc::spawn(this_test!(), "server", &path);
    restarted.expect("LISTENING");
    let client = Client::connect(&path).unwrap();
    assert!(client.list().unwrap().is_empty());
    let again = create_iota(&client, dev, "srv/x", 9, &stream, &kernels);
    check_iota(&ctx, &again, 9, &stream);
    again.release().unwrap();
    drop(client);
    restarted.kill();
    no_drop_errors("client");
    let _ = std::fs::remove_file(&path);
}

/// The `mempool-store-server` Cargo built; where the test binaries were packed for a GPU machine
/// (`.gpu/tests/`), the packed one beside them (`.gpu/bin/`).
/// Buffers of the attach_many test: more than one request carries (`Client::MAX_ATTACH_MANY`).
const MANY: usize = 200;

fn many_name(i: usize) -> String {
    format!("many/{i:03}")
}

#[test]
fn attach_many_across_processes_maps_every_buffer_all_or_nothing() {
    const { assert!(MANY > Client::MAX_ATTACH_MANY, "the test spans two requests") };
    match role().as_deref() {
        Some("creator") => {
            let (dev, _ctx, stream, kernels) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let g = client.devices()[0].1 as usize;
            let mut mine = Vec::with_capacity(MANY);
            for i in 0..MANY {
                // Sizes of 1, 2 and 3 granules, so that each buffer's own range shows.
                let created = client
                    .create(&many_name(i), g * (1 + i % 3), dev, &CreateOptions::new())
                    .unwrap();
                // SAFETY: 1. `created` maps `len` bytes (len / 4 u32s, aligned) read-write for `dev`, and
                // stays mapped until it is dropped, which synchronizes the context first.
                unsafe { kernels.iota(created.ptr(), created.len() / 4, (i as u32) << 20, stream.as_ref()) }.unwrap();
                mine.push(created.publish(stream.as_ref()).unwrap());
            }
            tell_parent("PUBLISHED");
            hear_parent("END");
            drop(mine);
            no_drop_errors("creator");
            return;
        }
        Some("attacher") => {
            let (_dev, ctx, stream, _) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let g = client.devices()[0].1 as usize;
            let names: Vec<String> = (0..MANY).map(many_name).collect();
            // The creator holds one attachment of each.
            assert_eq!(client.stats().unwrap().attachments, MANY as u64);
            // All or nothing: a missing name in the second request refuses the call, names it, and
            // the first request's buffers (already mapped here) are released.
            let mut with_missing = names.clone();
            with_missing.insert(150, "many/missing".into());
            match client.attach_many(&with_missing, stream.as_ref()) {
                Err(Error::UnknownName { name }) => assert_eq!(name, "many/missing"),
                other => panic!("expected UnknownName for many/missing, got {other:?}"),
            }
            assert_eq!(client.stats().unwrap().attachments, MANY as u64);
            let mut bufs = client.attach_many(&names, stream.as_ref()).unwrap();
            assert_eq!(bufs.len(), MANY);
            assert_eq!(client.stats().unwrap().attachments, 2 * MANY as u64);
            for (i, b) in bufs.iter().enumerate() {
                assert_eq!((b.name(), b.len()), (names[i].as_str(), g * (1 + i % 3)));
                check_iota(&ctx, b, (i as u32) << 20, &stream);
            }
            // Each buffer unmaps only its own range: drop every other one, the rest read the same.
            let mut kept = Vec::new();
            for (i, b) in bufs.drain(..).enumerate() {
                if i % 2 == 0 {
                    kept.push((i, b));
                }
            }
            for (i, b) in &kept {
                check_iota(&ctx, b, (*i as u32) << 20, &stream);
            }
            assert_eq!(client.stats().unwrap().attachments, (MANY + MANY.div_ceil(2)) as u64);
            drop(kept);
            assert_eq!(client.stats().unwrap().attachments, MANY as u64);
            no_drop_errors("attacher");
            tell_parent("OK");
            return;
        }
        Some(other) => panic!("unknown role {other}"),
        None => {}
    }
    let _s = serial();
    let (_dev, ctx) = gpu();
    let baseline = free_memory(&ctx);
    let path = socket_path(this_test!());
    let server = serve(&path);
    let mut creator = ChildProc::spawn(this_test!(), "creator", &path);
    creator.expect("PUBLISHED");
    let mut attacher = ChildProc::spawn(this_test!(), "attacher", &path);
    attacher.expect("OK");
    attacher.succeeds();
    creator.say("END");
    creator.succeeds();
    wait_stats(&server, "the children's attachments end", |s| s.attachments == 0);
    assert_eq!(server.stats().buffers, MANY as u64);
    let admin = Client::connect(&path).unwrap();
    for i in 0..MANY {
        admin.delete(&many_name(i)).unwrap();
    }
    wait_stats(&server, "the deleted buffers are freed", |s| {
        s.buffers == 0 && s.bytes == 0
    });
    drop(admin);
    server.shutdown();
    wait_free(&ctx, baseline, "after deleting every buffer and shutdown");
    no_drop_errors("server");
}

/// Members of the group the group test makes (sizes of 1, 2 and 3 granules, in turn).
const GROUP: usize = 7;

fn group_name(i: usize) -> String {
    format!("group/{i}")
}

#[test]
fn a_group_is_created_in_one_allocation_and_attached_through_one_mapping() {
    match role().as_deref() {
        Some("creator") => {
            let (dev, _ctx, stream, kernels) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let g = client.devices()[0].1 as usize;
            let members: Vec<(String, usize)> = (0..GROUP).map(|i| (group_name(i), g * (1 + i % 3))).collect();
            let created = client
                .create_many(&members, dev, &CreateOptions::new().tag("gpu-test"))
                .unwrap();
            assert_eq!(created.len(), GROUP);
            // Back to back in one mapping of the whole group, each with its own range.
            let base = created[0].mapping().addr();
            let mut offset = 0;
            for (i, c) in created.iter().enumerate() {
                assert_eq!(
                    (c.name(), c.len(), c.offset()),
                    (members[i].0.as_str(), members[i].1, offset)
                );
                assert_eq!(c.mapping().addr(), base);
                assert_eq!(c.ptr(), base.offset(offset));
                offset += c.len();
            }
            assert_eq!(created[0].mapping().len(), offset);
            let mut published = Vec::with_capacity(GROUP);
            for (i, c) in created.into_iter().enumerate() {
                // SAFETY: 1. `c` maps `len` bytes (len / 4 u32s, aligned) at `ptr` read-write for `dev`
                // (its own range of the group's mapping), mapped until the last member is dropped,
                // which synchronizes the context first.
                unsafe { kernels.iota(c.ptr(), c.len() / 4, (i as u32) << 20, stream.as_ref()) }.unwrap();
                published.push(c.publish(stream.as_ref()).unwrap());
            }
            // A second group, one member left unpublished: the other is not attachable.
            let half = client
                .create_many(&[("half/a", g), ("half/b", g)], dev, &CreateOptions::new())
                .unwrap();
            let mut half = half.into_iter();
            let half_a = half.next().unwrap().publish(stream.as_ref()).unwrap();
            let half_b = half.next().unwrap();
            // All or nothing: a taken name refuses the whole group.
            match client.create_many(
                &[("fresh/a", g), (group_name(3).as_str(), g)],
                dev,
                &CreateOptions::new(),
            ) {
                Err(Error::NameTaken { name }) => assert_eq!(name, group_name(3)),
                other => panic!("expected NameTaken, got {other:?}"),
            }
            assert!(client.list().unwrap().iter().all(|b| b.name != "fresh/a"));
            tell_parent("PUBLISHED");
            hear_parent("END");
            drop((published, half_a, half_b));
            no_drop_errors("creator");
            return;
        }
        Some("attacher") => {
            let (_dev, ctx, stream, _) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let g = client.devices()[0].1 as usize;
            match client.attach("half/a", stream.as_ref()) {
                Err(Error::WrongState { name, state, .. }) => {
                    assert_eq!((name.as_str(), state), ("half/a", BufferState::Creating));
                }
                other => panic!("expected WrongState for half/a, got {other:?}"),
            }
            let names: Vec<String> = (0..GROUP).map(group_name).collect();
            let mut bufs: Vec<Option<Attached>> = client
                .attach_many(&names, stream.as_ref())
                .unwrap()
                .into_iter()
                .map(Some)
                .collect();
            let base = bufs[0].as_ref().unwrap().mapping().addr();
            let mut offset = 0;
            for (i, b) in bufs.iter().enumerate() {
                let b = b.as_ref().unwrap();
                assert_eq!(
                    (b.name(), b.len(), b.offset()),
                    (names[i].as_str(), g * (1 + i % 3), offset)
                );
                assert_eq!(b.mapping().addr(), base, "one mapping for the group");
                assert_eq!(b.ptr(), base.offset(offset));
                offset += b.len();
                check_iota(&ctx, b, (i as u32) << 20, &stream);
            }
            // A view covers the member's own bytes only.
            let third = bufs[2].as_ref().unwrap();
            let host = third.view(stream.as_ref()).unwrap().to_host().unwrap();
            assert_eq!(host.len(), third.len());
            assert_eq!(u32s(&host)[..2], [2 << 20, (2 << 20) + 1]);
            // Dropping members keeps the others' bytes mapped.
            bufs[1] = None;
            bufs[GROUP - 1] = None;
            for (i, b) in bufs.iter().enumerate() {
                if let Some(b) = b {
                    check_iota(&ctx, b, (i as u32) << 20, &stream);
                }
            }
            // A single attach of a member reuses the group's live mapping (no import): its range
            // is at the same base address.
            let again = client.attach(&names[1], stream.as_ref()).unwrap();
            assert_eq!(again.mapping().addr(), base);
            assert_eq!(again.ptr(), base.offset(g));
            check_iota(&ctx, &again, 1 << 20, &stream);
            // The creator's (the group's and half's two) and this process's.
            assert_eq!(client.stats().unwrap().attachments, (GROUP + 2 + GROUP - 2 + 1) as u64);
            // Once every member is dropped the mapping goes; a later attach maps the group anew.
            drop(bufs);
            drop(again);
            let last = client.attach(&names[4], stream.as_ref()).unwrap();
            // Offsets: 0, 1, 3, 6, 7, 9, 12 granules.
            assert_eq!((last.len(), last.offset()), (2 * g, 7 * g));
            check_iota(&ctx, &last, 4 << 20, &stream);
            drop(last);
            no_drop_errors("attacher");
            tell_parent("OK");
            return;
        }
        Some(other) => panic!("unknown role {other}"),
        None => {}
    }
    let _s = serial();
    let (_dev, ctx) = gpu();
    let baseline = free_memory(&ctx);
    let path = socket_path(this_test!());
    let server = serve(&path);
    let mut creator = ChildProc::spawn(this_test!(), "creator", &path);
    creator.expect("PUBLISHED");
    let mut attacher = ChildProc::spawn(this_test!(), "attacher", &path);
    attacher.expect("OK");
    attacher.succeeds();
    creator.say("END");
    creator.succeeds();
    wait_stats(&server, "the children's attachments end", |s| s.attachments == 0);
    // The group's members and half/a (half/b was abandoned unpublished).
    assert_eq!(server.stats().named, GROUP as u64 + 1);
    let admin = Client::connect(&path).unwrap();
    for i in 0..GROUP {
        admin.delete(&group_name(i)).unwrap();
    }
    admin.delete("half/a").unwrap();
    wait_stats(&server, "the deleted groups are freed", |s| {
        s.buffers == 0 && s.bytes == 0
    });
    drop(admin);
    server.shutdown();
    wait_free(&ctx, baseline, "after deleting every group and shutdown");
    no_drop_errors("server");
}

/// Kernels the creator of the pending-work test queues after its first write: more than the
/// driver's launch queue holds, so that many are still to run when it publishes.
const PENDING_ADDS: u32 = 3000;

#[test]
fn a_buffer_published_with_gpu_work_pending_is_read_in_stream_order() {
    match role().as_deref() {
        Some("creator") => {
            let (dev, _ctx, stream, kernels) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let created = client.create("pending/w", SIZE, dev, &CreateOptions::new()).unwrap();
            let n = SIZE / 4;
            // SAFETY: 1. `created` maps SIZE bytes (n aligned u32s) read-write for `dev`, and stays
            // mapped until it is dropped, which synchronizes the context first.
            unsafe { kernels.iota(created.ptr(), n, 5, stream.as_ref()) }.unwrap();
            for _ in 0..PENDING_ADDS {
                // SAFETY: 1. as above.
                unsafe { kernels.add(created.ptr(), n, 1, stream.as_ref()) }.unwrap();
            }
            // Published at once, no synchronization: the final bytes are still being written.
            let mine = created.publish(stream.as_ref()).unwrap();
            tell_parent("PUBLISHED");
            hear_parent("END");
            mine.release().unwrap();
            no_drop_errors("creator");
            return;
        }
        Some("attacher") => {
            let (_dev, ctx, stream, _) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            tell_parent("READY");
            hear_parent("GO");
            // The stream waits on the server's event (or nothing, if the work is done by now): the
            // copy to the host, ordered after it, sees the final bytes either way.
            let many = client.attach_many(&["pending/w"], stream.as_ref()).unwrap();
            check_iota(&ctx, &many[0], 5 + PENDING_ADDS, &stream);
            let one = client.attach("pending/w", stream.as_ref()).unwrap();
            check_iota(&ctx, &one, 5 + PENDING_ADDS, &stream);
            drop((many, one));
            no_drop_errors("attacher");
            tell_parent("OK");
            return;
        }
        Some(other) => panic!("unknown role {other}"),
        None => {}
    }
    let _s = serial();
    let (_dev, ctx) = gpu();
    let baseline = free_memory(&ctx);
    let path = socket_path(this_test!());
    let server = serve(&path);
    // The attacher is up (CUDA initialized, connected) before the creator publishes, so that it
    // attaches while the creator's kernels still run.
    let mut attacher = ChildProc::spawn(this_test!(), "attacher", &path);
    attacher.expect("READY");
    let mut creator = ChildProc::spawn(this_test!(), "creator", &path);
    creator.expect("PUBLISHED");
    attacher.say("GO");
    attacher.expect("OK");
    attacher.succeeds();
    creator.say("END");
    creator.succeeds();
    wait_stats(&server, "the children's attachments end", |s| s.attachments == 0);
    let admin = Client::connect(&path).unwrap();
    admin.delete("pending/w").unwrap();
    wait_stats(&server, "the deleted buffer is freed", |s| {
        s.buffers == 0 && s.bytes == 0
    });
    drop(admin);
    server.shutdown();
    wait_free(&ctx, baseline, "after delete and shutdown");
    no_drop_errors("server");
}

fn store_server() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_mempool-store-server"));
    if built.exists() {
        return built;
    }
    let exe = std::env::current_exe().unwrap();
    let packed = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("bin/mempool-store-server"));
    packed.filter(|p| p.exists()).unwrap_or(built)
}

#[test]
fn store_server_listens_and_stops_on_sigterm() {
    let _s = serial();
    let _ = gpu();
    let path = socket_path(this_test!());
    let mut child = Command::new(store_server())
        .args([
            "--socket",
            path.to_str().unwrap(),
            "--device",
            "0",
            "--uid-buffers",
            "4",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(
        line.contains("listening on") && line.contains(path.to_str().unwrap()),
        "{line:?}"
    );
    let client = Client::connect(&path).unwrap();
    assert!(client.list().unwrap().is_empty());
    let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "mempool-store-server exits 0 on SIGTERM: {status}");
    assert!(!path.exists(), "mempool-store-server removes its socket file");
    assert!(matches!(client.list(), Err(Error::PeerGone { .. })));
}

/// The good client's round buffers in the hostile-clients test: a size the granularity rounds up.
const ROUND_SIZE: usize = 64 * MIB + 1;
/// The hostile-clients test's `mempool-store-server` limits (short time limits, so that attackers are
/// cut off soon; the idle flood meets the per-uid connection limit first).
const MAX_CONNECTIONS: usize = 40;
const MAX_CONNECTIONS_PER_UID: usize = 24;
/// What the server's resident memory may exceed its pre-attack baseline by after an attack
/// wave: the connection threads' stacks that glibc caches for reuse and the per-thread malloc
/// arenas (each keeps its top chunk, up to 128 KiB, mapped) stay resident once touched.
const RSS_SLACK: u64 = 64 << 20;
/// What it may grow by from the first wave to the next (the caches are warm by then: a leak per
/// attacking connection or per request shows here).
const RSS_WAVE_SLACK: u64 = 16 << 20;

/// What each descriptor of process `pid` links to, sorted.
fn fds_of(pid: u32) -> Vec<String> {
    let mut fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap_or_else(|e| panic!("cannot list /proc/{pid}/fd: {e}"))
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|t| t.to_string_lossy().into_owned())
        .collect();
    fds.sort();
    fds
}

/// Process `pid`'s resident memory in bytes (`VmRSS` of `/proc/<pid>/status`).
fn vm_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status:\n{status}"));
    kib << 10
}

/// The entries of `a` that `b` lacks (as multisets).
fn missing_from(a: &[String], b: &[String]) -> Vec<String> {
    let mut b = b.to_vec();
    a.iter()
        .filter(|x| match b.iter().position(|y| y == *x) {
            Some(i) => {
                b.swap_remove(i);
                false
            }
            None => true,
        })
        .cloned()
        .collect()
}

/// Waits (bounded) until process `pid` holds no more descriptors than `baseline` lists.
fn wait_fds(pid: u32, baseline: &[String], what: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let now = fds_of(pid);
        if now.len() <= baseline.len() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: mempool-store-server (pid {pid}) holds {} descriptors, {} at the baseline; new: {:?}; gone: {:?}",
            now.len(),
            baseline.len(),
            missing_from(&now, baseline),
            missing_from(baseline, &now)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A `mempool-store-server` process, killed if the test fails first.
struct ServeProc {
    child: Child,
    path: PathBuf,
}

impl ServeProc {
    /// Starts `mempool-store-server` on `path` with `flags` and waits until it listens.
    fn spawn(path: &Path, flags: &[&str]) -> ServeProc {
        let mut child = Command::new(store_server())
            .args(["--socket", path.to_str().unwrap()])
            .args(flags)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", store_server().display()));
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(
            line.contains("listening on"),
            "mempool-store-server {flags:?} said {line:?}"
        );
        ServeProc {
            child,
            path: path.to_owned(),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM; it must exit 0 and remove its socket file.
    fn stop(mut self) {
        let pid = rustix::process::Pid::from_raw(self.pid() as i32).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "mempool-store-server exits 0 on SIGTERM: {status}");
        assert!(!self.path.exists(), "mempool-store-server removes its socket file");
    }
}

impl Drop for ServeProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One round of the well-behaved client: creates a buffer (of a size the granularity `g` rounds
/// up), writes it on the GPU, publishes it, attaches it and checks its bytes, deletes it and
/// lets go of both mappings. Every step must succeed.
fn good_round(
    client: &Client,
    (dev, ctx, stream, kernels): (Device, &Context, &Stream, &CheckKernels),
    g: usize,
    round: u32,
) {
    let name = format!("flt/round-{round}");
    let step = |what: &str, e: Error| -> ! { panic!("good client, round {round}: {what}: {e}") };
    let created = client
        .create(&name, ROUND_SIZE, dev, &CreateOptions::new().tag("good"))
        .unwrap_or_else(|e| step("create", e));
    assert_eq!(
        created.len(),
        ROUND_SIZE.next_multiple_of(g),
        "{ROUND_SIZE} bytes rounded up to the granularity {g}"
    );
    let base = round << 20;
    // SAFETY: 1. `created` maps `len` bytes (a multiple of the granularity: len / 4 aligned u32s)
    // read-write for `dev`; published, the mapping stays until `mine` is released below, which
    // synchronizes the context first.
    unsafe { kernels.iota(created.ptr(), created.len() / 4, base, stream.as_ref()) }.unwrap();
    let mine = created.publish(stream.as_ref()).unwrap_or_else(|e| step("publish", e));
    let attached = client
        .attach(&name, stream.as_ref())
        .unwrap_or_else(|e| step("attach", e));
    assert_eq!(attached.len(), mine.len());
    check_iota(ctx, &attached, base, stream);
    client.delete(&name).unwrap_or_else(|e| step("delete", e));
    drop(attached);
    mine.release().unwrap_or_else(|e| step("release", e));
    no_drop_errors(&format!("good client, round {round}"));
}

#[test]
fn hostile_clients_all_at_once_leave_the_store_server_at_its_baseline_and_a_good_client_is_served() {
    match role().as_deref() {
        Some("good") => {
            // Holds a published buffer throughout (so that its connection is never closed as
            // idle, and the buffer must survive the attack), and runs a round when told.
            let (dev, ctx, stream, kernels) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let g = client.devices()[0].1 as usize;
            let on_gpu = (dev, &*ctx, &stream, &kernels);
            let keep = client.create("flt/keep", g, dev, &CreateOptions::new()).unwrap();
            // SAFETY: 1. `keep` maps `g` bytes (g / 4 aligned u32s) read-write for `dev`;
            // published, the mapping stays until it is released at the end, which synchronizes
            // the context first.
            unsafe { kernels.iota(keep.ptr(), g / 4, 77, stream.as_ref()) }.unwrap();
            let keep = keep.publish(stream.as_ref()).unwrap();
            // Warm-up: the driver's and the server's caches (its recycled events, say) reach the
            // state the rounds keep them in before the parent measures the baseline.
            let mut round = 0;
            for _ in 0..3 {
                good_round(&client, on_gpu, g, round);
                round += 1;
            }
            tell_parent("READY");
            loop {
                let mut line = String::new();
                std::io::stdin().read_line(&mut line).unwrap();
                match line.trim_end() {
                    "ROUND" => {
                        good_round(&client, on_gpu, g, round);
                        tell_parent(&format!("DONE {round}"));
                        round += 1;
                    }
                    "END" => break,
                    other => panic!("unknown command {other:?}"),
                }
            }
            let again = client.attach("flt/keep", stream.as_ref()).unwrap();
            check_iota(&ctx, &again, 77, &stream);
            drop(again);
            client.delete("flt/keep").unwrap();
            keep.release().unwrap();
            no_drop_errors("good client");
            tell_parent("ENDED");
            return;
        }
        Some("fresh") => {
            let (dev, ctx, stream, kernels) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let g = client.devices()[0].1 as usize;
            good_round(&client, (dev, &ctx, &stream, &kernels), g, 1000);
            assert!(client.list().unwrap().is_empty());
            tell_parent("DONE");
            return;
        }
        Some(other) => panic!("unknown role {other}"),
        None => {}
    }
    let _s = serial();
    let (_dev, ctx) = gpu();
    let before_server = free_memory(&ctx);
    let path = socket_path(this_test!());
    let max_connections = MAX_CONNECTIONS.to_string();
    let per_uid = MAX_CONNECTIONS_PER_UID.to_string();
    let frame_timeout = Duration::from_millis(500);
    let server = ServeProc::spawn(
        &path,
        &[
            "--device",
            "0",
            "--max-connections",
            &max_connections,
            "--max-connections-per-uid",
            &per_uid,
            "--handshake-timeout",
            "500ms",
            "--frame-timeout",
            "500ms",
            "--idle-timeout",
            "2s",
            "--write-timeout",
            "500ms",
        ],
    );
    let pid = server.pid();
    let mut good = ChildProc::spawn(this_test!(), "good", &path);
    good.expect("READY");
    // The baseline, before any attack: the server's descriptors (its listener, the good client's
    // connection, the driver's), its resident memory and the GPU's free memory (the good
    // client's kept buffer included).
    let fds = fds_of(pid);
    let rss = vm_rss(pid);
    let free = free_memory(&ctx);
    println!(
        "baseline: {} descriptors, VmRSS {} KiB, {} MiB free on the GPU",
        fds.len(),
        rss >> 10,
        free / MIB
    );
    let plan = store_attack::Attack {
        frame_timeout,
        max_connections: MAX_CONNECTIONS_PER_UID,
        garbage: 20,
        stray: format!("store-gpu-stray-{}", std::process::id()),
    };
    let mut first_rss = None;
    for wave in 0..2 {
        let report = store_attack::attack(&path, &plan, || {
            // The server at its connection limit, every attacker at work: the good client is
            // served.
            for _ in 0..3 {
                good.say("ROUND");
                good.expect("DONE");
            }
        });
        println!("wave {wave}: {}", report.summary());
        assert!(
            report.idle_admitted < MAX_CONNECTIONS_PER_UID,
            "the good client's connection holds one of the uid's slots: {}",
            report.summary()
        );
        good.say("ROUND");
        good.expect("DONE");
        // Every attacker is closed and the server's time limits have run out: back to the
        // baseline (descriptors exactly, memory within the slack).
        wait_fds(pid, &fds, &format!("after attack wave {wave}"));
        wait_free(&ctx, free, &format!("after attack wave {wave}"));
        let now = fds_of(pid);
        assert!(
            !now.iter().any(|t| t.contains(&plan.stray)),
            "the server still holds a stray descriptor: {now:?}"
        );
        let wave_rss = vm_rss(pid);
        println!(
            "after wave {wave}: {} descriptors, VmRSS {} KiB ({:+} KiB), {} MiB free on the GPU",
            now.len(),
            wave_rss >> 10,
            (wave_rss as i64 - rss as i64) >> 10,
            free_memory(&ctx) / MIB
        );
        assert!(
            wave_rss <= rss + RSS_SLACK,
            "after wave {wave}: mempool-store-server's VmRSS is {} KiB, {} KiB at the baseline (slack {} KiB)",
            wave_rss >> 10,
            rss >> 10,
            RSS_SLACK >> 10
        );
        let first = *first_rss.get_or_insert(wave_rss);
        assert!(
            wave_rss <= first + RSS_WAVE_SLACK,
            "after wave {wave}: mempool-store-server's VmRSS is {} KiB, {} KiB after the first wave (slack {} KiB)",
            wave_rss >> 10,
            first >> 10,
            RSS_WAVE_SLACK >> 10
        );
    }
    good.say("END");
    good.expect("ENDED");
    good.succeeds();
    // Still serving: a new client process runs a round, and the counters add up.
    let mut fresh = ChildProc::spawn(this_test!(), "fresh", &path);
    fresh.expect("DONE");
    fresh.succeeds();
    let admin = Client::connect(&path).unwrap();
    assert!(admin.list().unwrap().is_empty());
    // The children's connections end once the server has seen them close.
    let deadline = Instant::now() + WAIT;
    let stats = loop {
        let stats = admin.stats().unwrap();
        if (stats.buffers, stats.bytes, stats.attachments, stats.connections) == (0, 0, 0, 1) {
            break stats;
        }
        assert!(
            Instant::now() < deadline,
            "the clients left, yet the server counts: {stats:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(stats.rejected >= 2 * 34, "every attacker was counted: {stats:?}");
    drop(admin);
    wait_fds(pid, &fds, "after the clients left");
    server.stop();
    wait_free(&ctx, before_server, "after mempool-store-server exited");
    no_drop_errors("test process");
}

/// The uid the listed attacher runs as (`nobody` on most systems), and one the list leaves out.
const GUEST: u32 = 65534;
const STRANGER: u32 = 65533;

/// A client of another uid than the server's: it trusts the server's (root's) uid.
fn guest_client() -> Client {
    Client::connect_with(
        child_socket(),
        ClientOptions {
            trust_uids: vec![0],
            ..ClientOptions::default()
        },
    )
    .unwrap()
}

fn refused_to(uid: u32, result: Result<Attached, Error>, name: &str) {
    match result {
        Err(Error::NotPermitted { uid: u, what }) => {
            assert_eq!(u, uid);
            assert!(what.contains(&format!("attach buffer {name:?}")), "{what}");
        }
        Err(other) => panic!("uid {uid} attaching {name}: expected NotPermitted, got {other}"),
        Ok(_) => panic!("uid {uid} attached {name}"),
    }
}

/// Needs root: clients run as two other uids, both in the server's allow-list. A buffer is
/// attachable by its owner's uid only unless its attach list names another; after its owner
/// deletes a buffer another uid still holds, the owner's quota is free and the holder pays.
#[test]
fn an_attach_list_admits_only_its_uids_across_processes_and_the_holder_pays_after_delete() {
    match role().as_deref() {
        Some("creator") => {
            let (dev, _ctx, stream, kernels) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            assert_eq!(client.protocol_version(), 3);
            let listed = CreateOptions::new().attach_uids([GUEST]);
            for (name, options, base) in [("acl/default", CreateOptions::new(), 5), ("acl/listed", listed, 7)] {
                let created = client.create(name, SIZE, dev, &options).unwrap();
                // SAFETY: 1. `created` maps SIZE bytes (SIZE / 4 u32s, aligned) read-write for `dev`,
                // and stays mapped until it is dropped, which synchronizes the context first.
                unsafe { kernels.iota(created.ptr(), SIZE / 4, base, stream.as_ref()) }.unwrap();
                created.publish(stream.as_ref()).unwrap().release().unwrap();
            }
            tell_parent("PUBLISHED");
            return;
        }
        Some("guest") => {
            let (dev, ctx, stream, _) = client_gpu();
            let client = guest_client();
            refused_to(GUEST, client.attach("acl/default", stream.as_ref()), "acl/default");
            let buf = client.attach("acl/listed", stream.as_ref()).unwrap();
            check_iota(&ctx, &buf, 7, &stream);
            tell_parent("HOLDING");
            hear_parent("CHECK");
            // Deleted by its owner meanwhile: the bytes are still here, and charged to this uid
            // (its quota, 2 buffers' worth, has room for one more only).
            check_iota(&ctx, &buf, 7, &stream);
            match client.create("acl/guest", 2 * SIZE, dev, &CreateOptions::new()) {
                Err(Error::QuotaExceeded { in_use, .. }) => assert_eq!(in_use, SIZE as u64),
                other => panic!("expected this uid's quota to count what it holds, got {other:?}"),
            }
            drop(buf);
            no_drop_errors("guest");
            tell_parent("OK");
            return;
        }
        Some("stranger") => {
            let (_dev, _ctx, stream, _) = client_gpu();
            let client = guest_client();
            refused_to(STRANGER, client.attach("acl/listed", stream.as_ref()), "acl/listed");
            match client.attach_many(&["acl/default", "acl/listed"], stream.as_ref()) {
                Err(Error::NotPermitted { uid, .. }) => assert_eq!(uid, STRANGER),
                other => panic!("attach_many by a uid no list names: {:?}", other.map(|v| v.len())),
            }
            tell_parent("OK");
            return;
        }
        Some("again") => {
            // The owner's quota (2 buffers' worth) holds acl/default and, since the delete, not
            // acl/listed, which the guest still maps.
            let (dev, _ctx, _stream, _) = client_gpu();
            let client = Client::connect(child_socket()).unwrap();
            let again = client.create("acl/again", SIZE, dev, &CreateOptions::new()).unwrap();
            match client.create("acl/more", SIZE, dev, &CreateOptions::new()) {
                Err(Error::QuotaExceeded { in_use, .. }) => assert_eq!(in_use, 2 * SIZE as u64),
                other => panic!(
                    "expected the owner's quota to be full, got {:?}",
                    other.map(|c| c.len())
                ),
            }
            again.discard().unwrap();
            no_drop_errors("again");
            tell_parent("OK");
            return;
        }
        Some(other) => panic!("unknown role {other}"),
        None => {}
    }
    assert_eq!(
        rustix::process::geteuid().as_raw(),
        0,
        "this test runs clients as uids {GUEST} and {STRANGER}: run it as root"
    );
    let _s = serial();
    let (_dev, ctx) = gpu();
    let baseline = free_memory(&ctx);
    let path = socket_path(this_test!());
    let server = Server::serve(
        ServerConfig::new(&path)
            .devices([0])
            .allow_uids([GUEST, STRANGER])
            .socket_mode(0o666)
            .quotas(Quotas {
                per_uid_bytes: Some(2 * SIZE as u64),
                ..Quotas::default()
            }),
    )
    .expect("start the memory server on GPU 0");
    let mut creator = ChildProc::spawn(this_test!(), "creator", &path);
    creator.expect("PUBLISHED");
    creator.succeeds();
    let mut guest = ChildProc::spawn_as(this_test!(), "guest", &path, Some(GUEST));
    guest.expect("HOLDING");
    let mut stranger = ChildProc::spawn_as(this_test!(), "stranger", &path, Some(STRANGER));
    stranger.expect("OK");
    stranger.succeeds();
    let admin = Client::connect(&path).unwrap();
    admin.delete("acl/listed").unwrap();
    let stats = server.stats();
    assert_eq!(
        (stats.lingering_buffers, stats.lingering_bytes),
        (1, SIZE as u64),
        "{stats:?}"
    );
    let mut again = ChildProc::spawn(this_test!(), "again", &path);
    again.expect("OK");
    again.succeeds();
    guest.say("CHECK");
    guest.expect("OK");
    guest.succeeds();
    wait_stats(&server, "the guest let go", |s| {
        s.lingering_buffers == 0 && s.lingering_bytes == 0 && s.buffers == 1
    });
    admin.delete("acl/default").unwrap();
    wait_stats(&server, "everything freed", |s| s.buffers == 0);
    drop(admin);
    wait_free(&ctx, baseline, "after the deletes");
    server.shutdown();
    no_drop_errors("server");
}

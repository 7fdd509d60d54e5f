"""mempool.ipc: host tests (API shape, argument validation, the errors of a connection without a GPU, a
driver-less exporter) and GPU tests (marked ``gpu``): a producer (this process) and consumers started with
multiprocessing in spawn mode (tests/_ipc_child.py), viewing the shared memory with PyTorch and CuPy;
leases released on garbage collection; a consumer killed with SIGKILL."""

import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time

import pytest

import mempool
from mempool import ipc, mr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ipc_child  # noqa: E402  (the spawned children import it by this name)

# A spawned child imports PyTorch or CuPy and starts CUDA before it connects (seconds); a failure costs at
# most this long per wait. A little longer than the children's own timeouts, so that their reports
# (with the cause) arrive before the parent gives up.
TIMEOUT = _ipc_child.TIMEOUT + 5


def _socket_path(name):
    d = tempfile.mkdtemp(prefix="mempool-ipc-test-")
    return os.path.join(d, name)


# ---------------------------------------------------------------------------------------------- host tests


def test_module_shape():
    for name in ("Exporter", "Importer", "ExportedBuffer", "ImportedBuffer", "ImportedRange"):
        assert getattr(ipc, name) is getattr(mempool._lib, name)
    for name in ("alloc", "share", "share_many", "share_range", "importers", "wait_for_importers", "wait_idle", "stats", "pool_usage", "shutdown",
                 "__enter__", "__exit__"):
        assert hasattr(ipc.Exporter, name), name
    for name in ("recv", "recv_many", "rings", "close", "held", "imported_blocks", "device", "path", "__enter__",
                 "__exit__"):
        assert hasattr(ipc.Importer, name), name
    # One verb in Rust and Python: mempool-ipc's Importer::recv.
    assert not hasattr(ipc.Importer, "receive")
    assert not hasattr(ipc.Exporter, "close")  # mempool-ipc's verb: Exporter::shutdown
    for cls in (ipc.ImportedBuffer, ipc.ExportedBuffer, ipc.ImportedRange):
        for name in ("ptr", "size", "id", "tobytes", "__cuda_array_interface__", "__dlpack__", "__dlpack_device__"):
            assert hasattr(cls, name), (cls, name)
    for name in ("chunks", "chunk_sizes"):
        assert hasattr(ipc.ImportedRange, name), name
    assert not hasattr(ipc.ImportedRange, "chunk_size")  # the sizes may differ: chunk_sizes lists them
    for cls in (ipc.Exporter, ipc.Importer, ipc.ImportedBuffer, ipc.ExportedBuffer, ipc.ImportedRange):
        # Pickling is refused with an explanation (the instances need a GPU: test_pickling_is_refused).
        assert "__reduce__" in vars(cls), cls


def test_exception_hierarchy():
    for e in (ipc.PeerGoneError, ipc.IpcProtocolError, ipc.RefusedError, ipc.IpcTimeoutError):
        assert issubclass(e, ipc.IpcError)
        assert getattr(mempool, e.__name__) is e
    assert issubclass(ipc.IpcError, mempool.MempoolError)


def test_argument_validation_before_the_driver():
    path = _socket_path("never.sock")
    for kwargs, match in (
        ({"max_importers": 0}, "max_importers"),
        ({"max_handshakes": 0}, "max_handshakes"),
        ({"send_queue_len": 0}, "send_queue_len"),
        ({"io_timeout": 0}, "io_timeout"),
        ({"handshake_timeout": -1.0}, "handshake_timeout"),
        ({"idle_timeout": float("nan")}, "idle_timeout"),
        ({"shutdown_timeout": float("inf")}, "shutdown_timeout"),
        ({"mode": 0o4777}, "mode"),
    ):
        with pytest.raises(ValueError, match=match):
            ipc.Exporter(path, **kwargs)
    with pytest.raises(OverflowError):
        ipc.Exporter(path, max_importers=-1)
    with pytest.raises(TypeError):
        ipc.Exporter(path, mr="not a resource")
    with pytest.raises(TypeError):
        ipc.Exporter(path, 256)  # mr must be a resource; the limits are keyword-only
    with pytest.raises(ValueError, match="timeout"):
        ipc.Importer(path, timeout=0)
    with pytest.raises(ValueError, match="io_timeout"):
        ipc.Importer(path, io_timeout=-1)
    assert not os.path.exists(path)


def test_exporter_names_the_missing_driver(no_driver):
    if not no_driver:
        return
    path = _socket_path("nodriver.sock")
    with pytest.raises(mempool.DriverNotFoundError, match="(?i)driver"):
        ipc.Exporter(path)
    assert not os.path.exists(path)


def test_importer_without_an_exporter_is_peer_gone():
    path = _socket_path("nobody.sock")
    with pytest.raises(ipc.PeerGoneError, match="nobody.sock") as e:
        ipc.Importer(path, timeout=5)
    print(e.value)
    # A socket file nobody listens on any more (a crashed exporter's).
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()
    with pytest.raises(ipc.PeerGoneError):
        ipc.Importer(path, timeout=5)


class FakeExporter:
    """A Unix socket server that accepts one connection and does `behaviour` with it: "close" (hang up at
    once), "silent" (read the Hello, say nothing), "garbage" (answer the Hello with a frame of bad magic)."""

    def __init__(self, behaviour):
        self.path = _socket_path("fake.sock")
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(1)
        self.behaviour = behaviour
        self.received = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.server.accept()
        with conn:
            if self.behaviour == "close":
                return
            conn.settimeout(10)
            self.received = conn.recv(4096)
            if self.behaviour == "garbage":
                conn.sendall(b"XXXX" + bytes(8) + b"garbage")
            time.sleep(3)

    def close(self):
        self.thread.join(timeout=10)
        self.server.close()


@pytest.mark.parametrize(
    "behaviour,error,match",
    [
        ("close", ipc.PeerGoneError, "closed the connection"),
        ("silent", ipc.IpcTimeoutError, "timed out"),
        ("garbage", ipc.IpcProtocolError, "(?i)magic"),
    ],
)
def test_handshake_errors_name_their_cause(behaviour, error, match):
    fake = FakeExporter(behaviour)
    try:
        with pytest.raises(error, match=match) as e:
            ipc.Importer(fake.path, timeout=1.0)
        print(f"{behaviour}: {type(e.value).__name__}: {e.value}")
        assert fake.path in str(e.value)
        if behaviour != "close":
            assert fake.received.startswith(b"MPIP"), fake.received  # the importer said Hello first
    finally:
        fake.close()


# ----------------------------------------------------------------------------------------------- GPU tests


def _spawn(target, *args):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, queue), daemon=True)
    p.start()
    return p, queue


def _result(queue, process, what):
    """The child's next report; fails with its traceback, or with its exit code if it died."""
    try:
        status, value = queue.get(timeout=TIMEOUT)
    except Exception:  # noqa: BLE001
        process.join(timeout=1)
        pytest.fail(f"no report from the child ({what}) within {TIMEOUT} s; exit code {process.exitcode}")
    assert status == "ok", f"the child failed ({what}):\n{value}"
    return value


PATTERN = bytes(range(256)) * 4096  # 1 MiB


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_spawned_consumer_views_without_a_copy(framework):
    path = _socket_path(f"{framework}.sock")
    exporter = ipc.Exporter(path)
    child, queue = _spawn(_ipc_child.view_and_check, path, framework, len(PATTERN))
    try:
        importers = exporter.wait_for_importers(1, timeout=TIMEOUT)
        assert importers[0]["pid"] == child.pid, (importers, child.pid)
        buf = exporter.alloc(len(PATTERN))
        buf.copy_from_host(PATTERN)
        shared = exporter.share(buf)
        assert shared is buf
        assert buf.holders() == [importers[0]["id"]], exporter.stats()
        got = _result(queue, child, "view and check")
        print(got)
        assert got["size"] == got["len"] == len(PATTERN)
        assert got["same_memory"], got
        assert got["sum"] == sum(PATTERN), got
        assert got["head"] == PATTERN[:16], got
        assert got["held"] == 1 and got["held_after_gc"] == 0, got
        buf.wait_released(timeout=TIMEOUT)
        assert buf.holders() == []
        errors = exporter.shutdown()
        assert errors == [], errors
        gone = _result(queue, child, "receive after close")
        assert gone.startswith("PeerGoneError"), gone
        child.join(timeout=TIMEOUT)
        assert child.exitcode == 0, child.exitcode
        del buf
    finally:
        exporter.shutdown()
        if child.is_alive():
            child.kill()


@pytest.mark.gpu
def test_lease_is_released_when_the_last_view_is_collected():
    path = _socket_path("gc.sock")
    ctx = multiprocessing.get_context("spawn")
    commands = ctx.Queue()
    with ipc.Exporter(path) as exporter:
        child, queue = _spawn(_ipc_child.hold_until_told, path, commands)
        try:
            exporter.wait_for_importers(1, timeout=TIMEOUT)
            buf = exporter.share(b"\x2a" * 4096)
            got = _result(queue, child, "hold a view")
            print(got)
            assert got["id"] == buf.id and got["first"] == 0x2A, got
            # The ImportedBuffer object is gone in the child; its torch view keeps the lease.
            assert got["held_with_view"] == 1, got
            time.sleep(0.5)
            assert len(buf.holders()) == 1, (buf.holders(), exporter.stats())
            commands.put("drop")
            buf.wait_released(timeout=TIMEOUT)
            done = _result(queue, child, "drop the view")
            assert done["held_after_drop"] == 0, done
            del buf
            exporter.wait_idle(timeout=TIMEOUT)
            stats = exporter.stats()
            print(stats)
            assert stats["live_buffers"] == 0 and stats["freed_buffers"] == 1, stats
            assert stats["reclaimed_buffers"] == 0, stats
        finally:
            if child.is_alive():
                child.kill()


@pytest.mark.gpu
def test_killed_consumer_leaves_the_producer_at_its_baseline():
    path = _socket_path("kill.sock")
    with ipc.Exporter(path) as exporter:
        baseline = exporter.pool_usage()["used_current"]
        child, queue = _spawn(_ipc_child.receive_and_hang, path)
        try:
            exporter.wait_for_importers(1, timeout=TIMEOUT)
            buf = exporter.share(8 << 20)
            got = _result(queue, child, "receive and write")
            assert got["id"] == buf.id, got
            assert exporter.pool_usage()["used_current"] >= baseline + (8 << 20), exporter.pool_usage()
            # The producer lets go first: the memory stays while the consumer holds it.
            del buf
            time.sleep(0.5)
            stats = exporter.stats()
            assert stats["deferred_buffers"] == 1, stats
            os.kill(child.pid, signal.SIGKILL)
            child.join(timeout=TIMEOUT)
            assert child.exitcode == -signal.SIGKILL, child.exitcode
            exporter.wait_idle(timeout=TIMEOUT)
            deadline = time.monotonic() + TIMEOUT
            while exporter.pool_usage()["used_current"] != baseline and time.monotonic() < deadline:
                time.sleep(0.05)
            usage, stats = exporter.pool_usage(), exporter.stats()
            print(usage, stats)
            assert usage["used_current"] == baseline, (baseline, usage, stats)
            assert stats["reclaimed_buffers"] == 1 and stats["importers"] == 0, stats
        finally:
            if child.is_alive():
                child.kill()


@pytest.mark.gpu
def test_suballocations_from_a_resource_share_one_block():
    path = _socket_path("sub.sock")
    upstream = mr.CudaAsyncMemoryResource(enable_ipc=True)
    pool = mr.PoolMemoryResource(upstream, initial_pool_size=16 << 20)
    with ipc.Exporter(path, pool) as exporter:
        assert exporter.mr is pool
        child, queue = _spawn(_ipc_child.receive_many, path, 3)
        try:
            exporter.wait_for_importers(1, timeout=TIMEOUT)
            payloads = [b"first", b"second buffer" * 100, bytes(range(200))]
            bufs = [exporter.share(p) for p in payloads]
            got = _result(queue, child, "receive three")
            print({k: v for k, v in got.items() if k != "contents"})
            assert got["contents"] == payloads
            assert got["blocks"] == 1 and got["held"] == 3, got
            for err, name in zip(got["pickle_errors"], ("Importer", "ImportedBuffer")):
                assert f"mempool.ipc.{name} cannot be pickled" in err and "socket path" in err, err
            child.join(timeout=TIMEOUT)
            for b in bufs:
                b.wait_released(timeout=TIMEOUT)
            # The loop variable holds the last buffer too: the exporter's own hold goes only with both.
            del bufs, b
            exporter.wait_idle(timeout=TIMEOUT)
        finally:
            if child.is_alive():
                child.kill()


@pytest.mark.gpu
def test_pickling_is_refused_and_bad_sources_are_named():
    path = _socket_path("pickle.sock")
    with pytest.raises(mempool.UnsupportedError, match="enable_ipc"):
        ipc.Exporter(path, mr.CudaAsyncMemoryResource())
    with pytest.raises(mempool.UnsupportedError, match="exported"):
        ipc.Exporter(path, mr.CudaMemoryResource())
    with ipc.Exporter(path) as exporter:
        buf = exporter.alloc(16)
        for obj, name in ((exporter, "Exporter"), (buf, "ExportedBuffer")):
            with pytest.raises(TypeError, match=f"mempool.ipc.{name} cannot be pickled.*socket path"):
                pickle.dumps(obj)
        ctx = multiprocessing.get_context("spawn")
        p = ctx.Process(target=print, args=(exporter,))
        with pytest.raises(TypeError, match="cannot be pickled"):
            p.start()
        with pytest.raises(TypeError, match="DeviceBuffer cannot be shared"):
            exporter.share(mempool.DeviceBuffer(size=8))
        with pytest.raises(TypeError, match="bytes-like"):
            exporter.share(object())
        other = ipc.Exporter(_socket_path("other.sock"))
        with pytest.raises(ValueError, match="another Exporter"):
            other.share(buf)
        assert other.shutdown() == []
        # Nobody is connected: shared with nobody, and nothing holds it.
        assert exporter.share(buf).holders() == []
        # `obj`, the loop variable above, holds the buffer too: the exporter's own hold goes only with both.
        del buf, obj
        exporter.wait_idle(timeout=TIMEOUT)
    assert exporter.closed
    with pytest.raises(ipc.IpcError, match="closed"):
        exporter.alloc(8)


MiB = 1 << 20


def _service_buffer(n, seed):
    """A service resource, its "kv-cache" tag, a small allocation (so that the next may start inside a chunk)
    and a buffer of `n` bytes holding a pattern, across several chunks."""
    svc = mr.ServiceMemoryResource(0, region_size=1 << 30)
    kv = svc.tagged("kv-cache")
    small = mempool.DeviceBuffer(size=MiB, mr=kv)
    data = bytes((i * 7 + seed) % 256 for i in range(n))
    buf = mempool.DeviceBuffer(size=n, mr=kv)
    buf.copy_from_host(data)
    return svc, kv, small, buf, data


@pytest.mark.gpu
def test_service_range_is_viewed_by_torch_in_another_process_and_keeps_its_tag_awake():
    n = 5 * MiB + 4096
    svc, kv, small, buf, data = _service_buffer(n, 3)
    path = _socket_path("range.sock")
    ctx = multiprocessing.get_context("spawn")
    commands = ctx.Queue()
    with ipc.Exporter(path) as exporter:
        child, queue = _spawn(_ipc_child.view_range_until_told, path, commands)
        try:
            exporter.wait_for_importers(1, timeout=TIMEOUT)
            with pytest.raises(TypeError, match="ServiceMemoryResource"):
                exporter.share_range(mr.CudaMemoryResource(), buf)
            range_id = exporter.share_range(kv, buf)
            got = _result(queue, child, "view the range with torch")
            print(got)
            assert got["type"] == "ImportedRange" and got["id"] == range_id, got
            assert got["size"] == got["len"] == n, got
            assert got["same_memory"], got
            # The small allocation's chunk was mapped alone, the buffer's growth mapped the rest of its
            # chunks as one allocation: the range lies across allocations of different sizes.
            sizes = got["chunk_sizes"]
            assert got["chunks"] == len(sizes) >= 2 and sum(sizes) >= n, got
            assert len(set(sizes)) >= 2 and all(s % svc.chunk_size == 0 for s in sizes), got
            assert got["sum"] == sum(data), got
            assert got["head"] == data[:16], got
            assert got["held"] == 1, got
            # The importer holds the range: the tag cannot sleep, and says why.
            with pytest.raises(mempool.UnsupportedError, match="shared with another process"):
                svc.sleep("kv-cache", mode="discard")
            commands.put("drop")
            done = _result(queue, child, "drop the range")
            assert done["held_after_drop"] == 0, done
            exporter.wait_idle(timeout=TIMEOUT)
            stats = exporter.stats()
            assert stats["freed_buffers"] == 1 and stats["reclaimed_buffers"] == 0, stats
            # The child's writes are the owner's bytes; the tag sleeps and wakes with them.
            expected = bytes((b + 1) % 256 for b in data)
            assert buf.tobytes() == expected
            svc.sleep("kv-cache", mode="offload")
            svc.wake("kv-cache")
            assert buf.tobytes() == expected
            child.join(timeout=TIMEOUT)
            assert child.exitcode == 0, child.exitcode
        finally:
            if child.is_alive():
                child.kill()
    del buf, small


@pytest.mark.gpu
def test_service_range_held_by_a_killed_consumer_lets_its_tag_sleep_again():
    n = 3 * MiB
    svc, kv, small, buf, data = _service_buffer(n, 5)
    path = _socket_path("range-kill.sock")
    with ipc.Exporter(path) as exporter:
        child, queue = _spawn(_ipc_child.view_range_and_hang, path)
        try:
            exporter.wait_for_importers(1, timeout=TIMEOUT)
            range_id = exporter.share_range(kv, buf)
            got = _result(queue, child, "view and write the range")
            assert got == {"id": range_id, "size": n}, got
            with pytest.raises(mempool.UnsupportedError, match="shared with another process"):
                svc.sleep("kv-cache", mode="discard")
            os.kill(child.pid, signal.SIGKILL)
            child.join(timeout=TIMEOUT)
            assert child.exitcode == -signal.SIGKILL, child.exitcode
            exporter.wait_idle(timeout=TIMEOUT)
            stats = exporter.stats()
            assert stats["reclaimed_buffers"] == 1 and stats["importers"] == 0, stats
            assert buf.tobytes() == b"\x09" * n  # the consumer's writes landed before it died
            report = svc.sleep("kv-cache", mode="discard")
            assert report["released_bytes"] >= n, report
            svc.wake("kv-cache")
        finally:
            if child.is_alive():
                child.kill()
    del buf, small


@pytest.mark.gpu
@pytest.mark.parametrize("exporter_rings,importer_rings", [(True, True), (True, False), (False, True)])
def test_share_many_and_recv_many_hand_over_every_byte(exporter_rings, importer_rings):
    count, size = 16, 64 << 10
    path = _socket_path(f"many-{int(exporter_rings)}{int(importer_rings)}.sock")
    with ipc.Exporter(path, rings=exporter_rings) as exporter:
        child, queue = _spawn(_ipc_child.recv_many_add_one, path, importer_rings, count)
        try:
            exporter.wait_for_importers(1, timeout=TIMEOUT)
            bufs = []
            for i in range(count):
                b = exporter.alloc(size)
                b.copy_from_host(bytes([i + 1]) * size)
                bufs.append(b)
            shared = exporter.share_many(bufs)
            assert [s.id for s in shared] == [b.id for b in bufs]
            got = _result(queue, child, "receive many, check and add one")
            print({k: v for k, v in got.items() if k != "firsts"})
            assert got["rings"] == (exporter_rings and importer_rings), got
            assert sorted(got["firsts"]) == list(range(1, count + 1)), got
            assert all(got["uniform"]), got
            assert got["held"] == 0, got
            for i, b in enumerate(bufs):
                b.wait_released(timeout=TIMEOUT)
                assert b.tobytes() == bytes([i + 2]) * size, f"buffer {i}: the consumer's writes"
            child.join(timeout=TIMEOUT)
            assert child.exitcode == 0, child.exitcode
            del bufs, shared, b
            exporter.wait_idle(timeout=TIMEOUT)
            stats = exporter.stats()
            assert stats["live_buffers"] == 0 and stats["reclaimed_buffers"] == 0, stats
        finally:
            if child.is_alive():
                child.kill()


@pytest.mark.gpu
def test_a_consumer_killed_mid_batch_leaves_the_producer_at_its_baseline():
    count, size = 8, 8 << 20
    path = _socket_path("many-kill.sock")
    with ipc.Exporter(path) as exporter:
        baseline = exporter.pool_usage()["used_current"]
        child, queue = _spawn(_ipc_child.recv_part_of_a_batch_and_hang, path)
        try:
            exporter.wait_for_importers(1, timeout=TIMEOUT)
            bufs = exporter.share_many([size] * count)
            ids = [b.id for b in bufs]
            got = _result(queue, child, "receive part of the batch")
            assert got["rings"] is True, got
            assert 1 <= len(got["ids"]) <= 2 and set(got["ids"]) <= set(ids), (got, ids)
            assert exporter.pool_usage()["used_current"] >= baseline + count * size, exporter.pool_usage()
            del bufs
            os.kill(child.pid, signal.SIGKILL)
            child.join(timeout=TIMEOUT)
            assert child.exitcode == -signal.SIGKILL, child.exitcode
            exporter.wait_idle(timeout=TIMEOUT)
            deadline = time.monotonic() + TIMEOUT
            while exporter.pool_usage()["used_current"] != baseline and time.monotonic() < deadline:
                time.sleep(0.05)
            usage, stats = exporter.pool_usage(), exporter.stats()
            print(usage, stats)
            assert usage["used_current"] == baseline, (baseline, usage, stats)
            assert stats["live_buffers"] == 0 and stats["importers"] == 0, stats
            assert stats["reclaimed_buffers"] >= len(got["ids"]), stats
        finally:
            if child.is_alive():
                child.kill()


@pytest.mark.gpu
def test_the_exporters_spins_are_read_set_and_checked():
    path = _socket_path("spin.sock")
    with ipc.Exporter(path) as exporter:
        assert exporter.spin == pytest.approx(50e-6)
        assert exporter.wait_spin == pytest.approx(50e-6)
        exporter.spin = 0.0
        assert exporter.spin == 0.0
        assert exporter.wait_spin == pytest.approx(50e-6), "the two spins are set apart"
        exporter.wait_spin = 1e-5
        assert exporter.wait_spin == pytest.approx(1e-5)
        for bad in (-1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="spin"):
                exporter.spin = bad
            with pytest.raises(ValueError, match="wait_spin"):
                exporter.wait_spin = bad
        assert exporter.spin == 0.0
        exporter.shutdown()
        with pytest.raises(ipc.IpcError):
            exporter.spin = 1e-5

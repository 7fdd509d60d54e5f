"""GPU tests (marked gpu; they fail, never skip, without a GPU). Frameworks that must not initialise CUDA
first (PyTorch's change_current_allocator) run in subprocesses; each prints what it saw on failure."""

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest

import mempool
from mempool import mr

pytestmark = pytest.mark.gpu


def run_py(code: str, env=None, timeout=300) -> str:
    """Runs `code` in a fresh interpreter; fails the test with its output unless it exits 0."""
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p.stdout


def test_device_buffer_round_trip():
    buf = mempool.DeviceBuffer(size=100)
    assert buf.size == 100 and buf.ptr != 0 and buf.ptr % 256 == 0
    data = bytes(range(256)) * 40
    d = mempool.DeviceBuffer.to_device(data)
    assert d.size == len(data)
    assert d.tobytes() == data
    import numpy as np

    host = d.copy_to_host()  # a NumPy uint8 array, as RMM returns
    assert isinstance(host, np.ndarray) and host.dtype == np.uint8 and host.shape == (len(data),), repr(host)
    assert host.tobytes() == data
    out = bytearray(len(data))
    assert d.copy_to_host(out) is out and bytes(out) == data
    assert mempool.DeviceBuffer(size=0).ptr == 0


def test_tobytes_and_copy_to_host_on_a_stream():
    import torch

    s = torch.cuda.Stream()
    d = mempool.DeviceBuffer.to_device(b"\x09" * 4096)
    t = torch.from_dlpack(d)
    with torch.cuda.stream(s):
        s.wait_stream(torch.cuda.current_stream())
        torch.cuda._sleep(100_000_000)  # keeps `s` busy, so a copy not ordered on it would read 9s
        t.fill_(3)
    # Copied on `s`: after the fill.
    assert d.tobytes(stream=s) == b"\x03" * 4096
    assert bytes(d.copy_to_host(stream=s.cuda_stream)) == b"\x03" * 4096
    del t


def test_copy_from_host():
    """RMM's copy_from_host: the host bytes land at the start of the buffer, the rest stays; a host object
    larger than the buffer is a ValueError naming both sizes; any object exporting a buffer is taken in C
    order; stream= orders the copy on that stream."""
    import numpy as np
    import torch

    buf = mempool.DeviceBuffer.to_device(b"\x00" * 10)
    assert buf.copy_from_host(b"abcdef") is None
    assert buf.tobytes() == b"abcdef\x00\x00\x00\x00"
    buf.copy_from_host(bytearray(b"XY"))
    buf.copy_from_host(b"")  # 0 bytes: nothing changes
    assert buf.tobytes() == b"XYcdef\x00\x00\x00\x00"
    with pytest.raises(ValueError) as e:
        buf.copy_from_host(b"z" * 11)
    assert "0..11" in str(e.value) and "10 bytes" in str(e.value), str(e.value)
    assert buf.tobytes() == b"XYcdef\x00\x00\x00\x00"  # a refused copy writes nothing
    a = np.arange(6, dtype=np.int16).reshape(2, 3)
    wide = mempool.DeviceBuffer(size=a.nbytes)
    wide.copy_from_host(a.T)  # not contiguous: its bytes in C order
    assert wide.tobytes() == np.ascontiguousarray(a.T).tobytes()
    # On a stream: ordered after the work queued there (a fill of 7s after a long sleep).
    s = torch.cuda.Stream()
    d = mempool.DeviceBuffer(size=4096)
    t = torch.from_dlpack(d)
    with torch.cuda.stream(s):
        s.wait_stream(torch.cuda.current_stream())
        torch.cuda._sleep(100_000_000)
        t.fill_(7)
    d.copy_from_host(b"\x01" * 16, stream=s)
    assert d.tobytes(stream=s) == b"\x01" * 16 + b"\x07" * (4096 - 16)
    del t
    with pytest.raises(TypeError):
        buf.copy_from_host(12)


def test_binning_bins_are_mempool_rmms():
    """Power-of-two bins from BinningResource, added bins in front of them (AddedBinsAdaptor): a request goes
    to the smallest bin that holds it, larger ones to the upstream."""
    cuda = mr.CudaMemoryResource()
    upstream = mr.StatisticsResourceAdaptor(cuda)
    b = mr.BinningMemoryResource(upstream, 8, 10)
    assert b.bin_sizes == [256, 512, 1024]
    added = mr.StatisticsResourceAdaptor(mr.FixedSizeMemoryResource(cuda, block_size=3072, blocks_to_preallocate=4))
    b.add_bin(3000, added)  # rounded up to 3072
    with pytest.raises(ValueError, match="already has a bin of 512 bytes"):
        b.add_bin(400)
    assert b.bin_sizes == [256, 512, 1024, 3072]
    x = mempool.DeviceBuffer.to_device(b"a" * 2000, mr=b)  # the added 3072-byte bin
    assert added.allocation_counts.current_count == 1
    y = mempool.DeviceBuffer.to_device(b"b" * 700, mr=b)  # the 1024-byte power-of-two bin
    assert added.allocation_counts.current_count == 1
    z = mempool.DeviceBuffer.to_device(b"c" * 5000, mr=b)  # no bin holds it: the upstream
    assert added.allocation_counts.current_count == 1
    assert (x.tobytes(), y.tobytes(), z.tobytes()) == (b"a" * 2000, b"b" * 700, b"c" * 5000)
    assert b.name == "AddedBinsAdaptor"
    with pytest.raises(ValueError, match="add_bin after the first allocation"):
        b.add_bin(8192)
    del x, y, z
    assert added.allocation_counts.current_count == 0
    assert mempool._lib._last_error() == "", mempool._lib._last_error()


def test_user_guide_numpy_snippet():
    import numpy as np
    a = np.array([1, 2, 3], dtype="float64")
    buf = mempool.DeviceBuffer.to_device(a.view("int8"))
    assert buf.size == 24
    assert np.frombuffer(buf.tobytes()).tolist() == [1.0, 2.0, 3.0]


def test_cuda_array_interface_v3():
    buf = mempool.DeviceBuffer(size=64)
    cai = buf.__cuda_array_interface__
    assert cai["version"] == 3 and cai["shape"] == (64,) and cai["typestr"] == "|u1"
    assert cai["data"] == (buf.ptr, False) and cai["stream"] == 1


def test_every_resource_allocates():
    dev = mr.get_current_device()
    cuda = mr.CudaMemoryResource()
    resources = {
        "cuda": cuda,
        "async": mr.CudaAsyncMemoryResource(),
        "managed": mr.ManagedMemoryResource(),
        "pool": mr.PoolMemoryResource(cuda, initial_pool_size=2**24, maximum_pool_size=2**26),
        "fixed": mr.FixedSizeMemoryResource(cuda, block_size=2**16, blocks_to_preallocate=4),
        "binning": mr.BinningMemoryResource(cuda, 10, 16),
        "arena": mr.ArenaMemoryResource(cuda, arena_size=2**24),
        "stats": mr.StatisticsResourceAdaptor(cuda),
        "tracking": mr.TrackingResourceAdaptor(cuda),
        "limiting": mr.LimitingResourceAdaptor(cuda, 2**20),
        "failure": mr.FailureCallbackResourceAdaptor(cuda, lambda n: False),
        "vmm": mr.VmmMemoryResource(),
    }
    for name, r in resources.items():
        assert r.device == dev
        b = mempool.DeviceBuffer(size=1000, mr=r)
        assert b.ptr % 256 == 0, name
        b2 = mempool.DeviceBuffer.to_device(b"x" * 1000, mr=r)
        assert b2.tobytes() == b"x" * 1000, name
        del b, b2


def test_composition_and_current_resource():
    old = mr.get_current_device_resource()
    pool = mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=2**24, maximum_pool_size=2**25)
    stats = mr.StatisticsResourceAdaptor(pool)
    lim = mr.LimitingResourceAdaptor(stats, 2**22)
    assert lim.upstream_mr is stats and stats.get_upstream() is pool
    mr.set_current_device_resource(lim)
    try:
        assert mr.get_current_device_resource() is lim
        b = mempool.DeviceBuffer(size=1234)
        # The limit counts sizes rounded up to 256 bytes, as RMM's limiting adaptor does.
        assert stats.allocation_counts.current_bytes == 1234 and lim.get_allocated_bytes() == 1280
        assert pool.pool_size() >= 2**24
        with pytest.raises(mempool.OutOfMemoryError) as e:
            mempool.DeviceBuffer(size=2**23)
        assert str(2**23) in str(e.value), str(e.value)
        del b
        assert stats.allocation_counts.current_bytes == 0 and stats.allocation_counts.peak_bytes == 1234
    finally:
        mr.set_current_device_resource(old)


def test_vmm_resource_alone_under_adaptors_and_as_current():
    dev = mr.get_current_device()
    vmm = mr.VmmMemoryResource()
    g = vmm.granularity
    assert g > 0 and g % 4096 == 0 and vmm.device == dev and vmm.name == "VmmResource", (g, vmm)
    assert vmm.allocated() == (0, 0)
    # One mapping per allocation, its size rounded up to whole granules, its address aligned to one.
    a = mempool.DeviceBuffer.to_device(b"v" * 1000, mr=vmm)
    b = mempool.DeviceBuffer(size=g + 1, mr=vmm)
    assert a.ptr % g == 0 and b.ptr % g == 0, (hex(a.ptr), hex(b.ptr), g)
    assert vmm.allocated() == (3 * g, 2), vmm.allocated()
    assert a.tobytes() == b"v" * 1000
    del a, b
    assert vmm.allocated() == (0, 0), vmm.allocated()
    # Under a pool and a binning resource, and as the current device resource.
    pool = mr.PoolMemoryResource(vmm, initial_pool_size=4 * g)
    binning = mr.BinningMemoryResource(pool, 8, 16)
    stats = mr.StatisticsResourceAdaptor(binning)
    old = mr.get_current_device_resource()
    mr.set_current_device_resource(stats)
    try:
        bufs = [mempool.DeviceBuffer.to_device(bytes([i]) * (100 + 1000 * i)) for i in range(20)]
        assert [x.tobytes() for x in bufs] == [bytes([i]) * (100 + 1000 * i) for i in range(20)]
        assert stats.allocation_counts.current_count == 20, stats.allocation_counts
        assert vmm.allocated()[1] >= 1 and vmm.allocated()[0] % g == 0, vmm.allocated()
        del bufs
    finally:
        mr.set_current_device_resource(old)
    # peers=None: the owner only; peers=[dev]: the owner named (allowed); a device that does not exist.
    for peers in (None, [dev]):
        r = mr.VmmMemoryResource(peers=peers)
        x = mempool.DeviceBuffer.to_device(b"p" * 10, mr=r)
        assert x.tobytes() == b"p" * 10 and r.allocated() == (g, 1), (peers, r.allocated())
        del x
    with pytest.raises(mempool.NoDeviceError) as e:
        mr.VmmMemoryResource(peers=[dev, 4096])
    assert "4096" in str(e.value), str(e.value)


def test_pool_out_of_memory_names_the_size():
    pool = mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=2**20, maximum_pool_size=2**21)
    with pytest.raises(MemoryError) as e:
        mempool.DeviceBuffer(size=2**22, mr=pool)
    assert isinstance(e.value, mempool.OutOfMemoryError) and str(2**22) in str(e.value), str(e.value)


def test_concurrent_add_bin_and_allocate():
    """add_bin racing allocations from other threads: each add_bin is either in before the first
    allocation routes or refused; every buffer frees cleanly (a free routed to a bin that never gave the
    memory out would fail or corrupt the bin)."""
    cuda = mr.CudaMemoryResource()
    for round_ in range(20):
        b = mr.BinningMemoryResource(cuda)
        start = threading.Barrier(3)
        bufs, errors, added, refused = [], [], [], []

        def allocate():
            start.wait()
            try:
                for i in range(50):
                    bufs.append(mempool.DeviceBuffer(size=100 + i * 40, mr=b))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        def add():
            start.wait()
            for size in range(256, 256 * 40, 256):
                try:
                    b.add_bin(size)
                    added.append(size)
                except ValueError as e:
                    assert "add_bin after" in str(e), str(e)
                    refused.append(size)

        threads = [threading.Thread(target=allocate), threading.Thread(target=allocate), threading.Thread(target=add)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, (round_, errors)
        assert b.bin_sizes == sorted(added), (b.bin_sizes, added)
        assert len(added) + len(refused) == 39
        bufs.clear()  # every free must succeed (a failure would be reported as unraisable / crash)
        assert mempool._lib._last_error() == "", mempool._lib._last_error()


def test_failure_callback_cycle_is_collected():
    cuda = mr.CudaMemoryResource()
    fc = mr.FailureCallbackResourceAdaptor(cuda, lambda n: False)

    class Holder:
        pass

    h = Holder()
    h.fc = mr.FailureCallbackResourceAdaptor(cuda, lambda n, h=h: h is None)  # callback -> h -> adaptor
    w = weakref.ref(h)  # h is reachable only through the cycle h -> adaptor -> callback -> h
    del h
    gc.collect()
    assert w() is None, "the callback <-> adaptor cycle was not collected"
    assert fc.callback is not None


def test_logging_file_names_follow_rmm(tmp_path, monkeypatch):
    cuda = mr.CudaMemoryResource()
    dev = cuda.device
    monkeypatch.chdir(tmp_path)
    cwd = os.getcwd()
    log = mr.LoggingResourceAdaptor(cuda, log_file_name="a.b.csv")
    assert log.get_file_name() == os.path.join(cwd, f"a.b.dev{dev}.csv"), log.get_file_name()
    assert mr.LoggingResourceAdaptor(cuda, log_file_name="plain").get_file_name() == os.path.join(cwd, f"plain.dev{dev}")
    assert mr.LoggingResourceAdaptor(cuda, log_file_name=".hidden").get_file_name() == os.path.join(cwd, f".hidden.dev{dev}")
    monkeypatch.setenv("RMM_LOG_FILE", str(tmp_path / "env.log"))
    assert mr.LoggingResourceAdaptor(cuda).get_file_name() == str(tmp_path / f"env.dev{dev}.log")


def test_current_logging_adaptor_is_flushed_at_exit(tmp_path):
    out = run_py(
        f"""
        import mempool
        from mempool import mr
        log = mr.LoggingResourceAdaptor(mr.CudaMemoryResource(), log_file_name={str(tmp_path / "exit.csv")!r})
        mr.set_current_device_resource(log)
        b = mempool.DeviceBuffer(size=12345)
        del b
        print("NAME", log.get_file_name())
        """
    )
    name = [l.split(" ", 1)[1] for l in out.splitlines() if l.startswith("NAME")][0]
    text = open(name).read()
    assert "12345" in text, f"the log was not flushed at exit: {text!r}"


def test_reinitialize_checks_every_device_before_switching_any():
    old = mr.get_current_device_resource()
    with pytest.raises(mempool.NoDeviceError):
        mempool.reinitialize(pool_allocator=True, initial_pool_size=2**20, devices=[0, 4096])
    assert mr.get_per_device_resource(0) is old or mr.get_current_device() != 0


def test_torch_free_refuses_a_wrong_size_and_a_double_free():
    so = ctypes.CDLL(mempool._lib._shared_object_path())
    so.mempool_torch_alloc_nullable.restype = ctypes.c_void_p
    so.mempool_torch_alloc_nullable.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    so.mempool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    old = mr.get_current_device_resource()
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    mr.set_current_device_resource(stats)
    try:
        dev = mr.get_current_device()
        live, failed = mempool._lib._torch_allocator_state()
        p = so.mempool_torch_alloc_nullable(4096, dev, None)
        assert p, mempool._lib._last_error()
        assert stats.allocation_counts.current_bytes == 4096
        so.mempool_torch_free(p, 1000, dev, None)
        assert "1000 bytes" in mempool._lib._last_error(), mempool._lib._last_error()
        assert stats.allocation_counts.current_bytes == 4096  # nothing freed
        so.mempool_torch_free(p, 4096, dev, None)
        assert mempool._lib._last_error() == "" and stats.allocation_counts.current_bytes == 0
        so.mempool_torch_free(p, 4096, dev, None)
        assert "did not hand out" in mempool._lib._last_error(), mempool._lib._last_error()
        assert mempool._lib._torch_allocator_state() == (live, failed + 2)
    finally:
        mr.set_current_device_resource(old)


def test_binning_add_bin_and_failure_callback():
    cuda = mr.CudaMemoryResource()
    b = mr.BinningMemoryResource(cuda)
    b.add_bin(4096)
    b.add_bin(2**20, mr.FixedSizeMemoryResource(cuda, block_size=2**20))
    assert b.bin_sizes == [4096, 2**20]
    x = mempool.DeviceBuffer(size=100, mr=b)
    with pytest.raises(ValueError, match="add_bin after"):
        b.add_bin(8192)
    del x
    calls = []
    limited = mr.LimitingResourceAdaptor(cuda, 1000)
    fc = mr.FailureCallbackResourceAdaptor(limited, lambda n: calls.append(n) is None and len(calls) < 3)
    with pytest.raises(mempool.OutOfMemoryError):
        mempool.DeviceBuffer(size=5000, mr=fc)
    assert calls == [5000, 5000, 5000]


def test_reinitialize_pool_and_logging(tmp_path):
    old = mr.get_current_device_resource()
    log = tmp_path / "log.csv"
    try:
        mempool.reinitialize(pool_allocator=True, initial_pool_size=2**24, maximum_pool_size=2**26, logging=True,
                             log_file_name=str(log))
        cur = mr.get_current_device_resource()
        assert isinstance(cur, mr.LoggingResourceAdaptor) and isinstance(cur.upstream_mr, mr.PoolMemoryResource)
        b = mempool.DeviceBuffer(size=4096)
        del b
        cur.flush()
        text = (tmp_path / f"log.dev{mr.get_current_device()}.csv").read_text()
        assert "allocate" in text and "4096" in text, text
        mempool.reinitialize(managed_memory=True)
        assert isinstance(mr.get_current_device_resource(), mr.ManagedMemoryResource)
        assert mempool.is_initialized()
    finally:
        mr.set_current_device_resource(old)


def test_dlpack_torch_cupy_numba_zero_copy_and_keep_alive():
    import cupy
    import torch
    from numba import cuda

    buf = mempool.DeviceBuffer.to_device(bytes(range(200)))
    ptr = buf.ptr
    t = torch.from_dlpack(buf)
    c = cupy.from_dlpack(buf)
    n = cuda.as_cuda_array(buf)
    ca = cupy.asarray(buf)  # through __cuda_array_interface__
    assert t.data_ptr() == ptr and c.data.ptr == ptr and n.__cuda_array_interface__["data"][0] == ptr
    assert ca.data.ptr == ptr
    del buf
    gc.collect()
    # The views keep the memory alive: its contents are intact after the buffer object is gone.
    assert t.cpu().tolist() == list(range(200))
    assert c.get().tolist() == list(range(200))
    assert n.copy_to_host().tolist() == list(range(200))
    # Legacy (unversioned) capsule too.
    b2 = mempool.DeviceBuffer.to_device(b"\x05" * 8)
    cap = b2.__dlpack__(stream=-1)
    t2 = torch.utils.dlpack.from_dlpack(cap)
    assert t2.data_ptr() == b2.ptr and t2.cpu().tolist() == [5] * 8
    # Every view gone: the memory goes back to its resource.
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    b4 = mempool.DeviceBuffer(size=300, mr=stats)
    w4 = weakref.ref(b4)
    views = [torch.from_dlpack(b4), cupy.from_dlpack(b4), cuda.as_cuda_array(b4), cupy.asarray(b4)]
    del b4
    gc.collect()
    assert w4() is not None and stats.allocation_counts.current_bytes == 300
    del views
    gc.collect()
    assert w4() is None, "a view still holds the buffer"
    assert stats.allocation_counts.current_bytes == 0, stats.allocation_counts
    # A capsule never consumed frees its reference: the buffer can be collected.
    b3 = mempool.DeviceBuffer(size=16)
    w = weakref.ref(b3)
    b3.__dlpack__(stream=-1)
    del b3
    gc.collect()
    assert w() is None


def test_dlpack_orders_a_consumer_stream_after_the_buffer_stream():
    import torch

    s = torch.cuda.Stream()
    buf = mempool.DeviceBuffer.to_device(b"\x07" * 1024, stream=s)
    assert buf.stream == s.cuda_stream
    # Queue a long kernel and then a write on `s` (to_device synchronized, so without this nothing on `s`
    # would be pending): a consumer stream not made to wait on `s` would read the old 7s.
    writer = torch.from_dlpack(buf.__dlpack__(stream=-1))
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        writer.fill_(2)
    t = torch.from_dlpack(buf)  # torch passes its current stream; mempool makes it wait on `s`
    assert int(t.sum().item()) == 2 * 1024
    del writer


def test_cupy_allocates_through_mempool():
    import cupy

    from mempool.allocators.cupy import mempool_cupy_allocator

    old = mr.get_current_device_resource()
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    mr.set_current_device_resource(stats)
    cupy.cuda.set_allocator(mempool_cupy_allocator)
    try:
        a = cupy.arange(1000, dtype=cupy.float32)
        assert stats.allocation_counts.current_bytes >= 4000, stats.allocation_counts
        assert float((a * 2).sum()) == 999000.0
        del a
    finally:
        cupy.cuda.set_allocator(None)
        mr.set_current_device_resource(old)


def test_numba_allocates_through_mempool_by_environment():
    out = run_py(
        """
        from numba import cuda
        import numpy as np
        import mempool
        from mempool import mr
        stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
        mr.set_current_device_resource(stats)
        a = cuda.to_device(np.arange(1000, dtype=np.float64))
        print("bytes", stats.allocation_counts.current_bytes)
        assert stats.allocation_counts.current_bytes == 8000, stats.allocation_counts
        assert a.copy_to_host().sum() == 499500
        """,
        env={"NUMBA_CUDA_MEMORY_MANAGER": "mempool.allocators.numba"},
    )
    assert "bytes 8000" in out


def test_numba_set_memory_manager():
    run_py(
        """
        from numba import cuda
        import numpy as np
        from mempool import mr
        from mempool.allocators.numba import MempoolNumbaManager
        cuda.set_memory_manager(MempoolNumbaManager)
        stats = mr.StatisticsResourceAdaptor(mr.CudaMemoryResource())
        mr.set_current_device_resource(stats)
        a = cuda.device_array(512, dtype=np.float32)
        assert stats.allocation_counts.current_bytes == 2048, stats.allocation_counts
        """
    )


TORCH_MODEL = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).cuda()
x = torch.randn(32, 64, device="cuda")
loss = model(x).square().mean()
loss.backward()
grads = [p.grad.double().sum().item() for p in model.parameters()]
print("RESULT", repr((loss.item(), grads)))
"""


def test_torch_change_current_allocator_matches_native():
    native = run_py(TORCH_MODEL)
    routed = run_py(
        textwrap.dedent(
            """
        import torch
        from mempool import mr
        from mempool.allocators.torch import mempool_torch_allocator, allocator_state
        stats = mr.StatisticsResourceAdaptor(mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=2**26))
        mr.set_current_device_resource(stats)
        torch.cuda.memory.change_current_allocator(mempool_torch_allocator)
        """
        )
        + TORCH_MODEL
        + """
print("STATS", stats.allocation_counts.total_count, stats.allocation_counts.peak_bytes, allocator_state())
assert stats.allocation_counts.total_count > 0
del model, x, loss
import gc
gc.collect()
torch.cuda.synchronize()
# cuBLAS's workspaces are allocated through the allocator and kept by PyTorch until cleared.
if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
    torch._C._cuda_clearCublasWorkspaces()
live, failed = allocator_state()
print("STATE", live, failed, stats.allocation_counts)
assert failed == 0, (live, failed)
assert live == 0 and stats.allocation_counts.current_bytes == 0, (live, stats.allocation_counts)
"""
    )
    result = lambda out: [l for l in out.splitlines() if l.startswith("RESULT")][0]
    assert result(native) == result(routed), f"native: {native}\nmempool: {routed}"


def test_torch_out_of_memory_is_a_python_exception_naming_the_size():
    out = run_py(
        """
        import torch
        from mempool import mr
        from mempool.allocators.torch import mempool_torch_allocator
        mr.set_current_device_resource(mr.LimitingResourceAdaptor(mr.CudaMemoryResource(), 2**20))
        torch.cuda.memory.change_current_allocator(mempool_torch_allocator)
        ok = torch.ones(1000, device="cuda")
        try:
            torch.empty(2**22, dtype=torch.uint8, device="cuda")
        except RuntimeError as e:
            print("RAISED", e)
        else:
            raise SystemExit("no exception")
        print("AFTER", ok.sum().item())
        """
    )
    assert f"RAISED" in out and str(2**22) in out and "AFTER 1000.0" in out, out


def test_torch_mempool_region():
    out = run_py(
        """
        import torch
        from mempool import mr
        from mempool.allocators.torch import mempool_torch_pool_allocator, allocator_state
        stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
        mr.set_current_device_resource(stats)
        pool = torch.cuda.MemPool(mempool_torch_pool_allocator.allocator())
        with torch.cuda.use_mem_pool(pool):
            a = torch.ones(1 << 20, device="cuda")
        b = torch.ones(1 << 20, device="cuda")  # outside the region: PyTorch's own allocator
        print("STATS", stats.allocation_counts.current_bytes, allocator_state())
        assert stats.allocation_counts.current_bytes >= 4 << 20, stats.allocation_counts
        assert a.sum().item() == b.sum().item() == float(1 << 20)
        # Out of memory inside the region: PyTorch's OutOfMemoryError.
        lim = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), 64 << 20)
        mr.set_current_device_resource(lim)
        pool2 = torch.cuda.MemPool(mempool_torch_pool_allocator.allocator())
        try:
            with torch.cuda.use_mem_pool(pool2):
                torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as e:
            print("OOM", e)
        else:
            raise SystemExit("no OutOfMemoryError")
        """
    )
    assert "OOM" in out, out

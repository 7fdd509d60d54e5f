"""GPU tests of issue 33, finding 2, from Python: the per-thread default stream (``CU_STREAM_PER_THREAD``, the
handle 2) is a different stream on every thread, so memory one thread's per-thread stream let go of may reach
another thread's only after that thread is ordered after the first one's work.

Thread A allocates an array on its per-thread stream, launches a kernel that spins for 200 ms and then writes
into it, and lets it go (``del`` on A; or on a third thread C it was handed to, while A still runs,
``C_alive``, or after A ended, ``C``); thread B then allocates the
same size on its own per-thread stream and fills it. After a device synchronize, B's data must be intact
(the bug: mempool keyed both per-thread streams as the handle 2, so B got A's memory at once and A's late
write overwrote B's data; over some resources B's allocation hung). CuPy runs with
``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1`` through mempool's C allocator; PyTorch on
``torch.cuda.get_stream_from_external(2)`` (``ExternalStream(2)`` where that is missing) through mempool's
pluggable allocator. Both choose their stream or allocator before CUDA starts, so each case runs in a fresh
interpreter, whose Python stacks are dumped if it stalls (``faulthandler``) before the time limit kills it.

``pytest crates/mempool-py/tests/test_per_thread_stream.py -m gpu``. Marked gpu: the tests fail, never skip,
without a GPU (or without CuPy or PyTorch)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

#: How long one case may take before it counts as hung (the child dumps its stacks a little earlier).
TIMEOUT = 180


def run_child(code: str, env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    env.update(env_extra)
    prologue = f"import faulthandler\nfaulthandler.dump_traceback_later({TIMEOUT - 30}, exit=True)\n"
    try:
        p = subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(code)], capture_output=True,
                           text=True, timeout=TIMEOUT, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung (no exit within {TIMEOUT} s)\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p.stdout


#: The resources each framework's cases run over, as Python expressions (``mr`` is ``mempool.mr``). The
#: pool and arena take an initial size, so each keeps one engine and B meets A's memory; the binning and
#: fixed-size suballocators keep one engine per hardware thread, so there B may not (they still must
#: keep B's data intact).
RESOURCES = {
    "service": "mr.ServiceMemoryResource(region_size=1 << 30, max_tags=2)",
    "pool": "mr.PoolMemoryResource(mr.CudaAsyncMemoryResource(), initial_pool_size=64 << 20)",
    "arena": "mr.ArenaMemoryResource(mr.CudaAsyncMemoryResource(), arena_size=64 << 20)",
    "binning": "mr.BinningMemoryResource(mr.CudaAsyncMemoryResource(), 8, 20)",
    "fixed_size": "mr.FixedSizeMemoryResource(mr.CudaAsyncMemoryResource(), 1 << 20, 16)",
    "cuda_async": "mr.CudaAsyncMemoryResource()",
    "cuda": "mr.CudaMemoryResource()",
    "managed": "mr.ManagedMemoryResource()",
}

CUPY_CASE = """
    import sys
    import threading

    import cupy
    import numpy

    import mempool
    from mempool import mr
    from mempool.allocators import cupy as hook

    RESOURCE, FREE_ON = sys.argv[1], sys.argv[2]
    assert cupy.cuda.get_current_stream().ptr == 2, "CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1 is not in effect"
    mr.set_current_device_resource(eval(RESOURCE))
    cupy.cuda.set_allocator(hook.mempool_cupy_c_allocator)

    N, LATE_NS, A_VALUE, B_BASE = 1 << 16, 200_000_000, 0xAAAAAAAA, 0x10000000
    source = r'''
    extern "C" __global__ void late_fill(unsigned int* p, unsigned int v, unsigned long long n,
                                         unsigned long long ns) {
        unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
        if (i >= n) return;
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
        p[i] = v;
    }
    extern "C" __global__ void iota(unsigned int* p, unsigned int base, unsigned long long n) {
        unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
        if (i < n) p[i] = base + (unsigned int)i;
    }
    '''
    module = cupy.RawModule(code=source)
    late_fill, iota = module.get_function("late_fill"), module.get_function("iota")
    grid = ((N + 255) // 256,)

    expected = (numpy.arange(N, dtype=numpy.uint64) + B_BASE).astype(numpy.uint32)
    reused = 0
    for round in range(3):
        handed = []
        freed, ready, done = threading.Event(), threading.Event(), threading.Event()

        def thread_a():
            x = cupy.empty(N, dtype=cupy.uint32)
            assert mempool._lib._cupy_allocation(x.data.ptr)[0] == 2, "allocated on the per-thread stream"
            late_fill(grid, (256,), (x, cupy.uint32(A_VALUE), cupy.uint64(N), cupy.uint64(LATE_NS)))
            handed.append(x.data.ptr)
            if FREE_ON != "A":
                handed.append(x)
            del x
            if FREE_ON == "A":
                freed.set()
            if FREE_ON == "C_alive":
                ready.set()
                assert done.wait(120)  # thread A runs until B is done

        def thread_c():
            handed.pop()  # the last reference to A's array: CuPy frees it here, on thread C
            freed.set()

        got = []

        def thread_b():
            assert freed.wait(60)
            y = cupy.empty(N, dtype=cupy.uint32)
            iota(grid, (256,), (y, cupy.uint32(B_BASE), cupy.uint64(N)))
            cupy.cuda.get_current_stream().synchronize()
            got.append(y)

        a = threading.Thread(target=thread_a)
        a.start()
        if FREE_ON == "C_alive":
            assert ready.wait(60)
        else:
            a.join()
        for target in ([thread_c] if FREE_ON != "A" else []) + [thread_b]:
            t = threading.Thread(target=target)
            t.start()
            t.join()
        done.set()
        a.join()
        cupy.cuda.runtime.deviceSynchronize()
        y = got[0]
        same = y.data.ptr == handed[0]
        reused += same
        host = y.get()
        wrong = int((host != expected).sum())
        print(f"round {round}: B {'got' if same else 'did not get'} A's address; {wrong} of {N} wrong", flush=True)
        assert wrong == 0, f"round {round}: B's data was overwritten ({wrong} of {N}; B got A's address: {same})"
        del y, got
    print(f"PER-THREAD OK {reused}", flush=True)
"""


@pytest.mark.parametrize("free_on", ["A", "C_alive", "C"])
@pytest.mark.parametrize("resource", sorted(RESOURCES))
def test_cupy_per_thread_streams_never_share_memory_unordered(resource, free_on):
    out = run_child(
        CUPY_CASE.replace("sys.argv[1], sys.argv[2]", f"{RESOURCES[resource]!r}, {free_on!r}"),
        {"CUPY_CUDA_PER_THREAD_DEFAULT_STREAM": "1"},
    )
    assert "PER-THREAD OK" in out, out
    print(out)


TORCH_CASE = """
    import threading

    import torch

    from mempool import mr
    from mempool.allocators import torch as mt

    mr.set_current_device_resource(RESOURCE)
    torch.cuda.memory.change_current_allocator(mt.mempool_torch_allocator)
    dev = torch.device("cuda", 0)
    if hasattr(torch.cuda, "get_stream_from_external"):
        ptds = torch.cuda.get_stream_from_external(2, dev)
    else:
        ptds = torch.cuda.ExternalStream(2, device=dev)
    assert ptds.cuda_stream == 2, ptds.cuda_stream

    N, A_VALUE, B_VALUE = 1 << 16, -0x55555556, 0x10000000
    # About 200 ms of spinning on any recent GPU (torch.cuda._sleep counts clock cycles).
    CYCLES = 400_000_000
    reused = 0
    for round in range(3):
        handed = []
        freed, ready, done = threading.Event(), threading.Event(), threading.Event()

        def thread_a():
            with torch.cuda.stream(ptds):
                x = torch.empty(N, dtype=torch.int32, device=dev)
                torch.cuda._sleep(CYCLES)
                x.fill_(A_VALUE)  # the late write, after the spin on A's per-thread stream
                handed.append(x.data_ptr())
                if FREE_ON != "A":
                    handed.append(x)
                del x
            if FREE_ON == "A":
                freed.set()
            if FREE_ON == "C_alive":
                ready.set()
                assert done.wait(120)  # thread A runs until B is done

        def thread_c():
            handed.pop()  # the last reference: PyTorch frees it here, naming stream 2 (thread C's own)
            freed.set()

        got = []

        def thread_b():
            assert freed.wait(60)
            with torch.cuda.stream(ptds):
                y = torch.empty(N, dtype=torch.int32, device=dev)
                y.fill_(B_VALUE)
                torch.cuda.current_stream().synchronize()
            got.append(y)

        a = threading.Thread(target=thread_a)
        a.start()
        if FREE_ON == "C_alive":
            assert ready.wait(60)
        else:
            a.join()
        for target in ([thread_c] if FREE_ON != "A" else []) + [thread_b]:
            t = threading.Thread(target=target)
            t.start()
            t.join()
        done.set()
        a.join()
        torch.cuda.synchronize()
        y = got[0]
        same = y.data_ptr() == handed[0]
        reused += same
        wrong = int((y != B_VALUE).sum())
        print(f"round {round}: B {'got' if same else 'did not get'} A's address; {wrong} of {N} wrong", flush=True)
        assert wrong == 0, f"round {round}: B's data was overwritten ({wrong} of {N}; B got A's address: {same})"
        del y, got
    print(f"PER-THREAD OK {reused}", flush=True)
"""


@pytest.mark.parametrize("free_on", ["A", "C_alive", "C"])
@pytest.mark.parametrize("resource", ["service", "pool", "cuda_async"])
def test_torch_per_thread_streams_never_share_memory_unordered(resource, free_on):
    code = TORCH_CASE.replace("RESOURCE)", f"{RESOURCES[resource]})").replace(
        "    import threading\n", f"    import threading\n    FREE_ON = {free_on!r}\n", 1)
    out = run_child(code, {})
    assert "PER-THREAD OK" in out, out
    print(out)

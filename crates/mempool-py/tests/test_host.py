"""Host tests: no GPU needed. Import, the exceptions that name the cause without a driver, argument
validation, the API against the type stubs, the C entry points of the extension module."""

import ast
import ctypes
import importlib
import inspect
import pathlib
import sys

import pytest

import mempool
import mempool._lib as lib
from mempool import mr


def test_imports_without_a_gpu():
    assert mempool.DeviceBuffer is lib.DeviceBuffer
    assert mr.PoolMemoryResource is lib.PoolMemoryResource
    assert callable(mempool.reinitialize)
    assert not mempool.is_initialized()


def test_the_source_tree_says_to_build_the_wheel(tmp_path):
    """`import mempool` from crates/mempool-py/python (no compiled extension there) raises an ImportError
    that says to build the wheel with maturin, not "No module named 'mempool._lib'" alone. The package's
    Python files are copied without any extension a `maturin develop` may have left beside them."""
    import shutil
    import subprocess

    source = pathlib.Path(__file__).resolve().parents[1] / "python" / "mempool"
    shutil.copytree(source, tmp_path / "mempool", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    r = subprocess.run(
        [sys.executable, "-c", "import mempool"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1, r
    lines = r.stderr.strip().splitlines()
    assert any(l.startswith("ImportError: mempool's compiled extension mempool._lib is missing") for l in lines), r.stderr
    for needle in (
        str(tmp_path / "mempool"),
        "maturin build --release -o ../../target/wheels",
        "pip install target/wheels/mempool-*.whl",
        'pip install "maturin>=1.9.4,<2"',
    ):
        assert needle in r.stderr, (needle, r.stderr)
    assert "ModuleNotFoundError" not in r.stderr, r.stderr


def test_exception_hierarchy():
    assert issubclass(mempool.OutOfMemoryError, MemoryError)
    assert issubclass(mempool.OutOfMemoryError, mempool.MempoolError)
    for e in (
        mempool.DriverNotFoundError,
        mempool.NoDeviceError,
        mempool.UnsupportedError,
        mempool.DriverError,
        mempool.PeerAccessError,
    ):
        assert issubclass(e, mempool.MempoolError) and issubclass(e, RuntimeError)


def test_first_driver_call_names_the_missing_driver(no_driver):
    """Without a driver (CI) each call raises DriverNotFoundError naming it; where a driver is installed
    the same calls succeed (the host suite run on a GPU machine)."""
    calls = (
        lambda: mempool.DeviceBuffer(size=100),
        lambda: mempool.DeviceBuffer.to_device(b"abc"),
        lambda: mr.CudaMemoryResource(),
        lambda: mr.CudaAsyncMemoryResource(),
        lambda: mr.ManagedMemoryResource(device=0),
        lambda: mr.VmmMemoryResource(),
        lambda: mr.VmmMemoryResource(peers=None),
        lambda: mr.get_current_device_resource(),
        lambda: mr.device_count(),
    )
    if not no_driver:
        old = mr.get_current_device_resource()
        try:
            for call in calls:
                call()
        finally:
            mr.set_current_device_resource(old)
        return
    for call in calls:
        with pytest.raises(mempool.DriverNotFoundError) as e:
            call()
        assert "driver" in str(e.value).lower(), str(e.value)


def test_argument_validation_before_the_driver():
    with pytest.raises(OverflowError):
        mempool.DeviceBuffer(size=-1)
    with pytest.raises(TypeError):
        mempool.DeviceBuffer(size="100")
    with pytest.raises(TypeError):
        mempool.DeviceBuffer(100)  # size is keyword-only, as RMM's
    with pytest.raises(TypeError, match="stream must be"):
        mempool.DeviceBuffer(size=1, stream=object())
    with pytest.raises(ValueError, match="not a valid stream handle"):
        mempool.DeviceBuffer(size=1, stream=-5)

    class BadProtocol:
        def __cuda_stream__(self):
            return 7

    with pytest.raises(TypeError, match="__cuda_stream__"):
        mempool.DeviceBuffer(size=1, stream=BadProtocol())
    with pytest.raises(TypeError):
        mr.PoolMemoryResource(None)
    with pytest.raises(TypeError):
        mr.StatisticsResourceAdaptor(object())
    with pytest.raises(TypeError):
        mr.set_current_device_resource("not a resource")
    with pytest.raises(ValueError, match="log_file_name"):
        mempool.reinitialize(logging=True)
    with pytest.raises(ValueError, match="ordinals"):
        mempool.reinitialize(devices=[-1])
    with pytest.raises(ValueError, match="twice"):
        mempool.reinitialize(devices=[0, 0])


def test_vmm_resource_arguments_are_checked_before_the_driver():
    with pytest.raises(ValueError, match='"all"') as e:
        mr.VmmMemoryResource(peers="some")
    assert "None" in str(e.value) and "ordinals" in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="-1 is negative"):
        mr.VmmMemoryResource(peers=[0, -1])
    for bad in ([0, "x"], 3, True, [0.5]):
        with pytest.raises(TypeError):
            mr.VmmMemoryResource(peers=bad)
    with pytest.raises(TypeError):
        mr.VmmMemoryResource(gpu_direct_rdma="yes")
    with pytest.raises(TypeError):
        mr.VmmMemoryResource(0)  # device is keyword-only, as CudaMemoryResource's
    with pytest.raises(OverflowError):
        mr.VmmMemoryResource(device=-1)


def test_reinitialize_takes_rmm_log_file_from_the_environment(monkeypatch, no_driver, tmp_path):
    """As RMM: logging=True without log_file_name uses RMM_LOG_FILE (here the argument check passes and,
    without a driver, the first driver call fails; with one, the log is named after the variable)."""
    monkeypatch.setenv("RMM_LOG_FILE", str(tmp_path / "env.csv"))
    if no_driver:
        with pytest.raises(mempool.DriverNotFoundError):
            mempool.reinitialize(logging=True)
        return
    old = mr.get_current_device_resource()
    try:
        mempool.reinitialize(logging=True)
        cur = mr.get_current_device_resource()
        assert cur.get_file_name() == str(tmp_path / "env.dev0.csv")
    finally:
        mr.set_current_device_resource(old)


def test_value_chains_are_followed_one_level():
    """A stream handle's ``.value`` (ctypes.c_void_p) is read once; an object whose ``.value`` has a
    ``.value`` of its own (here: itself, which recursed without end before) is a TypeError."""

    class SelfValued:
        @property
        def value(self):
            return self

    class NumbaLike:
        handle = SelfValued()

    with pytest.raises(TypeError, match="not an integer handle"):
        mempool.DeviceBuffer(size=8, stream=NumbaLike())


def test_stream_protocols_are_read_before_the_driver(no_driver):
    """Every accepted stream form gets past argument parsing: without a driver it then fails on the
    missing driver; with one it allocates on the legacy default stream (handle 0) each form names."""

    class Protocol:
        def __cuda_stream__(self):
            return (0, 0)

    class TorchLike:
        cuda_stream = 0

    class CupyLike:
        ptr = 0

    class NumbaLike:
        handle = ctypes.c_void_p(None)

    forms = (None, 0, Protocol(), TorchLike(), CupyLike(), NumbaLike())
    for s in forms + (1, 2):
        if no_driver:
            with pytest.raises(mempool.DriverNotFoundError):
                mempool.DeviceBuffer(size=8, stream=s)
    if not no_driver:
        for s in forms:
            assert mempool.DeviceBuffer(size=8, stream=s).stream == 0, s


def _stub_tree():
    text = pathlib.Path(lib.__file__).with_name("_lib.pyi").read_text()
    return ast.parse(text)


def test_api_matches_the_stubs():
    tree = _stub_tree()
    stub_names = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            stub_names.add(node.name)
            cls = getattr(lib, node.name)
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name != "__init__":
                    assert hasattr(cls, item.name), f"{node.name}.{item.name} is in the stubs, not in the module"
            for name, value in vars(cls).items():
                if not name.startswith("_") and (callable(value) or inspect.isdatadescriptor(value)):
                    stubbed = {i.name for i in node.body if isinstance(i, ast.FunctionDef)}
                    inherited = any(name in vars(b) for b in cls.__mro__[1:])
                    assert name in stubbed or inherited, f"{node.name}.{name} is missing from the stubs"
        elif isinstance(node, ast.FunctionDef):
            stub_names.add(node.name)
            assert callable(getattr(lib, node.name)), node.name
    public = {n for n in dir(lib) if not n.startswith("__")}
    assert public - {"Stream"} <= stub_names | {"Stream"}, public - stub_names
    # The package's own modules are typed inline; py.typed marks the package as typed.
    assert pathlib.Path(mempool.__file__).with_name("py.typed").exists()


def test_rmm_names_are_there():
    for name in (
        "CudaMemoryResource CudaAsyncMemoryResource ManagedMemoryResource PoolMemoryResource "
        "FixedSizeMemoryResource BinningMemoryResource ArenaMemoryResource StatisticsResourceAdaptor "
        "TrackingResourceAdaptor LoggingResourceAdaptor LimitingResourceAdaptor FailureCallbackResourceAdaptor "
        "set_current_device_resource get_current_device_resource set_per_device_resource "
        "get_per_device_resource"
    ).split():
        assert hasattr(mr, name), name
    assert issubclass(mr.PoolMemoryResource, mr.DeviceMemoryResource)
    params = inspect.signature(mempool.reinitialize).parameters
    rmm = [
        "pool_allocator",
        "managed_memory",
        "initial_pool_size",
        "maximum_pool_size",
        "devices",
        "logging",
        "log_file_name",
    ]
    # RMM's parameters, in RMM's order; mempool's additions (``stack``) are keyword-only after them.
    assert list(params)[: len(rmm)] == rmm
    extra = list(params.values())[len(rmm):]
    assert [p.name for p in extra] == ["stack"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is False for p in extra)


@pytest.mark.parametrize(
    "module, framework",
    [("mempool.allocators.cupy", "CuPy"), ("mempool.allocators.numba", "Numba"), ("mempool.allocators.torch", "PyTorch")],
)
def test_missing_framework_is_named(module, framework, monkeypatch):
    """The framework is hidden (``sys.modules[name] = None`` makes its import fail) whether or not it is
    installed, so the missing-framework path runs everywhere."""
    top = {"CuPy": "cupy", "Numba": "numba", "PyTorch": "torch"}[framework]
    monkeypatch.setitem(sys.modules, top, None)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=framework) as e:
        importlib.import_module(module)
    assert module in str(e.value), str(e.value)


def test_extension_exports_the_c_abi(no_driver):
    so = ctypes.CDLL(lib._shared_object_path())
    for sym in ("mempool_torch_alloc", "mempool_torch_alloc_nullable", "mempool_torch_free", "mempool_allocate",
                "mempool_last_error", "mempool_set_current_device_resource"):
        assert hasattr(so, sym), sym
    assert lib._torch_alloc_raises(), "built without the C++ shim: PyTorch out-of-memory could not raise"
    so.mempool_last_error.restype = ctypes.c_char_p
    so.mempool_status_name.restype = ctypes.c_char_p
    assert so.mempool_status_name(5) == b"MEMPOOL_ERROR_OUT_OF_MEMORY"
    n = ctypes.c_int(-1)
    rc = so.mempool_device_count(ctypes.byref(n))
    if no_driver:
        assert rc == 2 and b"driver" in so.mempool_last_error().lower()
    # PyTorch's free of a pointer mempool never handed out is refused, not freed, and counted.
    so.mempool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    before = lib._torch_allocator_state()[1]
    so.mempool_torch_free(0x100000, 256, 0, None)
    assert lib._torch_allocator_state()[1] == before + 1
    assert b"did not hand out" in so.mempool_last_error()


def test_extension_exports_cupys_c_allocator():
    """CuPy's C entry points are exported, their addresses are the ones ``_cupy_c_allocator`` hands CuPy, a
    free of a pointer they never handed out is refused and counted, and a failed allocation without a
    ``raise`` callback (a NULL param) returns NULL with the cause in the last error. No driver is needed:
    every call here fails before one is."""
    so = ctypes.CDLL(lib._shared_object_path())
    so.mempool_last_error.restype = ctypes.c_char_p
    so.mempool_cupy_malloc.restype = ctypes.c_void_p
    so.mempool_cupy_malloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    so.mempool_cupy_free.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    live, failed_allocs, failed_frees = lib._cupy_allocator_state()
    so.mempool_cupy_free(None, 0x200000, 0)
    assert lib._cupy_allocator_state() == (live, failed_allocs, failed_frees + 1)
    assert b"did not hand out" in so.mempool_last_error()
    assert lib._cupy_allocation(0x200000) is None
    assert so.mempool_cupy_malloc(None, 4096, -1) is None
    assert lib._cupy_allocator_state() == (live, failed_allocs + 1, failed_frees + 1)
    message = so.mempool_last_error()
    assert b"4096 bytes on device -1 for CuPy" in message and b"negative" in message, message


def test_buffer_classes_share_one_surface():
    """DeviceBuffer, ExportedBuffer and ImportedBuffer get their getters, CUDA array interface and DLPack from
    one definition (src/view.rs): the same names, the same signatures and the same documentation."""
    shared = ("ptr", "size", "nbytes", "device", "stream", "__len__", "__cuda_array_interface__",
              "__dlpack__", "__dlpack_device__")
    classes = (lib.DeviceBuffer, lib.ExportedBuffer, lib.ImportedBuffer)
    for name in shared:
        docs = {getattr(cls, name).__doc__ for cls in classes}
        assert len(docs) == 1, (name, docs)
        if callable(getattr(mempool.DeviceBuffer, name)) and name != "__len__":
            sigs = {str(inspect.signature(getattr(cls, name))) for cls in classes}
            assert len(sigs) == 1, (name, sigs)
    assert str(inspect.signature(mempool.DeviceBuffer.__dlpack__)) == (
        "(self, /, *, stream=None, max_version=None, dl_device=None, copy=None)"
    )


def test_copy_from_host_has_rmms_signature():
    # rmm.DeviceBuffer.copy_from_host(ary, stream=DEFAULT_STREAM); None is the buffer's own stream here.
    params = inspect.signature(mempool.DeviceBuffer.copy_from_host).parameters
    assert list(params) == ["self", "ary", "stream"]
    assert params["stream"].default is None and params["ary"].default is inspect.Parameter.empty


def test_binning_resource_has_rmms_signature():
    params = inspect.signature(mr.BinningMemoryResource.add_bin).parameters
    assert list(params) == ["self", "allocation_size", "bin_resource"]
    assert params["bin_resource"].default is None

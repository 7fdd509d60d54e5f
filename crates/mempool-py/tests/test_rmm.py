"""Host tests of mempool.rmm and the RMM bridge (docs/rmm.md, "Python"): the options are checked before the
GPU is touched, the bridge's class is RMM's kind of resource and refuses clearly without a GPU, and a missing
or mismatched RMM is named. scripts/python-tests.sh installs RMM 26.10 and the bridge built against it.
The GPU tests are crates/mempool-py/rmm-bridge/tests (scripts/rmm-gpu-tests.sh packs them)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import mempool
import mempool.rmm


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("kind", "options", "error", "words"),
    [
        ("nope", {}, ValueError, ["unknown resource kind 'nope'", "default", "pool", "service"]),
        (7, {}, TypeError, ["kind: expected one of", "got 7"]),
        ("pool", {"arena_size": 1}, ValueError, ["arena_size=1 does not apply to kind 'pool'"]),
        ("cuda", {"initial_pool_size": 1}, ValueError, ["initial_pool_size=1 does not apply to kind 'cuda'"]),
        ("pool", {"initial_pool_size": "1 parsec"}, ValueError, ["unknown unit 'parsec'"]),
        ("pool", {"initial_pool_size": -1}, ValueError, ["initial_pool_size: a size cannot be negative"]),
        ("async", {"enable_ipc": "maybe"}, ValueError, ["enable_ipc: expected true or false"]),
        ("service", {"tag": 1.5}, ValueError, ["tag: expected a non-empty name"]),
        ("pool", {"bogus": 1}, ValueError, ["unknown resource option 'bogus'", "initial_pool_size"]),
        ("default", {"limit": 0}, ValueError, ["limit: must be more than 0 bytes"]),
        ("default", {"device": -1}, ValueError, ["device: must be in"]),
        ("pool", {"initial_pool_size": "2GiB", "maximum_pool_size": "1GiB"}, ValueError,
         ["initial_pool_size 2.00 GiB", "larger than maximum_pool_size 1.00 GiB"]),
        ("binning", {"bins": (21, 20)}, ValueError, ["bins: the smallest exponent 21 is larger than the largest 20"]),
        ("current", {"initial_pool_size": 1}, ValueError, ["kind 'current' takes no options"]),
    ],
)
def test_make_resource_checks_options_before_the_gpu(kind, options, error, words):
    # mempool.spec's checks (the ones mempool.dask's workers use), made before anything touches the GPU.
    with pytest.raises(error) as e:
        mempool.rmm.make_resource(kind, **options)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_every_kind_is_known():
    assert set(mempool.rmm.KINDS) == {
        "default", "current", "async", "pool", "binning", "arena", "cuda", "managed", "service"
    }


def test_without_a_gpu_making_a_resource_names_the_cause():
    # The options are fine: the first driver call fails, with mempool's own error.
    with pytest.raises(mempool.MempoolError) as e:
        mempool.rmm.make_resource("pool", initial_pool_size=1 << 20)
    assert type(e.value) in (mempool.DriverNotFoundError, mempool.NoDeviceError, mempool.DriverTooOldError)


def test_the_bridge_class_is_an_rmm_resource():
    import rmm

    cls = mempool.rmm.MempoolResource
    assert issubclass(cls, rmm.mr.DeviceMemoryResource)
    assert cls.__module__ == "mempool_rmm_bridge._bridge"


def test_the_bridge_refuses_clearly_without_a_gpu():
    with pytest.raises(mempool.MempoolError) as e:
        mempool.rmm.MempoolResource()
    assert type(e.value) in (mempool.DriverNotFoundError, mempool.NoDeviceError, mempool.DriverTooOldError)
    with pytest.raises(mempool.MempoolError):
        mempool.rmm.MempoolResource(kind="async", release_threshold=1 << 30)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "words"),
    [
        ((), {"kind": "nope"}, ValueError, ["unknown resource kind 'nope'"]),
        ((object(),), {}, TypeError, ["wraps a mempool.mr resource, not object"]),
        ((), {"kind": "pool", "bogus": 1}, ValueError, ["unknown resource option 'bogus'"]),
    ],
)
def test_the_bridge_checks_its_arguments(args, kwargs, error, words):
    with pytest.raises(error) as e:
        mempool.rmm.MempoolResource(*args, **kwargs)
    for w in words:
        assert w in str(e.value)


def test_the_bridge_is_a_class_path_with_keyword_options():
    # What cudf-polars' memory resource configuration and dask-cuda do with a qualified name.
    import importlib

    module, _, name = "mempool.rmm.MempoolResource".rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert cls is mempool.rmm.MempoolResource
    with pytest.raises(mempool.MempoolError):
        cls(**{"kind": "binning", "initial_pool_size": "16MiB", "bins": "8-20"})


def import_error_of(prelude: str, names: str = "mempool.rmm.MempoolResource") -> str:
    """What a fresh interpreter prints when, after ``prelude``, evaluating ``names`` raises ImportError."""
    r = run_python(
        prelude
        + f"""
import mempool.rmm
try:
    {names}
except ImportError as e:
    print("ImportError:", e)
"""
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_missing_rmm_is_named():
    # as if RMM were not installed; the module itself works without it
    out = import_error_of('import sys\nsys.modules["rmm"] = None', "mempool.rmm.make_resource; mempool.rmm.MempoolResource")
    assert "ImportError: mempool_rmm_bridge needs RMM 26.10" in out
    assert "pip install rmm-cu13==26.10.*" in out


def test_a_missing_bridge_is_named():
    # as if the bridge were not installed
    out = import_error_of(
        'import sys\nsys.modules["mempool_rmm_bridge"] = None',
        "mempool.rmm.as_rmm_resource; mempool.rmm.MempoolResource",
    )
    assert "mempool.rmm needs the RMM bridge" in out
    assert "scripts/build-rmm-bridge.sh" in out


def test_another_rmm_release_is_refused():
    out = import_error_of('import rmm\nrmm.__version__ = "26.12.00"')
    assert "built against RMM 26.10" in out
    assert "RMM 26.12.00 is installed" in out


def test_unknown_attributes_are_attribute_errors():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        mempool.rmm.Nope  # noqa: B018


def rmm_doc_blocks() -> list[str]:
    """The ```python blocks of docs/rmm.md (MEMPOOL_DOCS names docs/python.md's folder when the tests run
    from an installed wheel elsewhere)."""
    import os
    import re
    from pathlib import Path

    env = os.environ.get("MEMPOOL_DOCS")
    path = Path(env).with_name("rmm.md") if env else Path(__file__).resolve().parents[3] / "docs" / "rmm.md"
    text = path.read_text()
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```$", text, re.S | re.M)]


def test_the_docs_python_blocks_compile():
    blocks = rmm_doc_blocks()
    assert len(blocks) >= 2, "docs/rmm.md shows the Python bridge in a block or more"
    for i, code in enumerate(blocks):
        compile(code, f"docs/rmm.md python block {i + 1}", "exec")
    assert any("MempoolResource" in b and "set_current_device_resource" in b for b in blocks)


def test_a_bridge_for_other_entry_points_is_refused():
    import mempool_rmm_bridge._bridge as bridge

    good = mempool._lib._capi_functions()
    assert good[0] == ("abi", bridge.CAPI_ABI)
    with pytest.raises(ImportError, match="calls version 1 of mempool's C entry points.*gives version 2"):
        bridge._set_functions([("abi", 2)] + good[1:])
    with pytest.raises(ImportError, match="gives none"):
        bridge._set_functions(good[1:])
    with pytest.raises(ImportError, match="does not give the entry point mempool_deallocate"):
        bridge._set_functions([p for p in good if p[0] != "mempool_deallocate"])
    bridge._set_functions(good)  # back to the real table

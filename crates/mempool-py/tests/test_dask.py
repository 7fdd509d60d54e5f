"""Host tests of ``mempool.dask`` (no GPU): the resource spec and its sizes, the plugin's options and the
errors a worker's start raises, the preload module's command line, the handle frame (hostile frames
included), the transfer's decisions and the Dask machinery it rests on (the handshake advert reaching the
sender's serializer), and the bdb workload's queries against their naive references. The GPU tests are in
test_dask_gpu.py.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import struct
import types

import pytest

_WHY = ("mempool.dask's host tests need dask, distributed and NumPy: scripts/python-tests.sh installs them on "
        "Python 3.11 or newer (crates/mempool-py/tests/requirements-dask.txt)")
distributed = pytest.importorskip("distributed", reason=_WHY)
np = pytest.importorskip("numpy", reason=_WHY)

import mempool.dask as md  # noqa: E402
from mempool.benchmarks import bdb  # noqa: E402
from mempool.dask import framing, plugin, transfer  # noqa: E402
from mempool.dask.preload import dask_setup, plugin_from_options  # noqa: E402
from mempool.spec import ResourceSpec, format_size, parse_size  # noqa: E402

GiB = 1 << 30


def test_the_gpu_tests_submit_only_functions_workers_can_import():
    """A worker loads a task's function by reference (distributed pickles it so), and cannot import a test
    file: every function test_dask_gpu.py submits or runs on workers comes from an importable module."""
    import ast
    import importlib
    from pathlib import Path

    src = Path(__file__).with_name("test_dask_gpu.py").read_text(encoding="utf-8")
    tree = ast.parse(src)
    local_defs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    imported = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("mempool"):
            for a in n.names:
                imported[a.asname or a.name] = (n.module, a.name)
    submitted = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("submit", "run"):
            if n.args and isinstance(n.args[0], ast.Name):
                submitted.add(n.args[0].id)
    assert submitted, "no submit/run calls found"
    for name in submitted:
        assert name not in local_defs, f"test_dask_gpu.py submits {name}, defined in the test file"
        if name in imported:
            module, attr = imported[name]
            fn = getattr(importlib.import_module(module), attr)
            assert callable(fn) and fn.__module__ == module, (name, module)
        else:
            pytest.fail(f"test_dask_gpu.py submits {name}, which is not imported from a mempool module")


def test_the_package_does_not_shadow_dask():
    import dask

    assert dask.__name__ == "dask" and "mempool" not in dask.__file__
    assert md.__name__ == "mempool.dask"


# -------------------------------------------------------------------------------------------------
# Sizes and specs.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    (1024, 1024), (0, 0), ("4GiB", 4 * GiB), ("4 GiB", 4 * GiB), ("512MB", 512_000_000), ("1.5GB", 1_500_000_000),
    ("2KiB", 2048), ("100", 100), ("100B", 100), ("1e9", 10**9), ("0.8", 0.8), ("80%", 0.8), (0.5, 0.5),
    (1.0, 1.0), ("1TiB", 1 << 40), ("7 kb", 7000), (None, None),
])
def test_parse_size_reads_bytes_units_and_fractions(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text, match", [
    (-1, "cannot be negative"), (1.5, r"must be in \(0, 1\]"), (0.0, r"\(0, 1\]"), (float("nan"), r"\(0, 1\]"),
    ("4XB", "unknown unit 'XB'"), ("lots", "is not a size"), ("150%", r"\(0, 1\]"), ("0%", "more than 0"),
    ("1.5B", "whole number of bytes"), ("2.5", "neither a fraction"), (True, "a size must be"),
    ([1], "must be an int"), ("", "is not a size"),
])
def test_parse_size_names_the_field_and_value(text, match):
    with pytest.raises((ValueError, TypeError), match=match) as e:
        parse_size(text, "initial_pool_size")
    assert "initial_pool_size" in str(e.value)


def test_format_size():
    assert format_size(4 * GiB) == "4.00 GiB (4294967296 bytes)"
    assert format_size(100) == "100 bytes"


def test_spec_kinds_aliases_and_defaults():
    assert ResourceSpec().kind == "default" and ResourceSpec().statistics
    assert ResourceSpec(kind="driver-pool").kind == "async"
    assert ResourceSpec(kind="Default_Stack").kind == "default"
    for k in md.KINDS:
        assert ResourceSpec(kind=k).kind == k


@pytest.mark.parametrize("kwargs, match", [
    ({"kind": "slab"}, "kind: unknown resource kind 'slab'"),
    ({"kind": 3}, "kind: expected one of"),
    ({"kind": "pool", "arena_size": "1GiB"}, r"arena_size=1073741824 does not apply to kind 'pool'"),
    ({"kind": "cuda", "initial_pool_size": 1}, "initial_pool_size=1 does not apply to kind 'cuda'"),
    ({"kind": "async", "maximum_pool_size": "1GiB"}, "maximum_pool_size.*does not apply to kind 'async'"),
    ({"kind": "pool", "bins": (8, 20)}, "bins=.*does not apply"),
    ({"kind": "pool", "upstream": "vmm"}, "upstream: expected one of async, cuda, managed, got 'vmm'"),
    ({"kind": "pool", "upstream": "cuda", "release_threshold": 1}, "release_threshold needs upstream 'async'"),
    ({"kind": "pool", "initial_pool_size": "2GiB", "maximum_pool_size": "1GiB"}, "initial_pool_size 2.00 GiB .* larger than maximum_pool_size"),
    ({"kind": "binning", "bins": (20, 8)}, "bins: the smallest exponent 20 is larger than the largest 8"),
    ({"kind": "binning", "bins": (8,)}, "bins: expected two"),
    ({"kind": "binning", "bins": (8, 99)}, r"bins: must be in \[1, 40\], got 99"),
    ({"kind": "pool", "limit": 0}, "limit: must be more than 0"),
    ({"kind": "arena", "arena_size": 0}, "arena_size: must be more than 0"),
    ({"kind": "service", "max_tags": 0}, r"max_tags: must be in \[1, 1024\]"),
    ({"kind": "service", "tag": ""}, "tag: expected a non-empty name"),
    ({"statistics": "maybe"}, "statistics: expected true or false, got 'maybe'"),
    ({"device": -1}, r"device: must be in"),
])
def test_spec_refuses_with_the_field_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ResourceSpec(**kwargs)


def test_spec_from_text_and_dict_and_back():
    s = ResourceSpec.parse("pool:initial_pool_size=4GiB,maximum_pool_size=0.9,limit=30GB,upstream=cuda")
    assert (s.kind, s.initial_pool_size, s.maximum_pool_size, s.limit, s.upstream) == ("pool", 4 * GiB, 0.9, 30 * 10**9, "cuda")
    assert ResourceSpec.from_dict(s.to_dict()) == s
    b = ResourceSpec.parse("binning:bins=10-16, release-threshold=1GiB, statistics=false")
    assert b.bins == (10, 16) and b.release_threshold == GiB and b.statistics is False
    assert ResourceSpec.parse("arena") == ResourceSpec(kind="arena")
    assert ResourceSpec.coerce(None, kind="arena", arena_size="1GiB").arena_size == GiB
    assert ResourceSpec.coerce({"kind": "cuda"}).kind == "cuda"
    assert pickle.loads(pickle.dumps(s)) == s


@pytest.mark.parametrize("text, match", [
    (":initial_pool_size=1", "no kind before ':'"),
    ("pool:initial_pool_size", "'initial_pool_size' is not NAME=VALUE"),
    ("pool:size=1", "unknown resource option 'size'"),
    ("pool:limit=1,limit=2", "option 'limit' is given twice"),
    ("pool:kind=arena", "the kind goes before ':'"),
    ("pool:initial_pool_size=huge", "initial_pool_size: 'huge' is not a size"),
])
def test_spec_text_errors(text, match):
    with pytest.raises(ValueError, match=match):
        ResourceSpec.parse(text)


def test_spec_coerce_refuses_both_and_unknown():
    with pytest.raises(ValueError, match="not both"):
        ResourceSpec.coerce("pool", kind="arena")
    with pytest.raises(ValueError, match="unknown resource option 'pool_size'"):
        ResourceSpec.from_dict({"kind": "pool", "pool_size": 1})
    with pytest.raises(TypeError, match="must be a mapping"):
        ResourceSpec.from_dict(42)


def test_resolve_turns_fractions_into_bytes_and_refuses_sizes_larger_than_the_device():
    total = 80 * GiB
    r = ResourceSpec(kind="pool", initial_pool_size=0.5, maximum_pool_size="0.75", limit="60GiB").resolve(total)
    assert r["initial_pool_size"] == 40 * GiB and r["maximum_pool_size"] == 60 * GiB and r["limit"] == 60 * GiB
    assert r["initial_pool_size"] % 256 == 0
    with pytest.raises(ValueError, match=r"initial_pool_size 100.00 GiB .* is larger than the device's memory, 80.00 GiB"):
        ResourceSpec(kind="pool", initial_pool_size="100GiB").resolve(total)
    with pytest.raises(ValueError, match="limit .* larger than the device's memory"):
        ResourceSpec(kind="cuda", limit="81GiB").resolve(total)
    with pytest.raises(ValueError, match="initial_pool_size .* larger than maximum_pool_size"):
        ResourceSpec(kind="pool", initial_pool_size=0.9, maximum_pool_size="10GiB").resolve(total)
    with pytest.raises(ValueError, match="less than 256 bytes"):
        ResourceSpec(kind="pool", initial_pool_size=1e-12).resolve(total)
    with pytest.raises(ValueError, match="total_memory"):
        ResourceSpec().resolve(0)


# -------------------------------------------------------------------------------------------------
# The plugin.
# -------------------------------------------------------------------------------------------------


def test_parse_frameworks():
    assert md.parse_frameworks("auto") == "auto"
    assert md.parse_frameworks(None) == () and md.parse_frameworks("none") == () and md.parse_frameworks([]) == ()
    assert md.parse_frameworks("cupy, torch") == ("cupy", "torch")
    assert md.parse_frameworks(["Numba"]) == ("numba",)
    with pytest.raises(ValueError, match="unknown framework 'jax'"):
        md.parse_frameworks("cupy,jax")
    assert md.parse_frameworks(["rmm", "cupy"]) == ("rmm", "cupy")  # RMM through the bridge (docs/rmm.md)
    with pytest.raises(ValueError, match="'cupy' is listed twice"):
        md.parse_frameworks("cupy,cupy")
    with pytest.raises(TypeError, match="frameworks"):
        md.parse_frameworks(3)


def test_plugin_options_name_and_pickling():
    p = md.MempoolSetup(kind="pool", initial_pool_size="50%", frameworks="cupy", ipc=True)
    assert p.name == md.PLUGIN_NAME == "mempool-setup" and not p.idempotent
    assert p.spec == ResourceSpec(kind="pool", initial_pool_size=0.5) and p.frameworks == ("cupy",) and p.ipc
    q = pickle.loads(pickle.dumps(p))
    assert q.spec == p.spec and q.frameworks == p.frameworks and q.device == 0
    assert md.MempoolSetup("arena:arena_size=1GiB").spec.kind == "arena"
    assert md.MempoolSetup(ResourceSpec(kind="cuda", device=1)).device == 1
    with pytest.raises(ValueError, match="device: the spec names device 1 and device=2"):
        md.MempoolSetup(ResourceSpec(kind="cuda", device=1), device=2)
    with pytest.raises(ValueError, match="not both"):
        md.MempoolSetup("pool", kind="arena")
    with pytest.raises(ValueError, match="cupy_allocator"):
        md.MempoolSetup(cupy_allocator="rust")
    with pytest.raises(ValueError, match="device: expected a non-negative ordinal"):
        md.MempoolSetup(device=-1)


def test_a_missing_framework_is_named_before_the_gpu_is_touched(monkeypatch):
    monkeypatch.setattr(plugin, "_importable", lambda modules: "cupy" not in modules)
    with pytest.raises(ImportError, match=r"framework\(s\) cupy asked for but not installed"):
        md.setup_worker(ResourceSpec(kind="pool"), frameworks=("cupy", "torch"))
    assert md.current_setup()["spec"] is None  # nothing was built


def test_setup_worker_refuses_bad_arguments_before_the_gpu():
    with pytest.raises(TypeError, match="setup_worker needs a ResourceSpec, got dict"):
        md.setup_worker({"kind": "pool"})
    with pytest.raises(ValueError, match="device: the spec names device 1 and device=0"):
        md.setup_worker(ResourceSpec(kind="pool", device=1), device=0)
    with pytest.raises(ValueError, match="device: expected a non-negative ordinal, got -2"):
        md.setup_worker(ResourceSpec(kind="pool"), device=-2)
    with pytest.raises(ValueError, match="cupy_allocator"):
        md.setup_worker(ResourceSpec(kind="pool"), cupy_allocator="rust")
    with pytest.raises(ValueError, match="unknown framework 'jax'"):
        md.setup_worker(ResourceSpec(kind="pool"), frameworks="jax")


def test_a_hook_that_fails_is_an_error_when_asked_for_and_a_note_under_auto(monkeypatch):
    """What happens after the resource is built, with the build and the hooks replaced (no GPU here)."""
    monkeypatch.setattr(plugin, "_importable", lambda modules: True)
    monkeypatch.setattr(plugin, "device_total_memory", lambda device: 80 * GiB)
    import types

    monkeypatch.setattr(plugin, "build", lambda spec, device, total: types.SimpleNamespace(name="FakeResource"))
    import mempool.mr

    monkeypatch.setattr(mempool.mr, "set_per_device_resource", lambda device, res: None)
    monkeypatch.setattr(plugin, "_STATE", plugin._State())

    def hook(f, cupy_allocator, device, resource):
        assert device == 0 and resource.name == "FakeResource"
        if f == "torch":
            raise RuntimeError("PyTorch has already started CUDA in this worker")
        return {"cupy": "c", "rmm": "bridge"}.get(f, "emm")

    monkeypatch.setattr(plugin, "_hook", hook)
    with pytest.raises(RuntimeError, match="pointing torch at the resource failed: PyTorch has already started"):
        md.setup_worker(ResourceSpec(kind="pool"), frameworks=["cupy", "torch"])
    state = md.setup_worker(ResourceSpec(kind="pool"), frameworks="auto")
    assert state["hooked"] == {"cupy": "c", "numba": "emm", "rmm": "bridge"}
    assert "already started CUDA" in state["not_hooked"]["torch"]
    again = md.setup_worker(ResourceSpec(kind="pool"), frameworks="auto")
    assert again["resource_id"] == state["resource_id"] and again["setups"] == state["setups"] + 1


def test_setup_without_a_driver_says_so(no_driver):
    if not no_driver:
        return
    with pytest.raises(Exception, match="no CUDA driver: libcuda.so.1 cannot be loaded") as e:
        md.setup_worker(ResourceSpec(kind="pool"), frameworks="none")
    assert type(e.value).__name__ == "DriverNotFoundError"
    with pytest.raises(Exception, match="no CUDA driver"):
        md.device_total_memory(0)


def test_registering_on_a_cluster_fails_at_registration_with_the_workers_error(no_driver, monkeypatch):
    """Client.register_plugin raises the worker's setup error (here: no driver on this machine; a missing
    framework), so a misconfiguration shows before the first task."""
    from distributed import Client, LocalCluster

    monkeypatch.setattr(plugin, "_importable", lambda modules: "torch" not in modules)
    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        with pytest.raises(ImportError, match="torch asked for but not installed on worker "):
            md.register(client, kind="pool", frameworks=["torch"])
        if no_driver:
            with pytest.raises(Exception, match="no CUDA driver"):
                md.register(client, md.MempoolSetup(kind="pool", frameworks="none"))
        with pytest.raises(ValueError, match="not both"):
            md.register(client, md.MempoolSetup(), kind="pool")


def test_a_preloaded_worker_that_cannot_set_up_fails_to_start(no_driver):
    if not no_driver:
        return
    from distributed import Scheduler, Worker

    async def main():
        async with Scheduler(dashboard_address=":0") as s:
            with pytest.raises(SystemExit, match="mempool.dask.preload: .* cannot start: DriverNotFoundError: no CUDA driver"):
                async with Worker(s.address, preload=["mempool.dask.preload"],
                                  preload_argv=["--mempool-kind", "pool", "--mempool-frameworks", "none"]):
                    pass

    asyncio.run(main())


# -------------------------------------------------------------------------------------------------
# The preload module's command line.
# -------------------------------------------------------------------------------------------------


def _preload(*argv):
    ctx = dask_setup.make_context("dask_setup", list(argv))
    return plugin_from_options(**ctx.params)


def test_preload_options_make_the_plugin():
    p = _preload("--mempool-kind", "arena", "--mempool-arena-size", "2GiB", "--mempool-ipc", "--mempool-frameworks",
                 "cupy,torch", "--mempool-limit", "0.9", "--mempool-no-statistics")
    assert p.spec == ResourceSpec(kind="arena", arena_size=2 * GiB, limit=0.9, statistics=False)
    assert p.ipc and p.frameworks == ("cupy", "torch")
    assert _preload().spec == ResourceSpec()
    assert _preload("--mempool-spec", "pool:initial_pool_size=0.5").spec == ResourceSpec(kind="pool", initial_pool_size=0.5)
    assert _preload("--mempool-kind", "async", "--mempool-enable-ipc-pool").spec.enable_ipc
    assert _preload("--mempool-kind", "binning", "--mempool-bins", "9-15").spec.bins == (9, 15)
    assert _preload("--mempool-device", "1").device == 1


def test_preload_option_errors():
    import click

    with pytest.raises(click.UsageError, match="--mempool-spec and --mempool-kind both set the resource"):
        _preload("--mempool-spec", "pool", "--mempool-kind", "arena")
    with pytest.raises(click.BadParameter, match="initial_pool_size: 'lots' is not a size"):
        _preload("--mempool-kind", "pool", "--mempool-initial-pool-size", "lots")
    with pytest.raises(click.BadParameter, match="unknown resource kind 'slab'"):
        _preload("--mempool-kind", "slab")
    with pytest.raises(click.NoSuchOption):
        dask_setup.make_context("dask_setup", ["--mempool-pool-size", "1"])
    with pytest.raises(click.BadParameter):
        dask_setup.make_context("dask_setup", ["--mempool-cupy-allocator", "rust"])


# -------------------------------------------------------------------------------------------------
# The frame.
# -------------------------------------------------------------------------------------------------


def _handle(**kw):
    d = dict(kind="cupy", dtype="<f4", shape=(2, 3), strides=(12, 4), nbytes=24, buffer_id=7, sender_pid=1234,
             device=1, host="gpu-host/0f0f", path="/run/user/0/mempool-dask-1234-abcd.sock")
    d.update(kw)
    return framing.Handle(**d)


def test_frames_round_trip():
    for h in (_handle(), _handle(shape=(), strides=(), nbytes=4), _handle(kind="torch", dtype="torch.bfloat16", shape=(5,),
              strides=(2,), nbytes=10, flags=framing.FLAG_REQUIRES_GRAD), _handle(dtype="|b1", shape=(1, 1, 9),
              strides=(9, 9, 1), nbytes=9), _handle(shape=(2, 0, 3), strides=(0, 12, 4), nbytes=24)):
        if h.shape == (2, 0, 3):
            with pytest.raises(framing.FrameError, match="nbytes"):
                framing.encode(h)
            continue
        f = framing.encode(h)
        assert framing.decode(f) == h
        assert framing.decode(bytearray(f)) == h and framing.decode(memoryview(f)) == h
    assert framing.decode(framing.encode(_handle(kind="torch", flags=1))).requires_grad


def test_c_strides():
    assert framing.c_strides((2, 3, 4), 8) == (96, 32, 8)
    assert framing.c_strides((), 4) == ()
    assert framing.c_strides((0, 5), 4) == (20, 4)


def _raw(h=None, **over):
    """A frame with fields replaced, bypassing encode's checks."""
    h = h or _handle()
    f = dict(magic=framing.MAGIC, version=framing.VERSION, flags=h.flags, kind=1 if h.kind == "cupy" else 2,
             ndim=len(h.shape), dtype=h.dtype.encode(), host=h.host.encode(), nbytes=h.nbytes, id=h.buffer_id,
             pid=h.sender_pid, device=h.device, path=h.path.encode(), reserved=0, shape=h.shape, strides=h.strides)
    f.update(over)
    fixed = struct.pack("<4sHHBBBBQQIIHH", f["magic"], f["version"], f["flags"], f["kind"], f["ndim"], len(f["dtype"]),
                        len(f["host"]), f["nbytes"], f["id"], f["pid"], f["device"], len(f["path"]), f["reserved"])
    dims = struct.pack(f"<{len(f['shape'])}Q{len(f['strides'])}q", *f["shape"], *f["strides"])
    return fixed + dims + f["dtype"] + f["host"] + f["path"]


def test_the_raw_builder_matches_encode():
    assert _raw() == framing.encode(_handle())


@pytest.mark.parametrize("over, match", [
    ({"magic": b"MPDY"}, "magic: b'MPDY', not b'MPDX'"),
    ({"version": 2}, "version: 2; this mempool reads version 1"),
    ({"kind": 9}, "kind: unknown array kind 9"),
    ({"flags": 0x80}, "flags: unknown bits 0x80"),
    ({"flags": 1}, "flags: requires_grad is set on a cupy array"),
    ({"reserved": 5}, "reserved: 5, not 0"),
    ({"dtype": b"<f3"}, "dtype: '<f3' is not one a frame may carry"),
    ({"dtype": b"torch.bfloat16", "nbytes": 12}, "dtype: 'torch.bfloat16' is PyTorch's, but the kind is cupy"),
    ({"dtype": b"\xff\xfe"}, "a text field is not valid text"),
    ({"nbytes": 25}, "nbytes: 25 bytes, but shape"),
    ({"nbytes": 0}, r"nbytes: 0 is not in"),
    ({"strides": (4, 8)}, "strides: .* are not C-contiguous"),
    ({"strides": (-12, 4)}, "not C-contiguous"),
    ({"shape": (1 << 40, 1 << 40), "strides": (1 << 42, 4)}, "more than 281474976710656 bytes"),
    ({"id": 0}, "buffer_id: 0 is not a buffer id"),
    ({"pid": 0}, "sender_pid: 0 is not a pid"),
    ({"device": 1 << 20}, "device: 1048576 is not a device ordinal"),
    ({"host": b""}, "host: '' is empty"),
    ({"path": b"relative.sock"}, "path: 'relative.sock' is not an absolute socket path"),
    ({"path": b"/run/../etc/x"}, "not an absolute socket path"),
    ({"path": b"/tmp/\x00x"}, "not an absolute socket path"),
    ({"path": b"/" + b"p" * 107}, "path_len: 108, more than 107"),
])
def test_hostile_frames_are_refused_naming_the_field(over, match):
    with pytest.raises(framing.FrameError, match=match):
        framing.decode(_raw(**over))


def test_frames_of_the_wrong_length_are_refused():
    f = framing.encode(_handle())
    for n in range(len(f)):
        with pytest.raises(framing.FrameError, match="frame: "):
            framing.decode(f[:n])
    with pytest.raises(framing.FrameError, match="lengths add up to"):
        framing.decode(f + b"\0")
    with pytest.raises(framing.FrameError, match="more than a handle's 4096"):
        framing.decode(f + b"\0" * 5000)
    with pytest.raises(framing.FrameError, match="ndim: 33, more than 32"):
        framing.decode(_raw(ndim=33))
    with pytest.raises(framing.FrameError, match="frame: expected bytes, got int"):
        framing.decode(5)
    with pytest.raises(framing.FrameError, match="frame: expected bytes"):
        framing.decode("text")


def test_random_and_mutated_frames_raise_frame_errors_only():
    rng = random.Random(1)
    good = framing.encode(_handle())
    for _ in range(3000):
        b = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            h = framing.decode(bytes(b))
        except framing.FrameError:
            continue
        framing._check(h)  # what decoded passed every rule
        assert framing.decode(framing.encode(h)) == h
    for _ in range(2000):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))
        with pytest.raises(framing.FrameError):
            framing.decode(junk)


def test_encode_refuses_what_decode_would():
    with pytest.raises(framing.FrameError, match="kind"):
        framing.encode(_handle(kind="jax"))
    with pytest.raises(framing.FrameError, match="path"):
        framing.encode(_handle(path="/" + "x" * 200))
    with pytest.raises(framing.FrameError, match="shape"):
        framing.encode(_handle(shape=(-1, 3)))
    with pytest.raises(framing.FrameError, match="strides: 1 strides for 2 dimensions"):
        framing.encode(_handle(strides=(4,)))
    with pytest.raises(framing.FrameError, match="33 dimensions"):
        framing.encode(_handle(shape=(1,) * 33, strides=(4,) * 33, nbytes=4))


def test_adverts():
    good = {"v": 1, "host": "h/b", "pid": 5, "path": "/tmp/x.sock"}
    assert framing.check_advert(good) == good
    assert framing.check_advert(dict(good, extra=1)) == good
    for bad in (None, 3, {}, dict(good, v=2), dict(good, pid=True), dict(good, pid=0), dict(good, path="x.sock"),
                dict(good, path="/" + "y" * 200), dict(good, host=""), dict(good, host=7), dict(good, path="/a\nb")):
        assert framing.check_advert(bad) is None, bad
    h = framing.host_id()
    assert "/" in h and len(h.encode()) <= 255 and framing.same_host(h)


# -------------------------------------------------------------------------------------------------
# The transfer's decisions (a fake endpoint and a fake array type) and Dask's machinery under it.
# -------------------------------------------------------------------------------------------------


class FakeArray:
    nbytes = 64


class FakeEndpoint:
    def __init__(self, connected=True, fail=False):
        self.host, self.pid, self.path = framing.host_id(), 111, "/tmp/mempool-dask-111-0000.sock"
        self.connected, self.fail = connected, fail
        self.counters = dict.fromkeys(("offers_sent", "share_failures", "fallbacks"), 0)
        self.sent, self.offers = [], []

    def advert(self):
        return {"v": 1, "host": self.host, "pid": self.pid, "path": self.path}

    def importer_id(self, pid):
        return 42 if self.connected and pid == 222 else None

    def send(self, kind, x, importer):
        if self.fail:
            raise RuntimeError("share failed")
        self.sent.append((kind, importer))
        return framing.encode(_handle(path=self.path, sender_pid=self.pid, host=self.host))

    def offer(self, advert):
        self.offers.append(advert)


def _ctx(pid=222, host=None):
    return {"recipient": {"address": "tcp://127.0.0.1:1", transfer.ADVERT_KEY: {
        "v": 1, "host": host or framing.host_id(), "pid": pid, "path": "/tmp/mempool-dask-222-0000.sock"}}}


@pytest.fixture
def fake(monkeypatch):
    ep = FakeEndpoint()
    monkeypatch.setattr(plugin._STATE, "ipc", ep)
    monkeypatch.setattr(transfer, "_kind", lambda x: "cupy" if isinstance(x, FakeArray) else None)
    return ep


def test_try_handle_sends_only_to_a_connected_peer_of_this_host(fake):
    x = FakeArray()
    frame, offer = transfer.try_handle(x, _ctx())
    assert framing.decode(frame).path == fake.path and offer is None and fake.sent == [("cupy", 42)]
    assert transfer.try_handle(x, _ctx(host="elsewhere/1")) == (None, None)  # another host: default path
    assert transfer.try_handle(x, None) == (None, None)  # no context (an in-process comm)
    assert transfer.try_handle(x, {"recipient": {"address": "tcp://x"}}) == (None, None)  # a peer without the plugin
    assert transfer.try_handle(x, _ctx(pid=fake.pid)) == (None, None)  # itself
    assert transfer.try_handle(object(), _ctx()) == (None, None)  # not a CUDA array
    fake.connected = False
    assert transfer.try_handle(x, _ctx()) == (None, fake.advert())  # same host, not connected: an offer
    assert fake.counters["offers_sent"] == 1
    fake.connected, fake.fail = True, True
    assert transfer.try_handle(x, _ctx()) == (None, None)
    assert fake.counters["share_failures"] == 1


def test_try_handle_without_an_endpoint(monkeypatch):
    monkeypatch.setattr(plugin._STATE, "ipc", None)
    assert transfer.try_handle(FakeArray(), _ctx()) == (None, None)
    with pytest.raises(RuntimeError, match="without mempool.dask's endpoint"):
        transfer.receive_frame(framing.encode(_handle()))


def test_the_wrapped_dask_serializers(fake, monkeypatch):
    from dask.utils import Dispatch

    ser, deser = Dispatch("ser"), Dispatch("deser")
    ser.register(FakeArray, lambda x: ({"by": "value"}, [b"bytes"]))
    deser.register(FakeArray, lambda header, frames: ("value", header, frames))
    transfer._wrap(ser, deser, FakeArray, None)
    dumps, loads = ser.dispatch(FakeArray), deser.dispatch(FakeArray)
    from distributed.utils import has_keyword

    assert has_keyword(dumps, "context")  # distributed passes the comm's context to it
    header, frames = dumps(FakeArray(), context=_ctx())
    assert header == {transfer.ADVERT_KEY: 1} and framing.decode(frames[0])
    received = []
    monkeypatch.setattr(transfer, "receive_frame", lambda f: received.append(f) or "array")
    assert loads(header, frames) == "array" and received == frames
    fake.connected = False
    header, frames = dumps(FakeArray(), context=_ctx())
    assert header == {"by": "value", transfer.ADVERT_KEY + "-offer": fake.advert()} and frames == [b"bytes"]
    assert loads(header, frames)[0] == "value" and fake.offers == [fake.advert()]
    assert dumps(FakeArray())[0] == {"by": "value"}  # no context: by value, no offer
    assert fake.counters["fallbacks"] == 2
    with pytest.raises(ValueError, match="is not a handle"):
        transfer.family_loads({transfer.ADVERT_KEY: 1}, [b"a", b"b"])
    with pytest.raises(NotImplementedError):
        transfer.family_dumps(object(), _ctx())


class Probe:
    """Serialized by the dask family with a function that records what the comm's context says about the
    recipient."""


def test_the_advert_reaches_the_senders_serializer_through_a_real_comm():
    """What the handle path rests on: a worker that advertises its endpoint in its connections' handshakes
    (``advertise``) is named in the ``context["recipient"]`` that distributed passes to the serializer of
    the reply written on that connection (as ``Worker.get_data`` replies to ``gather_dep``)."""
    from distributed.core import ConnectionPool, Server
    from distributed.protocol.serialize import dask_deserialize, dask_serialize, to_serialize

    @dask_serialize.register(Probe)
    def _dumps(x, context=None):
        rec = (context or {}).get("recipient", {})
        return {"seen": rec.get(transfer.ADVERT_KEY)}, []

    @dask_deserialize.register(Probe)
    def _loads(header, frames):
        return header["seen"]

    async def main():
        async def get(comm):
            return {"data": to_serialize(Probe())}

        server = Server({"get": get})
        await server.listen("tcp://127.0.0.1:0")
        pool = ConnectionPool()
        await pool.start()

        class W:
            rpc = pool

        try:
            before = await pool(server.address).get()
            transfer.advertise(W, FakeEndpoint())
            pool.remove(server.address)  # new connections carry the advert
            after = await pool(server.address).get()
        finally:
            await pool.close()
            server.stop()
        return before["data"], after["data"]

    before, after = asyncio.run(main())
    assert before is None
    assert after == FakeEndpoint().advert()


def test_advertise_keeps_other_handshake_overrides():
    class Pool:
        connection_args = {"handshake_overrides": {"pickle-protocol": 4}, "ssl": None}

    class W:
        rpc = Pool()

    transfer.advertise(W, FakeEndpoint())
    assert W.rpc.connection_args["handshake_overrides"]["pickle-protocol"] == 4
    assert W.rpc.connection_args["handshake_overrides"][transfer.ADVERT_KEY]["pid"] == 111
    assert "ssl" in W.rpc.connection_args


# -------------------------------------------------------------------------------------------------
# The bdb workload with NumPy.
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale, partitions", [(0.003, 1), (0.01, 4), (0.02, 7)])
def test_bdb_queries_match_the_naive_reference(scale, partitions):
    got = bdb.run_local(scale, partitions)
    want = bdb.reference(scale, partitions)
    bdb.check_equal(got, want, "numpy against the reference")
    assert sum(want["q1_sort_merge_join"]["revenue_by_category"]) > 0
    assert len(want["q3_filter_topk"]["top_rows"]) == bdb.TOPK
    # Some sales name keys that do not exist: the joins drop them.
    rows = bdb.sizes(scale)["store_sales"]
    assert sum(want["q2_hash_join"]["count_by_region"]) < rows


def test_bdb_results_do_not_depend_on_the_partitioning():
    a, b = bdb.run_local(0.01, 3), bdb.run_local(0.01, 5)
    # q1, q2 and q4 aggregate over all rows; q3's rows are global row numbers. Different partitionings draw
    # different data (the seed includes the partition count), so compare each to its own reference.
    bdb.check_equal(a, bdb.reference(0.01, 3))
    bdb.check_equal(b, bdb.reference(0.01, 5))
    with pytest.raises(AssertionError, match="q1_sort_merge_join.revenue_by_category differs"):
        bdb.check_equal(a, b)


def test_hash_table_with_colliding_keys_and_misses():
    keys = np.array([k << 32 for k in range(50)] + [3, 5, 7], dtype=np.int64)  # the low 32 bits collide
    t = bdb.HashTable(keys, np)
    assert t.rounds > 10
    probe = np.array([7, 3 << 32, 8, 49 << 32, 50 << 32, 5], dtype=np.int64)
    rows, ok = t.lookup(probe)
    assert ok.tolist() == [True, True, False, True, False, True]
    assert keys[rows[ok]].tolist() == [7, 3 << 32, 49 << 32, 5]
    with pytest.raises(ValueError, match="the 2 build keys have duplicates"):
        bdb.HashTable(np.array([1, 1], dtype=np.int64), np)


def test_group_sum_and_bounds():
    keys = np.array([3, 0, 3, 1, 3], dtype=np.int64)
    vals = np.array([1, 2, 3, 4, 5], dtype=np.int64)
    assert bdb.group_sum(keys, vals, 5, np).tolist() == [2, 4, 0, 9, 0]
    assert bdb.group_sum(keys[:0], vals[:0], 2, np).tolist() == [0, 0]
    assert bdb.partition_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError, match="partitions: 5 partitions for 4 rows"):
        bdb.partition_bounds(4, 5)
    with pytest.raises(ValueError, match="partitions: must be a positive integer"):
        bdb.partition_bounds(4, 0)
    with pytest.raises(ValueError, match="scale: must be more than 0"):
        bdb.sizes(0)


def test_bdb_over_a_dask_cluster_equals_the_local_run():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        run = bdb.run_dask(client, 0.01, 4, "numpy", repeats=2)
        with pytest.raises(ValueError, match="unknown query 'q9'"):
            bdb.run_dask(client, 0.01, 4, "numpy", ["q9"])
    bdb.check_equal(run["results"], bdb.run_local(0.01, 4), "dask against local")
    assert set(run["seconds"]) == set(bdb.QUERIES) and all(len(v) == 2 for v in run["seconds"].values())


def test_bdb_cli_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        bdb.main(["--queries", "q9"])
    assert "unknown query 'q9'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bdb.main(["--gpus", "2", "--xp", "numpy"])
    assert "--gpus needs --xp cupy" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------
# The endpoint's receiving side over a fake importer: connecting on offers, taking the buffer a frame
# names, stashing the others, releasing what waited too long.
# -------------------------------------------------------------------------------------------------


class FakeBuf:
    def __init__(self, id_):
        self.id = id_


class FakeImporter:
    made: list = []

    def __init__(self, path, timeout=5.0):
        if path.endswith("refused.sock"):
            from mempool import ipc

            raise ipc.PeerGoneError(f"nobody serves {path}")
        self.path, self.queue, self.closed = path, [], False
        FakeImporter.made.append(self)

    def recv(self, timeout=None):
        from mempool import ipc

        if self.queue == "gone":
            raise ipc.PeerGoneError("the exporter said Goodbye")
        if not self.queue:
            raise ipc.IpcTimeoutError(f"nothing within {timeout} s")
        return self.queue.pop(0)


class FakeExporter:
    def __init__(self):
        self.listed = []

    def importers(self):
        return self.listed

    def stats(self):
        return {"live_buffers": 0}


@pytest.fixture
def endpoint(monkeypatch):
    from mempool import ipc

    FakeImporter.made = []
    monkeypatch.setattr(ipc, "Importer", FakeImporter)
    ep = transfer.Endpoint(FakeExporter(), 0, "/tmp/mempool-dask-1-self.sock")
    return ep


def _connect_and_wait(ep, path):
    import time

    ep.offer({"v": 1, "host": ep.host, "pid": 9, "path": path})
    deadline = time.monotonic() + 5
    while (path in ep._connecting or path not in ep._importers) and time.monotonic() < deadline:
        if path not in ep._connecting and ep.counters["connect_failures"]:
            break
        time.sleep(0.001)


def test_offers_connect_once_and_again_after_a_close(endpoint):
    ep, peer = endpoint, "/tmp/mempool-dask-9-peer.sock"
    ep.offer({"v": 1, "host": "other-host/1", "pid": 9, "path": peer})  # another host: nothing
    ep.offer({"v": 1, "host": ep.host, "pid": 9, "path": ep.path})  # itself: nothing
    ep.offer({"v": 2, "host": ep.host, "pid": 9, "path": peer})  # not an advert: nothing
    assert not FakeImporter.made
    _connect_and_wait(ep, peer)
    _connect_and_wait(ep, peer)
    assert len(FakeImporter.made) == 1 and ep.counters["connects"] == 1
    FakeImporter.made[0].closed = True
    _connect_and_wait(ep, peer)
    assert len(FakeImporter.made) == 2 and ep._importers[peer] is FakeImporter.made[1]
    _connect_and_wait(ep, "/tmp/refused.sock")
    assert ep.counters["connect_failures"] == 1 and "/tmp/refused.sock" not in ep._importers
    _connect_and_wait(ep, "/tmp/refused.sock")  # failed a moment ago: not tried again yet
    assert ep.counters["connect_failures"] == 1
    ep._failed["/tmp/refused.sock"] -= transfer.RETRY_AFTER + 1
    _connect_and_wait(ep, "/tmp/refused.sock")
    assert ep.counters["connect_failures"] == 2
    assert ep.stats()["peers_imported"] == 1


def test_take_returns_the_named_buffer_and_stashes_the_others(endpoint, monkeypatch):
    from mempool import ipc

    ep, peer = endpoint, "/tmp/mempool-dask-9-peer.sock"
    _connect_and_wait(ep, peer)
    imp = ep._importers[peer]
    imp.queue = [FakeBuf(5), FakeBuf(6), FakeBuf(7)]
    h = lambda i: _handle(path=peer, buffer_id=i, host=ep.host)  # noqa: E731
    assert ep.take(h(7)).id == 7  # 5 and 6 arrived first: stashed
    assert sorted(k[1] for k in ep._stash) == [5, 6]
    assert ep.take(h(5)).id == 5 and imp.queue == []  # from the stash
    with pytest.raises(ipc.IpcTimeoutError, match="buffer 8 from /tmp/mempool-dask-9-peer.sock did not arrive"):
        ep.take(h(8), timeout=0.01)
    monkeypatch.setattr(transfer, "STASH_TTL", 0.0)
    import time

    time.sleep(0.01)
    imp.queue = [FakeBuf(9)]
    assert ep.take(h(9)).id == 9
    assert ep._stash == {} and ep.counters["stash_expired"] == 1  # buffer 6 waited too long: released
    imp.queue = "gone"
    with pytest.raises(ipc.PeerGoneError):
        ep.take(h(10))
    assert peer not in ep._importers
    with pytest.raises(ipc.IpcError, match="has no connection to that endpoint"):
        ep.take(h(11))


def test_take_waits_for_a_connection_in_progress(endpoint):
    import threading
    import time

    ep, peer = endpoint, "/tmp/mempool-dask-9-late.sock"
    ep._connecting.add(peer)

    def finish():
        time.sleep(0.05)
        imp = FakeImporter(peer)
        imp.queue = [FakeBuf(3)]
        with ep._lock:
            ep._importers[peer] = imp
            ep._recv_locks[peer] = threading.Lock()
            ep._connecting.discard(peer)

    threading.Thread(target=finish).start()
    assert ep.take(_handle(path=peer, buffer_id=3, host=ep.host), timeout=5).id == 3


def test_importer_ids_and_receive_refusing_another_host(endpoint):
    ep = endpoint
    ep.exporter.listed = [{"id": 3, "pid": 9}, {"id": 8, "pid": 9}, {"id": 4, "pid": 10}]
    assert ep.importer_id(9) == 8 and ep.importer_id(10) == 4 and ep.importer_id(11) is None
    with pytest.raises(ValueError, match="a handle from host 'elsewhere/1' reached host"):
        ep.receive(_handle(host="elsewhere/1"))
    assert ep.advert() == {"v": 1, "host": framing.host_id(), "pid": os.getpid(), "path": ep.path}


# -------------------------------------------------------------------------------------------------
# End to end over a real Dask cluster (TCP comms, workers in this process), with a fake array type and a
# fake endpoint standing in for the GPU: a worker that fetches data gets a handle frame through the wrapped
# `dask` serializer; the client, which advertises nothing, gets the value; an unconnected fetcher gets the
# value with an offer, and acts on it.
# -------------------------------------------------------------------------------------------------


class WireArray:
    """Stands for a CUDA array: its payload travels by value (bytes) or by handle (a registry here)."""

    def __init__(self, payload: bytes):
        self.payload = payload
        self.nbytes = len(payload)


_SENT: dict = {}


class WireEndpoint(FakeEndpoint):
    def send(self, kind, x, importer):
        buffer_id = len(_SENT) + 1
        _SENT[buffer_id] = x.payload
        self.sent.append((kind, importer))
        return framing.encode(_handle(path=self.path, sender_pid=self.pid, host=self.host, buffer_id=buffer_id))


def _make_wire(n):
    return WireArray(bytes(range(n % 256)) * 3)


def _payload(x):
    return x.payload


def test_a_real_cluster_carries_handles_to_advertised_fetchers_and_values_to_others(monkeypatch):
    from distributed import Client, LocalCluster
    from distributed.protocol.serialize import dask_deserialize, dask_serialize

    dask_serialize.register(WireArray, lambda x: ({}, [x.payload]))
    dask_deserialize.register(WireArray, lambda header, frames: WireArray(bytes(frames[0])))
    transfer._wrap(dask_serialize, dask_deserialize, WireArray, None)
    ep = WireEndpoint()
    monkeypatch.setattr(plugin._STATE, "ipc", ep)
    monkeypatch.setattr(transfer, "_kind", lambda x: "cupy" if isinstance(x, WireArray) else None)

    def receive(frame):
        return WireArray(_SENT[framing.decode(frame).buffer_id])

    monkeypatch.setattr(transfer, "receive_frame", receive)

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, protocol="tcp",
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        fetcher = next(w for w in cluster.workers.values() if w.address == b)
        advert = FakeEndpoint()
        advert.pid = 222  # the fetcher's advert (a different process, as on a real cluster)
        transfer.advertise(fetcher, advert)

        x = client.submit(_make_wire, 5, workers=[a], pure=False)
        assert client.submit(_payload, x, workers=[b], pure=False).result() == bytes(range(5)) * 3
        assert ep.sent == [("cupy", 42)], "the fetcher's copy went by handle"
        assert client.gather(x).payload == bytes(range(5)) * 3  # the client advertises nothing: by value
        assert len(ep.sent) == 1 and ep.counters["fallbacks"] == 1

        ep.connected = False  # a fetcher not connected yet: the value, with an offer it acts on
        y = client.submit(_make_wire, 7, workers=[a], pure=False)
        assert client.submit(_payload, y, workers=[b], pure=False).result() == bytes(range(7)) * 3
        assert ep.offers == [ep.advert()] and ep.counters["offers_sent"] == 1


# -------------------------------------------------------------------------------------------------
# One view of the cluster's memory.
# -------------------------------------------------------------------------------------------------


def _tiny_snapshot(live_bytes: int) -> dict:
    """A version-1 snapshot of one resource holding one live allocation of ``live_bytes`` (no GPU needed)."""
    cols = {"t_ns": [0], "op": [0], "resource": [0], "address": [0x1000], "size": [live_bytes], "stream": [0],
            "tag": [0], "thread": [1]}
    return {
        "schema": "mempool.snapshot", "version": 1, "created_unix_ns": 1764212345000000000, "source": "test",
        "devices": [{"ordinal": 0, "name": "Simulated GPU", "total_bytes": 80 << 30, "free_bytes": 60 << 30}],
        "tags": ["default"], "streams": [{"id": 0, "handle": "0x0", "label": "default"}],
        "resources": [{"id": 0, "parent": None, "name": "log", "kind": "RmmLog", "device": None,
                       "stats": {"live_bytes": live_bytes, "peak_live_bytes": live_bytes, "held_bytes": None,
                                 "peak_held_bytes": None, "allocations": 1, "frees": 0, "live_count": 1},
                       "per_stream": [{"stream": 0, "live_bytes": live_bytes, "free_bytes": 0}], "chunks": []}],
        "live": [{"resource": 0, "address": 0x1000, "size": live_bytes, "stream": 0, "tag": 0, "t_ns": 0}],
        "history": dict(cols, capacity=1, recorded=1, dropped=0),
    }


def test_cluster_snapshot_gathers_every_worker_into_one_document_and_page(monkeypatch, tmp_path):
    """mempool.dask.cluster_snapshot on a real (in-process) Dask cluster, the snapshot call replaced (no GPU
    here): one entry per worker address, with host, pid and device, checked by mempool's own checks, and the
    page written."""
    import json
    import socket

    from distributed import Client, LocalCluster

    import mempool.memory
    import mempool.mr

    sizes = iter([3 << 20, 5 << 20, 7 << 20])
    monkeypatch.setattr(mempool.memory, "snapshot", lambda mr=None, device=None: _tiny_snapshot(next(sizes)))
    monkeypatch.setattr(mempool.mr, "get_per_device_resource", lambda device: types.SimpleNamespace(name="Fake"))
    with LocalCluster(n_workers=2, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        page = tmp_path / "cluster.html"
        doc = md.cluster_snapshot(client, page)
        addrs = sorted(client.scheduler_info()["workers"])
    assert doc["schema"] == "mempool.cluster-snapshot" and doc["source"] == "dask"
    assert sorted(w["name"] for w in doc["workers"]) == addrs
    for w in doc["workers"]:
        assert w["address"] == w["name"] and w["host"] == socket.gethostname() and w["pid"] == os.getpid()
        assert w["device"] == 0 and w["device_name"] == "Simulated GPU"
    assert sorted(w["snapshot"]["live"][0]["size"] for w in doc["workers"]) == [3 << 20, 5 << 20]
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html") or "<html" in text[:200]
    for a in addrs:
        assert json.dumps(a)[1:-1] in text


def test_cluster_snapshot_without_workers_says_so():
    class NoWorkers:
        def run(self, f, workers=None):
            return {}

    with pytest.raises(ValueError, match="no workers to take snapshots of"):
        md.cluster_snapshot(NoWorkers())

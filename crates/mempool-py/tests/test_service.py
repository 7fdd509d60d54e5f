"""``mempool.mr.ServiceMemoryResource`` (mempool-rmm's ``ServiceResource``) and its tags.

The host tests (unmarked) check what holds without a GPU: the classes, their signatures, the arguments
refused before the driver is asked, the missing driver named. The GPU tests (marked ``gpu``; they fail,
never skip, without a GPU) allocate under tags, read the statistics, sleep and wake (contents restored at
the same address, device memory released), trim, and the errors of sleeping tags, unknown tags and modes.
"""

import gc
import inspect

import pytest

import mempool
from mempool import mr

MiB = 1 << 20


# ---------------------------------------------------------------------------------------------- host


def test_the_classes_are_resources_with_rmm_style_names():
    assert mr.ServiceMemoryResource is mempool._lib.ServiceMemoryResource
    assert issubclass(mr.ServiceMemoryResource, mr.DeviceMemoryResource)
    assert issubclass(mr.TaggedMemoryResource, mr.DeviceMemoryResource)
    assert "ServiceMemoryResource" in mr.__all__ and "TaggedMemoryResource" in mr.__all__
    for name in ("tag", "tagged", "sleep", "wake", "trim", "stats", "reset_peaks", "chunk_size", "tag_names"):
        assert hasattr(mr.ServiceMemoryResource, name), name
    with pytest.raises(TypeError):
        mr.TaggedMemoryResource()  # made by ServiceMemoryResource.tagged only


def test_signatures():
    params = inspect.signature(mr.ServiceMemoryResource).parameters
    assert list(params) == ["device", "max_tags", "chunk_size", "region_size", "watermark", "shareable"]
    assert params["device"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and params["device"].default is None
    defaults = {n: p.default for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert defaults == {"max_tags": 8, "chunk_size": None, "region_size": None, "watermark": 15, "shareable": None}
    sleep = inspect.signature(mr.ServiceMemoryResource.sleep).parameters
    assert list(sleep) == ["self", "tags", "mode", "stream"]
    assert sleep["mode"].default == "offload" and sleep["stream"].default is None
    wake = inspect.signature(mr.ServiceMemoryResource.wake).parameters
    assert list(wake) == ["self", "tags", "stream"] and wake["stream"].default is None


def test_arguments_are_checked_before_the_driver():
    with pytest.raises(ValueError, match="max_tags must be at least 1"):
        mr.ServiceMemoryResource(max_tags=0)
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        mr.ServiceMemoryResource(chunk_size=0)
    with pytest.raises(ValueError, match="region_size must be positive"):
        mr.ServiceMemoryResource(region_size=0)
    with pytest.raises(ValueError, match="watermark=10001"):
        mr.ServiceMemoryResource(watermark=10001)
    with pytest.raises(OverflowError):
        mr.ServiceMemoryResource(watermark=-1)
    with pytest.raises(OverflowError):
        mr.ServiceMemoryResource(-1)
    with pytest.raises(TypeError):
        mr.ServiceMemoryResource(max_tags="8")
    with pytest.raises(TypeError):
        mr.ServiceMemoryResource(0, 8)  # the options are keyword-only


def test_the_missing_driver_is_named(no_driver):
    if not no_driver:
        return  # the GPU tests below make one
    for call in (lambda: mr.ServiceMemoryResource(), lambda: mr.ServiceMemoryResource(0, watermark=None)):
        with pytest.raises(mempool.DriverNotFoundError, match="driver"):
            call()


# ----------------------------------------------------------------------------------------------- GPU


def _free_device_memory() -> int:
    import torch

    torch.cuda.init()
    return torch.cuda.mem_get_info(0)[0]


def _pattern(n: int, seed: int) -> bytes:
    return bytes((i * 131 + seed) % 251 for i in range(256)) * (n // 256)


@pytest.mark.gpu
def test_allocations_under_two_tags_and_statistics_per_tag():
    svc = mr.ServiceMemoryResource(0, region_size=1 << 30)
    assert svc.device == 0 and svc.name == "ServiceResource"
    assert svc.chunk_size >= 2 * MiB and svc.region_size == 1 << 30
    weights = svc.tagged("weights")
    kv = svc.tagged("kv-cache")
    assert isinstance(weights, mr.DeviceMemoryResource) and weights.upstream_mr is svc
    assert (weights.tag, weights.tag_name, kv.tag, kv.tag_name) == (1, "weights", 2, "kv-cache")
    assert svc.tag("weights") == 1 and svc.tag_names == ["default", "weights", "kv-cache"]
    assert svc.tagged(2).tag_name == "kv-cache"

    a = mempool.DeviceBuffer(size=3 * MiB, mr=weights)
    b = mempool.DeviceBuffer(size=1000, mr=kv)
    c = mempool.DeviceBuffer(size=100, mr=svc)  # the default tag
    s = svc.stats()
    t = s["tags"]
    assert list(t) == ["default", "weights", "kv-cache"]
    assert t["weights"]["live_allocations"] == 1 and t["weights"]["used_bytes"] >= 3 * MiB
    assert t["weights"]["mapped_bytes"] >= 3 * MiB and t["weights"]["mapped_bytes"] % svc.chunk_size == 0
    assert t["kv-cache"]["live_allocations"] == 1 and 1000 <= t["kv-cache"]["used_bytes"] < 3 * MiB
    assert t["default"]["live_allocations"] == 1 and t["default"]["tag"] == 0
    assert all(row["asleep"] is None and row["exports"] == 0 for row in t.values())
    assert s["used_bytes"] == sum(row["used_bytes"] for row in t.values())
    assert s["mapped_bytes"] == sum(row["mapped_bytes"] for row in t.values())
    assert s["peak_used_bytes"] >= s["used_bytes"] and s["chunk_size"] == svc.chunk_size
    assert s["reservation_bytes"] >= 3 << 30
    # The buffers lie in their tags' regions, in tag order.
    assert a.ptr < b.ptr and c.ptr < a.ptr

    a.copy_from_host(_pattern(3 * MiB, 1))
    assert a.tobytes() == _pattern(3 * MiB, 1)
    del b
    t = svc.stats()["tags"]["kv-cache"]
    assert (t["live_allocations"], t["allocations"], t["frees"], t["used_bytes"]) == (0, 1, 1, 0)
    assert t["peak_used_bytes"] >= 1000
    svc.reset_peaks()
    assert svc.stats()["tags"]["kv-cache"]["peak_used_bytes"] == 0
    del a, c


@pytest.mark.gpu
def test_a_tag_as_the_current_device_resource():
    svc = mr.ServiceMemoryResource(0, region_size=1 << 30)
    acts = svc.tagged("activations")
    old = mr.get_current_device_resource()
    mr.set_current_device_resource(acts)
    try:
        assert mr.get_current_device_resource() is acts
        buf = mempool.DeviceBuffer(size=5000)
        assert svc.stats()["tags"]["activations"]["live_allocations"] == 1
        del buf
    finally:
        mr.set_current_device_resource(old)
    assert svc.stats()["tags"]["activations"]["frees"] == 1


@pytest.mark.gpu
def test_sleep_offload_and_wake_restore_the_bytes_at_the_same_address():
    svc = mr.ServiceMemoryResource(0, region_size=1 << 30)
    weights = svc.tagged("weights")
    n = 64 * MiB + 4096  # not a whole number of chunks
    data = _pattern(n, 7)
    buf = mempool.DeviceBuffer(size=n, mr=weights)
    buf.copy_from_host(data)
    other = mempool.DeviceBuffer.to_device(b"\x05" * 4096, mr=svc)
    ptr = buf.ptr

    report = svc.sleep("weights", mode="offload")
    assert report["released_bytes"] >= n and report["offloaded_bytes"] >= n
    t = svc.stats()["tags"]
    assert t["weights"]["asleep"] == "offload" and t["weights"]["mapped_bytes"] == 0
    assert t["weights"]["offloaded_bytes"] == report["offloaded_bytes"]
    assert t["weights"]["live_allocations"] == 1  # the buffer stays, its memory does not
    assert t["default"]["asleep"] is None and other.tobytes() == b"\x05" * 4096  # other tags stay awake
    with pytest.raises(mempool.UnsupportedError, match="asleep"):
        mempool.DeviceBuffer(size=256, mr=weights)
    with pytest.raises(mempool.UnsupportedError, match="already asleep"):
        svc.sleep(["weights"], mode="discard")

    woken = svc.wake(["weights"])
    assert woken == {"mapped_bytes": report["offloaded_bytes"], "restored_bytes": report["offloaded_bytes"]}
    assert buf.ptr == ptr and buf.tobytes() == data
    assert svc.stats()["tags"]["weights"]["asleep"] is None
    # Waking an awake tag does nothing.
    assert svc.wake("weights") == {"mapped_bytes": 0, "restored_bytes": 0}
    # Allocating works again, and the buffer still reads back after another round by tag number.
    more = mempool.DeviceBuffer(size=1000, mr=weights)
    svc.sleep(weights.tag)
    svc.wake([weights.tag])
    assert buf.tobytes() == data
    del more, buf, other


@pytest.mark.gpu
def test_a_buffer_freed_while_its_tag_sleeps_goes_back_to_the_resource():
    # Issue 33: a free into a sleeping tag is taken (bookkeeping); before, it was refused, and a buffer
    # collected while its tag slept was lost to the resource for good.
    svc = mr.ServiceMemoryResource(0, region_size=1 << 30)
    t = svc.tagged("t")
    keep = mempool.DeviceBuffer.to_device(_pattern(4 * MiB, 3), mr=t)
    gone = mempool.DeviceBuffer(size=8 * MiB, mr=t)
    kept_mapped = svc.stats()["tags"]["t"]["mapped_bytes"]
    svc.sleep("t", mode="offload")
    del gone
    gc.collect()
    row = svc.stats()["tags"]["t"]
    assert row["asleep"] == "offload" and row["live_allocations"] == 1 and row["frees"] == 1, row
    woken = svc.wake("t")
    mapped = svc.stats()["tags"]["t"]["mapped_bytes"]
    assert woken["mapped_bytes"] == mapped < kept_mapped, (woken, mapped, kept_mapped)
    assert keep.tobytes() == _pattern(4 * MiB, 3)
    again = mempool.DeviceBuffer.to_device(b"\x09" * (8 * MiB), mr=t)  # its address space, mapped anew
    assert again.tobytes()[:4096] == b"\x09" * 4096
    del again, keep


@pytest.mark.gpu
def test_sleep_discard_gives_the_memory_back_to_the_device():
    svc = mr.ServiceMemoryResource(0, region_size=2 << 30)
    kv = svc.tagged("kv-cache")
    n = 512 * MiB
    buf = mempool.DeviceBuffer(size=n, mr=kv)
    ptr = buf.ptr
    mapped = svc.stats()["tags"]["kv-cache"]["mapped_bytes"]
    assert mapped >= n
    _free_device_memory()  # PyTorch's context first, so that it is not counted below
    before = _free_device_memory()
    report = svc.sleep(["kv-cache"], mode="discard")
    after = _free_device_memory()
    assert report == {"released_bytes": mapped, "offloaded_bytes": 0}
    assert after - before >= 0.99 * mapped, (before, after, mapped)
    assert svc.stats()["tags"]["kv-cache"]["asleep"] == "discard"

    woken = svc.wake("kv-cache")
    assert woken["restored_bytes"] == 0 and woken["mapped_bytes"] >= n
    assert _free_device_memory() <= after - 0.99 * n
    # Fresh memory at the same address: writable and readable again.
    assert buf.ptr == ptr
    buf.copy_from_host(b"\x11" * 4096)
    assert buf.tobytes()[:4096] == b"\x11" * 4096
    del buf


@pytest.mark.gpu
def test_trim_returns_the_idle_memory():
    svc = mr.ServiceMemoryResource(0, region_size=1 << 30, watermark=None)
    w = svc.tagged("w")
    bufs = [mempool.DeviceBuffer(size=4 * MiB, mr=w) for _ in range(4)]
    keep = mempool.DeviceBuffer.to_device(b"\x07" * 1000, mr=svc)
    mapped = svc.stats()["mapped_bytes"]
    assert mapped >= 16 * MiB
    del bufs
    # Nothing is unmapped on its own without a watermark.
    assert svc.stats()["mapped_bytes"] == mapped
    released = svc.trim()
    assert released >= 16 * MiB and released % svc.chunk_size == 0
    s = svc.stats()
    assert s["mapped_bytes"] == mapped - released and s["tags"]["w"]["mapped_bytes"] == 0
    assert s["reclaimed_bytes"] >= released
    assert svc.trim() == 0
    assert keep.tobytes() == b"\x07" * 1000  # the default tag's chunk is touched by `keep`: kept
    del keep


@pytest.mark.gpu
def test_tags_modes_and_streams_are_checked_with_clear_errors():
    import torch

    svc = mr.ServiceMemoryResource(0, max_tags=3, region_size=256 * MiB)
    svc.tag("a")
    svc.tag("b")
    with pytest.raises(ValueError, match="room for 3 tags"):
        svc.tag("c")
    with pytest.raises(ValueError, match="ASCII letters"):
        svc.tag("not a name")
    with pytest.raises(ValueError, match='no tag named "missing"'):
        svc.sleep("missing")
    with pytest.raises(ValueError, match="tag 7 is not one of"):
        svc.wake([0, 7])
    with pytest.raises(ValueError, match="tag -1 is negative"):
        svc.tagged(-1)
    with pytest.raises(ValueError, match='"offload"'):
        svc.sleep("a", mode="swap")
    with pytest.raises(TypeError, match="a tag is a name"):
        svc.sleep([1.5])
    with pytest.raises(TypeError, match="iterable of tags"):
        svc.wake(None)
    assert svc.stats()["tags"]["a"]["asleep"] is None  # nothing was put to sleep by the refusals

    # A stream with work still queued is refused; once it is done, the same call succeeds.
    a = svc.tagged("a")
    buf = mempool.DeviceBuffer(size=4096, mr=a)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
    with pytest.raises(mempool.UnsupportedError, match="work still queued"):
        svc.sleep("a", stream=s)
    assert svc.stats()["tags"]["a"]["asleep"] is None
    s.synchronize()
    assert svc.sleep("a", stream=s)["released_bytes"] >= 4096
    assert svc.wake("a", stream=s.cuda_stream)["mapped_bytes"] >= 4096
    del buf


@pytest.mark.gpu
def test_out_of_memory_names_what_the_resource_holds():
    svc = mr.ServiceMemoryResource(0, region_size=64 * MiB)
    w = svc.tagged("w")
    keep = mempool.DeviceBuffer(size=MiB, mr=w)
    with pytest.raises(mempool.OutOfMemoryError) as e:
        mempool.DeviceBuffer(size=128 * MiB, mr=w)
    text = str(e.value)
    for part in ("134217728 bytes", "`w`", "mapped", "live", "largest free block", "device has"):
        assert part in text, text
    assert isinstance(e.value, MemoryError)
    del keep

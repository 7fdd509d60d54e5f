"""A client process of the memory store GPU tests (test_store_gpu.py): ``python _store_child.py MODE PATH
NAME NBYTES SEED [--hold]``. Prints one JSON line per report on stdout (``{"ready": ...}`` when it holds and
waits for a line on stdin, then ``{"ok": true, ...}`` at the end); any failed check raises, so the process
exits non-zero with the traceback on stderr.

Modes:
- ``create``: creates NAME (NBYTES), writes the pattern of SEED through ``torch.from_dlpack`` on a PyTorch
  stream, publishes on that stream, checks that the tensor made from the created buffer still reads the
  pattern once both buffer objects are dropped, and exits.
- ``create-hold``: creates NAME and writes it, does not publish, reports ready and waits (to be killed).
- ``torch``: attaches NAME on a PyTorch stream, checks ``torch.from_dlpack`` views it with no copy (the same
  address) and reads the pattern; drops the buffer object and checks the view still reads it and the server
  still counts the attachment; drops the view and checks the attachment is gone. With ``--hold``: reports
  ready while holding a view, waits for a line on stdin, checks the bytes again, then exits.
- ``cupy``: the same with ``cupy.from_dlpack`` (and ``cupy.asarray`` over the CUDA array interface).
- ``torch-many``: ``attach_many`` of NAME0, NAME1, NAME2 (written with seeds SEED, SEED+1, SEED+2) on a
  PyTorch stream: with a missing name among them it raises ``UnknownNameError`` naming it and attaches
  nothing; then attaches all three, checks each ``torch.from_dlpack`` view (no copy) reads its pattern, and
  that dropping them ends the attachments.
- ``misc``: the errors and the buffer methods without a framework, under names NAME/x, NAME/y and NAME/z:
  protocol version 3, a create with an attach list (discarded), attach of an unknown name, a name taken, ``copy_from_host``/``tobytes``, ``discard`` before and after a view,
  publishing after a discard; deletes what it made.
"""

import gc
import json
import os
import sys

from mempool import ipc


def report(**kw):
    print(json.dumps(kw), flush=True)


def torch_pattern(torch, nbytes, seed):
    return ((torch.arange(nbytes, dtype=torch.int64, device="cuda") * 7 + seed) % 251).to(torch.uint8)


def cupy_pattern(cupy, nbytes, seed):
    return ((cupy.arange(nbytes, dtype=cupy.int64) * 7 + seed) % 251).astype(cupy.uint8)


def attachments(client):
    return client.stats()["attachments"]


def create(path, name, nbytes, seed, hold):
    import torch

    client = ipc.Client(path)
    stream = torch.cuda.Stream()
    buf = client.create(name, nbytes, device=0, tag="test")
    assert buf.size >= nbytes and buf.name == name, (buf.size, buf.name)
    with torch.cuda.stream(stream):
        t = torch.from_dlpack(buf)
        assert t.data_ptr() == buf.ptr and t.dtype == torch.uint8 and t.numel() == buf.size
        t[:nbytes].copy_(torch_pattern(torch, nbytes, seed))
    if hold:
        stream.synchronize()
        report(ready=True, ptr=buf.ptr)
        sys.stdin.readline()
        return
    published = buf.publish(stream)
    assert published.ptr == buf.ptr and published.size == buf.size and published.name == name
    try:
        buf.publish(stream)
        raise AssertionError("a second publish was accepted")
    except ipc.WrongStateError:
        pass
    held = attachments(client)
    del buf, published
    gc.collect()
    # The tensor made from the created buffer keeps the mapping (and the attachment).
    assert attachments(client) == held
    with torch.cuda.stream(stream):
        assert torch.equal(t[:nbytes], torch_pattern(torch, nbytes, seed))
    del t
    gc.collect()
    assert attachments(client) == held - 1, (attachments(client), held)
    info = {i.name: i for i in client.list()}[name]
    assert info.state == "published" and info.tag == "test" and info.size >= nbytes, info
    torch.cuda.synchronize()
    report(ok=True)


def attach_torch(path, name, nbytes, seed, hold):
    import torch

    client = ipc.Client(path)
    before = attachments(client)
    stream = torch.cuda.Stream()
    buf = client.attach(name, stream=stream)
    assert buf.stream == stream.cuda_stream and buf.name == name and buf.size >= nbytes
    assert attachments(client) == before + 1
    with torch.cuda.stream(stream):
        t = torch.from_dlpack(buf)
        assert t.data_ptr() == buf.ptr, "torch.from_dlpack copied"
        assert torch.equal(t[:nbytes], torch_pattern(torch, nbytes, seed))
    ptr = buf.ptr
    del buf
    gc.collect()
    # The view keeps the mapping after the buffer object is gone.
    assert attachments(client) == before + 1
    with torch.cuda.stream(stream):
        assert t.data_ptr() == ptr
        assert torch.equal(t[:nbytes], torch_pattern(torch, nbytes, seed))
    if hold:
        report(ready=True, ptr=ptr)
        sys.stdin.readline()
        with torch.cuda.stream(stream):
            assert torch.equal(t[:nbytes], torch_pattern(torch, nbytes, seed))
    del t
    gc.collect()
    assert attachments(client) == before, (attachments(client), before)
    report(ok=True, ptr=ptr)


def attach_cupy(path, name, nbytes, seed, hold):
    import cupy

    client = ipc.Client(path)
    before = attachments(client)
    stream = cupy.cuda.Stream(non_blocking=True)
    buf = client.attach(name, stream=stream)
    assert buf.stream == stream.ptr
    with stream:
        a = cupy.from_dlpack(buf)
        assert a.data.ptr == buf.ptr, "cupy.from_dlpack copied"
        assert bool((a[:nbytes] == cupy_pattern(cupy, nbytes, seed)).all())
        c = cupy.asarray(buf)  # the CUDA array interface
        assert c.data.ptr == buf.ptr, "cupy.asarray copied"
        assert bool((c[:nbytes] == a[:nbytes]).all())
    ptr = buf.ptr
    del buf, c
    gc.collect()
    assert attachments(client) == before + 1
    with stream:
        assert bool((a[:nbytes] == cupy_pattern(cupy, nbytes, seed)).all())
    if hold:
        report(ready=True, ptr=ptr)
        sys.stdin.readline()
        with stream:
            assert bool((a[:nbytes] == cupy_pattern(cupy, nbytes, seed)).all())
    stream.synchronize()
    del a
    gc.collect()
    assert attachments(client) == before, (attachments(client), before)
    report(ok=True, ptr=ptr)


def attach_many_torch(path, prefix, nbytes, seed, count):
    import torch

    client = ipc.Client(path)
    before = attachments(client)
    stream = torch.cuda.Stream()
    names = [f"{prefix}{i}" for i in range(count)]
    assert client.attach_many([], stream=stream) == []
    missing = prefix + "missing"
    try:
        client.attach_many(names[:1] + [missing] + names[1:], stream=stream)
        raise AssertionError("attach_many of a missing name succeeded")
    except ipc.UnknownNameError as e:
        assert missing in str(e), str(e)
    assert attachments(client) == before, (attachments(client), before)
    bufs = client.attach_many(names, stream=stream)
    assert [b.name for b in bufs] == names
    assert all(b.stream == stream.cuda_stream and b.size >= nbytes for b in bufs)
    assert len({b.ptr for b in bufs}) == count
    assert attachments(client) == before + count
    with torch.cuda.stream(stream):
        views = [torch.from_dlpack(b) for b in bufs]
        for i, (b, t) in enumerate(zip(bufs, views)):
            assert t.data_ptr() == b.ptr, "torch.from_dlpack copied"
            assert torch.equal(t[:nbytes], torch_pattern(torch, nbytes, seed + i)), f"buffer {b.name}"
    stream.synchronize()
    del bufs, views, b, t  # the loop's own names hold the last buffer and view too
    gc.collect()
    assert attachments(client) == before, (attachments(client), before)
    report(ok=True)


def create_group(path, prefix, nbytes, seed, count):
    """Creates ``count`` buffers of ``nbytes`` as one group, writes member ``i`` with the pattern of
    ``seed + i`` through PyTorch, checks the layout and a host copy of one member, and publishes them."""
    import torch

    client = ipc.Client(path)
    stream = torch.cuda.Stream()
    names = [f"{prefix}{i}" for i in range(count)]
    try:
        client.create_many(names, [nbytes] * (count - 1), device=0)
        raise AssertionError("create_many with a size missing was accepted")
    except ValueError:
        pass
    bufs = client.create_many(names, [nbytes] * count, device=0, tag="group")
    assert [b.name for b in bufs] == names
    # Back to back in the group's one mapping (nbytes is a multiple of the granularity).
    assert [b.ptr - bufs[0].ptr for b in bufs] == [i * nbytes for i in range(count)]
    with torch.cuda.stream(stream):
        for i, b in enumerate(bufs):
            t = torch.from_dlpack(b)
            assert t.data_ptr() == b.ptr and t.numel() == b.size == nbytes, (t.data_ptr(), b.ptr, b.size)
            t.copy_(torch_pattern(torch, nbytes, seed + i))
    stream.synchronize()
    # A host copy reads the member's own bytes, not the group's from its start.
    host = torch.frombuffer(bytearray(bufs[1].tobytes()), dtype=torch.uint8)
    assert torch.equal(host, torch_pattern(torch, nbytes, seed + 1).cpu())
    published = [b.publish(stream) for b in bufs]
    assert [p.ptr for p in published] == [b.ptr for b in bufs]
    del t, b, bufs, published
    gc.collect()
    assert attachments(client) == 0, client.stats()
    report(ok=True)


def misc(path, name, nbytes, seed):
    client = ipc.Client(path)
    assert client.protocol_version == 3, client.protocol_version
    # An attach list travels with create (who is in it is the server's to enforce: the host tests).
    widened = client.create(name + "/z", 4096, device=0, attach_uids=[os.getuid() + 1, 65534])
    widened.discard()
    try:
        client.attach(name + "/nobody")
        raise AssertionError("attached a name nobody created")
    except ipc.UnknownNameError:
        pass
    created = client.create(name + "/x", 1, device=0)
    assert created.size >= 1 and created.size % (2 << 20) == 0, created.size
    try:
        client.create(name + "/x", 4096, device=0)
        raise AssertionError("a taken name was created again")
    except ipc.NameTakenError:
        pass
    created.copy_from_host(bytes([1, 2, 3, seed % 256]), offset=5)
    assert created.tobytes()[5:9] == bytes([1, 2, 3, seed % 256])
    created.discard()  # no view was made: deleted now
    try:
        created.publish()
        raise AssertionError("a discarded buffer was published")
    except ipc.WrongStateError:
        pass
    try:
        client.delete(name + "/x")
        raise AssertionError("a discarded buffer was still named")
    except ipc.UnknownNameError:
        pass
    created = client.create(name + "/y", 4096, device=0)
    created.__cuda_array_interface__  # a view may exist from here on
    try:
        created.discard()
        raise AssertionError("discard with views was accepted")
    except BufferError:
        pass
    created.copy_from_host(b"abc")
    attached = created.publish()
    assert attached.ptr == created.ptr and attached.tobytes()[:3] == b"abc"
    del created, attached
    gc.collect()
    assert attachments(client) == 0, client.stats()
    client.delete(name + "/y")
    report(ok=True)


def main():
    mode, path, name, nbytes, seed = sys.argv[1:6]
    hold = "--hold" in sys.argv[6:]
    nbytes, seed = int(nbytes), int(seed)
    if mode == "create":
        create(path, name, nbytes, seed, False)
    elif mode == "create-hold":
        create(path, name, nbytes, seed, True)
    elif mode == "torch":
        attach_torch(path, name, nbytes, seed, hold)
    elif mode == "cupy":
        attach_cupy(path, name, nbytes, seed, hold)
    elif mode == "torch-many":
        attach_many_torch(path, name, nbytes, seed, 3)
    elif mode == "group":
        create_group(path, name, nbytes, seed, 3)
    elif mode == "misc":
        misc(path, name, nbytes, seed)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()

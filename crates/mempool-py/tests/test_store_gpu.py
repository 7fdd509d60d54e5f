"""mempool.ipc's memory store on the GPU (marker ``gpu``): a server in this process (``mempool.ipc.serve``)
and client processes (tests/_store_child.py, started with ``sys.executable``) that create, write, publish
and attach named buffers through PyTorch and CuPy.

- A creator process writes a buffer through ``torch.from_dlpack``, publishes it on its PyTorch stream and
  exits; fresh processes attach it by name and read the same bytes through ``torch.from_dlpack`` and
  ``cupy.from_dlpack`` (and the CUDA array interface) at the buffer's own address (no copy); a view keeps
  the mapping (and the server's attachment) after the buffer object is dropped, and dropping the last view
  ends the attachment (checked in the children).
- A client killed with SIGKILL while holding views, and one killed while writing an unpublished buffer:
  the server's counters return to their baseline, and the published buffer is still there, with the same
  bytes, for the next process.
- ``Client.attach_many``: three buffers attached in one call in a fresh process, all or nothing (a missing
  name raises ``UnknownNameError`` naming it and nothing stays attached), each viewed by PyTorch with no copy.
- ``Client.create_many``: a group of three buffers made in one process (back to back in one mapping, each
  written through PyTorch at its own address), attached by ``attach_many`` in a fresh process.
- Deleting a buffer while a process holds it attached: the name goes at once (``attach`` raises
  ``UnknownNameError``), the holder still reads its bytes, the server's counters show the buffer and its
  bytes as lingering, and the memory is freed when it lets go.

This process only serves and makes host calls (list, delete, stats): every mapping and event is in a
child, never in the server's own process. Nothing here times anything; the waits for the server to notice
a process's exit poll its counters (up to ``TIMEOUT`` seconds). The last test runs docs/memory-store.md's
Python block in a child against a server on the block's path.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from mempool import ipc

pytestmark = pytest.mark.gpu

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_store_child.py")
#: Seconds a child may take (it imports PyTorch or CuPy and starts CUDA), and the server to notice an exit.
TIMEOUT = 120
#: A multiple of every GPU's VMM granularity (2 MiB on current GPUs): the size is not rounded.
NBYTES = 8 << 20


@pytest.fixture(scope="module")
def server():
    path = os.path.join(tempfile.mkdtemp(prefix="mempool-store-gpu-"), "svc.sock")
    with ipc.serve(path, devices=[0]) as s:
        yield s
    assert not os.path.exists(path)


def run_child(server, mode, name, seed, *extra):
    done = subprocess.run(
        [sys.executable, CHILD, mode, server.path, name, str(NBYTES), str(seed), *extra],
        capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert done.returncode == 0, f"{mode} child failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert reports and reports[-1].get("ok"), done.stdout
    return reports[-1]


class Held:
    """A child that reports ready and waits for a line on stdin (``release``) or a signal (``kill``)."""

    def __init__(self, server, mode, name, seed):
        self.proc = subprocess.Popen(
            [sys.executable, CHILD, mode, server.path, name, str(NBYTES), str(seed), "--hold"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            self.proc.kill()
            out, err = self.proc.communicate(timeout=TIMEOUT)
            pytest.fail(f"{mode} child did not get ready:\n{line}{out}\n{err}")
        self.ready = json.loads(line)

    def release(self):
        out, err = self.proc.communicate("go\n", timeout=TIMEOUT)
        assert self.proc.returncode == 0, f"held child failed ({self.proc.returncode}):\n{out}\n{err}"
        return json.loads(out.splitlines()[-1])

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.communicate(timeout=TIMEOUT)
        assert self.proc.returncode == -signal.SIGKILL


def wait_for(server, **expected):
    """Polls the server's counters until each of ``expected`` has its value; fails after TIMEOUT seconds."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        stats = server.stats()
        if all(stats[k] == v for k, v in expected.items()):
            return stats
        if time.monotonic() > deadline:
            pytest.fail(f"the server's counters did not reach {expected}: {stats}")
        time.sleep(0.05)


def baseline(server):
    """The counters once no client is connected: (buffers, bytes, named)."""
    stats = wait_for(server, connections=0, attachments=0)
    return {k: stats[k] for k in ("buffers", "bytes", "named")}


def back_to(server, base):
    """Waits until no client is connected and the buffers, bytes and names are those of ``base``."""
    wait_for(server, connections=0, attachments=0, **base)


def test_publish_then_attach_in_fresh_processes_with_torch_and_cupy(server):
    base = baseline(server)
    run_child(server, "create", "t1/weights", 11)
    after_create = wait_for(server, connections=0, attachments=0, named=base["named"] + 1)
    assert after_create["bytes"] == base["bytes"] + NBYTES
    torch_seen = run_child(server, "torch", "t1/weights", 11)
    cupy_seen = run_child(server, "cupy", "t1/weights", 11)
    assert torch_seen["ptr"] and cupy_seen["ptr"]
    # A restarted client finds the same bytes again.
    run_child(server, "torch", "t1/weights", 11)
    client = ipc.Client(server.path)
    [info] = [i for i in client.list() if i.name == "t1/weights"]
    assert (info.state, info.size, info.tag, info.attachments) == ("published", NBYTES, "test", 0)
    assert info.device_uuid in client.devices
    client.delete("t1/weights")
    with pytest.raises(ipc.UnknownNameError):
        client.delete("t1/weights")
    del client
    back_to(server, base)


def test_a_client_killed_holding_views_is_reclaimed(server):
    base = baseline(server)
    run_child(server, "create", "t2/w", 22)
    for mode in ("torch", "cupy"):
        held = Held(server, mode, "t2/w", 22)
        wait_for(server, attachments=1)
        held.kill()
        wait_for(server, connections=0, attachments=0)
    # The buffer outlived its killed holders; a restarted client reads the same bytes.
    run_child(server, "torch", "t2/w", 22)
    client = ipc.Client(server.path)
    client.delete("t2/w")
    del client
    back_to(server, base)


def test_a_creator_killed_before_publishing_is_reclaimed(server):
    base = baseline(server)
    held = Held(server, "create-hold", "t3/unpublished", 33)
    client = ipc.Client(server.path)
    [info] = [i for i in client.list() if i.name == "t3/unpublished"]
    assert info.state == "creating" and info.owner_pid == held.proc.pid
    with pytest.raises(ipc.WrongStateError):
        client.attach("t3/unpublished")
    held.kill()
    del client
    back_to(server, base)
    client = ipc.Client(server.path)
    assert "t3/unpublished" not in [i.name for i in client.list()]
    del client


def test_delete_while_attached(server):
    base = baseline(server)
    run_child(server, "create", "t4/w", 44)
    held = Held(server, "torch", "t4/w", 44)
    client = ipc.Client(server.path)
    client.delete("t4/w")
    assert "t4/w" not in [i.name for i in client.list()]
    with pytest.raises(ipc.UnknownNameError):
        client.attach("t4/w")
    # The name is free again while the old memory is still held, and shows as lingering (charged to the
    # holder's uid, not the owner's).
    stats = server.stats()
    assert stats["named"] == base["named"] and stats["buffers"] == base["buffers"] + 1
    assert (stats["lingering_buffers"], stats["lingering_bytes"]) == (1, NBYTES), stats
    assert held.release()["ok"]  # it read the same bytes after the delete
    del client
    back_to(server, base)
    stats = server.stats()
    assert (stats["lingering_buffers"], stats["lingering_bytes"]) == (0, 0), stats


def test_errors_and_buffer_methods(server):
    base = baseline(server)
    run_child(server, "misc", "t5", 55)
    back_to(server, base)


def test_attach_many_in_a_fresh_process(server):
    base = baseline(server)
    for i in range(3):
        run_child(server, "create", f"t6/w{i}", 60 + i)
    wait_for(server, connections=0, attachments=0, named=base["named"] + 3)
    run_child(server, "torch-many", "t6/w", 60)
    client = ipc.Client(server.path)
    for i in range(3):
        client.delete(f"t6/w{i}")
    del client
    back_to(server, base)


def test_a_group_created_with_create_many_is_attached_in_a_fresh_process(server):
    base = baseline(server)
    run_child(server, "group", "t7/g", 70)
    after = wait_for(server, connections=0, attachments=0, named=base["named"] + 3)
    assert after["bytes"] == base["bytes"] + 3 * NBYTES
    run_child(server, "torch-many", "t7/g", 70)
    client = ipc.Client(server.path)
    infos = {i.name: i for i in client.list()}
    assert [infos[f"t7/g{i}"].tag for i in range(3)] == ["group"] * 3
    for i in range(3):
        client.delete(f"t7/g{i}")
    del client
    back_to(server, base)


def test_the_docs_python_block_runs():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_store import python_blocks

    [code] = python_blocks()
    path = "/tmp/mempool-weights.sock"  # the block's path
    with ipc.serve(path, devices=[0]) as server:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT,
                              cwd=tempfile.mkdtemp())
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
        assert "demo/w" in done.stdout and 'no buffer is named "demo/nope"' in done.stdout, done.stdout
        back_to(server, {"buffers": 0, "bytes": 0, "named": 0})

"""Consumer processes of test_ipc.py, started with multiprocessing in spawn mode (a module of its own, so
that the spawned child can import the functions by name). Each reports through a queue: ("ok", details) or
("error", traceback text), so that a failure in the child shows in the parent's assertion message."""

import gc
import os
import pickle
import time
import traceback

# What the children wait at most: a failure must cost the test run seconds, not minutes (test_ipc.py
# waits a little longer for their reports).
TIMEOUT = 20


def _report(queue, fn):
    try:
        queue.put(("ok", fn()))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put(("error", f"pid {os.getpid()}:\n{traceback.format_exc()}"))


def view_and_check(path, framework, expected_len, queue):
    """Receives one buffer, views it with `framework` (torch or cupy) through DLPack, checks it is the same
    memory, and reports its size, the sum of its bytes and its first bytes; then waits for the exporter to
    go and reports the class of the error that says so."""

    def run():
        from mempool import ipc

        importer = ipc.Importer(path, timeout=TIMEOUT)
        buf = importer.recv(timeout=TIMEOUT)
        if framework == "torch":
            import torch

            t = torch.from_dlpack(buf)
            same = t.data_ptr() == buf.ptr
            total = int(t.to(torch.int64).sum().item())
            head = bytes(t[:16].cpu().tolist())
        else:
            import cupy

            t = cupy.from_dlpack(buf)
            same = int(t.data.ptr) == buf.ptr
            total = int(t.astype(cupy.int64).sum().get())
            head = bytes(t[:16].get().tolist())
        details = {"size": buf.size, "len": int(t.shape[0]), "same_memory": same, "sum": total, "head": head,
                   "held": importer.held, "device": buf.device, "expected_len": expected_len}
        del t, buf
        gc.collect()
        details["held_after_gc"] = importer.held
        queue.put(("ok", details))
        # The parent closes its exporter next: recv() must say the exporter is gone.
        try:
            importer.recv(timeout=TIMEOUT)
            return "received a second buffer"
        except ipc.PeerGoneError as e:
            return f"PeerGoneError: {e}"
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"

    _report(queue, run)


def hold_until_told(path, commands, queue):
    """Receives one buffer, keeps only a torch view of it (the ImportedBuffer object itself is dropped),
    reports, then drops the view when told and reports again. (`queue` comes last, as `_spawn` in
    test_ipc.py appends it after the other arguments.)"""

    def run():
        import torch

        from mempool import ipc

        importer = ipc.Importer(path, timeout=TIMEOUT)
        buf = importer.recv(timeout=TIMEOUT)
        t = torch.from_dlpack(buf)
        buf_id = buf.id
        del buf
        gc.collect()
        queue.put(("ok", {"id": buf_id, "held_with_view": importer.held, "first": int(t[0].item())}))
        assert commands.get(timeout=TIMEOUT) == "drop"
        del t
        gc.collect()
        return {"held_after_drop": importer.held}

    _report(queue, run)


def receive_and_hang(path, queue):
    """Receives one buffer, views and writes it with torch, reports, then sleeps until killed."""

    def run():
        import torch

        from mempool import ipc

        importer = ipc.Importer(path, timeout=TIMEOUT)
        buf = importer.recv(timeout=TIMEOUT)
        t = torch.from_dlpack(buf)
        t.fill_(7)
        torch.cuda.synchronize()
        queue.put(("ok", {"id": buf.id, "size": buf.size}))
        time.sleep(600)
        return "not killed"

    _report(queue, run)


def receive_many(path, count, queue):
    """Receives `count` buffers and reports their contents and how many blocks were imported."""

    def run():
        from mempool import ipc

        importer = ipc.Importer(path, timeout=TIMEOUT)
        bufs = [importer.recv(timeout=TIMEOUT) for _ in range(count)]
        refused = []
        for obj in (importer, bufs[0]):
            try:
                pickle.dumps(obj)
                refused.append("pickled")
            except TypeError as e:
                refused.append(str(e))
        return {"contents": [b.tobytes() for b in bufs], "blocks": importer.imported_blocks,
                "held": importer.held, "pickle_errors": refused}

    _report(queue, run)


def view_range_until_told(path, commands, queue):
    """Receives a service resource's range (Exporter.share_range), views it with torch through DLPack,
    checks it is the same memory, sums it on the GPU, adds 1 to every byte, reports; drops it when told and
    reports again."""

    def run():
        import torch

        from mempool import ipc

        importer = ipc.Importer(path, timeout=TIMEOUT, accept_ranges=True)
        r = importer.recv(timeout=TIMEOUT)
        t = torch.from_dlpack(r)
        details = {"type": type(r).__name__, "id": r.id, "size": r.size, "len": int(t.shape[0]),
                   "chunks": r.chunks, "chunk_sizes": r.chunk_sizes, "same_memory": t.data_ptr() == r.ptr,
                   "sum": int(t.to(torch.int64).sum().item()), "head": bytes(t[:16].cpu().tolist()),
                   "held": importer.held}
        t.add_(1)
        torch.cuda.synchronize()
        queue.put(("ok", details))
        assert commands.get(timeout=TIMEOUT) == "drop"
        del t, r
        gc.collect()
        return {"held_after_drop": importer.held}

    _report(queue, run)


def view_range_and_hang(path, queue):
    """Receives a service resource's range, views and writes it with torch, reports, then sleeps until
    killed."""

    def run():
        import torch

        from mempool import ipc

        importer = ipc.Importer(path, timeout=TIMEOUT, accept_ranges=True)
        r = importer.recv(timeout=TIMEOUT)
        t = torch.from_dlpack(r)
        t.fill_(9)
        torch.cuda.synchronize()
        queue.put(("ok", {"id": r.id, "size": r.size}))
        time.sleep(600)
        return "not killed"

    _report(queue, run)


def recv_many_add_one(path, rings, count, queue):
    """Receives `count` buffers with recv_many (rings as asked), checks on the GPU (torch) that every byte
    of each equals its first, adds 1 to every byte on the GPU, synchronizes and lets go of them; reports
    the first bytes in arrival order, how many calls it took and whether the rings were used."""

    def run():
        import torch

        from mempool import ipc

        importer = ipc.Importer(path, timeout=TIMEOUT, rings=rings)
        firsts, uniform, calls = [], [], 0
        while len(firsts) < count:
            bufs = importer.recv_many(max=count - len(firsts), timeout=TIMEOUT)
            calls += 1
            for b in bufs:
                t = torch.from_dlpack(b)
                firsts.append(int(t[0].item()))
                uniform.append(bool(torch.all(t == t[0]).item()))
                t.add_(1)
                del t
            torch.cuda.synchronize()
            del bufs, b
            gc.collect()
        return {"firsts": firsts, "uniform": uniform, "calls": calls, "rings": importer.rings,
                "held": importer.held}

    _report(queue, run)


def recv_part_of_a_batch_and_hang(path, queue):
    """Receives part of a batch (recv_many with max=2), writes it with torch, reports, then sleeps until
    killed."""

    def run():
        import torch

        from mempool import ipc

        importer = ipc.Importer(path, timeout=TIMEOUT)
        bufs = importer.recv_many(max=2, timeout=TIMEOUT)
        for b in bufs:
            torch.from_dlpack(b).fill_(7)
        torch.cuda.synchronize()
        queue.put(("ok", {"ids": [b.id for b in bufs], "rings": importer.rings}))
        time.sleep(600)
        return "not killed"

    _report(queue, run)

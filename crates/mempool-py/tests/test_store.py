"""mempool.ipc's memory store (``Client``, ``serve``): host tests, no GPU.

The module's surface, the stubs, name validation, argument checks, connecting to a path nobody serves, and a
``Client`` against a fake server written here (a thread speaking the service's protocol, docs/memory-store.md
"The protocol"): the Welcome handshake in protocol version 3, and with a server of version 2 (which refuses
a version-3 Hello: the client connects again in version 2), ``stats()``, ``list()`` and its ``BufferInfo``s,
every refusal the server can send mapped to its Python class (the connection staying usable after each),
attach lists checked before anything is sent, a server that closes the connection (``ServerGoneError`` then
and for every later call) and one that never answers (a timeout).
The GPU tests are in ``test_store_gpu.py``.
"""

import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading

import pytest

import mempool
from mempool import ipc

# An exception in a thread of this file (the fake server's) fails the test it happened in, instead of
# passing with a warning: a use of a closed socket is a bug of the test's own.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")

HELLO, CREATE, PUBLISH, ATTACH, DETACH, DELETE, LIST, STATS = 1, 2, 3, 4, 5, 6, 7, 8
WELCOME, GRANTED, DONE, LIST_PAGE, STATS_REPLY, REFUSED = 64, 65, 66, 67, 68, 69

UUID = bytes(range(16))


def _frame(kind, body=b"", version=3):
    return b"MPMS" + struct.pack("<HHI", version, kind, len(body)) + body


def _str(s):
    b = s.encode()
    return struct.pack("<H", len(b)) + b


def _refused(code, name="", uid=0, scope=0, kind=0, state=0, numbers=(0, 0, 0), text="", version=3):
    body = struct.pack("<HIBBB3Q", code, uid, scope, kind, state, *numbers) + _str(name) + _str(text)
    return _frame(REFUSED, body, version)


def _recv_exact(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


class FakeServer:
    """A server on a temporary socket path that answers Hello with a Welcome (one GPU), then each request with
    ``self.reply(kind, body)`` (bytes to send, or None to close the connection), in frames of the Hello's
    protocol version. ``welcome=False``: it accepts and never answers. ``version=2``: a server of protocol
    version 2, which refuses a frame of any other version (``Protocol``, in a version-2 frame) and closes that
    connection, as version 2's did. It serves its connections one after the other; ``hellos`` lists the
    versions of the Hellos it got.

    ``close()`` shuts the sockets down (which wakes the thread from a blocked ``accept`` or ``recv``), joins the
    thread, and only then closes them: a socket closed under a thread that still uses it is a use of a closed
    descriptor (``EBADF``, or worse, another file that took its number). A socket error in the thread before
    ``close()`` is re-raised there, and this file turns thread exceptions into failures."""

    def __init__(self, welcome=True, version=3):
        self.dir = tempfile.mkdtemp(prefix="mempool-store-test-")
        self.path = os.path.join(self.dir, "svc.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(4)
        self.welcome = welcome
        self.version = version
        self.hellos = []
        self.requests = []
        self.conns = []
        self.lock = threading.Lock()
        self.closing = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self._serve()
        except OSError:
            # After close() shut the sockets down, an accept or a send fails: that is the end.
            if not self.closing:
                raise

    def _serve(self):
        while self._converse():
            pass

    def _converse(self):
        """Serves one connection; returns whether to accept another."""
        conn, _ = self.sock.accept()
        with self.lock:
            if self.closing:
                conn.close()
                return False
            self.conns.append(conn)
        spoken = None
        while True:
            header = _recv_exact(conn, 12)
            if header is None:
                return False
            assert header[:4] == b"MPMS"
            version, kind, length = struct.unpack("<HHI", header[4:])
            if self.version == 2 and version != 2:
                # What a server of version 2 does with a frame of another version.
                conn.sendall(_refused(13, text=f"protocol version {version}, this side speaks version 2", version=2))
                conn.shutdown(socket.SHUT_RDWR)
                return True
            body = _recv_exact(conn, length) if length else b""
            self.requests.append((kind, body))
            if kind == HELLO:
                self.hellos.append(version)
                spoken = version
                if not self.welcome:
                    continue
                out = _frame(WELCOME, struct.pack("<IH", 4242, 1) + UUID + struct.pack("<Q", 2 << 20), spoken)
            else:
                assert version == spoken, f"a version-{version} frame on a version-{spoken} connection"
                out = self.reply(kind, body, spoken)
            if out is None:
                # The client sees the connection end now (the socket is closed by close(), after the join).
                conn.shutdown(socket.SHUT_RDWR)
                return False
            conn.sendall(out)

    def reply(self, kind, body, version):
        if kind == STATS:
            numbers = (1, 2 << 20, 1, 3, 2, 5, 6, 8, 9)[: 9 if version >= 3 else 7]
            return _frame(STATS_REPLY, struct.pack(f"<{len(numbers)}Q", *numbers), version)
        if kind == LIST:
            entry = (_str("weights/a") + struct.pack("<Q", 2 << 20) + UUID + _str("bf16")
                     + struct.pack("<BIIIBQ", 1, os.getuid(), 777, 2, 1, 1500))
            entry2 = (_str("weights/b") + struct.pack("<Q", 4 << 20) + UUID + _str("")
                      + struct.pack("<BIIIBQ", 0, os.getuid(), 778, 1, 0, 0))
            return _frame(LIST_PAGE, struct.pack("<BH", 0, 2) + entry + entry2, version)
        if kind == DELETE:
            name = body[2:].decode()
            code = int(name.split("-")[1])
            return _refused(code, name=name, uid=os.getuid(), numbers=(10, 8, 4), text="delete a buffer of uid 0",
                            version=version)
        return None

    def close(self):
        with self.lock:
            self.closing = True
            conns = list(self.conns)
        for s in (self.sock, *conns):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected: the client is gone already
        self.thread.join(timeout=20)
        assert not self.thread.is_alive(), "the fake server's thread did not end after its sockets were shut down"
        for s in (self.sock, *conns):
            s.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.close()


def test_module_surface():
    for name in ("Client", "CreatedBuffer", "AttachedBuffer", "BufferInfo", "MemoryStoreServer", "serve", "validate_name"):
        assert getattr(ipc, name) is getattr(mempool._lib, name), name
        assert name in ipc.__all__, name
    for name in ("create", "create_many", "attach", "attach_many", "delete", "list", "stats", "path", "server_pid",
                 "devices", "protocol_version"):
        assert hasattr(ipc.Client, name), name
    for cls in (ipc.CreatedBuffer, ipc.AttachedBuffer):
        for name in ("ptr", "size", "device", "name", "stream", "tobytes", "copy_from_host",
                     "__cuda_array_interface__", "__dlpack__", "__dlpack_device__"):
            assert hasattr(cls, name), (cls, name)
        assert "__reduce__" in vars(cls)
    assert hasattr(ipc.CreatedBuffer, "publish") and hasattr(ipc.CreatedBuffer, "discard")
    assert not hasattr(ipc.AttachedBuffer, "publish")
    for name in ("name", "size", "device_uuid", "tag", "state", "owner_uid", "owner_pid", "attachments", "expires_in"):
        assert hasattr(ipc.BufferInfo, name), name
    for name in ("path", "closed", "stats", "shutdown", "__enter__", "__exit__"):
        assert hasattr(ipc.MemoryStoreServer, name), name


def test_exception_classes():
    assert issubclass(ipc.MemoryStoreError, ipc.IpcError)
    assert issubclass(ipc.MemoryStoreError, mempool.MempoolError)
    pairs = [
        (ipc.NameTakenError, FileExistsError),
        (ipc.UnknownNameError, LookupError),
        (ipc.InvalidNameError, ValueError),
        (ipc.NotPermittedError, PermissionError),
        (ipc.ServerGoneError, ConnectionError),
        (ipc.ServerGoneError, ipc.PeerGoneError),
    ]
    for cls, builtin in pairs:
        assert issubclass(cls, ipc.MemoryStoreError), cls
        assert issubclass(cls, builtin), (cls, builtin)
        assert str(cls("the message")) == "the message"
    for cls in (ipc.QuotaExceededError, ipc.WrongStateError):
        assert issubclass(cls, ipc.MemoryStoreError)


@pytest.mark.parametrize(
    "name, rule",
    [("", "must not be empty"), ("a" * 129, "at most 128 bytes"), ("has space", "may hold only"),
     ("/abs", "must not start with '/'"), ("dot/../x", "must not contain '..'"), ("\u00e9", "may hold only")],
)
def test_bad_names_are_refused_with_the_rule(name, rule):
    with pytest.raises(ipc.InvalidNameError) as e:
        ipc.validate_name(name)
    assert rule in str(e.value), str(e.value)
    assert isinstance(e.value, ValueError)


def test_good_names_pass():
    for name in ("a", "llama/layer.0", "model-7b/w_q.bias", "A" * 128, "x.y_z-0/1", "a//b", "trailing/"):
        ipc.validate_name(name)


def test_connecting_to_a_missing_path_says_nobody_serves_it():
    path = os.path.join(tempfile.mkdtemp(prefix="mempool-store-test-"), "nobody.sock")
    with pytest.raises(ipc.ServerGoneError) as e:
        ipc.Client(path)
    assert path in str(e.value) and "no server listens" in str(e.value)
    assert isinstance(e.value, ConnectionError)


def test_client_argument_checks():
    with pytest.raises(ValueError, match="timeout"):
        ipc.Client("/nonexistent/x.sock", timeout=-1)
    with pytest.raises(ValueError, match="timeout"):
        ipc.Client("/nonexistent/x.sock", timeout=float("nan"))
    with pytest.raises(TypeError):
        ipc.Client("/nonexistent/x.sock", trust_uids="0")
    with pytest.raises(TypeError):
        ipc.Client(42)


def test_serve_argument_checks(no_driver):
    path = os.path.join(tempfile.mkdtemp(prefix="mempool-store-test-"), "s.sock")
    with pytest.raises(ValueError, match="devices"):
        ipc.serve(path, devices=[])
    with pytest.raises(ValueError, match="default_ttl"):
        ipc.serve(path, default_ttl=-1.0)
    with pytest.raises(ValueError, match="socket_mode"):
        ipc.serve(path, socket_mode=0o7777)
    with pytest.raises(TypeError):
        ipc.serve(path, 0)  # everything after the path is keyword-only
    if no_driver:
        with pytest.raises(mempool.DriverNotFoundError) as e:
            ipc.serve(path)
        assert "starting a memory server" in str(e.value)
        assert not os.path.exists(path)


def test_client_against_a_fake_server(fake):
    client = ipc.Client(fake.path, timeout=10)
    assert fake.requests[0] == (HELLO, b"")
    assert fake.hellos == [3] and client.protocol_version == 3
    assert client.path == fake.path
    assert client.server_pid == 4242
    assert client.devices == ["GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"]
    assert "4242" in repr(client)
    assert client.stats() == {
        "buffers": 1, "bytes": 2 << 20, "named": 1, "attachments": 3, "connections": 2, "freed": 5, "rejected": 6,
        "lingering_buffers": 8, "lingering_bytes": 9,
    }
    infos = client.list()
    assert [i.name for i in infos] == ["weights/a", "weights/b"]
    a, b = infos
    assert (a.size, a.tag, a.state, a.owner_uid, a.owner_pid, a.attachments) == (2 << 20, "bf16", "published",
                                                                                   os.getuid(), 777, 2)
    assert a.expires_in == pytest.approx(1.5)
    assert a.device_uuid == client.devices[0]
    assert (b.state, b.tag, b.expires_in, b.attachments) == ("creating", "", None, 1)
    assert "weights/a" in repr(a)


def test_refusals_map_to_their_classes_and_keep_the_connection(fake):
    client = ipc.Client(fake.path, timeout=10)
    expected = {
        1: ipc.NameTakenError,
        2: ipc.UnknownNameError,
        5: ipc.QuotaExceededError,
        6: ipc.NotPermittedError,
        7: ipc.WrongStateError,
        8: ipc.WrongStateError,
        9: ValueError,
        10: ipc.MemoryStoreError,
        11: ipc.RefusedError,
    }
    for code, cls in expected.items():
        name = f"code-{code}"
        with pytest.raises(cls) as e:
            client.delete(name)
        assert f"deleting buffer {name!r}"[:-1] in str(e.value).replace('"', "'"), str(e.value)
        # A refusal leaves the connection usable.
        assert client.stats()["buffers"] == 1
    with pytest.raises(ipc.QuotaExceededError, match="limit 10"):
        client.delete("code-5")


def test_client_names_are_checked_before_anything_is_sent(fake):
    client = ipc.Client(fake.path, timeout=10)
    sent = len(fake.requests)
    for call in (lambda: client.delete("bad name"), lambda: client.attach(""), lambda: client.create("/x", 4096)):
        with pytest.raises(ipc.InvalidNameError):
            call()
    # attach_many checks every name before it sends anything; the error names the bad one.
    with pytest.raises(ipc.InvalidNameError, match="bad name"):
        client.attach_many(["ok", "bad name", "ok2"])
    with pytest.raises(TypeError):
        client.attach_many("ok")  # a str is not a list of names
    with pytest.raises(ValueError, match="size"):
        client.create("ok", 0)
    with pytest.raises(ValueError, match="ttl"):
        client.create("ok", 4096, ttl=-1)
    # create_many checks its names, sizes and options before it sends anything (or asks the GPU).
    with pytest.raises(ipc.InvalidNameError, match="bad name"):
        client.create_many(["ok", "bad name"], [4096, 4096])
    with pytest.raises(ValueError, match="one size per name"):
        client.create_many(["ok", "ok2"], [4096])
    with pytest.raises(ValueError, match="ok2"):
        client.create_many(["ok", "ok2"], [4096, 0])
    with pytest.raises(ValueError, match="1 to 128 members"):
        client.create_many([], [])
    with pytest.raises(ValueError, match="1 to 128 members"):
        client.create_many([f"n{i}" for i in range(129)], [4096] * 129)
    with pytest.raises(ValueError, match="ttl"):
        client.create_many(["ok"], [4096], ttl=-1)
    with pytest.raises(TypeError):
        client.attach("ok", stream="not a stream")
    with pytest.raises(TypeError):
        client.attach_many(["ok"], stream="not a stream")
    assert len(fake.requests) == sent


def test_a_version_2_server_is_spoken_to_in_version_2():
    server = FakeServer(version=2)
    try:
        client = ipc.Client(server.path, timeout=10)
        # Refused in version 3, then welcomed in version 2 on a second connection.
        assert server.hellos == [2] and len(server.conns) == 2
        assert client.protocol_version == 2
        assert client.stats() == {
            "buffers": 1, "bytes": 2 << 20, "named": 1, "attachments": 3, "connections": 2, "freed": 5,
            "rejected": 6, "lingering_buffers": 0, "lingering_bytes": 0,
        }
        # Version 2 has no attach lists: asking for one is refused before anything is sent (or the GPU asked).
        sent = len(server.requests)
        for call in (lambda: client.create("x", 4096, attach_uids=[1234]),
                     lambda: client.create_many(["x"], [4096], attach_uids=[1234])):
            with pytest.raises(ValueError, match="protocol version 2, which has no attach lists"):
                call()
        assert len(server.requests) == sent
    finally:
        server.close()


def test_attach_lists_are_checked_before_anything_is_sent(fake):
    client = ipc.Client(fake.path, timeout=10)
    sent = len(fake.requests)
    for create in (lambda uids: client.create("x", 4096, attach_uids=uids),
                   lambda uids: client.create_many(["x", "y"], [4096, 4096], attach_uids=uids)):
        with pytest.raises(ValueError, match="no uid"):
            create([2**32 - 1])
        with pytest.raises(ValueError, match="at most 64"):
            create(list(range(65)))
        with pytest.raises(OverflowError):
            create([-1])
        with pytest.raises(TypeError):
            create("1000")
        with pytest.raises(TypeError):
            create([1.5])
    assert len(fake.requests) == sent


def test_a_closed_connection_is_server_gone_for_every_later_call(fake):
    client = ipc.Client(fake.path, timeout=10)
    fake.reply = lambda kind, body, version: None  # closes on the next request
    with pytest.raises(ipc.ServerGoneError):
        client.stats()
    for call in (client.stats, client.list, lambda: client.delete("x")):
        with pytest.raises(ipc.ServerGoneError):
            call()


def test_a_server_that_never_answers_times_out():
    server = FakeServer(welcome=False)
    try:
        with pytest.raises(ipc.IpcTimeoutError) as e:
            ipc.Client(server.path, timeout=0.5)
        assert server.path in str(e.value)
    finally:
        server.close()


def test_objects_cannot_be_pickled(fake):
    import pickle

    client = ipc.Client(fake.path, timeout=10)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(client)


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "mempool.benchmarks.store", *args], capture_output=True, text=True,
                          timeout=120, cwd="/")


def test_benchmark_help_and_argument_checks():
    done = _bench("--help")
    assert done.returncode == 0 and "--gib" in done.stdout and "--hidden" in done.stdout, done.stderr
    done = _bench("--hidden", "0")
    assert done.returncode == 2 and "--hidden" in done.stderr
    probe = "import sys, mempool.benchmarks.store as m; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, cwd="/").returncode == 0


def test_benchmark_without_a_driver_says_why(no_driver):
    if not no_driver:
        return
    done = _bench("--gib", "0.01", "--hidden", "64", "--repeats", "1")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "cannot start the memory server" in done.stderr


def store_doc():
    """docs/memory-store.md: next to the guide named by ``MEMPOOL_DOCS`` (an installed wheel's tests), else
    relative to this file."""
    from pathlib import Path

    env = os.environ.get("MEMPOOL_DOCS")
    if env:
        return Path(env).with_name("memory-store.md")
    return Path(__file__).resolve().parents[3] / "docs" / "memory-store.md"


def python_blocks():
    """The ```python blocks of the document's "## Python" section."""
    import re

    text = store_doc().read_text()
    section = text.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```$", section, flags=re.S | re.M)


def test_the_docs_python_block_compiles_and_names_what_the_module_has():
    import ast

    blocks = python_blocks()
    assert len(blocks) == 1
    tree = ast.parse(blocks[0])
    used = {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "ipc"}
    assert {"Client", "UnknownNameError"} <= used
    for name in used:
        assert hasattr(ipc, name), name
    methods = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    for name in ("create", "publish", "attach", "list", "delete"):
        assert name in methods, name
        assert any(hasattr(c, name) for c in (ipc.Client, ipc.CreatedBuffer, ipc.AttachedBuffer)), name

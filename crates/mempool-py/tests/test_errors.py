"""The exception table and the C ABI of the extension against their one definition: mempool-capi's status
table (``crates/mempool-capi/src/error.rs``), which ``_lib._exception_table()`` reports, and the C header
``crates/mempool-capi/include/mempool.h`` (itself checked against the Rust table by mempool-capi's
``tests/abi.rs``). Host tests: no GPU or driver needed."""

import ctypes
import importlib
import inspect
import pathlib
import re

import mempool
from mempool import _errors
from mempool import _lib as lib

HEADER = pathlib.Path(__file__).resolve().parents[2] / "mempool-capi" / "include" / "mempool.h"


def _header_text() -> str:
    return HEADER.read_text()


def _header_statuses() -> list[tuple[int, str]]:
    body = re.search(r"typedef enum mempool_status \{(.*?)\} mempool_status_t;", _header_text(), re.S)
    assert body, f"no mempool_status enum in {HEADER}"
    text = re.sub(r"/\*.*?\*/", "", body.group(1), flags=re.S)
    return [(int(code), name) for name, code in re.findall(r"(\w+)\s*=\s*(-?\d+)", text)]


def _header_functions() -> list[str]:
    text = re.sub(r"/\*.*?\*/", "", _header_text(), flags=re.S)
    return re.findall(r"\b(mempool_\w+)\s*\(", text)


def _status_rows():
    return [row for row in lib._exception_table() if row[0] is not None]


def _resolve(module: str, name: str) -> type:
    cls = getattr(importlib.import_module(module), name)
    assert isinstance(cls, type) and issubclass(cls, BaseException), f"{module}.{name} is not an exception class"
    return cls


def test_the_status_table_is_the_header_enum():
    rows = _status_rows()
    assert [(code, name) for code, name, _, _ in rows] == _header_statuses()
    assert [code for code, *_ in rows] == list(range(len(rows))), "codes are 0, 1, 2, ... in order"


def test_every_status_raises_its_class_with_its_message():
    for code, name, module, cls_name in _status_rows():
        err = lib._exception_for_status(code, f"the cause of {name}")
        if module is None:
            assert name == "MEMPOOL_SUCCESS"
            assert type(err) is mempool.MempoolError
            continue
        cls = _resolve(module, cls_name)
        assert type(err) is cls, (name, type(err), cls)
        assert str(err) == f"the cause of {name}"
        if module == "mempool._errors":
            assert issubclass(cls, mempool.MempoolError) and issubclass(cls, RuntimeError), cls
        else:
            assert (module, cls_name) == ("builtins", "ValueError"), (name, module, cls_name)
    assert issubclass(mempool.OutOfMemoryError, MemoryError)
    rc = {name: code for code, name, _, _ in _status_rows()}
    assert isinstance(lib._exception_for_status(rc["MEMPOOL_ERROR_OUT_OF_MEMORY"], "x"), MemoryError)
    assert type(lib._exception_for_status(12345, "x")) is ValueError


def test_the_errors_module_defines_exactly_the_classes_of_the_table():
    table = {cls for _, _, module, cls in lib._exception_table() if module == "mempool._errors"}
    defined = {
        name
        for name, obj in vars(_errors).items()
        if inspect.isclass(obj) and obj.__module__ == _errors.__name__
    }
    assert defined == table, f"only in _errors.py: {defined - table}; only in the table: {table - defined}"
    for name in defined:
        assert getattr(mempool, name) is getattr(_errors, name), f"mempool.{name} is not exported"
        assert name in mempool.__all__, name
    ipc = [cls for code, _, _, cls in lib._exception_table() if code is None]
    assert "IpcError" in ipc
    for name in ipc:
        assert issubclass(getattr(_errors, name), _errors.IpcError), name


def test_the_extension_exports_every_function_of_the_header():
    functions = _header_functions()
    assert len(functions) >= 18, functions
    so = ctypes.CDLL(lib._shared_object_path())
    missing = [f for f in functions if not hasattr(so, f)]
    assert not missing, f"declared in mempool.h, not exported by the extension: {missing}"
    so.mempool_status_name.restype = ctypes.c_char_p
    for code, name in _header_statuses():
        assert so.mempool_status_name(code) == name.encode()
    assert so.mempool_status_name(len(_header_statuses())) == b"MEMPOOL_UNKNOWN_STATUS"

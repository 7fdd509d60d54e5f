"""Builds mempool_rmm_bridge._bridge against the installed RMM (its headers, CCCL's, rapids-logger's and the
CUDA runtime's, and its Cython declarations): see pyproject.toml. Limited API (abi3, Python 3.11 and later),
as RMM's own extension modules."""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent


def fail(message: str) -> None:
    sys.exit(f"mempool_rmm_bridge build: {message}")


def package_dir(name: str, what: str) -> Path:
    try:
        module = __import__(name)
    except ImportError as e:
        fail(f"needs {what} installed in the build environment (build with --no-build-isolation): {e}")
    return Path(module.__file__).resolve().parent


def mempool_include() -> Path:
    """mempool.h: $MEMPOOL_INCLUDE, else the repository's crates/mempool-capi/include."""
    candidates = [os.environ.get("MEMPOOL_INCLUDE"), HERE.parent.parent / "mempool-capi" / "include"]
    for c in candidates:
        if c and (Path(c) / "mempool.h").is_file() and (Path(c) / "mempool" / "rmm.hpp").is_file():
            return Path(c)
    fail("cannot find mempool.h and mempool/rmm.hpp: set MEMPOOL_INCLUDE to crates/mempool-capi/include")


def cuda_dirs() -> tuple[Path, Path]:
    """The CUDA 13 runtime's include and lib folders: $CUDA_HOME's, else the nvidia-cuda-runtime wheel's."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "include" / "cuda_runtime_api.h").is_file():
        lib = Path(home) / "lib64"
        return Path(home) / "include", lib if lib.is_dir() else Path(home) / "lib"
    for entry in sys.path:
        base = Path(entry) / "nvidia" / "cu13"
        if (base / "include" / "cuda_runtime_api.h").is_file():
            return base / "include", base / "lib"
    fail(
        "cannot find the CUDA 13 runtime's headers: set CUDA_HOME, or install nvidia-cuda-runtime and "
        "nvidia-cuda-crt (13.x)"
    )


librmm = package_dir("librmm", "librmm (rmm-cu13)")
logger = package_dir("rapids_logger", "rapids-logger")
package_dir("rmm", "rmm (rmm-cu13)")
rmm_version = __import__("rmm").__version__
cuda_include, cuda_lib = cuda_dirs()
if not glob.glob(str(cuda_lib / "libcudart.so*")):
    fail(f"no libcudart.so in {cuda_lib}")

(HERE / "mempool_rmm_bridge" / "_build.py").write_text(
    '"""Written by setup.py: the RMM release the compiled module was built against."""\n\n'
    f"RMM_VERSION = {rmm_version!r}\n"
)

cudart = sorted(glob.glob(str(cuda_lib / "libcudart.so.*")))
cudart_name = Path(cudart[0]).name if cudart else "libcudart.so"
extension = Extension(
    "mempool_rmm_bridge._bridge",
    sources=["mempool_rmm_bridge/_bridge.pyx"],
    language="c++",
    include_dirs=[
        str(HERE / "mempool_rmm_bridge"),
        str(mempool_include()),
        str(librmm / "include"),
        str(librmm / "include" / "rapids"),
        str(logger / "include"),
        str(cuda_include),
    ],
    # What rmm::rmm's CMake package adds for CCCL (lib64/cmake/rmm/rmm-dependencies.cmake), and the limited
    # API of Python 3.11.
    define_macros=[
        ("CUB_DISABLE_NAMESPACE_MAGIC", None),
        ("CUB_IGNORE_NAMESPACE_MAGIC_ERROR", None),
        ("THRUST_DISABLE_ABI_NAMESPACE", None),
        ("THRUST_IGNORE_ABI_NAMESPACE_ERROR", None),
        ("CCCL_DISABLE_PDL", None),
        ("Py_LIMITED_API", "0x030B0000"),
    ],
    py_limited_api=True,
    extra_compile_args=["-std=c++20", "-fvisibility=hidden", "-O2", "-Wno-deprecated-declarations"],
    # librmm (rmm::process_is_exiting) and the CUDA runtime, found where RMM's and the runtime's wheels put
    # them (they are loaded already when the module is: mempool_rmm_bridge imports rmm and loads cudart first).
    library_dirs=[str(librmm / "lib64"), str(cuda_lib)],
    extra_link_args=[
        "-Wl,--no-as-needed",
        "-lrmm",
        f"-l:{cudart_name}",
        "-Wl,-rpath,$ORIGIN/../librmm/lib64",
        "-Wl,-rpath,$ORIGIN/../nvidia/cu13/lib",
    ],
)

setup(
    ext_modules=cythonize([extension], compiler_directives={"language_level": "3"}),
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)

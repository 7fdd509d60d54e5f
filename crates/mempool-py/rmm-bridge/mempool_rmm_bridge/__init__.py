"""mempool resources as RMM resources in Python (docs/rmm.md, "Python").

Import it through ``mempool.rmm`` (``mempool.rmm.MempoolResource``), which says what is missing when this
package, RMM or a matching version is not there. This package is built against RMM's headers
(``scripts/build-rmm-bridge.sh``, or ``pip install --no-build-isolation crates/mempool-py/rmm-bridge`` in an
environment with ``rmm-cu13`` installed) and works with the RMM release it was built against.
"""

from __future__ import annotations

from ._build import RMM_VERSION as _BUILT_FOR


def _release(version: str) -> tuple[int, int]:
    parts = version.split(".")
    return int(parts[0]), int(parts[1])


def _check_rmm() -> None:
    try:
        import rmm
    except ImportError as e:
        raise ImportError(
            f"mempool_rmm_bridge needs RMM {_BUILT_FOR} (pip install rmm-cu13=={_BUILT_FOR[:5]}.*): {e}"
        ) from e
    have = getattr(rmm, "__version__", "unknown")
    try:
        same = _release(have) == _release(_BUILT_FOR)
    except (ValueError, IndexError):
        same = False
    if not same:
        raise ImportError(
            f"mempool_rmm_bridge was built against RMM {_BUILT_FOR}, and RMM {have} is installed: rebuild the "
            "bridge against it (scripts/build-rmm-bridge.sh), or install the RMM it was built for"
        )


def _load_cudart() -> None:
    """Loads the CUDA runtime the bridge's header calls (cudaStreamSynchronize for allocate_sync) the way the
    CUDA Python packages find it: a wheel's, the toolkit's or the system's."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError as e:  # cuda-pathfinder comes with cuda-bindings, which RMM needs
        raise ImportError(f"mempool_rmm_bridge needs cuda-pathfinder to find the CUDA runtime: {e}") from e
    try:
        load_nvidia_dynamic_lib("cudart")
    except Exception as e:  # its own error types vary by version; the message names the search
        raise ImportError(f"mempool_rmm_bridge could not load the CUDA runtime (libcudart.so.13): {e}") from e


_check_rmm()
_load_cudart()

import mempool._lib as _mempool_lib  # noqa: E402

from . import _bridge  # noqa: E402

_bridge._set_functions(_mempool_lib._capi_functions())

MempoolResource = _bridge.MempoolResource

__all__ = ["MempoolResource"]

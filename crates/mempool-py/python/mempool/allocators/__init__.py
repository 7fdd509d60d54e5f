"""Hooks that route CuPy, Numba and PyTorch allocations through mempool's current device resource:
``mempool.allocators.cupy``, ``mempool.allocators.numba`` and ``mempool.allocators.torch``. Each imports its
framework when it is imported; a missing framework raises ``ImportError`` naming it."""

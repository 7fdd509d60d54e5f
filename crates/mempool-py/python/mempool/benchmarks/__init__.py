"""Benchmarks shipped with mempool.

``python -m mempool.benchmarks.random_workload`` drives the project's standard random workload
(the sequence ``mempool-bench random`` and the Rust crates draw, bit for bit) from Python through
PyTorch, CuPy, RMM and mempool, one process per configuration and point, and prints a Markdown table
(``--help`` lists the options). ``python -m mempool.benchmarks.ipc_handoff`` hands GPU buffers between
processes through ``mempool.ipc`` (with and without its shared-memory rings), ``torch.multiprocessing`` and
cuda.core's IPC-enabled memory resource in one run. ``python -m mempool.benchmarks.store`` measures a
restarted PyTorch process's time to its first forward pass with weights attached from the memory store
(``mempool.ipc``) against weights loaded from a file in host memory. Importing this package imports no
framework and not mempool's
compiled extension.
"""

"""The RMM bridge's GPU tests (docs/rmm.md, "Python"): they need a GPU, RMM 26.10 and the bridge installed, and
fail (never skip) without them. scripts/rmm-gpu-tests.sh packs them with the wheels they need."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; fails (never skips) without one")
    config.addinivalue_line("markers", "two_gpu: needs two GPUs (also marked gpu); fails (never skips) with fewer")

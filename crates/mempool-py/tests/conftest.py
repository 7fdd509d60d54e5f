import ctypes

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; fails (never skips) without one")
    config.addinivalue_line(
        "markers", "two_gpu: needs two GPUs (one per process; also marked gpu); fails (never skips) with fewer"
    )


def _driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def no_driver() -> bool:
    """True on a machine without a CUDA driver (CI): the tests of the no-driver path check it there, and
    return at once where a driver is installed."""
    return not _driver_present()

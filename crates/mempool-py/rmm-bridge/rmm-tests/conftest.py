"""The fixture under which RMM's own Python tests run with mempool as RMM's current device resource (docs/rmm.md,
"Python"). scripts/rmm-gpu-tests.sh copies RMM's tests (test_device_buffer.py, test_cupy_integration.py,
test_rmm_pytorch.py, test_lifecycle.py, test_statistics.py and test_helpers.py, at the pinned commit) beside
this file, in place of RMM's conftest.py, whose fixtures it keeps:

- ``rmm_auto_reinitialize`` (autouse): RMM's resets RMM's default resource after each test; this one makes
  ``mempool.rmm.MempoolResource(kind=$MEMPOOL_RMM_KIND)`` (default: mempool's default stack) current before
  each test and again after it, and fails a test through which mempool refused a free;
- ``stats_mr``: as RMM's (``rmm.statistics.statistics()`` over the current resource, here the bridge).

At the end the session fails unless mempool served allocations through the bridge: a run in which RMM's
tests never reached mempool proves nothing.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Generator

import pytest

import rmm
import rmm.mr
import rmm.statistics
from mempool.rmm import MempoolResource

KIND = os.environ.get("MEMPOOL_RMM_KIND", "default")
_served = {"allocations": 0, "resources": 0}


def _fresh() -> MempoolResource:
    mr = MempoolResource(kind=KIND, statistics=True)
    _served["resources"] += 1
    return mr


@pytest.fixture(scope="function", autouse=True)
def rmm_auto_reinitialize() -> Generator[None, None, None]:
    mr = _fresh()
    rmm.mr.set_current_device_resource(mr)
    yield
    gc.collect()
    _served["allocations"] += mr.mempool_mr.allocation_counts.total_count
    assert mr.failed_deallocations == 0, mr.last_deallocation_error
    rmm.mr.set_current_device_resource(_fresh())


@pytest.fixture
def stats_mr() -> Generator[rmm.mr.DeviceMemoryResource, None, None]:
    """Fixture that makes a StatisticsResourceAdaptor available to the test (as RMM's conftest)."""
    with rmm.statistics.statistics():
        yield rmm.mr.get_current_device_resource()


def pytest_sessionfinish(session, exitstatus):
    print(
        f"\nmempool served {_served['allocations']} allocations of RMM's tests through "
        f"{_served['resources']} MempoolResource(kind={KIND!r})"
    )
    if _served["allocations"] == 0 and session.testscollected:
        print("FAILED: no allocation of RMM's tests reached mempool")
        session.exitstatus = 1

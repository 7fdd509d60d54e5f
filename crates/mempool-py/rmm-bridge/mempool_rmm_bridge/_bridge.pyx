# cython: language_level=3, binding=True
# distutils: language = c++
"""The compiled half of mempool_rmm_bridge: ``MempoolResource``, an ``rmm.mr.DeviceMemoryResource`` whose C++
resource is mempool/rmm.hpp's ``mempool::rmm_resource`` over a handle of mempool's C ABI (docs/rmm.md,
"Python"). RMM's C++ calls it directly: no allocation or free enters Python."""

from cython.operator cimport dereference as deref
from libc.stdint cimport uintptr_t
from libcpp cimport bool
from libcpp.memory cimport unique_ptr
from libcpp.optional cimport optional
from libcpp.string cimport string

from rmm.librmm.memory_resource cimport device_async_resource_ref
from rmm.pylibrmm.memory_resource cimport DeviceMemoryResource


cdef extern from "bridge.hpp" namespace "mempool" nogil:
    cdef cppclass rmm_resource:
        size_t failed_deallocations()
        string last_deallocation_error() except +
        int device()

cdef extern from "bridge.hpp" namespace "mempool_py" nogil:
    void clear_staging()
    bool set_function(const char* name, uintptr_t address)
    const char* missing_function()
    bool commit_functions()
    unique_ptr[rmm_resource] adopt(uintptr_t handle) except +

# RMM's template (rmm/librmm/memory_resource.pxd) for this resource type.
cdef extern from *:
    optional[device_async_resource_ref] make_device_async_resource_ref(rmm_resource&) except +


# The version of mempool's C entry points (their signatures and meaning) this bridge calls.
CAPI_ABI = 1


def _set_functions(functions):
    """Takes the addresses of mempool's C entry points (``mempool._lib._capi_functions()``, led by
    ``("abi", N)``): raises ImportError for another N, or naming the first entry point the bridge needs and
    did not get (a mempool older than the bridge)."""
    functions = list(functions)
    abi = dict(functions).get("abi")
    if abi != CAPI_ABI:
        raise ImportError(
            f"mempool_rmm_bridge calls version {CAPI_ABI} of mempool's C entry points, and the installed mempool "
            f"gives {'none' if abi is None else f'version {abi}'}: install the mempool this bridge was built with, "
            "or rebuild the bridge (scripts/build-rmm-bridge.sh)"
        )
    clear_staging()
    for name, address in functions:
        if name != "abi":
            set_function(name.encode(), <uintptr_t>address)
    missing = missing_function().decode()
    if missing or not commit_functions():
        raise ImportError(
            f"mempool_rmm_bridge: the installed mempool does not give the entry point {missing} "
            "(install the mempool this bridge was built with)"
        )


cdef class MempoolResource(DeviceMemoryResource):
    """A mempool resource as an RMM memory resource: ``rmm.mr.set_current_device_resource(MempoolResource())``
    makes ``rmm.DeviceBuffer``, ``rmm.allocators.cupy``, ``rmm.allocators.torch``, libcudf and anything else
    that allocates through RMM's current resource allocate from mempool.

    ``MempoolResource(mr)`` wraps a ``mempool.mr`` resource (kept alive as ``mempool_mr``);
    ``MempoolResource(kind=..., **options)`` makes one first (``mempool.rmm.make_resource``: ``"default"``,
    the default stack, when neither is given). Make it with its device current, as RMM's resources.
    """

    cdef unique_ptr[rmm_resource] c_obj
    cdef readonly object mempool_mr

    def __cinit__(self, *args, **kwargs):
        from mempool.rmm import _resource_and_handle

        mr, handle = _resource_and_handle(*args, **kwargs)
        cdef uintptr_t h = <uintptr_t>handle
        # adopt owns the handle from here on, also when it throws.
        self.c_obj = adopt(h)
        self.c_ref = make_device_async_resource_ref(deref(self.c_obj))
        self.mempool_mr = mr

    @property
    def device(self):
        """The ordinal of the device the resource allocates on."""
        return deref(self.c_obj).device()

    @property
    def failed_deallocations(self):
        """How many frees mempool refused through this resource (a free is never raised: RMM's deallocate
        is noexcept)."""
        return deref(self.c_obj).failed_deallocations()

    @property
    def last_deallocation_error(self):
        """The message of the last refused free ("" when none was)."""
        return deref(self.c_obj).last_deallocation_error().decode()

    def __repr__(self):
        return f"<mempool_rmm_bridge.MempoolResource device={self.device} over {self.mempool_mr!r}>"

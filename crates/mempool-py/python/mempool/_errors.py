"""mempool's exceptions. Every error names its cause: no driver, no device, the size that did not fit."""


class MempoolError(RuntimeError):
    """Base of mempool's errors."""


class DriverNotFoundError(MempoolError):
    """No CUDA driver (libcuda.so) could be loaded."""


class DriverTooOldError(MempoolError):
    """The installed driver is older than a call needs."""


class NoDeviceError(MempoolError):
    """No CUDA device is visible, or none with the ordinal asked for."""


class OutOfMemoryError(MempoolError, MemoryError):
    """An allocation did not fit (or passed a LimitingResourceAdaptor's limit); the message names the size."""


class UnsupportedError(MempoolError):
    """The device or resource cannot serve the request (a missing capability, a size a fixed-size resource does
    not serve, ...)."""


class InvalidDeallocationError(MempoolError):
    """A deallocation that matched no live allocation."""


class DriverError(MempoolError):
    """Another driver call failed; the message names the call and the CUDA error."""

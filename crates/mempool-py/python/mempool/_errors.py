"""mempool's exceptions. Every error names its cause: no driver, no device, the size that did not fit.

Which class an error of each C ABI status (``MEMPOOL_ERROR_*``) raises is defined once, in mempool-capi's
status table (``crates/mempool-capi/src/error.rs``); the package's tests check this module against it."""


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


class PeerAccessError(MempoolError):
    """A device cannot be given access to another's memory: no peer capability between the two (as
    ``cuDeviceCanAccessPeer`` reports), or the owning device's own access; the message names both."""


class IpcError(MempoolError):
    """Sharing buffers between processes (``mempool.ipc``) failed; the base of the errors below, and the
    class of the rest (a socket path that cannot be used, a buffer shared twice with one importer, ...)."""


class PeerGoneError(IpcError):
    """The other process is gone: it closed the connection, said Goodbye, died, or nobody serves the socket
    path."""


class IpcProtocolError(IpcError):
    """The peer broke the protocol (a malformed or unexpected message) or reported an error of its own."""


class RefusedError(IpcError):
    """The exporter turned the connection away (its importer limit, its access policy, or shutting down), or
    the peer runs as a user the access policy does not allow."""


class IpcTimeoutError(IpcError):
    """The peer did not complete a step in time, or a wait (for importers, a buffer, releases) timed out."""

"""gpufeed: device-resident training batches from the gpufeed daemon, zero-copy into PyTorch, JAX,
CuPy and NumPy through DLPack.

    import gpufeed
    client = gpufeed.Client("/run/gpufeed/gpufeed.sock")
    for batch in client.open_stream("tokens", batch_size=4096, device="cuda:0", shuffle="window"):
        ids = torch.from_dlpack(batch["ids"])

See docs/PYTHON.md for the API, the lifetime of batches and CUDA stream ordering.
"""

from gpufeed._gpufeed import (
    Batch,
    Client,
    Field,
    Stream,
    __version__,
    keep_thread_off_interrupt_cpus,
)
from gpufeed.errors import (
    AllSlotsHeldError,
    ConnectError,
    CudaError,
    DaemonError,
    Error,
    InvalidSpecError,
    ProtocolError,
    SessionError,
)

__all__ = [
    "AllSlotsHeldError",
    "Batch",
    "Client",
    "ConnectError",
    "CudaError",
    "DaemonError",
    "Error",
    "Field",
    "InvalidSpecError",
    "ProtocolError",
    "SessionError",
    "Stream",
    "__version__",
    "keep_thread_off_interrupt_cpus",
]

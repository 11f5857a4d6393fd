"""gpufeed: device-resident training batches from the gpufeed daemon, zero-copy into PyTorch, JAX,
CuPy and NumPy through DLPack.

    import gpufeed
    with gpufeed.Client("/run/gpufeed.sock") as client:   # or Client(): $GPUFEED_SOCKET
        for batch in client.open_stream("tokens", batch_size=4096, device="cuda:0", shuffle="window"):
            ids = torch.from_dlpack(batch["ids"])

    gpufeed.pack("/data/emb", fields={"emb": emb, "label": labels})   # a dataset from NumPy arrays

See docs/PYTHON.md for the API, the lifetime of batches and CUDA stream ordering.
"""

from collections.abc import Mapping as _Mapping

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
from gpufeed._pack import PackError, Ragged, pack

# A batch is a read-only mapping of field name to Field: isinstance(batch, Mapping) holds, and code
# that takes a Mapping takes a batch.
_Mapping.register(Batch)

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
    "PackError",
    "ProtocolError",
    "Ragged",
    "SessionError",
    "Stream",
    "__version__",
    "keep_thread_off_interrupt_cpus",
    "pack",
]

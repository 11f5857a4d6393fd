"""The native half of the gpufeed package (a PyO3 extension over the Rust client crate)."""

from types import TracebackType
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type, Union

__version__: str
"""The package's version."""

DTypeLike = Any
"""An element type: gpufeed's name (``"u8"``, ``"i8"``, ``"u16"``, ``"i16"``, ``"u32"``, ``"i32"``,
``"u64"``, ``"i64"``, ``"f16"``, ``"bf16"``, ``"f32"``, ``"f64"``), NumPy's and PyTorch's name for it
(``"float32"``, ``"bfloat16"``, ...), or their type objects (``np.float32``, ``np.dtype("float32")``,
``torch.float32``). Names without a width (``"float"``) are refused: they mean 32 bits to PyTorch and
64 to NumPy."""

def keep_thread_off_interrupt_cpus(device: str) -> Optional[List[int]]:
    """Moves the calling thread off the CPUs that service ``device``'s interrupts (``"cuda"`` or
    ``"cuda:N"``), when other CPUs are allowed to it; returns the CPUs it runs on now, or None when it
    was left as it was. Threads it starts afterwards inherit the restriction. For the thread that
    takes batches: its per-batch CUDA driver calls stall behind the interrupt handler on those CPUs.
    Raises ``ValueError`` for a device that is not a CUDA device, ``CudaError`` without a driver."""

class Client:
    """A connection to the daemon. Each stream it opens is a session of its own; the first uses the
    connection the constructor made.

    A context manager: ``with gpufeed.Client() as client:`` closes the client, and the streams it
    opened, on leaving the block.
    """

    def __init__(self, socket: Optional[str] = None) -> None:
        """Connects to the daemon's Unix socket and greets it. ``socket`` None: the
        ``GPUFEED_SOCKET`` environment variable, else ``$GPUFEED_DATA_ROOT/gpufeed.sock`` (the
        daemon's own default), else ``/run/gpufeed.sock``. Raises ``ConnectError`` when nothing
        listens there (saying where the path came from when it was not given)."""
    @property
    def socket(self) -> str:
        """The socket path connected to."""
    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
    def open_stream(
        self,
        dataset: Optional[str] = None,
        batch_size: Optional[int] = None,
        *,
        sources: Optional[Sequence[Tuple[str, float]]] = None,
        mixture_epoch_samples: Optional[int] = None,
        fields: Union[None, Sequence[str], Mapping[str, Optional[DTypeLike]]] = None,
        device: str = "cpu",
        shuffle: Optional[str] = None,
        window_shards: int = 4,
        seed: Optional[int] = None,
        epoch: Optional[int] = None,
        rank: int = 0,
        world_size: Optional[int] = None,
        tail: str = "drop",
        start_step: Optional[int] = None,
        state: Optional[Dict[str, Any]] = None,
        on_corrupt: str = "fail",
        prefetch: int = 4,
        world: Optional[int] = None,
        variable: Optional[Mapping[str, Union[str, Tuple[str, Optional[int]]]]] = None,
    ) -> Stream:
        """Opens a stream of ``dataset`` in batches of ``batch_size`` samples for this rank; the
        daemon starts filling slots at once.

        - ``sources``: instead of ``dataset``, a mixture: ``[("web", 0.7), ("code", 0.3)]``, each
          dataset drawn with its weight (weights need not sum to 1), every source's fields the same
          (names, types, shapes, or the error names the source and the field). Each source runs
          through its own epochs, reshuffled each time, whatever the mixture's epoch; the mixture's
          epoch is ``mixture_epoch_samples`` positions (default: the sources' samples summed).
          Deterministic for a ``seed``, resumed from ``state_dict`` at any world size like a single
          dataset; on a CUDA device assembled on the host and uploaded (a few GB/s); fixed-shape
          fields only, without ``variable`` (``docs/PYTHON.md``).
        - ``fields``: None (every field, stored type), a list of names, or a mapping of name to
          element type (:data:`DTypeLike`, or None for the stored type).
        - ``device``: ``"cpu"`` (host memory), ``"cuda"`` or ``"cuda:N"``.
        - ``shuffle``: ``"none"``, ``"window"`` (``window_shards`` shards at a time) or ``"full"``;
          the order depends on the dataset, ``seed``, ``epoch`` and ``shuffle`` only.
        - ``rank`` of ``world_size`` (default 1) ranks reading the epoch together. ``world`` is the
          deprecated alias of ``world_size`` (a ``DeprecationWarning``; removed in the next release).
        - ``tail``: ``"drop"`` the samples that do not fill a last step, or ``"pad"`` it (wrapping to
          the epoch's start).
        - ``start_step``: start at this step; or ``state``: resume a :meth:`Stream.state_dict` (its
          dataset, seed, epoch, shuffle and cursor), at any world size and batch size.
        - ``on_corrupt``: ``"fail"`` (``DaemonError`` with code ``"CorruptData"``) or ``"replace"``
          (zero-filled samples, counted in :attr:`Batch.replaced`).
        - ``prefetch``: slots the daemon fills ahead, at least (1 to 64).
        - ``variable``: the batch form of each variable-length field named: ``"padded"``
          (``batch[name]`` ``[samples, L, ...]`` zero-padded to the batch's longest, with int32
          ``batch[name + ".lengths"]``), ``"packed"`` (``[total, ...]`` with int32
          ``batch[name + ".cu_seqlens"]`` of ``samples + 1`` entries from 0), or a ``(form, cap)``
          pair truncating samples to ``cap`` elements. Fields not named are padded, uncapped.

        Raises ``ValueError`` for a bad option value, ``InvalidSpecError`` for a spec the protocol
        refuses (nothing sent), ``DaemonError`` for one the daemon refuses (unknown dataset or
        field, impossible conversion, a bound reached), ``ValueError`` once the client is closed."""
    def close(self) -> None:
        """Closes the client and every stream it opened that is still open; batches still held stay
        valid until released. Idempotent."""
    def __enter__(self) -> Client:
        """Returns the client."""
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        """Closes the client (and its streams)."""

class Stream:
    """An open stream: iterates over the epoch's batches for this rank, in step order, and ends with
    the epoch. A context manager: closed on leaving a ``with`` block."""

    def __iter__(self) -> Iterator[Batch]:
        """Returns the stream."""
    def __next__(self) -> Batch:
        """Blocks until the daemon sent the next batch; ``StopIteration`` at the epoch's end or once
        closed. Raises ``AllSlotsHeldError`` when every slot is held by batches not yet released
        (the next would never come), ``DaemonError`` when the daemon ended the stream (a corrupt
        block under ``on_corrupt="fail"``), ``SessionError`` when the daemon went away."""
    def state_dict(self) -> Dict[str, Any]:
        """Where the epoch stands, for a checkpoint: ``{"version", "dataset", "sources",
        "mixture_epoch_samples", "seed", "epoch", "shuffle", "window_shards", "world_size",
        "batch_size", "cursor"}`` (``sources`` a list of (dataset, weight), empty but for a
        mixture, whose ``dataset`` is empty), which
        ``open_stream(..., state=...)`` resumes from at this or another world size. ``cursor``
        counts the positions of the epoch's order every rank together consumed up to this rank's
        last batch: store it once every rank passed that step."""
    @property
    def steps(self) -> int:
        """Batches this rank receives from where the stream started to the end of the epoch."""
    @property
    def epoch_samples(self) -> int:
        """Samples in the epoch (the dataset's), over all ranks."""
    @property
    def slot_count(self) -> int:
        """Slots the daemon fills ahead of the consumer (at least ``prefetch``; more for small
        batches, as slot rings are sized in bytes)."""
    @property
    def device(self) -> str:
        """Where batches are: ``"cpu"`` or ``"cuda:N"``."""
    @property
    def closed(self) -> bool:
        """True once the stream was closed (by :meth:`close`, its ``with`` block, or its client's
        ``close()``)."""
    def set_cuda_stream(self, stream: int) -> None:
        """Makes ``stream`` (a ``CUstream`` address as an int, e.g.
        ``torch.cuda.current_stream().cuda_stream``; 0 is the legacy default stream) the stream
        batches are delivered on: each batch is ready for work queued on it, and released after
        that work. The stream must outlive the batches."""
    def close(self) -> None:
        """Ends the stream (its session); batches still held stay valid until released."""
    def __enter__(self) -> Stream:
        """Returns the stream."""
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        """Closes the stream."""

class Batch(Mapping[str, "Field"]):
    """One batch: a lease on a slot of the stream, and a read-only mapping of field name to
    :class:`Field` in slot order (``batch[name]``, ``for name in batch``, ``items()``, ``len``,
    ``in``; ``isinstance(batch, collections.abc.Mapping)`` holds).

    The slot goes back to the daemon when the batch and every array exported from it are gone, or at
    once by :meth:`release`. A context manager: released on leaving a ``with`` block."""

    @property
    def epoch(self) -> int:
        """The epoch this batch belongs to."""
    @property
    def step(self) -> int:
        """The batch's step in the epoch (the same on every rank)."""
    @property
    def samples(self) -> int:
        """Samples in the batch."""
    @property
    def replaced(self) -> int:
        """Samples zero-filled because their block was corrupt (``on_corrupt="replace"``)."""
    @property
    def cursor_after(self) -> int:
        """The epoch cursor once every rank consumed this step."""
    def keys(self) -> List[str]:  # type: ignore[override]
        """The field names, in slot order (a list)."""
    def values(self) -> List[Field]:  # type: ignore[override]
        """The fields, in slot order (a list)."""
    def items(self) -> List[Tuple[str, Field]]:  # type: ignore[override]
        """``(name, field)`` pairs, in slot order (a list)."""
    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        """``batch[name]``, or ``default`` when the batch has no such field."""
    def __iter__(self) -> Iterator[str]:
        """Iterates over the field names, in slot order."""
    def __contains__(self, name: object) -> bool:
        """Whether the batch has a field ``name``."""
    def __len__(self) -> int:
        """The number of fields."""
    def __getitem__(self, name: str) -> Field:
        """The field ``name``; ``KeyError`` when there is none, ``ValueError`` once released."""
    def release(self) -> None:
        """Releases the slot now. Arrays exported from the batch must not be used afterwards."""
    def __enter__(self) -> Batch:
        """Returns the batch."""
    def __exit__(self, *args: Any) -> None:
        """Releases the batch."""

class Field:
    """One field of a batch, exported zero-copy through DLPack, ``__cuda_array_interface__``
    (device batches) or ``__array_interface__`` (host batches). It shares its batch's lease: the
    slot stays the daemon's to reuse only once the field and every array taken from it are gone."""

    @property
    def name(self) -> str:
        """The field's name."""
    @property
    def dtype(self) -> str:
        """gpufeed's name of the element type (``"f32"``, ``"bf16"``, ...)."""
    @property
    def shape(self) -> Tuple[int, ...]:
        """The shape, batch dimension first (C order)."""
    @property
    def nbytes(self) -> int:
        """Bytes of the field's data."""
    @property
    def data_ptr(self) -> int:
        """The address of the first element (host or device); ``BufferError`` once released."""
    def __dlpack_device__(self) -> Tuple[int, int]:
        """DLPack's ``(device type, ordinal)``: ``(1, 0)`` for host memory, ``(2, N)`` for
        ``cuda:N``."""
    def __dlpack__(
        self,
        *,
        stream: Optional[int] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """A DLPack capsule aliasing the field (a versioned one when ``max_version`` is 1.x or
        later; host batches are marked read-only). For device batches ``stream`` (DLPack's
        encoding: 1 legacy default, 2 per-thread default, else a ``CUstream``; -1 none) waits for
        the batch on the device, and the slot is released after the work queued on it.
        ``copy=True`` and another ``dl_device`` raise ``BufferError``."""
    @property
    def __array_interface__(self) -> Dict[str, Any]:
        """NumPy's array interface (host batches only): read-only, C order. bf16 has none: use
        DLPack."""
    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        """The CUDA array interface, version 3 (device batches only), ready on the stream set with
        :meth:`Stream.set_cuda_stream` (reported as 1, the legacy default stream). bf16 has none:
        use DLPack."""
